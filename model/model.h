/*
 * model.h - the public header of pdmesh's model layer: GGUF files, tokenizer, weights, the
 * transformer forward pass as per-layer steps, the KV cache and sampling.
 *
 * The forward pass is exposed as steps (ARCHITECTURE.md "The engine"; KV-Runahead §4.3,
 * Fig. 7) so that the distributed prefill methods only change where the KV comes from:
 *
 *     embed(tokens) -> x
 *     for each layer:
 *         attn_in(x, positions)          -> q, k, v   (RMSNorm, QKV, RoPE at absolute pos)
 *         attention(q, kv_views[])       -> o, lse    (causal over absolute positions)
 *         attn_out_ffn(x, o)             -> x         (output proj, residual, FFN, residual)
 *     logits(x_last) -> logits
 *
 * A batch of activations (pdm_act_t) carries every intermediate tensor of a step, so a caller
 * can ship k/v or q/o/lse between processes between the steps.
 */
#ifndef PDM_MODEL_H
#define PDM_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "../common/pdm.h"
#include "../kernels/kernels.h"
#include "gguf.h"
#include "grammar.h"
#include "tokenizer.h"

#define PDM_MAX_KV_HEADS 64
#define PDM_MAX_HEAD_DIM 256

/* ---- Weights ------------------------------------------------------------------------------ */

/* The GGUF architectures (general.architecture) the forward pass implements; docs/models.md
 * and the table in model/model.c say which keys and tensors each reads. */
typedef enum {
    PDM_ARCH_LLAMA,  /* "llama": Llama 2/3.x, Mistral-style, SmolLM */
    PDM_ARCH_QWEN2,  /* "qwen2": Q/K/V biases, NEOX RoPE */
    PDM_ARCH_QWEN3,  /* "qwen3": per-head Q/K RMSNorm, NEOX RoPE, head_dim from key_length */
    PDM_ARCH_GEMMA3, /* "gemma3": scaled embeddings, pre+post norms, GeGLU, local/global layers */
} pdm_model_arch_t;

/* The architecture's GGUF name ("llama", "qwen2", ...). */
const char *pdm_model_arch_name(pdm_model_arch_t arch);

typedef struct {
    uint32_t n_layers;
    uint32_t d_model;     /* embedding width */
    uint32_t n_ff;        /* FFN hidden width */
    uint32_t n_heads;     /* query heads */
    uint32_t n_kv_heads;  /* key/value heads (GQA: n_heads % n_kv_heads == 0) */
    uint32_t head_dim;    /* <arch>.attention.key_length, else d_model / n_heads */
    uint32_t n_vocab;
    uint32_t n_ctx_train; /* <arch>.context_length */
    float rope_theta;     /* <arch>.rope.freq_base (global layers) */
    float rms_eps;        /* <arch>.attention.layer_norm_rms_epsilon */
    /* Architecture switches, set by the loader from the architecture and the file. */
    pdm_model_arch_t arch;
    int rope_neox;          /* RoPE pairs (i, i + head_dim/2) instead of (2i, 2i + 1) */
    float rope_freq_scale; /* 1 / <arch>.rope.scaling.factor (linear scaling), global layers */
    float attn_scale;      /* softmax scale of q.k: 1/sqrt(head_dim) unless the arch says */
    float embd_scale;      /* embeddings multiplied by this (gemma3: sqrt(d_model)), else 1 */
    int ffn_gelu;          /* gated FFN activation: 0 SiLU (SwiGLU), 1 GELU-tanh (GeGLU) */
    float logit_softcap;   /* <arch>.final_logit_softcapping: cap * tanh(logit / cap); 0 off */
    uint32_t n_swa;        /* <arch>.attention.sliding_window of the local layers; 0 none */
} pdm_model_hparams_t;

