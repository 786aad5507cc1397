/*
 * decode.h - the decode node: sequences whose prompt KV arrived from a prefill group, generated
 * together in one continuous batch.
 *
 * One decode step takes one token of every active sequence: the projections and the FFN run
 * as one batched matrix product over all of them, attention runs per sequence against its own
 * KV cache (ARCHITECTURE.md "Request lifecycle", step 4). Sequences join and leave between
 * steps.
 */
#ifndef PDM_DECODE_H
#define PDM_DECODE_H

#include <stdint.h>

#include "decode_node/beam.h"
#include "decode_node/nsamp.h"
#include "decode_node/offload.h"
#include "common/wire.h"
#include "kvtransfer/kvtransfer.h"
#include "model/model.h"

/* ---- One batched step ------------------------------------------------------------------ */

typedef struct {
    pdm_kv_cache_t *cache; /* the sequence's KV; the token goes to slot cache->n_tokens */
    int32_t token;         /* input token of this step */
    float *logits;         /* out: [n_vocab] next-token logits; when the n outputs are
                            * consecutive rows of one [n][n_vocab] array they are computed in
                            * one matrix product */
} pdm_decode_seq_t;

/* Runs one decode step for `n` sequences (n <= the context's max batch; `act` holds at least
 * n rows). Appends each token's K/V to its cache (n_tokens grows by one). PDM_EOVERFLOW (and
 * nothing changed) if a cache is full. Equal to pdm_model_decode of each sequence alone. */
int pdm_decode_step(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs, int n);
/* The same step with beam searches among the rows: beams[i] NULL is an ordinary row; else row
 * i is beam b of a beam search over the segmented cache beams[i] (beam.c), whose n_live rows
 * are consecutive (beam b = its b-th row) and whose `cache` is the shared prompt. beams may be
 * NULL (no beam rows). */
int pdm_decode_step_beams(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs,
                          pdm_beam_kv_t *const *beams, int n);
/* The same step with the seconds of its phases added to phases[PDM_DECODE_PHASES] (NULL: not
 * timed), for benchmarks (bench/decode --breakdown). */
enum {
    PDM_DECODE_PH_EMBED,
    PDM_DECODE_PH_ATTN_IN,   /* norm + QKV + RoPE, batched */
    PDM_DECODE_PH_ATTN,      /* per sequence: KV store + attention */
    PDM_DECODE_PH_FFN,       /* output projection + FFN, batched */
    PDM_DECODE_PH_LOGITS,
    PDM_DECODE_PHASES
};
extern const char *const pdm_decode_phase_names[PDM_DECODE_PHASES];
int pdm_decode_step_timed(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs,
                          pdm_beam_kv_t *const *beams, int n, double *phases);

/* ---- Static-window KV (Qualcomm's KV manager for static-shape engines) ------------------ *
 * For engines whose graphs take a fixed-size past K/V of S-1 tokens per head: each head's K
 * and V live in a buffer reserved as r x (S-1) rows (r = 2 by default, down to 1.5). The past
 * window is always the S-1 rows ending at `end` (left-padded while fewer tokens exist), so
 * appending is writing row `end`, and sliding past S tokens is advancing `end`: no copy until
 * the reserve is exhausted, then one copy moves the window back to the front. Generation
 * beyond S attends to the last S-1 tokens plus the current one. */
typedef struct {
    pdm_kv_cache_t *cache; /* capacity = reserve rows per head; slot i holds position
                            * pos_next - (end - i) */
    int32_t window;        /* S - 1: past tokens an input sees */
    int32_t reserve;       /* rows per head, ceil(r * (S - 1)) */
    int32_t end;           /* next row to write; the window is [end - window, end) */
    int32_t n_valid;       /* past tokens in the window (<= window) */
    int32_t pos_next;      /* absolute position of the next token */
    uint64_t copies;       /* window moves */
    uint64_t bytes_moved;  /* bytes those moves copied (all layers, heads, K and V) */
} pdm_kvwin_t;

/* A window for sequences of at most S tokens in view (S >= 2), reserve factor r in [1.5, 8]
 * (anything else is PDM_EINVAL). */
int pdm_kvwin_create(const pdm_model_hparams_t *hp, int32_t S, double r, pdm_dtype_t dtype,
                     pdm_kvwin_t **out);
