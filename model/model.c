/*
 * model.c - loads a Llama-architecture GGUF: hyperparameters from metadata, weights as
 * quantized views into the mapping, every shape checked against the hyperparameters.
 */
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pdm_model_default_path(void)
{
    const char *env = getenv("PDMESH_MODEL");
    return env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

static int pdm__get_u32_req(const pdm_gguf_t *g, const char *path, const char *key,
                            uint32_t *out)
{
    int rc = pdm_gguf_get_u32(g, key, out);
    if (rc == PDM_ENOTFOUND)
        return pdm_error_set(PDM_EFORMAT, "%s: missing metadata key '%s'", path, key);
    return rc;
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

static int pdm__read_hparams(const pdm_gguf_t *g, const char *path, pdm_model_hparams_t *hp)
{
    int rc;
    pdm_gguf_str_t arch;
    if (pdm_gguf_get_str(g, "general.architecture", &arch) != PDM_OK)
        return pdm_error_set(PDM_EFORMAT, "%s: missing general.architecture", path);
    if (!pdm_gguf_str_eq(arch, "llama"))
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: architecture '%.*s' is not supported "
                             "(only llama)", path, (int)PDM_MIN(arch.len, 64), arch.ptr);
    memset(hp, 0, sizeof(*hp));
    if ((rc = pdm__get_u32_req(g, path, "llama.block_count", &hp->n_layers)) ||
        (rc = pdm__get_u32_req(g, path, "llama.embedding_length", &hp->d_model)) ||
        (rc = pdm__get_u32_req(g, path, "llama.feed_forward_length", &hp->n_ff)) ||
        (rc = pdm__get_u32_req(g, path, "llama.attention.head_count", &hp->n_heads)) ||
        (rc = pdm__get_u32_req(g, path, "llama.context_length", &hp->n_ctx_train)))
        return rc;
    rc = pdm_gguf_get_u32(g, "llama.attention.head_count_kv", &hp->n_kv_heads);
    if (rc == PDM_ENOTFOUND) hp->n_kv_heads = hp->n_heads;
    else if (rc) return rc;
    hp->rope_theta = 10000.0f;
    rc = pdm_gguf_get_f32(g, "llama.rope.freq_base", &hp->rope_theta);
    if (rc && rc != PDM_ENOTFOUND) return rc;
    hp->rms_eps = 1e-5f;
    rc = pdm_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps);
    if (rc && rc != PDM_ENOTFOUND) return rc;

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
    if (hp->d_model % hp->n_heads)
        return pdm_error_set(PDM_EFORMAT, "%s: d_model %u is not divisible by %u heads", path,
                             hp->d_model, hp->n_heads);
    hp->head_dim = hp->d_model / hp->n_heads;
    if (hp->head_dim % 2 || hp->head_dim > PDM_MAX_HEAD_DIM)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: head dimension %u is not supported (even, "
                             "<= %d)", path, hp->head_dim, PDM_MAX_HEAD_DIM);
    uint32_t rope_dims = hp->head_dim;
    rc = pdm_gguf_get_u32(g, "llama.rope.dimension_count", &rope_dims);
    if (rc && rc != PDM_ENOTFOUND) return rc;
    if (rope_dims != hp->head_dim)
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: partial RoPE (%u of %u dims) is not "
                             "supported", path, rope_dims, hp->head_dim);
    if (!(hp->rope_theta > 0.0f) || !(hp->rms_eps > 0.0f))
        return pdm_error_set(PDM_EFORMAT, "%s: invalid rope theta %g or rms epsilon %g", path,
                             hp->rope_theta, hp->rms_eps);
    return PDM_OK;
}

int pdm_model_load(const char *path, pdm_model_t **out)
{
    int rc;
    pdm_model_t *m = calloc(1, sizeof(*m));
    if (!m) return pdm_error_set(PDM_ENOMEM, "%s: out of memory", path);
    if ((rc = pdm_gguf_open(path, &m->gguf))) goto err_free;
    if ((rc = pdm__read_hparams(m->gguf, path, &m->hp))) goto err_gguf;

    const pdm_model_hparams_t *hp = &m->hp;
    const pdm_gguf_tensor_t *emb = pdm_gguf_tensor(m->gguf, "token_embd.weight");
    if (!emb || emb->n_dims != 2) {
        rc = pdm_error_set(PDM_EFORMAT, "%s: missing or malformed tensor 'token_embd.weight'",
                           path);
        goto err_gguf;
    }
    m->hp.n_vocab = (uint32_t)emb->ne[1];
    uint32_t meta_vocab;
    if (pdm_gguf_get_u32(m->gguf, "llama.vocab_size", &meta_vocab) == PDM_OK &&
        meta_vocab != m->hp.n_vocab) {
        rc = pdm_error_set(PDM_EFORMAT, "%s: llama.vocab_size %u disagrees with token_embd "
                           "(%u rows)", path, meta_vocab, m->hp.n_vocab);
        goto err_gguf;
    }
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

    size_t n_norms = (size_t)hp->d_model * (2 * (size_t)hp->n_layers + 1);
    m->norms = malloc(n_norms * sizeof(float));
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

    const int64_t qdim = (int64_t)hp->n_heads * hp->head_dim;
    const int64_t kvdim = (int64_t)hp->n_kv_heads * hp->head_dim;
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
#undef PDM__NAME
    }

    pdm_gguf_str_t tok_model;
    if (pdm_gguf_get_str(m->gguf, "tokenizer.ggml.model", &tok_model) == PDM_OK) {
        if ((rc = pdm_tokenizer_create(m->gguf, &m->tokenizer))) goto err_layers;
        if (pdm_tokenizer_n_vocab(m->tokenizer) != (int32_t)hp->n_vocab) {
            rc = pdm_error_set(PDM_EFORMAT, "%s: tokenizer has %d tokens but the model %u",
                               path, pdm_tokenizer_n_vocab(m->tokenizer), hp->n_vocab);
            goto err_tokenizer;
        }
    }
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

void pdm_model_free(pdm_model_t *model)
{
    if (!model) return;
    pdm_tokenizer_destroy(model->tokenizer);
    free(model->layers);
    free(model->norms);
    pdm_gguf_close(model->gguf);
    free(model);
}