typedef struct {
    const float *attn_norm; /* (d_model) */
    pdm_kern_mat_t wq;      /* (n_heads * head_dim rows, d_model cols) */
    pdm_kern_mat_t wk;      /* (n_kv_heads * head_dim, d_model) */
    pdm_kern_mat_t wv;      /* (n_kv_heads * head_dim, d_model) */
    pdm_kern_mat_t wo;      /* (d_model, n_heads * head_dim) */
    const float *ffn_norm;  /* (d_model) */
    pdm_kern_mat_t w_gate;  /* (n_ff, d_model) */
    pdm_kern_mat_t w_up;    /* (n_ff, d_model) */
    pdm_kern_mat_t w_down;  /* (d_model, n_ff) */
    /* Optional per architecture (NULL when absent): */
    const float *bq;             /* (n_heads * head_dim) attn_q.bias (qwen2) */
    const float *bk, *bv;        /* (n_kv_heads * head_dim) attn_k.bias, attn_v.bias */
    const float *q_norm;         /* (head_dim) attn_q_norm: RMSNorm of each query head */
    const float *k_norm;         /* (head_dim) attn_k_norm: RMSNorm of each key head */
    const float *attn_post_norm; /* (d_model) post_attention_norm of the attention output */
    const float *ffn_post_norm;  /* (d_model) post_ffw_norm of the FFN output */
    /* The layer's kind: local (sliding window) or global. */
    int32_t window;              /* sliding window in tokens; 0 = global (full causal) */
    float rope_theta;            /* RoPE frequency base of this layer */
    float rope_freq_scale;       /* its linear scaling (1 / factor; 1 = none) */
} pdm_model_layer_t;

typedef struct pdm_model {
    pdm_gguf_t *gguf;           /* owns the mapping every weight points into */
    pdm_model_hparams_t hp;
    pdm_kern_mat_t tok_embd;    /* (n_vocab, d_model) */
    pdm_kern_mat_t output;      /* (n_vocab, d_model); tok_embd when tied */
    const float *output_norm;   /* (d_model) */
    const float *rope_freqs;    /* (head_dim / 2) Llama 3 frequency divisors (rope_freqs.weight,
                                 * global layers), or NULL */
    pdm_model_layer_t *layers;  /* [n_layers] */
    pdm_tokenizer_t *tokenizer; /* NULL if the file has no tokenizer */
    float *norms;               /* owned f32 copies of all norm and bias vectors */
    void *repacked;             /* owned: the matrices repacked at load (pdm_kern_repack), or
                                 * NULL; their pdm_kern_mat_t point here instead of the file */
    size_t repacked_bytes;
} pdm_model_t;

/* Opens a GGUF file of a supported architecture (pdm_model_arch_t) and validates every shape
 * against the hyperparameters. Weights stay quantized in the mapping, except the layer and
 * output matrices (tied or not) of a type with a layout the CPU kernels compute on faster
 * (today Q4_K, Q6_K, Q8_0): those are repacked into memory of the model's own
 * (pdm_kern_repack) and their pages of the mapping are dropped, so resident memory stays
 * about the file's size. PDMESH_REPACK=0 keeps every matrix in the file's layout. On error
 * *out is
 * untouched and pdm_error_last() names the file and the problem (an unsupported
 * architecture, a missing key or tensor, with its name). */
int pdm_model_load(const char *path, pdm_model_t **out);
void pdm_model_free(pdm_model_t *model);

/* Sets the per-layer fields of an attention call (softmax scale, causal, sliding window) for
 * `layer`; the caller fills the rest. Every attention of the model goes through this (the
 * forward steps and the decode node's beam attention), so the mask is the same everywhere. */
void pdm_model_attn_setup(const pdm_model_t *m, int layer, pdm_kern_attn_t *a);

/* The model path from $PDMESH_MODEL, else the default under models/. */
const char *pdm_model_default_path(void);

/* ---- KV cache ----------------------------------------------------------------------------- */

/* Head-major: for each (layer, kv head) one contiguous [capacity][head_dim] array of K and
 * one of V, so a head can be offloaded, transferred or quantized on its own. Slot i holds the
 * token at absolute position pos0 + i. */
typedef struct {
    uint32_t n_layers, n_kv_heads, head_dim;
    int32_t capacity; /* token slots per head */
    int32_t n_tokens; /* filled slots [0, n_tokens) */
    int32_t pos0;     /* absolute position of slot 0 */
    pdm_dtype_t dtype; /* PDM_DT_F32, PDM_DT_F16 or PDM_DT_I8 ("q8") */
    void **k, **v;    /* [n_layers * n_kv_heads] -> [capacity][head_dim] of dtype */
    void *storage;       /* one block holding every k and v array */
    size_t storage_bytes; /* its size when mmapped (model/kv_cache.c), else 0 */
    /* q8 only: [n_layers * n_kv_heads][2] (K scale, V scale) of each head, fixed once from
     * the prompt (scales_fixed = 1) and used for every later row, prompt and response alike
     * (see model/kv_quant.c). 1 for other dtypes. */
    float *scale;
    int scales_fixed;
    struct pdm_kvoff *offload; /* set when the heads live in offload tiers (decode_node/
                                * offload.h): the decode step then goes through it */
    /* Windowed layers (the static-window KV manager of the Qualcomm note, "KV cache buffer
     * management optimizations"): a local layer (sliding window of S tokens) needs only the
     * S - 1 keys before the oldest token it has yet to attend for. Its arrays hold win_rows
     * rows (about r(S-1)); slot s sits at row s - win_first. Appending writes the next row;
     * the window slides by itself (the view starts at win_first); when the rows run out,
     * pdm_kv_cache_room moves the last S - 1 rows to the front: one copy every
     * win_rows - (S - 1) tokens. Global layers keep every slot. */
    uint8_t *windowed;        /* [n_layers] 1 for a windowed layer; NULL: none (all full) */
    int32_t win_keep;         /* past rows a windowed layer keeps: S - 1 */
    int32_t win_rows;         /* rows per head of a windowed layer (> win_keep) */
    int32_t win_first;        /* slot held by row 0 of every windowed array */
    uint64_t win_copies;      /* window moves so far */
    uint64_t win_bytes_moved; /* bytes those moves copied (all windowed layers, heads, K, V) */
} pdm_kv_cache_t;

