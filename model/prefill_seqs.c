/*
 * prefill_seqs.c - several sequences prefilled as one batch (model.h, pdm_model_prefill_seqs).
 *
 * The linear parts of a layer (norms, Q/K/V, output projection, FFN) are per row: the rows
 * of all sequences go through them as one matrix product, which is where a batch pays off
 * (each weight row is read once per layer for all of them, as the decode node's steps do).
 * Attention is the only step that mixes rows, so it runs once per sequence on a view of the
 * batch's rows of that sequence against that sequence's own cache: no query ever sees
 * another sequence's keys (the block-diagonal causal mask of packed batches; cf. Orca's
 * "selective batching", Yu et al., OSDI '22, §4.2: attention split per request, the other
 * operations batched).
 */
#include <string.h>

#include "common/pdm.h"
#include "model/model.h"

/* Rows [off, off + n) of act as an activation batch of its own (no copy). */
static pdm_act_t pdm__act_rows(const pdm_model_hparams_t *hp, const pdm_act_t *act, int off,
                               int n)
{
    const size_t d = hp->d_model, qd = (size_t)hp->n_heads * hp->head_dim,
                 kvd = (size_t)hp->n_kv_heads * hp->head_dim;
    pdm_act_t s = {
        .n = n,
        .pos = act->pos + off,
        .x = act->x + (size_t)off * d,
        .q = act->q + (size_t)off * qd,
        .k = act->k + (size_t)off * kvd,
        .v = act->v + (size_t)off * kvd,
        .o = act->o + (size_t)off * qd,
        .lse = act->lse + (size_t)off * hp->n_heads,
    };
    return s;
}

int pdm_model_prefill_seqs(pdm_model_ctx_t *ctx, pdm_act_t *act, const pdm_model_seq_t *seqs,
                           int n_seqs, pdm_model_layer_cb on_layer, void *data)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    const pdm_model_hparams_t *hp = &m->hp;
    if (n_seqs < 1 || n_seqs > PDM_MODEL_MAX_SEQS)
        return pdm_error_set(PDM_EINVAL, "a batch of %d sequences (1..%d)", n_seqs,
                             PDM_MODEL_MAX_SEQS);
    int total = 0;
    for (int s = 0; s < n_seqs; s++) {
        const pdm_model_seq_t *q = &seqs[s];
        if (q->n < 1 || !q->tokens || !q->cache)
            return pdm_error_set(PDM_EINVAL, "sequence %d of the batch is empty", s);
        if (q->cache->windowed)
            return pdm_error_set(PDM_EUNSUPPORTED, "sequence %d: a batched prefill needs a "
                                 "cache without windowed layers", s);
        for (int t = 0; t < s; t++)
            if (seqs[t].cache == q->cache)
                return pdm_error_set(PDM_EINVAL, "sequences %d and %d share a KV cache", t, s);
        if ((int64_t)q->cache->n_tokens + q->n > q->cache->capacity)
            return pdm_error_set(PDM_EOVERFLOW, "sequence %d: %d tokens do not fit in its KV "
                                 "cache (%d of %d slots used)", s, q->n, q->cache->n_tokens,
                                 q->cache->capacity);
        for (int i = 0; i < q->n; i++)
            if (q->tokens[i] < 0 || (uint32_t)q->tokens[i] >= hp->n_vocab)
                return pdm_error_set(PDM_ERANGE, "sequence %d: token id %d is outside the "
                                     "vocabulary (0..%u)", s, q->tokens[i], hp->n_vocab - 1);
        total += q->n;
        if (total > pdm_model_ctx_max_batch(ctx))
            return pdm_error_set(PDM_EINVAL, "a batch of more than %d tokens exceeds the "
                                 "context's %d", total - 1, pdm_model_ctx_max_batch(ctx));
    }

    /* Embed every sequence's tokens at its own positions (cache->pos0 + n_tokens + i). */
    int off[PDM_MODEL_MAX_SEQS + 1];
    off[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        const pdm_model_seq_t *q = &seqs[s];
        pdm_act_t rows = pdm__act_rows(hp, act, off[s], q->n);
        for (int i = 0; i < q->n; i++)
            rows.pos[i] = q->cache->pos0 + q->cache->n_tokens + i;
        /* embed copies positions onto themselves: pos already points at the rows */
        int st = pdm_model_embed(ctx, q->tokens, rows.pos, q->n, &rows);
        if (st) return st; /* (not reached: the tokens were checked above) */
        off[s + 1] = off[s] + q->n;
    }
    act->n = total;

    int fix[PDM_MODEL_MAX_SEQS]; /* q8 caches whose scales this prompt sets */
    for (int s = 0; s < n_seqs; s++)
        fix[s] = seqs[s].cache->dtype == PDM_DT_I8 && !seqs[s].cache->scales_fixed;
    int st = PDM_OK;
    for (uint32_t l = 0; l < hp->n_layers && !st; l++) {
        pdm_model_attn_in(ctx, (int)l, act);
        for (int s = 0; s < n_seqs; s++) {
            pdm_kv_cache_t *c = seqs[s].cache;
            pdm_act_t rows = pdm__act_rows(hp, act, off[s], seqs[s].n);
            if (fix[s]) {
                /* q8, a new prompt: this sequence's scales from its own rows (as a prompt
                 * prefilled alone in one batch takes them) */
                float absmax[2 * PDM_MAX_KV_HEADS] = {0};
                pdm_kv_absmax(hp, &rows, absmax);
                pdm_kv_cache_set_scales(c, l, absmax);
            }
            pdm_model_kv_store(ctx, c, (int)l, &rows, c->n_tokens);
            pdm_kv_view_t view;
            pdm_kv_cache_view(c, l, 0, c->n_tokens + seqs[s].n, &view);
            pdm_model_attention(ctx, (int)l, &rows, &view, 1);
        }
        /* every sequence's KV of layer l is final now: the caller may send it while the
         * next layers compute */
        if (on_layer) st = on_layer(data, (int)l);
        if (!st) pdm_model_attn_out_ffn(ctx, (int)l, act);
    }
    if (st) return st;
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].logits) pdm_model_logits(ctx, act, off[s + 1] - 1, seqs[s].logits);
        seqs[s].cache->n_tokens += seqs[s].n;
        if (fix[s]) pdm_kv_cache_fix_scales(seqs[s].cache);
    }
    return PDM_OK;
}
