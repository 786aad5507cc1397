/*
 * kv_quant.c - int8 ("q8") KV: one scale per (layer, kv head) for K and one for V, fixed when
 * the prompt is prefilled and shared by every later row of the sequence.
 *
 * This follows the Qualcomm KV-cache note ("Quantized model optimization", d): the past K/V
 * and the newly computed K/V have the same quantization parameters, so nothing is ever
 * re-quantized - not when prefill ranks pass KV to each other, not on the stream to the
 * decode node, not when the decode node appends response rows. The price: a response value
 * outside the prompt's range saturates at +-127 steps (pdm_q8_quantize_row).
 *
 * A scale must be known before the first row of its layer is stored, and it must cover every
 * prompt row of that layer. The engine's ordinary prefill runs all layers of one chunk
 * before the next chunk, so the first chunk's rows would be stored before later chunks'
 * rows of the same layer exist. The prompt of a q8 cache is therefore prefilled layer by
 * layer over all its tokens: QKV of every chunk, scales from their absolute maxima, store,
 * then attention and FFN of every chunk. Distributed prefill does the same per rank with an
 * all-reduce (max) of the maxima (prefill_node/rank_steps.c).
 */
#include "model.h"
#include "model_internal.h"

#include <math.h>
#include <string.h>

void pdm_kv_absmax(const pdm_model_hparams_t *hp, const pdm_act_t *act, float *out)
{
    const uint32_t hd = hp->head_dim, nkv = hp->n_kv_heads;
    for (int i = 0; i < act->n; i++)
        for (uint32_t h = 0; h < nkv; h++) {
            const float *k = act->k + ((size_t)i * nkv + h) * hd;
            const float *v = act->v + ((size_t)i * nkv + h) * hd;
            float mk = out[2 * h], mv = out[2 * h + 1];
            for (uint32_t d = 0; d < hd; d++) {
                mk = fmaxf(mk, fabsf(k[d]));
                mv = fmaxf(mv, fabsf(v[d]));
            }
            out[2 * h] = mk;
            out[2 * h + 1] = mv;
        }
}

void pdm_kv_cache_set_scales(pdm_kv_cache_t *c, uint32_t layer, const float *absmax)
{
    for (uint32_t h = 0; h < c->n_kv_heads; h++) {
        float *s = c->scale + 2 * ((size_t)layer * c->n_kv_heads + h);
        s[0] = pdm_q8_scale(absmax[2 * h]);
        s[1] = pdm_q8_scale(absmax[2 * h + 1]);
    }
}

void pdm_kv_cache_fix_scales(pdm_kv_cache_t *c)
{
    c->scales_fixed = 1;
}

void pdm_model__kv_store_q8(pdm_kv_cache_t *cache, int layer, const pdm_act_t *act,
                            int32_t row)
{
    const uint32_t hd = cache->head_dim, nkv = cache->n_kv_heads;
    for (uint32_t h = 0; h < nkv; h++) {
        const float *s = cache->scale + 2 * ((size_t)layer * nkv + h);
        int8_t *k = (int8_t *)pdm_kv_cache_k(cache, (uint32_t)layer, h) + (size_t)row * hd;
        int8_t *v = (int8_t *)pdm_kv_cache_v(cache, (uint32_t)layer, h) + (size_t)row * hd;
        for (int i = 0; i < act->n; i++) {
            pdm_q8_quantize_row(act->k + ((size_t)i * nkv + h) * hd, k + (size_t)i * hd, hd, s[0]);
            pdm_q8_quantize_row(act->v + ((size_t)i * nkv + h) * hd, v + (size_t)i * hd, hd, s[1]);
        }
    }
}

/* Rows [c0, c0 + cn) of `all` as a batch of their own (no copy). */
static pdm_act_t pdm__act_rows(const pdm_model_hparams_t *hp, const pdm_act_t *all, int c0, int cn)
{
    const size_t qdim = (size_t)hp->n_heads * hp->head_dim;
    const size_t kvdim = (size_t)hp->n_kv_heads * hp->head_dim;
    pdm_act_t a = {
        .n = cn,
        .pos = all->pos + c0,
        .x = all->x + (size_t)c0 * hp->d_model,
        .q = all->q + (size_t)c0 * qdim,
        .k = all->k + (size_t)c0 * kvdim,
        .v = all->v + (size_t)c0 * kvdim,
        .o = all->o + (size_t)c0 * qdim,
        .lse = all->lse + (size_t)c0 * hp->n_heads,
    };
    return a;
}

int pdm_model__prefill_q8_prompt(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache,
                                 const int32_t *tokens, int n, float *logits)
{
    const pdm_model_hparams_t *hp = &pdm_model_ctx_model(ctx)->hp;
    const int mb = pdm_model_ctx_max_batch(ctx);
    const int32_t slot0 = cache->n_tokens;
    if (cache->windowed) /* every layer of the whole prompt is stored before attention */
        return pdm_error_set(PDM_EUNSUPPORTED, "a q8 prompt prefill needs a cache without "
                             "windowed layers (its scales come from the whole prompt)");
    pdm_act_t all;
    int st = pdm_act_alloc(hp, n, &all);
    if (st) return st;
    for (int c0 = 0; c0 < n && !st; c0 += mb) {
        pdm_act_t part = pdm__act_rows(hp, &all, c0, PDM_MIN(mb, n - c0));
        for (int i = 0; i < part.n; i++) part.pos[i] = cache->pos0 + slot0 + c0 + i;
        st = pdm_model_embed(ctx, tokens + c0, part.pos, part.n, &part);
    }
    if (st) {
        pdm_act_free(&all);
        return st;
    }
    all.n = n;
    float absmax[2 * PDM_MAX_KV_HEADS];
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        for (int c0 = 0; c0 < n; c0 += mb) {
            pdm_act_t part = pdm__act_rows(hp, &all, c0, PDM_MIN(mb, n - c0));
            pdm_model_attn_in(ctx, (int)l, &part);
        }
        memset(absmax, 0, sizeof(absmax));
        pdm_kv_absmax(hp, &all, absmax);
        pdm_kv_cache_set_scales(cache, l, absmax);
        for (int c0 = 0; c0 < n; c0 += mb) {
            pdm_act_t part = pdm__act_rows(hp, &all, c0, PDM_MIN(mb, n - c0));
            pdm_model_kv_store(ctx, cache, (int)l, &part, slot0 + c0);
        }
        for (int c0 = 0; c0 < n; c0 += mb) {
            pdm_act_t part = pdm__act_rows(hp, &all, c0, PDM_MIN(mb, n - c0));
            pdm_kv_view_t view;
            pdm_kv_cache_view(cache, l, 0, slot0 + c0 + part.n, &view);
            pdm_model_attention(ctx, (int)l, &part, &view, 1);
            pdm_model_attn_out_ffn(ctx, (int)l, &part);
        }
    }
    pdm_kv_cache_fix_scales(cache);
    if (logits) pdm_model_logits(ctx, &all, n - 1, logits);
    cache->n_tokens += n;
    pdm_act_free(&all);
    return PDM_OK;
}

int pdm_kv_dtype_parse(const char *name, pdm_dtype_t *out)
{
    if (name && !strcmp(name, "f32")) *out = PDM_DT_F32;
    else if (name && !strcmp(name, "f16")) *out = PDM_DT_F16;
    else if (name && !strcmp(name, "q8")) *out = PDM_DT_I8;
    else
        return pdm_error_set(PDM_EINVAL, "invalid KV dtype '%s' (f32, f16 or q8)",
                             name ? name : "");
    return PDM_OK;
}