int pdm_kv_cache_create(const pdm_model_hparams_t *hp, int32_t capacity, pdm_dtype_t dtype,
                        pdm_kv_cache_t **out);

/* A cache with windowed layers (above). `model` names the local layers (layers[l].window >
 * 0) and their window S; window_reserve is the note's r, rows per windowed head =
 * max(ceil(r (S - 1)), S) (r = 2: one copy of S - 1 rows every S - 1 tokens, the note's
 * no-copy reserve; r = 1.5: twice as many copies). When those rows would not be fewer than
 * `capacity` (short sequences), or the model has no local layer, or window_reserve is 0, the
 * cache is an ordinary full one (windowed = NULL). */
typedef struct {
    int32_t capacity;          /* token slots of the sequence (what a global layer holds) */
    pdm_dtype_t dtype;
    const struct pdm_model *model; /* its layer kinds; NULL: no windowed layers */
    double window_reserve;     /* r in [1.5, 8], or 0: no windowed layers */
} pdm_kv_cache_params_t;

/* The layout such a cache would have, without allocating it: rows per head of a full and of a
 * windowed layer, how many layers are windowed, and the bytes of the whole cache. PDM_EINVAL
 * for a reserve outside [1.5, 8] (0 allowed). */
typedef struct {
    int32_t full_rows, win_rows; /* win_rows 0: no windowed layer */
    int32_t win_keep;            /* S - 1 */
    uint32_t n_windowed, n_full; /* layers of each kind */
    size_t full_bytes, win_bytes; /* K and V of all heads of all layers of that kind */
} pdm_kv_cache_layout_t;
int pdm_kv_cache_layout(const pdm_model_hparams_t *hp, const pdm_kv_cache_params_t *p,
                        pdm_kv_cache_layout_t *out);
int pdm_kv_cache_create_params(const pdm_model_hparams_t *hp, const pdm_kv_cache_params_t *p,
                               pdm_kv_cache_t **out);
/* The slot held by row 0 of `layer`'s arrays (win_first for a windowed layer, else 0). */
static inline int32_t pdm_kv_cache_row0(const pdm_kv_cache_t *c, uint32_t layer)
{
    return c->windowed && c->windowed[layer] ? c->win_first : 0;
}
/* The most tokens one append (a prefill chunk) may add: the free slots, and for windowed
 * layers the rows beyond the S - 1 kept ones. */
int32_t pdm_kv_cache_append_max(const pdm_kv_cache_t *c);
/* Makes windowed layers ready to take slots [n_tokens, n_tokens + n): when those rows would
 * run past win_rows, moves the kept rows (the last S - 1 slots) to row 0 (the note's one
 * copy). PDM_EOVERFLOW (nothing changed) when n exceeds pdm_kv_cache_append_max. No-op for
 * a cache without windowed layers. */
int pdm_kv_cache_room(pdm_kv_cache_t *c, int32_t n);
/* The static window's one copy: moves rows [from, from + n) of each head's arrays to row `to`
 * (memmove) in every windowed layer, or in every layer of a cache without windowed layers
 * (decode_node/window.c's whole-model window), and counts it in win_copies and
 * win_bytes_moved. */
void pdm_kv_cache_move_rows(pdm_kv_cache_t *c, int32_t from, int32_t to, int32_t n);
/* Windowed layers, after their slots [0, n_prompt) were written somewhere else (a KV stream
 * received into full-size staging arrays): copies the last S - 1 rows of each staging array
 * (stage_k/v[layer * n_kv_heads + head], n_prompt rows, NULL for full layers) into the
 * window and sets win_first. */
