/*
 * model.c - loads a GGUF of one of the supported architectures (llama, qwen2, qwen3, gemma3):
 * hyperparameters from metadata as the architecture table below says, weights as quantized
 * views into the mapping, every shape checked against the hyperparameters.
 */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

const char *pdm_model_default_path(void)
{
    const char *env = getenv("PDMESH_MODEL");
    return env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

/* Binds `name` to a matrix of `rows` x `cols`, checking shape and type. */
static int pdm__bind_mat(const pdm_gguf_t *g, const char *path, const char *name, int64_t rows,
                         int64_t cols, pdm_kern_mat_t *out)
{
    const pdm_gguf_tensor_t *t = pdm_gguf_tensor(g, name);
    if (!t) return pdm_error_set(PDM_EFORMAT, "%s: missing tensor '%s'", path, name);
    if (t->n_dims != 2 || t->ne[0] != cols || t->ne[1] != rows)
        return pdm_error_set(PDM_EFORMAT,
                             "%s: tensor '%s' has shape [%lld, %lld], expected [%lld, %lld]",
                             path, name, (long long)t->ne[0],
                             (long long)(t->n_dims > 1 ? t->ne[1] : 1), (long long)cols,
                             (long long)rows);
    if (!pdm_dtype_is_weight(t->type))
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: tensor '%s' has type %s (%d), which is not "
                             "supported for weights (supported: %s)", path, name,
                             pdm_dtype_name(t->type), (int)t->type, pdm_dtype_weight_list());
    if (cols % pdm_dtype_block_elems(t->type))
        return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' row length %lld is not a multiple "
                             "of the %s block size %d", path, name, (long long)cols,
                             pdm_dtype_name(t->type), pdm_dtype_block_elems(t->type));
    out->data = t->data;
    out->type = t->type;
    out->rows = rows;
    out->cols = cols;
    out->row_bytes = pdm_dtype_row_bytes(t->type, cols);
    return PDM_OK;
}

/* Copies a norm vector of length n into dst as f32. */
static int pdm__bind_norm(const pdm_gguf_t *g, const char *path, const char *name, int64_t n,
                          float *dst)
{
    const pdm_gguf_tensor_t *t = pdm_gguf_tensor(g, name);
    if (!t) return pdm_error_set(PDM_EFORMAT, "%s: missing tensor '%s'", path, name);
    if (t->n_dims != 1 || t->ne[0] != n)
        return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' has %lld elements, expected %lld",
                             path, name, (long long)t->ne[0], (long long)n);
    if (t->type != PDM_DT_F32 && t->type != PDM_DT_F16 && t->type != PDM_DT_BF16)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: norm '%s' has unsupported type %s", path,
                             name, pdm_dtype_name(t->type));
    pdm_dequantize_row(t->type, t->data, dst, n);
    return PDM_OK;
}

/* ---- Architectures ----------------------------------------------------------------------- */

/* What differs between the architectures, read off llama.cpp (src/models/<arch>.cpp and
 * llama_model_rope_type in src/llama-model.cpp, vendored in llama-cpp-python 0.3.36). */
typedef struct {
    const char *name;       /* general.architecture */
    pdm_model_arch_t arch;
    int rope_neox;          /* LLAMA_ROPE_TYPE_NEOX (else NORM) */
    int qk_norm;            /* attn_q_norm / attn_k_norm over head_dim required */
    int post_norms;         /* post_attention_norm and post_ffw_norm required */
    int gelu;               /* GeGLU FFN (LLM_FFN_GELU, LLM_FFN_PAR) instead of SwiGLU */
    int embd_scale;         /* embeddings times sqrt(d_model) */
    int swa;                /* local/global layers from attention.sliding_window */
} pdm__arch_t;

