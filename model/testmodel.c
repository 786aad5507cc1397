/*
 * testmodel.c - writes small GGUF models (llama, qwen2, qwen3, gemma3) with random weights and
 * a real byte-level BPE vocabulary, so that engine, tokenizer and distributed tests run in
 * seconds on any shape, and llama.cpp can check each architecture's forward pass.
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void pdm_testmodel_params_default(pdm_testmodel_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->n_layers = 2;
    p->d_model = 64;
    p->n_ff = 96;
    p->n_heads = 4;
    p->n_kv_heads = 2;
    p->n_ctx = 1024;
    p->wtype = PDM_DT_Q4_1;
    p->embtype = PDM_DT_Q8_0;
    p->tied = 1;
    p->rope_theta = 10000.0f;
    p->seed = 1;
    p->emb_range = 1.0f;
}

int pdm_testmodel_params_preset(pdm_testmodel_params_t *p, const char *name)
{
    pdm_testmodel_params_default(p);
    if (!strcmp(name, "llama")) return PDM_OK;
    if (!strcmp(name, "llama3")) { /* Llama 3.x: untied, theta 500000, rope_freqs, GQA 4:1 */
        p->n_heads = 4;
        p->n_kv_heads = 1;
        p->tied = 0;
        p->rope_theta = 500000.0f;
        /* Llama 3.1's formula with an original context of 64 instead of 8192, so that the
         * factors reach pairs whose angles matter within a test prompt of ~64 tokens */
        p->rope_freqs_ctx = 64;
        return PDM_OK;
    }
    if (!strcmp(name, "qwen2")) { /* Qwen2.5: Q/K/V biases, theta 1e6, tied (small sizes) */
        p->arch = PDM_ARCH_QWEN2;
        p->rope_theta = 1000000.0f;
        p->tied = 0; /* (as Qwen2.5 7B and up) so the logits do not echo the input token */
        return PDM_OK;
    }
    if (!strcmp(name, "qwen3")) { /* Qwen3: Q/K norms, head_dim 32 with d_model 64 and 4
                                   * heads (n_heads * head_dim != d_model, as in Qwen3 0.6B) */
        p->arch = PDM_ARCH_QWEN3;
        p->head_dim = 32;
        p->rope_theta = 1000000.0f;
        p->tied = 0;
        return PDM_OK;
    }
    if (!strcmp(name, "gemma3")) { /* Gemma 3 270M's traits: head_dim 256, 4 heads over 1 KV
                                    * head, 5 local : 1 global layers (7 layers: both kinds,
                                    * a local one after the global), window 16 */
        p->arch = PDM_ARCH_GEMMA3;
        p->n_layers = 7;
        p->n_heads = 4;
        p->n_kv_heads = 1;
        p->head_dim = 256;
        p->n_ff = 128;
        p->rope_theta = 1000000.0f;
        p->rope_theta_swa = 10000.0f;
        p->n_swa = 16;
        /* tied as Gemma's; small embeddings keep the sqrt(d_model)-scaled input from
         * dominating the logits through the tied output */
        p->emb_range = 0.1f;
        return PDM_OK;
    }
    return pdm_error_set(PDM_EINVAL, "unknown test model preset '%s' (llama, llama3, qwen2, "
                         "qwen3, gemma3)", name);
}

/* Uniform in [-1, 1). */
static float pdm__rng_sym(uint64_t *s)
{
    return (float)((double)(pdm_splitmix64(s) >> 11) * 0x1.0p-52 - 1.0);
}

/* GPT-2's reversible map from bytes to printable code points, UTF-8 encoded into out. */
static void pdm__byte_token(int byte, char out[5])
{
    int cp;
    if ((byte >= 33 && byte <= 126) || (byte >= 161 && byte <= 172) || (byte >= 174)) {
        cp = byte;
    } else {
        /* the remaining bytes map to 256, 257, ... in increasing byte order */
        int rank = 0;
        for (int b = 0; b < byte; b++)
            if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174))) rank++;
        cp = 256 + rank;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