void pdm_kv_cache_window_fill(pdm_kv_cache_t *c, void *const *stage_k, void *const *stage_v,
                              int32_t n_prompt);
void pdm_kv_cache_destroy(pdm_kv_cache_t *c);
void pdm_kv_cache_clear(pdm_kv_cache_t *c);
size_t pdm_kv_cache_bytes(const pdm_kv_cache_t *c);
static inline void *pdm_kv_cache_k(const pdm_kv_cache_t *c, uint32_t layer, uint32_t head)
{
    return c->k[layer * c->n_kv_heads + head];
}
static inline void *pdm_kv_cache_v(const pdm_kv_cache_t *c, uint32_t layer, uint32_t head)
{
    return c->v[layer * c->n_kv_heads + head];
}

/* q8: sets every head's K and V scale of `layer` from the absolute maxima of its K and V
 * (absmax[2 * head + 0] for K, + 1 for V); scales_fixed becomes 1 after the last layer is
 * set by pdm_kv_cache_fix_scales. */
void pdm_kv_cache_set_scales(pdm_kv_cache_t *c, uint32_t layer, const float *absmax);
void pdm_kv_cache_fix_scales(pdm_kv_cache_t *c);
/* Absolute maxima of the K and V rows of act (n tokens) per kv head: out[2 * head + {0,1}]
 * = max(out, |K|, |V|), so calls accumulate (start from zeros). */
struct pdm_act;
void pdm_kv_absmax(const pdm_model_hparams_t *hp, const struct pdm_act *act, float *out);

/* "f32", "f16" or "q8" (int8 with per-head scales) -> the cache dtype; PDM_EINVAL else. */
int pdm_kv_dtype_parse(const char *name, pdm_dtype_t *out);

/* A window of one layer's KV for every kv head: keys at absolute positions
 * pos0 .. pos0 + n_tokens - 1. It only points at memory owned elsewhere. */
typedef struct {
    const void *k[PDM_MAX_KV_HEADS]; /* [n_tokens][head_dim] of dtype, per kv head */
    const void *v[PDM_MAX_KV_HEADS];
    pdm_dtype_t dtype;
    int32_t pos0;
    int32_t n_tokens;
    float k_scale[PDM_MAX_KV_HEADS], v_scale[PDM_MAX_KV_HEADS]; /* q8 only, per kv head */
} pdm_kv_view_t;

/* The view of slots [start, start + n) of `layer`. For a windowed layer the view begins at
 * the first slot it still holds (max(start, win_first)): the slots before it are outside the
 * window of every token not yet appended. */
void pdm_kv_cache_view(const pdm_kv_cache_t *c, uint32_t layer, int32_t start, int32_t n,
                       pdm_kv_view_t *out);

/* ---- Forward pass as steps ---------------------------------------------------------------- */

/* A compute context: thread pool, kernel variant and scratch for batches of up to
 * `max_batch` tokens. One context is used by one thread at a time. */
typedef struct pdm_model_ctx pdm_model_ctx_t;

int pdm_model_ctx_create(const pdm_model_t *model, int n_threads, int max_batch,
                         pdm_model_ctx_t **out);
void pdm_model_ctx_destroy(pdm_model_ctx_t *ctx);
/* Whether a single token's attention splits its keys over the threads and merges the parts
 * by log-sum-exp (on by default: a decode step's latency with long contexts). The merge
 * rounds differently from the one-pass online softmax of a batch, and 8-bit activations can
 * turn that into logit differences of a few tenths (0.41 measured on SmolLM2 Q4_1), so a
 * context whose single tokens must equal the same tokens of a batched prefill (a prefill
 * rank computing a cached prompt's last token alone) turns it off. */
void pdm_model_ctx_set_split_single(pdm_model_ctx_t *ctx, int on);
int pdm_model_ctx_max_batch(const pdm_model_ctx_t *ctx);
const pdm_model_t *pdm_model_ctx_model(const pdm_model_ctx_t *ctx);
const pdm_kern_ops_t *pdm_model_ctx_ops(const pdm_model_ctx_t *ctx);
/* The context's thread pool (steps built outside forward.c, e.g. the decode node's beam
 * attention, split their work over it). */
pdm_kern_pool_t *pdm_model_ctx_pool(const pdm_model_ctx_t *ctx);
/* Forces a kernel variant (tests and benchmarks compare them); NULL restores the default. */
void pdm_model_ctx_set_ops(pdm_model_ctx_t *ctx, const pdm_kern_ops_t *ops);