static const pdm__arch_t pdm__archs[] = {
    /*                                     neox qkn post gelu emb  swa */
    {"llama", PDM_ARCH_LLAMA,               0,   0,   0,   0,   0,   0},
    {"qwen2", PDM_ARCH_QWEN2,               1,   0,   0,   0,   0,   0},
    {"qwen3", PDM_ARCH_QWEN3,               1,   1,   0,   0,   0,   0},
    {"gemma3", PDM_ARCH_GEMMA3,             1,   1,   1,   1,   1,   1},
};
#define PDM__N_ARCHS (sizeof(pdm__archs) / sizeof(pdm__archs[0]))

const char *pdm_model_arch_name(pdm_model_arch_t arch)
{
    for (size_t i = 0; i < PDM__N_ARCHS; i++)
        if (pdm__archs[i].arch == arch) return pdm__archs[i].name;
    return "?";
}

/* The metadata keys ("<arch>." + suffix) each architecture reads, in the column order of
 * pdm__archs: 'R' required (a missing one is an error naming it), 'O' optional (the default
 * in the comment, as llama.cpp's), '-' not read. docs/models.md reproduces this table. */
typedef struct {
    const char *suffix;
    char need[PDM__N_ARCHS + 1];
} pdm__key_t;

static const pdm__key_t pdm__keys[] = {
    /* suffix                            llama qwen2 qwen3 gemma3 */
    {"block_count",                      "RRRR"},
    {"context_length",                   "RRRR"},
    {"embedding_length",                 "RRRR"},
    {"feed_forward_length",              "RRRR"},
    {"attention.head_count",             "RRRR"},
    {"attention.head_count_kv",          "OOOO"}, /* head_count */
    {"attention.layer_norm_rms_epsilon", "ORRR"}, /* llama: 1e-5 */
    {"attention.key_length",             "OOOO"}, /* embedding_length / head_count */
    {"attention.value_length",           "OOOO"}, /* key_length; must equal it */
    {"rope.dimension_count",             "OOOO"}, /* key_length; partial RoPE unsupported */
    {"rope.freq_base",                   "OOOO"}, /* 10000 */
    {"rope.scaling.type",                "OOOO"}, /* "linear"; only none/linear supported */
    {"rope.scaling.factor",              "OOOO"}, /* 1 (no scaling) */
    {"vocab_size",                       "OOOO"}, /* rows of token_embd; checked */
    {"attention.sliding_window",         "---O"}, /* 0: every layer global */
    {"attention.sliding_window_pattern", "---O"}, /* 6 (5 local, then 1 global) */
    {"rope.freq_base_swa",               "---O"}, /* 10000 (local layers) */
    {"final_logit_softcapping",          "---O"}, /* 0: off */
};

/* Reading context: the file, its path and its architecture's row in the tables. */
typedef struct {
    const pdm_gguf_t *g;
    const char *path;
    const pdm__arch_t *arch;
    size_t col; /* index of arch in pdm__archs */
} pdm__reader_t;

/* Looks key `suffix` up in pdm__keys for the reader's architecture and builds its full name.
 * Returns 'R', 'O' or '-'. */
static char pdm__key_need(const pdm__reader_t *r, const char *suffix, char *key, size_t key_len)
{
    snprintf(key, key_len, "%s.%s", r->arch->name, suffix);
    for (size_t i = 0; i < sizeof(pdm__keys) / sizeof(pdm__keys[0]); i++)
        if (!strcmp(pdm__keys[i].suffix, suffix)) return pdm__keys[i].need[r->col];
    return '-';
}

/* Reads a u32 or f32 key per the table: *out keeps its (default) value when an optional key
 * is missing; a missing required key is PDM_EFORMAT naming it. */
static int pdm__key_read(const pdm__reader_t *r, const char *suffix, uint32_t *u32, float *f32)
{
    char key[128];
    char need = pdm__key_need(r, suffix, key, sizeof(key));
    if (need == '-') return PDM_OK;
    int rc = u32 ? pdm_gguf_get_u32(r->g, key, u32) : pdm_gguf_get_f32(r->g, key, f32);
    if (rc == PDM_ENOTFOUND) {
        if (need == 'O') return PDM_OK;
        return pdm_error_set(PDM_EFORMAT, "%s: missing metadata key '%s' (required by the %s "
                             "architecture)", r->path, key, r->arch->name);
    }
    return rc;
}

