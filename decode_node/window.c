/*
 * window.c - the static-window KV manager (Qualcomm AI Research, "KV cache implementation
 * for inference on HTP", section "KV cache buffer management optimizations", c and d: reserve
 * 2(S-1) rows per K/V so that append is a write and sliding is pointer arithmetic; with a
 * smaller reserve, e.g. 1.5(S-1), one copy every reserve - (S-1) tokens).
 *
 * Two users: pdm_kvwin_t below, a whole-model window for static-shape engines (every layer
 * sees the last S - 1 tokens), and the decode node's windowed layers (Gemma 3's local
 * layers), whose rows live in the sequence's own cache (model/kv_cache.c moves them, with the
 * same rule) and whose accounting is here (pdm_kvwin_slots, pdm_kvwin_plan).
 */
#include "decode_node/decode.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/pdm.h"

int pdm_kvwin_create(const pdm_model_hparams_t *hp, int32_t S, double r, pdm_dtype_t dtype,
                     pdm_kvwin_t **out)
{
    if (S < 2 || !(r >= 1.5 && r <= 8) || (dtype != PDM_DT_F16 && dtype != PDM_DT_F32))
        return pdm_error_set(PDM_EINVAL, "static window: S must be >= 2 and r in [1.5, 8]");
    pdm_kvwin_t *w = calloc(1, sizeof(*w));
    if (!w) return pdm_error_set(PDM_ENOMEM, "static window: out of memory");
    w->window = S - 1;
    w->reserve = (int32_t)ceil(r * (S - 1));
    if (w->reserve < w->window + 1) w->reserve = w->window + 1;
    int st = pdm_kv_cache_create(hp, w->reserve, dtype, &w->cache);
    if (st) {
        free(w);
        return st;
    }
    /* Left padding: the (empty) window is rows [0, S-1), the first token goes to row S-1. */
    w->end = w->window;
    *out = w;
    return PDM_OK;
}

void pdm_kvwin_destroy(pdm_kvwin_t *w)
{
    if (!w) return;
    pdm_kv_cache_destroy(w->cache);
    free(w);
}

/* Makes room for n rows at `end`: when the reserve is exhausted, moves the valid rows back
 * towards the front (the one copy the design allows), ending at S-1 (or lower for a prompt
 * batch that would not fit after it). Callers guarantee n_valid + n <= reserve. */
static void pdm__kvwin_room(pdm_kvwin_t *w, int n)
{
    if (w->end + n <= w->reserve) return;
    const int32_t new_end = PDM_MIN(w->window, w->reserve - n);
    if (w->n_valid > 0) { /* the same move as the decode node's windowed layers */
        pdm_kv_cache_move_rows(w->cache, w->end - w->n_valid, new_end - w->n_valid, w->n_valid);
        w->copies = w->cache->win_copies;
        w->bytes_moved = w->cache->win_bytes_moved;
    }
    w->end = new_end;
}

int pdm_kvwin_forward(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_kvwin_t *w,
                      const int32_t *tokens, int n, float *logits)
{
    if (n < 1 || n > pdm_model_ctx_max_batch(ctx))
        return pdm_error_set(PDM_EINVAL, "static window: %d tokens in one step", n);
    if (n > 1 && w->n_valid + n > w->window)
        return pdm_error_set(PDM_EINVAL, "static window: a batch of %d tokens after %d must fit "
                             "the window of %d without sliding", n, w->n_valid, w->window);
    pdm__kvwin_room(w, n);
    int32_t pos[n];
    for (int i = 0; i < n; i++) pos[i] = w->pos_next + i;
    int st = pdm_model_embed(ctx, tokens, pos, n, act);
    if (st) return st;
    pdm_kv_cache_t *c = w->cache;
    /* Slot i holds position pos_next - (end - i). */
    c->pos0 = w->pos_next - w->end;
    /* What the new tokens see: the last n_valid past rows, then themselves (causal). For a
     * single token with a full window that is the last S-1 tokens plus itself. */
    const int32_t first = w->end - w->n_valid;
    for (int l = 0; l < (int)c->n_layers; l++) {
        pdm_model_attn_in(ctx, l, act);
        pdm_model_kv_store(ctx, c, l, act, w->end);
        pdm_kv_view_t view;
        pdm_kv_cache_view(c, (uint32_t)l, first, w->n_valid + n, &view);
        pdm_model_attention(ctx, l, act, &view, 1);
        pdm_model_attn_out_ffn(ctx, l, act);
    }
    if (logits) pdm_model_logits(ctx, act, n - 1, logits);
    w->end += n;
    w->pos_next += n;
    w->n_valid = PDM_MIN(w->n_valid + n, w->window);
    return PDM_OK;
}

int64_t pdm_kvwin_slots(uint32_t n_layers, uint32_t n_windowed, int32_t win_rows,
                        int64_t n_tokens)
{
    if (!n_layers || !n_windowed || win_rows <= 0 || n_tokens <= win_rows) return n_tokens;
    const int64_t rows = (int64_t)(n_layers - n_windowed) * n_tokens +
                         (int64_t)n_windowed * win_rows;
    return (rows + n_layers - 1) / n_layers;
}

int pdm_kvwin_plan(const pdm_model_t *m, pdm_dtype_t dtype, double r, int32_t n_prompt,
                   int32_t max_new, pdm_kvwin_plan_t *out)
{
    const int64_t n = (int64_t)n_prompt + max_new;
    if (n_prompt < 1 || max_new < 0 || n > INT32_MAX)
        return pdm_error_set(PDM_EINVAL, "static window: %d + %d tokens", n_prompt, max_new);
    const pdm_kv_cache_params_t cp = {.capacity = (int32_t)n, .dtype = dtype, .model = m,
                                      .window_reserve = r};
    pdm_kvwin_plan_t p = {0};
    int st = pdm_kv_cache_layout(&m->hp, &cp, &p.layout);
    if (st) return st;
    const pdm_kv_cache_layout_t *l = &p.layout;
    p.slots = pdm_kvwin_slots(m->hp.n_layers, l->n_windowed, l->win_rows, n);
    if (l->win_rows && n_prompt > l->win_rows) /* staging: n_prompt rows per windowed head */
        p.stage_slots = ((int64_t)l->n_windowed * n_prompt + m->hp.n_layers - 1) /
                        m->hp.n_layers;
    *out = p;
    return PDM_OK;
}

void pdm_kvwin_cache_bytes(const pdm_model_t *m, const pdm_kv_cache_t *c, uint64_t *local,
                           uint64_t *global)
{
    const uint64_t row = pdm_dtype_row_bytes(c->dtype, c->head_dim) * 2 * c->n_kv_heads;
    *local = *global = 0;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const uint64_t rows = c->windowed && c->windowed[l] ? (uint64_t)c->win_rows
                                                            : (uint64_t)c->capacity;
        if (m->layers[l].window > 0) *local += rows * row;
        else *global += rows * row;
    }
}