/* Activations of a batch of n tokens (all row-major, one row per token). */
typedef struct pdm_act {
    int n;         /* tokens */
    int32_t *pos;  /* [n] absolute positions */
    float *x;      /* [n][d_model] residual stream */
    float *q;      /* [n][n_heads * head_dim] queries after RoPE */
    float *k;      /* [n][n_kv_heads * head_dim] new keys after RoPE */
    float *v;      /* [n][n_kv_heads * head_dim] new values */
    float *o;      /* [n][n_heads * head_dim] attention output */
    float *lse;    /* [n][n_heads] log-sum-exp of each query row's scores */
} pdm_act_t;

/* Allocates (and frees) activations for up to `n` tokens. */
int pdm_act_alloc(const pdm_model_hparams_t *hp, int n, pdm_act_t *act);
void pdm_act_free(pdm_act_t *act);

/* x[i] = embedding of tokens[i]; pos[i] = positions[i]. Tokens must be < n_vocab
 * (PDM_ERANGE otherwise). act->n becomes n. */
int pdm_model_embed(pdm_model_ctx_t *ctx, const int32_t *tokens, const int32_t *positions,
                    int n, pdm_act_t *act);
/* RMSNorm, Q/K/V projections and RoPE at act->pos: fills q, k, v from x. */
void pdm_model_attn_in(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act);
/* Causal attention of act->q against the union of `views` (disjoint position ranges, any
 * order): fills o and lse. Partial results are merged by log-sum-exp; a row that sees no key
 * gets o = 0, lse = -inf. */
void pdm_model_attention(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act,
                         const pdm_kv_view_t *views, int n_views);
/* pdm_model_attention for kv heads [kvh0, kvh1) and their query heads only (the views need
 * valid k/v pointers for those heads only); the other heads' o/lse are left as they are.
 * Each head's result is the same as in pdm_model_attention (head-wise offload computes the
 * heads in groups, HeadInfer Alg. 1). */
void pdm_model_attention_heads(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act,
                               const pdm_kv_view_t *views, int n_views, int kvh0, int kvh1);
/* x += Wo o; x += W_down (silu(W_gate n) * W_up n) with n = RMSNorm(x). */
void pdm_model_attn_out_ffn(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act);
/* logits[n_vocab] of row `row` of act->x (final RMSNorm and output projection). */
void pdm_model_logits(pdm_model_ctx_t *ctx, const pdm_act_t *act, int row, float *logits);

/* logits[i][n_vocab] of rows [0, n) of act->x in one matrix product (n <= max batch): the
 * output projection is the largest matrix of a small model, so decode batches share it. */
void pdm_model_logits_batch(pdm_model_ctx_t *ctx, const pdm_act_t *act, int n, float *logits);
/* Stores act->k / act->v rows [0, act->n) of `layer` into cache slots [slot, slot + n). */
void pdm_model_kv_store(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, int layer,
                        const pdm_act_t *act, int32_t slot);

/* ---- Whole-sequence helpers built from the steps ------------------------------------------ */

/* Appends `n` tokens at positions cache->pos0 + cache->n_tokens... to the cache, processing
 * them in chunks of the context's max batch, and writes the last token's logits (may be NULL).
 * A q8 cache whose scales are not fixed yet takes them from these tokens (the prompt): every
 * layer's K/V of all n tokens is computed before any is stored. PDM_EOVERFLOW if the cache
 * is too small; the cache is unchanged on error. */
int pdm_model_prefill(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens, int n,
                      float *logits);
/* pdm_model_prefill that writes the logits of every token from `first` on:
 * logits[i - first][n_vocab] for first <= i < n (first == n: none; the caller's buffer holds
 * n - first rows). pdm_model_prefill is this with first = n - 1. Scoring tools (perplexity,
 * KL divergence) read every position. A q8 cache whose scales are not fixed yet gives only
 * the last token's logits (PDM_EUNSUPPORTED for first < n - 1). */
int pdm_model_prefill_logits(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens,
                             int n, int first, float *logits);
/* Several sequences prefilled as one batch (model/prefill_seqs.c): sequence s appends its
 * n tokens to its own cache at positions cache->pos0 + cache->n_tokens..., like
 * pdm_model_prefill. The rows of all sequences share the linear layers (one matrix product
 * per weight); attention runs per sequence against its own cache only (no cross-sequence
 * attention). Each sequence's logits and KV are those pdm_model_prefill gives it alone with a
 * context whose max batch holds its tokens (tests/unit/test_engine.c checks it for every
 * kernel variant). */