static int pdm__key_u32(const pdm__reader_t *r, const char *suffix, uint32_t *out)
{
    return pdm__key_read(r, suffix, out, NULL);
}

static int pdm__key_f32(const pdm__reader_t *r, const char *suffix, float *out)
{
    return pdm__key_read(r, suffix, NULL, out);
}

/* RoPE scaling: none or linear (rope_freq_scale = 1 / factor), as llama.cpp's defaults;
 * YaRN and LongRoPE change the rotation itself and are not implemented. */
static int pdm__read_rope_scaling(const pdm__reader_t *r, pdm_model_hparams_t *hp)
{
    char key[128];
    pdm_gguf_str_t type;
    if (pdm__key_need(r, "rope.scaling.type", key, sizeof(key)) != '-' &&
        pdm_gguf_get_str(r->g, key, &type) == PDM_OK && !pdm_gguf_str_eq(type, "linear") &&
        !pdm_gguf_str_eq(type, "none"))
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: %s '%.*s' is not supported (none or linear)",
                             r->path, key, (int)PDM_MIN(type.len, 32), type.ptr);
    float factor = 0.0f;
    int rc = pdm__key_f32(r, "rope.scaling.factor", &factor);
    if (rc) return rc;
    if (factor < 0.0f || !isfinite(factor))
        return pdm_error_set(PDM_EFORMAT, "%s: invalid rope scaling factor %g", r->path, factor);
    hp->rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
    return PDM_OK;
}