void pdm_kvwin_destroy(pdm_kvwin_t *w);
/* Appends n tokens (one decode step with n = 1 slides the window; a batch must fit without
 * sliding: n_valid + n <= S - 1) through the engine's steps; logits of the last token. */
int pdm_kvwin_forward(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_kvwin_t *w,
                      const int32_t *tokens, int n, float *logits);

/* ---- Windowed layers on the decode node ------------------------------------------------ *
 * Gemma 3's local layers (sliding window of S tokens) keep only their window: the same
 * static-window scheme, applied per layer inside a sequence's ordinary cache (model.h,
 * pdm_kv_cache_t, "Windowed layers"), while global layers keep the whole context. The node's
 * KV budget counts token slots of every layer; a sequence of n tokens then occupies fewer. */

/* KV token slots (rows of all layers over n_layers: the unit of the node's kv_budget) a
 * sequence of n_tokens occupies when n_windowed of the n_layers layers hold at most win_rows
 * rows: ceil((n_full n + n_windowed min(n, win_rows)) / n_layers). win_rows 0 or n_windowed
 * 0: n_tokens. */
int64_t pdm_kvwin_slots(uint32_t n_layers, uint32_t n_windowed, int32_t win_rows,
                        int64_t n_tokens);

/* What the node reserves for a sequence of n_prompt + max_new tokens with window reserve r
 * (0: off): the cache's layout, the slots it counts, and the slots its staging takes while
 * the prompt's KV arrives (a KV stream carries the full prompt of every layer; the windowed
 * layers' rows land in staging arrays of n_prompt rows first and only the last S - 1 are
 * kept: pdm_kv_cache_window_fill). PDM_EINVAL for bad sizes or r. */
typedef struct {
    pdm_kv_cache_layout_t layout;
    int64_t slots;       /* the cache */
    int64_t stage_slots; /* the staging, while the KV arrives (0: received in place) */
} pdm_kvwin_plan_t;
int pdm_kvwin_plan(const pdm_model_t *m, pdm_dtype_t dtype, double r, int32_t n_prompt,
                   int32_t max_new, pdm_kvwin_plan_t *out);
/* Bytes of cache c (a sequence of model m) in local (sliding-window) layers and in global
 * ones: windowed local layers count their window rows, others their capacity. */
void pdm_kvwin_cache_bytes(const pdm_model_t *m, const pdm_kv_cache_t *c, uint64_t *local,
                           uint64_t *global);

/* ---- The node --------------------------------------------------------------------------- */

typedef struct {
    int threads;            /* compute threads */
    int max_batch;          /* sequences per decode step */
    int max_sequences;      /* reserved + running, a bound on the node's queue */
    int64_t kv_budget;      /* KV token slots over all sequences (capacity check) */
    pdm_dtype_t kv_dtype;   /* F32, F16 or I8 (q8): must match the prefill ranks' (blocks of
                             * another dtype are rejected) */
    double kv_timeout;      /* seconds a reservation waits for its KV after start */
    pdm_beam_params_t beam; /* default beam search of requests that name none (width 0: off) */
    const pdm_kvoff_params_t *offload; /* head-wise KV offload (offload.h), or NULL */
    int64_t pool_tokens;    /* prefix pool: KV token slots finished sequences may keep (0:
                             * off; see pdm_decode_node_reserve_local) */
    double kv_window;       /* windowed layers: the static window's reserve r in [1.5, 8]
                             * (default 2), 0: every layer keeps the whole context. Applies to
                             * models with local layers (Gemma 3) and sampled sequences; beam
                             * searches, head-wise offload and a q8 local prefill keep full KV
                             * (docs/decode-memory.md); windowed sequences do not join the
                             * prefix pool */
    const char *pool_file_tier; /* prefix pool's second tier: "file:DIR" (offload.h's file
                             * tier) where sequences evicted from the pool's RAM go, or NULL */
    int64_t pool_file_tokens; /* that tier's budget in tokens (least recently used goes) */
    int fault_corrupt_pool; /* tests only (pdmesh-decode --fault-corrupt-pool): flip one byte
                             * of a pooled prefix's KV before each reuse, which its checksum
                             * must catch (the prefix is then recomputed, never used) */
} pdm_decode_params_t;

void pdm_decode_params_default(pdm_decode_params_t *p);

typedef struct pdm_decode_node pdm_decode_node_t;