#define PDM_MODEL_MAX_SEQS 64
typedef struct {
    const int32_t *tokens; /* [n] */
    int n;                 /* >= 1 */
    pdm_kv_cache_t *cache; /* the sequence's own cache (no two sequences share one; no
                            * windowed layers); a q8 cache without fixed scales takes them
                            * from these tokens, per layer, and has them fixed at the end */
    float *logits;         /* [n_vocab] of the last token, or NULL */
} pdm_model_seq_t;
/* Called after layer `layer`'s K and V of every sequence are stored, before the layer's
 * output projection: a caller streams them while the next layers compute. Nonzero stops the
 * prefill with that status. */
typedef int (*pdm_model_layer_cb)(void *data, int layer);
/* Runs the batch through `act` (capacity >= the sum of n; overwritten) and ctx (max batch >=
 * that sum). PDM_EINVAL / PDM_ERANGE / PDM_EOVERFLOW / PDM_EUNSUPPORTED on bad input with
 * nothing changed; on_layer's status if it stops it (the caches then hold a partial prefill:
 * n_tokens unchanged, rows past it undefined). */
int pdm_model_prefill_seqs(pdm_model_ctx_t *ctx, pdm_act_t *act, const pdm_model_seq_t *seqs,
                           int n_seqs, pdm_model_layer_cb on_layer, void *data);
/* One decode step: pdm_model_prefill of a single token. */
int pdm_model_decode(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, int32_t token, float *logits);

/* ---- Exact reference forward (model/reference.c) ------------------------------------------ */

typedef struct {
    int n_threads;  /* pool size (>= 1); the result does not depend on it */
    int act_q8;     /* experiment: round the inputs of quantized matrices to 8-bit blocks as
                     * the engine and llama.cpp do (32 values, scale amax / 127 as f16) */
    double perturb; /* experiment: multiply matrix inputs by 1 + perturb * u, u a fixed
                     * pseudo-random value in [-0.5, 0.5) per element; |perturb| < 1 */
} pdm_model_ref_params_t;

/* n_threads 1, no experiment. */
void pdm_model_ref_params_default(pdm_model_ref_params_t *p);

/* The model's logits computed the plain way in double precision: weights dequantized from the
 * file, every activation, norm, RoPE angle, attention score and sum in f64, no activation
 * quantization (unless p->act_q8) and no KV cache rounding. Tokens are at positions 0..n-1;
 * writes logits[i - first][n_vocab] (rounded to f32) for first <= i < n. Slow (scalar f64,
 * about 2 x n_params multiply-adds per token): for short texts, tests and fidelity
 * measurements. PDM_EINVAL / PDM_ERANGE / PDM_ENOMEM with a message; logits are untouched on
 * error. */
int pdm_model_reference_logits(const pdm_model_t *m, const pdm_model_ref_params_t *p,
                               const int32_t *tokens, int n, int first, float *logits);

/* ---- Sampling ----------------------------------------------------------------------------
 *
 * One step, in this order (docs/http.md "Sampling" states the same rule for users):
 *   1. l = the model's logits; l[t] += logit_bias[t] for every biased token t;
 *   2. repetition penalty (CTRL, as llama.cpp) on the distinct tokens among the last
 *      repeat_last_n of `history`: l > 0 ? l / penalty : l * penalty;
 *   3. OpenAI's penalties over all of `history` (the completion's tokens so far):
 *      l[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t];
 *   4. logprobs, when asked: log_softmax(l) over the whole vocabulary, at temperature 1 and
 *      before any top-k/top-p/min-p cut: the distribution the model (as biased and penalised
 *      by the request) gives, not the truncated one the draw uses;
 *   5. greedy (temperature 0: the highest l, lowest id among ties), or top-k -> top-p ->
 *      min-p -> softmax(l / temperature) -> one draw with u_i (below).
 * The draw is a function of (seed, i) only, i = n_history = the number of completion tokens
 * already sampled: u_i = top 53 bits of splitmix64(seed XOR ((i + 1) * 0x9E3779B97F4A7C15))
 * / 2^53. No state carries from one step to the next, so a sequence resumed at step k (a
 * migration re-creates the sampler on another node and passes the k delivered tokens as
 * history) continues exactly as the uninterrupted run. */

#define PDM_SAMPLER_MAX_TOP_LOGPROBS 20 /* alternatives reported per token */
#define PDM_SAMPLER_MAX_LOGIT_BIAS 300  /* biased tokens per request (OpenAI's bound) */