static int pdm__read_hparams(const pdm_gguf_t *g, const char *path, pdm__reader_t *r,
                             pdm_model_hparams_t *hp)
{
    int rc;
    pdm_gguf_str_t arch;
    if (pdm_gguf_get_str(g, "general.architecture", &arch) != PDM_OK)
        return pdm_error_set(PDM_EFORMAT, "%s: missing general.architecture", path);
    r->g = g;
    r->path = path;
    r->arch = NULL;
    for (size_t i = 0; i < PDM__N_ARCHS; i++)
        if (pdm_gguf_str_eq(arch, pdm__archs[i].name)) {
            r->arch = &pdm__archs[i];
            r->col = i;
        }
    if (!r->arch)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: architecture '%.*s' is not supported "
                             "(supported: llama, qwen2, qwen3, gemma3)", path,
                             (int)PDM_MIN(arch.len, 64), arch.ptr);
    memset(hp, 0, sizeof(*hp));
    hp->arch = r->arch->arch;
    if ((rc = pdm__key_u32(r, "block_count", &hp->n_layers)) ||
        (rc = pdm__key_u32(r, "embedding_length", &hp->d_model)) ||
        (rc = pdm__key_u32(r, "feed_forward_length", &hp->n_ff)) ||
        (rc = pdm__key_u32(r, "attention.head_count", &hp->n_heads)) ||
        (rc = pdm__key_u32(r, "context_length", &hp->n_ctx_train)))
        return rc;
    hp->n_kv_heads = hp->n_heads;
    hp->rope_theta = 10000.0f;
    hp->rms_eps = 1e-5f;
    if ((rc = pdm__key_u32(r, "attention.head_count_kv", &hp->n_kv_heads)) ||
        (rc = pdm__key_f32(r, "rope.freq_base", &hp->rope_theta)) ||
        (rc = pdm__key_f32(r, "attention.layer_norm_rms_epsilon", &hp->rms_eps)) ||
        (rc = pdm__read_rope_scaling(r, hp)))
        return rc;

    if (hp->n_layers < 1 || hp->n_layers > 1024 || hp->d_model < 1 || hp->d_model > 65536 ||
        hp->n_ff < 1 || hp->n_ff > 262144 || hp->n_heads < 1 || hp->n_heads > 1024 ||
        hp->n_ctx_train < 1)
        return pdm_error_set(PDM_EFORMAT, "%s: implausible hyperparameters (layers %u, d_model "
                             "%u, ffn %u, heads %u, context %u)", path, hp->n_layers,
                             hp->d_model, hp->n_ff, hp->n_heads, hp->n_ctx_train);
    if (hp->n_kv_heads < 1 || hp->n_kv_heads > PDM_MAX_KV_HEADS ||
        hp->n_heads % hp->n_kv_heads)
        return pdm_error_set(PDM_EFORMAT, "%s: %u query heads cannot be grouped over %u KV "
                             "heads", path, hp->n_heads, hp->n_kv_heads);
    /* head_dim: attention.key_length when present (Qwen3, Gemma 3 have heads wider than
     * d_model / n_heads), as llama.cpp's n_embd_head_k. */
    hp->head_dim = hp->d_model / hp->n_heads;
    char key[128];
    snprintf(key, sizeof(key), "%s.attention.key_length", r->arch->name);
    int has_key_length = pdm_gguf_find(g, key) != NULL;
    if ((rc = pdm__key_u32(r, "attention.key_length", &hp->head_dim))) return rc;
    if (!has_key_length && hp->d_model % hp->n_heads)
        return pdm_error_set(PDM_EFORMAT, "%s: d_model %u is not divisible by %u heads and "
                             "%s is missing", path, hp->d_model, hp->n_heads, key);
    if (hp->head_dim < 2 || hp->head_dim % 2 || hp->head_dim > PDM_MAX_HEAD_DIM)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: head dimension %u is not supported (even, "
                             "<= %d)", path, hp->head_dim, PDM_MAX_HEAD_DIM);
    uint32_t value_length = hp->head_dim, rope_dims = hp->head_dim;
    if ((rc = pdm__key_u32(r, "attention.value_length", &value_length)) ||
        (rc = pdm__key_u32(r, "rope.dimension_count", &rope_dims)))
        return rc;
    if (value_length != hp->head_dim)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: value heads of %u dims differ from key heads "
                             "of %u (not supported)", path, value_length, hp->head_dim);
    if (rope_dims != hp->head_dim)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: partial RoPE (%u of %u dims) is not "
                             "supported", path, rope_dims, hp->head_dim);
    if (!(hp->rope_theta > 0.0f) || !(hp->rms_eps > 0.0f))
        return pdm_error_set(PDM_EFORMAT, "%s: invalid rope theta %g or rms epsilon %g", path,
                             hp->rope_theta, hp->rms_eps);

    hp->rope_neox = r->arch->rope_neox;
    hp->ffn_gelu = r->arch->gelu;
    hp->embd_scale = r->arch->embd_scale ? sqrtf((float)hp->d_model) : 1.0f;
    /* Gemma 3 27B scales by d_model / n_heads instead of head_dim (llama.cpp gemma3.cpp,
     * after gemma_pytorch config.py query_pre_attn_scalar); 62 layers identify it there. */
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    if (hp->arch == PDM_ARCH_GEMMA3 && hp->n_layers == 62)
        hp->attn_scale = 1.0f / sqrtf((float)(hp->d_model / hp->n_heads));
    if ((rc = pdm__key_u32(r, "attention.sliding_window", &hp->n_swa)) ||
        (rc = pdm__key_f32(r, "final_logit_softcapping", &hp->logit_softcap)))
        return rc;
    if (hp->logit_softcap < 0.0f || !isfinite(hp->logit_softcap))
        return pdm_error_set(PDM_EFORMAT, "%s: invalid final_logit_softcapping %g", path,
                             hp->logit_softcap);
    return PDM_OK;
}

/* Layer kinds (Gemma 3): with a sliding window, layer l is local iff the pattern says so:
 * attention.sliding_window_pattern as a per-layer bool array, or as a period n where layers
 * l % n < n - 1 are local (llama.cpp llama_hparams::set_swa_pattern, default n = 6: five
 * local layers, then a global one). Local layers use rope.freq_base_swa (default 10000) and
 * no frequency scaling; global ones rope.freq_base and rope.scaling.factor
 * (llama_model::get_rope_freq_base / get_rope_freq_scale). */