int pdm_decode_node_create(const pdm_model_t *model, pdm_kvt_t *kvt,
                           const pdm_decode_params_t *p, pdm_decode_node_t **out);
/* Releases every sequence (cancelling receives) and frees the node. NULL is fine. */
void pdm_decode_node_destroy(pdm_decode_node_t *node);

/* Where a range of the prompt's tokens comes from. */
typedef struct {
    int32_t start, len;
    int peer;  /* kvt peer of the prefill rank that computed it */
    int chunk; /* its index in the prefill task (part of the blocks' tags) */
} pdm_decode_range_t;

typedef struct {
    uint64_t id;
    uint32_t attempt;
    int32_t n_prompt, max_new;
    const pdm_decode_range_t *ranges; /* cover [0, n_prompt) */
    int n_ranges;
    int beams;                        /* beam width (0: the node's default; -1: none) */
    int samples;                      /* OpenAI's n: samples sharing the prompt (nsamp.h; KV as
                                       * a beam search of that width; not with beams); 1: one
                                       * sample over that cache; 0: an ordinary sequence */
    const uint8_t *kv_key;            /* [PDM_KVT_KEY_BYTES] the request's KV key, or NULL:
                                       * blocks are not authenticated */
    const int32_t *tokens;            /* [n_prompt] the prompt's tokens, or NULL: with them
                                       * the finished sequence's KV can join the prefix pool */
    int32_t pool_prefix;              /* delta transfer (DecodeTask.pool_prefix): rows
                                       * [0, pool_prefix) come from this node's prefix pool
                                       * (needs tokens), `ranges` cover [pool_prefix, n_prompt)
                                       * only; 0: every row is streamed */
} pdm_decode_reserve_t;

/* Reserves KV for n_prompt + max_new tokens and posts the receives of every block of the
 * plan (layer x kv head x range) into the new cache. PDM_EOVERFLOW "node full" when the KV
 * budget or the sequence bound would be exceeded; PDM_EINVAL for a bad plan or a duplicate id.
 * With pool_prefix, the pooled rows are verified (checksums) and copied first; the pool not
 * holding that prefix any more gives PDM_ENOTFOUND, a checksum mismatch PDM_ECHECKSUM (the
 * entry dropped), a sequence that cannot take pooled rows (beams, samples, head-wise offload,
 * q8) PDM_EUNSUPPORTED: the caller streams the whole prompt instead. Nothing is held then. */
int pdm_decode_node_reserve(pdm_decode_node_t *node, const pdm_decode_reserve_t *r);

/* A local prefill (conditional disaggregation, migration). */
typedef struct {
    uint64_t id;
    uint32_t attempt;
    const int32_t *tokens;      /* [n_tokens] the prompt (+ a migration's completion so far) */
    int32_t n_tokens;
    int32_t max_new;
    int beams;                  /* beam search width (<= 0: none); the start then needs
                                 * prompt_last */
    int samples;                /* OpenAI's n: samples sharing the prompt (nsamp.h), their
                                 * first tokens drawn from this prefill's logits; no beams, no
                                 * prompt_lp. 1 with n_generated: a migrated choice of n, one
                                 * sample whose delivered tokens are replayed as steps of the
                                 * segmented cache (prompt = tokens less them), so that its
                                 * draws continue as in the shared run; more than 1: a new
                                 * prompt only. 0: an ordinary sequence */
    int32_t n_generated;        /* migration: the last n_generated tokens are completion tokens
                                 * already delivered; the sampler counts them and resumes its
                                 * draws at step n_generated (model.h "Sampling") */
    int replay;                 /* with n_generated: compute their KV one decode step at a time,
                                 * as they were first computed, so that the continuation's
                                 * logits are bit-identical to the uninterrupted run's (a
                                 * batched prefill rounds differently); costs one step per
                                 * token. The router asks for it for temperature > 0. */
    pdm_token_logprobs_t *prompt_lp; /* NULL, or [n_tokens] (caller's): a new prompt
                                 * (n_generated 0) is scored as a prefill rank scores it:
                                 * [p] = log p(tokens[p] | tokens[0..p)) with prompt_top
                                 * alternatives, for p >= 1 ([0] untouched); the prefix pool is
                                 * not used then (its rows' logits are gone); an f16/f32 KV cache
                                 * is needed (PDM_EUNSUPPORTED for q8) */
    int prompt_top;
} pdm_decode_local_t;