static const char pdm__training_text[] =
    "The quick brown fox jumps over the lazy dog. A serving mesh splits the work of a "
    "language model between prefill and decode. The prefill group computes the cache of "
    "keys and values for the prompt, and the decode node generates the answer one token at "
    "a time. Tests run on small random models so that they finish in seconds, and the real "
    "model checks that the numbers match an independent implementation. In the beginning "
    "there was the word, and the word was tokenized into bytes, then merged into pieces. "
    "Numbers like 12345 and 2024 appear, as do names such as Paris, London and Tokyo.";

#define PDM__MAX_MERGES 200

typedef struct {
    char **tokens; /* [n] owned strings */
    int n, cap;
    char **merges; /* [n_merges] "a b" */
    int n_merges;
} pdm__vocab_t;

static int pdm__vocab_add(pdm__vocab_t *v, const char *s)
{
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 512;
        char **t = realloc(v->tokens, (size_t)cap * sizeof(char *));
        if (!t) return PDM_ENOMEM;
        v->tokens = t;
        v->cap = cap;
    }
    if (!(v->tokens[v->n] = strdup(s))) return PDM_ENOMEM;
    return v->n++;
}

static void pdm__vocab_free(pdm__vocab_t *v)
{
    for (int i = 0; i < v->n; i++) free(v->tokens[i]);
    for (int i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens);
    free(v->merges);
}

/* Learns BPE merges on the built-in text: words (with their leading space) as byte-token
 * sequences; repeatedly merge the most frequent adjacent pair (lowest ids on ties). */
static int pdm__vocab_build(pdm__vocab_t *v)
{
    static const char *const specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    int byte_id[256];
    for (size_t i = 0; i < PDM_ARRAY_SIZE(specials); i++)
        if (pdm__vocab_add(v, specials[i]) < 0) return PDM_ENOMEM;
    for (int b = 0; b < 256; b++) {
        char s[5];
        pdm__byte_token(b, s);
        if ((byte_id[b] = pdm__vocab_add(v, s)) < 0) return PDM_ENOMEM;
    }
    size_t len = strlen(pdm__training_text);
    v->merges = calloc(PDM__MAX_MERGES, sizeof(char *));
    if (!v->merges) return PDM_ENOMEM;
    /* One sequence; -1 separates words so merges never cross a word start (a space
     * begins a new word, as the pre-tokenizer would split). */
    int n = 0;
    int *flat = malloc(2 * len * sizeof(int));
    if (!flat) return PDM_ENOMEM;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)pdm__training_text[i];
        if ((ch == ' ' || ch == '.' || ch == ',') && n > 0) flat[n++] = -1;
        flat[n++] = byte_id[ch];
    }
    int rc = PDM_OK;
    while (v->n_merges < PDM__MAX_MERGES) {
        int best_a = -1, best_b = -1, best_count = 1;
        for (int i = 0; i + 1 < n; i++) {
            if (flat[i] < 0 || flat[i + 1] < 0) continue;
            int count = 0;
            for (int j = 0; j + 1 < n; j++)
                if (flat[j] == flat[i] && flat[j + 1] == flat[i + 1]) count++;
            if (count > best_count || (count == best_count && best_a >= 0 &&
                                       (flat[i] < best_a ||
                                        (flat[i] == best_a && flat[i + 1] < best_b)))) {
                best_count = count;
                best_a = flat[i];
                best_b = flat[i + 1];
            }
        }
        if (best_a < 0) break;
        size_t la = strlen(v->tokens[best_a]), lb = strlen(v->tokens[best_b]);
        char *joined = malloc(la + lb + 1), *merge = malloc(la + lb + 2);
        if (!joined || !merge) {
            free(joined);
            free(merge);
            rc = PDM_ENOMEM;
            break;
        }
        memcpy(joined, v->tokens[best_a], la);
        memcpy(joined + la, v->tokens[best_b], lb + 1);
        snprintf(merge, la + lb + 2, "%s %s", v->tokens[best_a], v->tokens[best_b]);
        int id = pdm__vocab_add(v, joined);
        free(joined);
        if (id < 0) {
            free(merge);
            rc = PDM_ENOMEM;
            break;
        }
        v->merges[v->n_merges++] = merge;
        int w = 0;
        for (int i = 0; i < n; i++) {
            if (i + 1 < n && flat[i] == best_a && flat[i + 1] == best_b) {
                flat[w++] = id;
                i++;
            } else {
                flat[w++] = flat[i];
            }
        }
        n = w;
    }
    free(flat);
    return rc;
}