static int pdm__read_layer_kinds(const pdm__reader_t *r, const pdm_model_hparams_t *hp,
                                 pdm_model_layer_t *layers)
{
    float theta_swa = 10000.0f;
    uint32_t period = 6;
    const pdm_gguf_kv_t *pattern = NULL;
    int rc;
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        layers[l].window = 0;
        layers[l].rope_theta = hp->rope_theta;
        layers[l].rope_freq_scale = hp->rope_freq_scale;
    }
    if (!r->arch->swa || hp->n_swa == 0) return PDM_OK;
    if ((rc = pdm__key_f32(r, "rope.freq_base_swa", &theta_swa))) return rc;
    if (!(theta_swa > 0.0f))
        return pdm_error_set(PDM_EFORMAT, "%s: invalid rope.freq_base_swa %g", r->path,
                             theta_swa);
    if (hp->n_swa > INT32_MAX)
        return pdm_error_set(PDM_EFORMAT, "%s: sliding window %u is too large", r->path,
                             hp->n_swa);
    char key[128];
    pdm__key_need(r, "attention.sliding_window_pattern", key, sizeof(key));
    const pdm_gguf_kv_t *kv = pdm_gguf_find(r->g, key);
    if (kv && kv->type == PDM_GGUF_ARRAY) {
        if (kv->v.arr.type != PDM_GGUF_BOOL || kv->v.arr.n != hp->n_layers)
            return pdm_error_set(PDM_EFORMAT, "%s: '%s' must be %u bools (one per layer)",
                                 r->path, key, hp->n_layers);
        pattern = kv;
    } else if (kv && (rc = pdm__key_u32(r, "attention.sliding_window_pattern", &period))) {
        return rc;
    }
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        int local = pattern ? pattern->v.arr.data[l] != 0
                            : period == 0 || l % period < period - 1;
        if (!local) continue;
        layers[l].window = (int32_t)hp->n_swa;
        layers[l].rope_theta = theta_swa;
        layers[l].rope_freq_scale = 1.0f;
    }
    return PDM_OK;
}

/* An optional f32 vector: NULL in *out when the tensor is absent, else copied to dst. */
static int pdm__bind_opt_vec(const pdm_gguf_t *g, const char *path, const char *name,
                             int64_t n, float *dst, const float **out)
{
    *out = NULL;
    if (!pdm_gguf_tensor(g, name)) return PDM_OK;
    int rc = pdm__bind_norm(g, path, name, n, dst);
    if (rc == PDM_OK) *out = dst;
    return rc;
}

/* Tensors of llama.cpp's layer layout this forward pass does not implement: refusing them is
 * better than silently computing a different model. */
static int pdm__check_unsupported(const pdm_gguf_t *g, const char *path, uint32_t n_layers)
{
    static const char *const names[] = {"attn_qkv.weight", "attn_output.bias", "ffn_gate.bias",
                                        "ffn_up.bias", "ffn_down.bias", "ffn_gate_inp.weight",
                                        "rope_factors_long.weight"};
    char name[96];
    for (uint32_t l = 0; l < n_layers; l++)
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
            snprintf(name, sizeof(name), "blk.%u.%s", l, names[i]);
            if (pdm_gguf_tensor(g, name))
                return pdm_error_set(PDM_EUNSUPPORTED, "%s: tensor '%s' is not supported (fused "
                                     "QKV, output/FFN biases, mixture of experts and LongRoPE "
                                     "are not implemented)", path, name);
        }
    return PDM_OK;
}

/* Returns the pages lying wholly inside [p, p + n) of the read-only file mapping to the
 * kernel; they are read again from the file if anything touches them. */
static void pdm__drop_pages(const void *p, size_t n)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t b = ((uintptr_t)p + page - 1) & ~(page - 1), e = ((uintptr_t)p + n) & ~(page - 1);
    if (e > b) madvise((void *)b, e - b, MADV_DONTNEED);
}