typedef struct {
    float temperature;    /* <= 0: greedy */
    int32_t top_k;        /* <= 0: off */
    float top_p;          /* 1: off */
    float min_p;          /* 0: off */
    float repeat_penalty; /* 1: off */
    int32_t repeat_last_n; /* tokens of history the penalty looks at */
    uint64_t seed;
    float presence_penalty;   /* [-2, 2], 0: off */
    float frequency_penalty;  /* [-2, 2], 0: off */
    const int32_t *bias_ids;  /* [n_bias] token ids of logit_bias (borrowed; the sampler copies) */
    const float *bias_values; /* [n_bias] added to those tokens' logits, each in [-100, 100] */
    int32_t n_bias;           /* [0, PDM_SAMPLER_MAX_LOGIT_BIAS] */
    int32_t logprobs;         /* < 0: none; else report the chosen token's log-probability and
                               * the `logprobs` most likely tokens' (<= MAX_TOP_LOGPROBS) */
    const char *json_schema;  /* structured output: NUL-terminated JSON Schema text (borrowed),
                               * or NULL. Not used by the sampler itself: the caller compiles it
                               * (pdm_grammar_compile) and sets the matcher with
                               * pdm_sampler_set_grammar */
} pdm_sampler_params_t;

/* The limits pdm_sampler_params_check enforces (the router checks every request with it, and
 * the CLIs' sampling flags use the same bounds): temperature [0, MAX], top_k >= 0,
 * top_p (0, 1], min_p [0, 1], repeat_penalty (0, MAX], presence/frequency penalty [-2, 2],
 * logit_bias at most 300 entries of [-100, 100] on ids >= 0, logprobs <= 20. */
#define PDM_SAMPLER_TEMPERATURE_MAX 100.0f
#define PDM_SAMPLER_REPEAT_PENALTY_MAX 100.0f
#define PDM_SAMPLER_PENALTY_MAX 2.0f
#define PDM_SAMPLER_BIAS_MAX 100.0f

void pdm_sampler_params_default(pdm_sampler_params_t *p);
/* PDM_EINVAL with a message naming the bad parameter. */
int pdm_sampler_params_check(const pdm_sampler_params_t *p);

/* The log-probabilities of one step (step 4 above). */
typedef struct {
    float logprob;                                   /* of the chosen token */
    int32_t n_top;                                   /* = params.logprobs (<= n_vocab) */
    int32_t top_ids[PDM_SAMPLER_MAX_TOP_LOGPROBS];   /* most likely first, lower id on ties */
    float top_logprobs[PDM_SAMPLER_MAX_TOP_LOGPROBS];
} pdm_token_logprobs_t;

/* log_softmax(logits)[token] (logits as given: no bias, penalty or temperature) into
 * lp->logprob, and the `top` (<= PDM_SAMPLER_MAX_TOP_LOGPROBS) most likely tokens as in step 4
 * (most likely first, lower id on ties). The sum is llama.cpp's (float differences from the
 * maximum, expf summed in double), so `pdmesh perplexity` and the prompt log-probabilities of
 * a request give the same value for the same logits. Never allocates. */
void pdm_sampler_score(const float *logits, int32_t n_vocab, int32_t token, int32_t top,
                       pdm_token_logprobs_t *lp);

/* SamplingParams (proto/pdmesh.proto) <-> sampler parameters, one mapping for the router and
 * both daemons. from_msg: defaults for what the message leaves at 0 (top_p 0 -> 1, repeat
 * penalty 0 -> 1, seed 0 -> the default seed), then pdm_sampler_params_check; the bias arrays
 * point into the message (valid while it lives). to_msg: fills an initialised message whose
 * arrays then point into *p. A NULL message gives the defaults at temperature 0. */
struct Pdmesh__SamplingParams;
int pdm_sampler_params_from_msg(const struct Pdmesh__SamplingParams *m, pdm_sampler_params_t *p);
void pdm_sampler_params_to_msg(const pdm_sampler_params_t *p, struct Pdmesh__SamplingParams *m);

/* The seed of choice i of a request seeded with `seed` (OpenAI's n: choice i draws with it,
 * on whichever path computes it): common/pdm.h pdm_seed_for_choice, the rule the SDKs use
 * too. */
uint64_t pdm_sampler_seed_for_choice(uint64_t seed, int i);

typedef struct pdm_sampler pdm_sampler_t;

/* Copies p (the logit_bias arrays included). PDM_EINVAL (nothing allocated) when p fails the
 * check or names a biased token outside [0, n_vocab). */