/* Reserves KV for n_tokens + max_new (beam search: pdm_beam_kv_slots, the prompt's KV once)
 * and computes the prompt's KV on this node now (blocking the batch for that time). The
 * following start may pass first_token = -1: the node samples it from the prompt's logits.
 * PDM_EOVERFLOW when the budget or the sequence bound is exceeded, PDM_ERANGE for a token
 * outside the vocabulary, PDM_EINVAL for other bad parameters (beams over PDM_BEAM_MAX_WIDTH
 * or the batch); nothing is held on error. */
int pdm_decode_node_reserve_local(pdm_decode_node_t *node, const pdm_decode_local_t *r);

/* The prefix pool (pool_tokens > 0): a sequence that ends normally (eos, length, stop) with
 * its prompt tokens known leaves its KV (prompt and generated tokens) in the pool instead of
 * freeing it; a later local prefill whose tokens start with at least PDM_DECODE_POOL_MIN of a
 * pooled sequence's tokens copies those rows and computes only the rest (a chat's next turn:
 * its prompt is the last one, the answer and the new message). Pooled KV is evicted least
 * recently used first whenever a reservation needs the slots or the pool exceeds its size,
 * so it never refuses work. f16/f32 caches only (q8 scales are fixed per prompt), no beams,
 * no head-wise offload. */
#define PDM_DECODE_POOL_MIN 16

typedef struct {
    uint64_t id;
    int32_t first_token;        /* sampled by the prefill rank that owns the last token */
    const pdm_token_logprobs_t *first_logprob; /* its log-probabilities (sp.logprobs >= 0;
                                                * NULL: unknown, its TOKEN event has none) */
    pdm_sampler_params_t sp;    /* the bias arrays are copied */
    const char *const *stops;   /* stop strings (copied) */
    int n_stops;
    double deadline;            /* pdm_now() seconds; 0: none */
    pdm_beam_params_t beam;     /* beam search (width 0: as reserved); sp is then unused */
    int32_t prompt_last;        /* beam search, and n samples of a streamed prompt: the last
                                 * prompt token (-1: unknown) */
    int ignore_eos;             /* end-of-generation tokens do not end it (sampling only) */
    const float *first_logits;  /* n samples of a streamed prompt: [n_vocab] the last prompt
                                 * token's logits from the prefill side (copied); the samples
                                 * draw their first tokens from them instead of a priming step.
                                 * NULL: the priming step */
} pdm_decode_start_t;

/* Starts generation once the KV has arrived (checked by run_once). */
int pdm_decode_node_start(pdm_decode_node_t *node, const pdm_decode_start_t *s);
/* Ends a sequence now (its DONE event says "cancelled"); PDM_ENOTFOUND if unknown. */
int pdm_decode_node_cancel(pdm_decode_node_t *node, uint64_t id);

typedef enum { PDM_DECODE_EV_TOKEN = 1, PDM_DECODE_EV_DONE, PDM_DECODE_EV_ERROR } pdm_decode_ev_type_t;

typedef struct {
    pdm_decode_ev_type_t type;
    uint64_t id;
    int32_t token;          /* TOKEN: the generated token */
    int index;              /* TOKEN: its index among the generated tokens (first token = 0) */
    const pdm_token_logprobs_t *logprob; /* TOKEN: its log-probabilities (sp.logprobs >= 0),
                                          * else NULL */
    const char *finish;     /* DONE: "eos", "length", "stop", "deadline", "cancelled" */
    const int32_t *tokens;  /* DONE: every generated token, first token included */
    int n_tokens;
    const char *text;       /* DONE: their text (cut at a stop string) */
    double kv_seconds;      /* DONE: from start to the KV verified */
    double step_seconds;    /* DONE: mean seconds per decode step of this sequence */
    uint64_t kv_bytes;      /* DONE: KV bytes received */
    const char *error;      /* ERROR: what went wrong (the sequence is released) */
    int kv_error;           /* ERROR: 1 when the prompt's KV failed to arrive or verify */
    const pdm_beam_report_t *beam; /* DONE of a beam search: n-best list and memory; else NULL */
    int32_t cached_tokens;  /* DONE: prompt tokens whose KV came from the prefix pool */
    uint64_t kv_local_bytes, kv_global_bytes; /* DONE: the sequence's KV cache on this node per
                                               * layer kind (pdm_kvwin_cache_bytes) */
    /* n samples (pdm_decode_reserve_t.samples): a TOKEN is sample `sample`'s, index counts its
     * own tokens, sample_finish says how the sample ends with it ("eos", "length", "stop"; NULL:
     * it goes on). DONE: each sample's tokens, their count, end (the DONE's finish for a
     * sample still running: "deadline", "cancelled") and text; tokens/text are sample 0's. */
    int sample;
    const char *sample_finish;
    int n_samples;          /* DONE: 0 unless n samples */
    const int32_t *const *sample_tokens;
    const int *sample_n_tokens;
    const char *const *sample_finish_all;
    const char *const *sample_text;
} pdm_decode_event_t;