/* Adds a (rows x cols) matrix of uniform values in [-scale, scale) stored as `type`. */
static int pdm__add_matrix(pdm_gguf_writer_t *w, const char *name, pdm_dtype_t type,
                           int64_t rows, int64_t cols, float scale, float offset, uint64_t *rng)
{
    size_t rb = pdm_dtype_row_bytes(type, cols);
    float *row = malloc((size_t)cols * sizeof(float));
    char *data = malloc(rb * (size_t)rows);
    if (!row || !data) {
        free(row);
        free(data);
        return pdm_error_set(PDM_ENOMEM, "out of memory");
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) row[c] = offset + scale * pdm__rng_sym(rng);
        pdm_quantize_row(type, row, data + (size_t)r * rb, cols);
    }
    int64_t ne[2] = {cols, rows};
    int rc = pdm_gguf_writer_add_tensor(w, name, type, rows == 1 ? 1 : 2, ne, data);
    free(row);
    free(data);
    return rc;
}

/* Llama 3.1's RoPE frequency factors as llama.cpp's converter computes them
 * (conversion/llama.py, LlamaModel generate_extra_tensors): factor 8, low/high frequency
 * factors 1 and 4, original context old_ctx (8192 in Llama 3.1). */
static int pdm__add_rope_freqs(pdm_gguf_writer_t *w, uint32_t head_dim, float theta,
                               double old_ctx)
{
    const double factor = 8.0, low = 1.0, high = 4.0;
    const double low_wavelen = old_ctx / low, high_wavelen = old_ctx / high;
    float f[PDM_MAX_HEAD_DIM / 2];
    for (uint32_t i = 0; i < head_dim / 2; i++) {
        double freq = 1.0 / pow(theta, (double)(2 * i) / head_dim);
        double wavelen = 2.0 * M_PI / freq;
        if (wavelen < high_wavelen) f[i] = 1.0f;
        else if (wavelen > low_wavelen) f[i] = (float)factor;
        else {
            double smooth = (old_ctx / wavelen - low) / (high - low);
            f[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
        }
    }
    int64_t ne[1] = {head_dim / 2};
    return pdm_gguf_writer_add_tensor(w, "rope_freqs.weight", PDM_DT_F32, 1, ne, f);
}

int pdm_testmodel_write(const char *path, const pdm_testmodel_params_t *p)
{
    const uint32_t head_dim = p->head_dim ? p->head_dim
                                          : (p->n_heads ? p->d_model / p->n_heads : 0);
    if (!(p->emb_range > 0.0f))
        return pdm_error_set(PDM_EINVAL, "test model: embedding range %g must be > 0",
                             p->emb_range);
    if (p->n_heads == 0 || p->n_kv_heads == 0 || p->n_heads % p->n_kv_heads ||
        (!p->head_dim && p->d_model % p->n_heads) || head_dim % 2 || head_dim == 0 ||
        head_dim > PDM_MAX_HEAD_DIM || p->d_model % PDM_QK || p->n_ff % PDM_QK ||
        p->n_layers == 0)
        return pdm_error_set(PDM_EINVAL, "test model: inconsistent shape (d_model %u, heads "
                             "%u/%u, ffn %u)", p->d_model, p->n_heads, p->n_kv_heads, p->n_ff);
    if (!pdm_dtype_is_weight(p->wtype) || !pdm_dtype_is_weight(p->embtype))
        return pdm_error_set(PDM_EINVAL, "test model: %s / %s cannot hold weights (use one of "
                             "%s)", pdm_dtype_name(p->wtype), pdm_dtype_name(p->embtype),
                             pdm_dtype_weight_list());
    /* every matrix has rows of d_model or n_ff elements; embeddings rows of d_model */
    const int wb = pdm_dtype_block_elems(p->wtype), eb = pdm_dtype_block_elems(p->embtype);
    if (p->d_model % wb || p->n_ff % wb || p->d_model % eb ||
        ((int64_t)p->n_heads * head_dim) % wb)
        return pdm_error_set(PDM_EINVAL, "test model: d_model %u and ffn %u must be multiples "
                             "of the block size of %s (%d) and d_model of %s (%d)", p->d_model,
                             p->n_ff, pdm_dtype_name(p->wtype), wb, pdm_dtype_name(p->embtype), eb);
    int rc;
    pdm__vocab_t vocab = {0};
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    if (!w) return pdm_error_set(PDM_ENOMEM, "out of memory");
    if ((rc = pdm__vocab_build(&vocab))) {
        rc = pdm_error_set(rc, "test model: cannot build the vocabulary");
        goto out;
    }
    int32_t *types = malloc((size_t)vocab.n * sizeof(int32_t));
    if (!types) {
        rc = pdm_error_set(PDM_ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < vocab.n; i++) types[i] = i < 3 ? 3 : 1;
    const char *arch = pdm_model_arch_name(p->arch);
    char key[96];
#define PDM__K(suffix) (snprintf(key, sizeof(key), "%s.%s", arch, suffix), key)
    static const char chatml[] =
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
        "%}{{ '<|im_start|>assistant\n' }}{% endif %}";
    const float rms_eps = p->arch == PDM_ARCH_GEMMA3 ? 1e-6f : 1e-5f;
    if ((rc = pdm_gguf_writer_set_str(w, "general.architecture", arch)) ||
        (rc = pdm_gguf_writer_set_str(w, "general.name", "pdmesh random test model")) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("block_count"), p->n_layers)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("context_length"), p->n_ctx)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("embedding_length"), p->d_model)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("feed_forward_length"), p->n_ff)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("attention.head_count"), p->n_heads)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("attention.head_count_kv"), p->n_kv_heads)) ||
        (rc = pdm_gguf_writer_set_f32(w, PDM__K("rope.freq_base"), p->rope_theta)) ||
        (rc = pdm_gguf_writer_set_f32(w, PDM__K("attention.layer_norm_rms_epsilon"), rms_eps)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("rope.dimension_count"), head_dim)) ||
        (rc = pdm_gguf_writer_set_u32(w, PDM__K("vocab_size"), (uint32_t)vocab.n)) ||
        (p->head_dim &&
         ((rc = pdm_gguf_writer_set_u32(w, PDM__K("attention.key_length"), head_dim)) ||
          (rc = pdm_gguf_writer_set_u32(w, PDM__K("attention.value_length"), head_dim)))) ||
        (p->n_swa &&
         (rc = pdm_gguf_writer_set_u32(w, PDM__K("attention.sliding_window"), p->n_swa))) ||
        (p->rope_theta_swa > 0.0f &&
         (rc = pdm_gguf_writer_set_f32(w, PDM__K("rope.freq_base_swa"), p->rope_theta_swa))) ||
        (rc = pdm_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2")) ||
        (rc = pdm_gguf_writer_set_str(w, "tokenizer.ggml.pre", "smollm")) ||
        (rc = pdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens",
                                          (const char *const *)vocab.tokens, (uint64_t)vocab.n)) ||
        (rc = pdm_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types,
                                          (uint64_t)vocab.n)) ||
        (rc = pdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges",
                                          (const char *const *)vocab.merges,
                                          (uint64_t)vocab.n_merges)) ||
        (rc = pdm_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1)) ||
        (rc = pdm_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2)) ||
        (rc = pdm_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", 2)) ||
        (rc = pdm_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 0)) ||
        (rc = pdm_gguf_writer_set_str(w, "tokenizer.chat_template", chatml)))
        goto out_types;

    uint64_t rng = p->seed * 0x2545f4914f6cdd1dull + 7;
    int64_t d = p->d_model, qdim = (int64_t)p->n_heads * head_dim,
            kvdim = (int64_t)p->n_kv_heads * head_dim;
    float ws = 1.0f / sqrtf((float)d), fs = 1.0f / sqrtf((float)p->n_ff);
    if ((rc = pdm__add_matrix(w, "token_embd.weight", p->embtype, vocab.n, d, p->emb_range,
                              0.0f, &rng)))
        goto out_types;
    if (!p->tied &&
        (rc = pdm__add_matrix(w, "output.weight", p->embtype, vocab.n, d, ws, 0.0f, &rng)))
        goto out_types;
    if ((rc = pdm__add_matrix(w, "output_norm.weight", PDM_DT_F32, 1, d, 0.1f, 1.0f, &rng)))
        goto out_types;
    if (p->rope_freqs_ctx &&
        (rc = pdm__add_rope_freqs(w, head_dim, p->rope_theta, p->rope_freqs_ctx)))
        goto out_types;
    const int biases = p->arch == PDM_ARCH_QWEN2;
    const int qk_norm = p->arch == PDM_ARCH_QWEN3 || p->arch == PDM_ARCH_GEMMA3;
    const int post_norms = p->arch == PDM_ARCH_GEMMA3;
    for (uint32_t l = 0; l < p->n_layers; l++) {
        char name[64];
#define PDM__T(s) (snprintf(name, sizeof(name), "blk.%u.%s", l, s), name)
        if ((rc = pdm__add_matrix(w, PDM__T("attn_norm.weight"), PDM_DT_F32, 1, d, 0.1f, 1.0f, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("attn_q.weight"), p->wtype, qdim, d, 2 * ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("attn_k.weight"), p->wtype, kvdim, d, 2 * ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("attn_v.weight"), p->wtype, kvdim, d, ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("attn_output.weight"), p->wtype, d, qdim, ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("ffn_norm.weight"), PDM_DT_F32, 1, d, 0.1f, 1.0f, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("ffn_gate.weight"), p->wtype, p->n_ff, d, ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("ffn_up.weight"), p->wtype, p->n_ff, d, ws, 0, &rng)) ||
            (rc = pdm__add_matrix(w, PDM__T("ffn_down.weight"), p->wtype, d, p->n_ff, fs, 0, &rng)))
            goto out_types;
        /* biases large enough to matter; norms around 1 (GGUF stores Gemma's norms as plain
         * multipliers: llama.cpp's converter adds the 1 of Gemma3RMSNorm) */
        if (biases &&
            ((rc = pdm__add_matrix(w, PDM__T("attn_q.bias"), PDM_DT_F32, 1, qdim, 0.5f, 0, &rng)) ||
             (rc = pdm__add_matrix(w, PDM__T("attn_k.bias"), PDM_DT_F32, 1, kvdim, 0.5f, 0, &rng)) ||
             (rc = pdm__add_matrix(w, PDM__T("attn_v.bias"), PDM_DT_F32, 1, kvdim, 0.5f, 0, &rng))))
            goto out_types;
        if (qk_norm &&
            ((rc = pdm__add_matrix(w, PDM__T("attn_q_norm.weight"), PDM_DT_F32, 1, head_dim, 0.2f, 1.0f, &rng)) ||
             (rc = pdm__add_matrix(w, PDM__T("attn_k_norm.weight"), PDM_DT_F32, 1, head_dim, 0.2f, 1.0f, &rng))))
            goto out_types;
        if (post_norms &&
            ((rc = pdm__add_matrix(w, PDM__T("post_attention_norm.weight"), PDM_DT_F32, 1, d, 0.1f, 1.0f, &rng)) ||
             (rc = pdm__add_matrix(w, PDM__T("post_ffw_norm.weight"), PDM_DT_F32, 1, d, 0.1f, 1.0f, &rng))))
            goto out_types;
#undef PDM__T
    }
#undef PDM__K
    rc = pdm_gguf_writer_write(w, path);

out_types:
    free(types);
out:
    pdm__vocab_free(&vocab);
    pdm_gguf_writer_destroy(w);
    return rc;
}