int pdm_sampler_create(const pdm_sampler_params_t *p, int32_t n_vocab, pdm_sampler_t **out);
void pdm_sampler_destroy(pdm_sampler_t *s);
/* Picks the next token from `logits` (not modified). `history` holds the n_history tokens of
 * this completion sampled so far (not the prompt): the penalties count them and n_history is
 * the step index i of the draw. lp (may be NULL) receives the step's log-probabilities when
 * params.logprobs >= 0. Never allocates. */
int32_t pdm_sampler_sample(pdm_sampler_t *s, const float *logits, const int32_t *history,
                           int n_history, pdm_token_logprobs_t *lp);

/* Constrained sampling (structured output): with a matcher set, step 3 is followed by
 *   3b. l[t] = -inf for every token the grammar does not allow next (pdm_gmatch_mask),
 * so the logprobs, greedy choice and the draw all see the constrained distribution. At
 * temperature 0 without logprobs the sampler first checks the unconstrained argmax with
 * pdm_gmatch_allows and builds the mask only when the grammar refuses it (the result is the
 * same: the argmax over the allowed tokens). The sampler borrows m (NULL: none) and does not
 * advance it: the caller feeds the chosen token with pdm_gmatch_accept_token. If no token is
 * allowed at all (cannot happen with the grammars pdm_grammar_compile builds), the mask is
 * ignored. */
void pdm_sampler_set_grammar(pdm_sampler_t *s, pdm_gmatch_t *m);

/* ---- Quantization ------------------------------------------------------------------------ */

/* Writes `out_path`: the F32/F16/BF16 GGUF `in_path` with every 2-D weight matrix converted
 * to `scheme` (a weight type name such as "q4_k", or "q4_k_m": Q6_K for attn_v, ffn_down,
 * token_embd and output, Q4_K for the rest). One-row and 1-D tensors become F32; matrices
 * whose rows are not whole blocks of the target fall back to Q8_0 (or F16). All metadata is
 * kept; general.file_type is set to llama.cpp's number for the scheme. Errors (unknown scheme,
 * an already quantized input, I/O) are returned with a message; nothing is left at out_path. */
int pdm_model_quantize_file(const char *in_path, const char *out_path, const char *scheme);

/* ---- Random test models ------------------------------------------------------------------- */

typedef struct {
    uint32_t n_layers, d_model, n_ff, n_heads, n_kv_heads, n_ctx;
    pdm_dtype_t wtype;   /* type of the matrices: any weight type (pdm_dtype_is_weight) */
    pdm_dtype_t embtype; /* type of the token embeddings */
    int tied;            /* output projection shares tok_embd */
    float rope_theta;
    uint64_t seed;
    pdm_model_arch_t arch; /* general.architecture and the tensors it implies: qwen2 Q/K/V
                            * biases, qwen3 Q/K norms, gemma3 Q/K norms and post norms */
    uint32_t head_dim;     /* 0: d_model / n_heads; else written as attention.key_length */
    uint32_t rope_freqs_ctx; /* llama: write a Llama 3.1 rope_freqs.weight (factor 8,
                              * low/high frequency factors 1/4) for this original context
                              * (8192 in Llama 3.1); 0: none */
    uint32_t n_swa;        /* gemma3: attention.sliding_window (0: all layers global) */
    float rope_theta_swa;  /* gemma3: rope.freq_base_swa of the local layers (0: not written) */
    float emb_range;       /* token embeddings uniform in [-emb_range, emb_range) (default 1) */
} pdm_testmodel_params_t;

void pdm_testmodel_params_default(pdm_testmodel_params_t *p);
/* pdm_testmodel_params_default, then the shape of a preset named after the architecture
 * ("llama" the default, "llama3", "qwen2", "qwen3", "gemma3"): small dimensions with the
 * real models' traits (untied output and rope_freqs for llama3, head_dim 256 with 1 KV head
 * and 5 local : 1 global layers with a window of 16 for gemma3, ...). PDM_EINVAL for an
 * unknown name. */
int pdm_testmodel_params_preset(pdm_testmodel_params_t *p, const char *name);
/* Writes a GGUF of p->arch with random weights and a byte-level BPE vocabulary (256 byte
 * tokens, a few hundred merges learnt from a built-in text, ChatML control tokens) to `path`.
 * The same parameters give the same file, byte for byte. */
int pdm_testmodel_write(const char *path, const pdm_testmodel_params_t *p);

#endif /* PDM_MODEL_H */