/* Repacks every matrix that has a faster layout (see pdm_model_load) into one owned block,
 * slice by slice, dropping each slice's file pages once it is copied: the peak is the
 * repacked size plus 1024 rows. Untied token embeddings stay in the file's layout (they
 * are only looked up row by row). Returns PDM_OK (nothing changed when there is nothing to
 * repack or PDMESH_REPACK=0) or PDM_ENOMEM. */
#define PDM__REPACK_ROWS 1024 /* rows repacked before their file pages are dropped */

static int pdm__repack(pdm_model_t *m)
{
    const char *env = getenv("PDMESH_REPACK");
    if (env && !strcmp(env, "0")) return PDM_OK;
    const size_t n_mats = 7 * (size_t)m->hp.n_layers + 1;
    pdm_kern_mat_t **mats = malloc(n_mats * sizeof(*mats));
    if (!mats) return pdm_error_set(PDM_ENOMEM, "out of memory");
    size_t n = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        pdm_model_layer_t *L = &m->layers[l];
        pdm_kern_mat_t *layer[] = {&L->wq,     &L->wk,   &L->wv,    &L->wo,
                                   &L->w_gate, &L->w_up, &L->w_down};
        for (size_t k = 0; k < 7; k++) mats[n++] = layer[k];
    }
    /* the output matrix, tied or not; tied, the embeddings are looked up through the layout
     * (pdm_kern_mat_dequantize_row) and output follows tok_embd below */
    const int tied = m->output.data == m->tok_embd.data;
    mats[n++] = tied ? &m->tok_embd : &m->output;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += (pdm_kern_repack_bytes(mats[i]) + 63) / 64 * 64;
    if (total == 0) {
        free(mats);
        return PDM_OK;
    }
    char *buf = aligned_alloc(64, total);
    if (!buf) {
        free(mats);
        return pdm_error_set(PDM_ENOMEM, "cannot allocate %zu bytes for repacked weights", total);
    }
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const size_t bytes = pdm_kern_repack_bytes(mats[i]);
        if (!bytes) continue;
        /* slices of PDM__REPACK_ROWS rows (whole groups of 8): a slice's groups follow the
         * previous slice's in the repacked layout, and its file pages go as soon as it is
         * copied, so that a large matrix (Gemma's 262144-row tied embeddings) is never
         * resident twice */
        const pdm_kern_mat_t file = *mats[i];
        for (int64_t r0 = 0; r0 < file.rows; r0 += PDM__REPACK_ROWS) {
            pdm_kern_mat_t slice = file, done = file, packed;
            slice.data = (const char *)file.data + (size_t)r0 * file.row_bytes;
            slice.rows = PDM_MIN(file.rows - r0, (int64_t)PDM__REPACK_ROWS);
            done.rows = r0; /* rows before the slice: their repacked size is the offset */
            pdm_kern_repack(&slice, buf + off + (r0 ? pdm_kern_repack_bytes(&done) : 0), &packed);
            pdm__drop_pages(slice.data, file.row_bytes * (size_t)slice.rows);
        }
        *mats[i] = file;
        mats[i]->data = buf + off;
        mats[i]->layout = PDM_KERN_LAYOUT_X8;
        off += (bytes + 63) / 64 * 64;
    }
    free(mats);
    if (tied) m->output = m->tok_embd;
    m->repacked = buf;
    m->repacked_bytes = total;
    return PDM_OK;
}

