/*
 * model_internal.h - functions shared between the model layer's files (not public API).
 */
#ifndef PDM_MODEL_INTERNAL_H
#define PDM_MODEL_INTERNAL_H

#include "model.h"

/* q8 (model/kv_quant.c): stores act's K/V rows of `layer` at rows [row, row + n) of its
 * arrays (the slot minus pdm_kv_cache_row0) with the layer's fixed per-head scales,
 * saturating. */
void pdm_model__kv_store_q8(pdm_kv_cache_t *cache, int layer, const pdm_act_t *act,
                            int32_t row);
/* q8: pdm_model_prefill of the prompt of a cache whose scales are not fixed yet (layer by
 * layer over all tokens, so each layer's scales see every prompt row before one is stored). */
int pdm_model__prefill_q8_prompt(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache,
                                 const int32_t *tokens, int n, float *logits);

#endif