typedef void (*pdm_decode_event_cb)(void *arg, const pdm_decode_event_t *ev);

/* One scheduling round: checks KV arrivals and deadlines, then one batched decode step over
 * up to max_batch running sequences. Events go to `cb` as they happen. Returns the number of
 * sequences still held (reserved, waiting for KV or running). */
int pdm_decode_node_run_once(pdm_decode_node_t *node, pdm_decode_event_cb cb, void *arg);
/* Number of sequences running a decode step (0 means run_once would only poll). */
int pdm_decode_node_running(const pdm_decode_node_t *node);
/* Sequences held in any state and KV token slots reserved (0 and 0 when idle: tests check
 * that failures leave nothing behind). */
void pdm_decode_node_usage(const pdm_decode_node_t *node, int *held, int64_t *kv_slots);
/* The prefix pool: sequences kept, their KV token slots and bytes, the distinct prefix blocks
 * they hold (with block keys set), local prefills that looked into the pool, hits and tokens
 * reused, evictions, and pooled prefixes whose checksum failed on reuse. */
typedef struct {
    int entries;
    int64_t slots;
    uint64_t bytes, blocks;
    uint64_t lookups, hits, reused_tokens, evictions, corrupt;
    int64_t file_tokens;     /* second tier: tokens and bytes it holds, */
    uint64_t file_bytes;     /* hits served from it (loaded back), and its own evictions */
    uint64_t file_hits, file_evictions;
} pdm_decode_pool_stats_t;
void pdm_decode_node_pool_stats(const pdm_decode_node_t *node, pdm_decode_pool_stats_t *st);

/* ---- KV events of the prefix pool (Dynamo's KV events; proto KvEvents) ----
 * With the router's block keys set (pdm_decode_node_set_prefix_keys, from the RegisterAck),
 * every pooled sequence's whole blocks are keyed as the router keys prompts, and the pool
 * queues an event whenever a block key starts or stops being held by some pooled sequence
 * (a block shared by two sequences is evicted when the last goes). The queue is bounded
 * (PDM_DECODE_KVEV_QUEUE): on overflow it is emptied and refilled with a snapshot of the
 * whole pool, and the next drained batch says `reset`. */
#define PDM_DECODE_KVEV_QUEUE 8192
enum { PDM_DECODE_KVEV_STORED = 1, PDM_DECODE_KVEV_EVICTED = 2 };
typedef struct {
    int kind; /* PDM_DECODE_KVEV_* */
    int tier; /* 1: RAM, 2: the file tier (STORED only: a block moved there) */
    uint8_t key[32];
} pdm_decode_kv_event_t;

/* Sets (kp, copied) or clears (NULL) the block keys; every pooled sequence is keyed again and
 * a snapshot is queued (reset). */
void pdm_decode_node_set_prefix_keys(pdm_decode_node_t *node, const pdm_prefix_key_params_t *kp);
/* Queues a snapshot of the whole pool (reset): after a new registration, and periodically. */
void pdm_decode_node_kv_resync(pdm_decode_node_t *node);
/* Moves up to max queued events, oldest first, to out; *reset is 1 when the receiver must
 * forget this node's blocks before applying them. Returns the number moved. */
int pdm_decode_node_kv_events(pdm_decode_node_t *node, pdm_decode_kv_event_t *out, int max,
                              int *reset);

/* Head-wise offload statistics (tiers, prefetches, waits); PDM_ENOTFOUND without offload. */
int pdm_decode_node_offload_stats(pdm_decode_node_t *node, pdm_kvoff_stats_t *st);

#endif /* PDM_DECODE_H */