int pdm_model_load(const char *path, pdm_model_t **out)
{
    int rc;
    pdm__reader_t rd;
    pdm_model_t *m = calloc(1, sizeof(*m));
    if (!m) return pdm_error_set(PDM_ENOMEM, "%s: out of memory", path);
    if ((rc = pdm_gguf_open(path, &m->gguf))) goto err_free;
    if ((rc = pdm__read_hparams(m->gguf, path, &rd, &m->hp))) goto err_gguf;

    const pdm_model_hparams_t *hp = &m->hp;
    const pdm_gguf_tensor_t *emb = pdm_gguf_tensor(m->gguf, "token_embd.weight");
    if (!emb || emb->n_dims != 2) {
        rc = pdm_error_set(PDM_EFORMAT, "%s: missing or malformed tensor 'token_embd.weight'",
                           path);
        goto err_gguf;
    }
    m->hp.n_vocab = (uint32_t)emb->ne[1];
    uint32_t meta_vocab = m->hp.n_vocab;
    if ((rc = pdm__key_u32(&rd, "vocab_size", &meta_vocab))) goto err_gguf;
    if (meta_vocab != m->hp.n_vocab) {
        rc = pdm_error_set(PDM_EFORMAT, "%s: %s.vocab_size %u disagrees with token_embd "
                           "(%u rows)", path, rd.arch->name, meta_vocab, m->hp.n_vocab);
        goto err_gguf;
    }
    if ((rc = pdm__check_unsupported(m->gguf, path, hp->n_layers))) goto err_gguf;
    if ((rc = pdm__bind_mat(m->gguf, path, "token_embd.weight", hp->n_vocab, hp->d_model,
                            &m->tok_embd)))
        goto err_gguf;
    if (pdm_gguf_tensor(m->gguf, "output.weight")) {
        if ((rc = pdm__bind_mat(m->gguf, path, "output.weight", hp->n_vocab, hp->d_model,
                                &m->output)))
            goto err_gguf;
    } else {
        m->output = m->tok_embd;
    }

    const int64_t qdim = (int64_t)hp->n_heads * hp->head_dim;
    const int64_t kvdim = (int64_t)hp->n_kv_heads * hp->head_dim;
    /* f32 vectors of a layer: 4 norms of d_model, biases, 2 head norms; plus the output norm
     * and the RoPE frequency factors */
    const size_t per_layer = 4 * (size_t)hp->d_model + (size_t)qdim + 2 * (size_t)kvdim +
                             2 * (size_t)hp->head_dim;
    size_t n_floats = (size_t)hp->d_model + hp->head_dim / 2 + per_layer * hp->n_layers;
    m->norms = malloc(n_floats * sizeof(float));
    m->layers = calloc(hp->n_layers, sizeof(*m->layers));
    if (!m->norms || !m->layers) {
        rc = pdm_error_set(PDM_ENOMEM, "%s: out of memory for layers", path);
        goto err_layers;
    }
    float *norm = m->norms;
    if ((rc = pdm__bind_norm(m->gguf, path, "output_norm.weight", hp->d_model, norm)))
        goto err_layers;
    m->output_norm = norm;
    norm += hp->d_model;
    /* Llama 3: one rope_freqs.weight for every layer (llama.cpp src/models/llama.cpp
     * load_arch_tensors, duplicated per layer there). The other architectures' graphs pass no
     * frequency factors, so the tensor is not read for them. */
    if (rd.arch->arch == PDM_ARCH_LLAMA &&
        (rc = pdm__bind_opt_vec(m->gguf, path, "rope_freqs.weight", hp->head_dim / 2, norm,
                                &m->rope_freqs)))
        goto err_layers;
    norm += hp->head_dim / 2;
    if ((rc = pdm__read_layer_kinds(&rd, hp, m->layers))) goto err_layers;

    for (uint32_t l = 0; l < hp->n_layers; l++) {
        pdm_model_layer_t *L = &m->layers[l];
        char name[96];
#define PDM__NAME(suffix) (snprintf(name, sizeof(name), "blk.%u.%s", l, suffix), name)
        if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("attn_norm.weight"), hp->d_model, norm)))
            goto err_layers;
        L->attn_norm = norm;
        norm += hp->d_model;
        if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("ffn_norm.weight"), hp->d_model, norm)))
            goto err_layers;
        L->ffn_norm = norm;
        norm += hp->d_model;
        if ((rc = pdm__bind_mat(m->gguf, path, PDM__NAME("attn_q.weight"), qdim, hp->d_model, &L->wq)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("attn_k.weight"), kvdim, hp->d_model, &L->wk)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("attn_v.weight"), kvdim, hp->d_model, &L->wv)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("attn_output.weight"), hp->d_model, qdim, &L->wo)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("ffn_gate.weight"), hp->n_ff, hp->d_model, &L->w_gate)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("ffn_up.weight"), hp->n_ff, hp->d_model, &L->w_up)) ||
            (rc = pdm__bind_mat(m->gguf, path, PDM__NAME("ffn_down.weight"), hp->d_model, hp->n_ff, &L->w_down)))
            goto err_layers;
        /* Q/K/V biases are optional for every architecture, as in llama.cpp's
         * create_tensor_qkv (Qwen2 files have them). */
        if ((rc = pdm__bind_opt_vec(m->gguf, path, PDM__NAME("attn_q.bias"), qdim, norm, &L->bq)))
            goto err_layers;
        norm += qdim;
        if ((rc = pdm__bind_opt_vec(m->gguf, path, PDM__NAME("attn_k.bias"), kvdim, norm, &L->bk)))
            goto err_layers;
        norm += kvdim;
        if ((rc = pdm__bind_opt_vec(m->gguf, path, PDM__NAME("attn_v.bias"), kvdim, norm, &L->bv)))
            goto err_layers;
        norm += kvdim;
        if (rd.arch->qk_norm) {
            if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("attn_q_norm.weight"), hp->head_dim, norm)))
                goto err_layers;
            L->q_norm = norm;
            norm += hp->head_dim;
            if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("attn_k_norm.weight"), hp->head_dim, norm)))
                goto err_layers;
            L->k_norm = norm;
            norm += hp->head_dim;
        }
        if (rd.arch->post_norms) {
            if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("post_attention_norm.weight"), hp->d_model, norm)))
                goto err_layers;
            L->attn_post_norm = norm;
            norm += hp->d_model;
            if ((rc = pdm__bind_norm(m->gguf, path, PDM__NAME("post_ffw_norm.weight"), hp->d_model, norm)))
                goto err_layers;
            L->ffn_post_norm = norm;
            norm += hp->d_model;
        }
#undef PDM__NAME
    }

    pdm_gguf_str_t tok_model;
    if (pdm_gguf_get_str(m->gguf, "tokenizer.ggml.model", &tok_model) == PDM_OK) {
        rc = pdm_tokenizer_create(m->gguf, &m->tokenizer);
        if (rc == PDM_EUNSUPPORTED) {
            /* The weights still run on token ids (tests against llama.cpp, clients that send
             * ids); whatever needs text reports the missing tokenizer. */
            pdm_log(PDM_LOG_WARN, "%s; the model is loaded without a tokenizer",
                    pdm_error_last());
            m->tokenizer = NULL;
        } else if (rc) {
            goto err_layers;
        }
    }
    if (m->tokenizer) {
        if (pdm_tokenizer_n_vocab(m->tokenizer) != (int32_t)hp->n_vocab) {
            rc = pdm_error_set(PDM_EFORMAT, "%s: tokenizer has %d tokens but the model %u",
                               path, pdm_tokenizer_n_vocab(m->tokenizer), hp->n_vocab);
            goto err_tokenizer;
        }
    }
    if ((rc = pdm__repack(m))) goto err_tokenizer;
    *out = m;
    return PDM_OK;

err_tokenizer:
    pdm_tokenizer_destroy(m->tokenizer);
err_layers:
    free(m->layers);
    free(m->norms);
err_gguf:
    pdm_gguf_close(m->gguf);
err_free:
    free(m);
    return rc;
}

void pdm_model_attn_setup(const pdm_model_t *m, int layer, pdm_kern_attn_t *a)
{
    a->scale = m->hp.attn_scale;
    a->causal = 1;
    a->window = m->layers[layer].window;
}

void pdm_model_free(pdm_model_t *model)
{
    if (!model) return;
    pdm_tokenizer_destroy(model->tokenizer);
    free(model->layers);
    free(model->norms);
    free(model->repacked);
    pdm_gguf_close(model->gguf);
    free(model);
}
