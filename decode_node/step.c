/*
 * step.c - one continuous-batching decode step over the engine's per-layer steps.
 */
#include "decode_node/decode.h"

#include "common/pdm.h"

const char *const pdm_decode_phase_names[PDM_DECODE_PHASES] = {
    "embed", "attn_in", "kv_store_attention", "attn_out_ffn", "logits"};

int pdm_decode_step(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs, int n)
{
    return pdm_decode_step_timed(ctx, act, seqs, NULL, n, NULL);
}

int pdm_decode_step_beams(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs,
                          pdm_beam_kv_t *const *beams, int n)
{
    return pdm_decode_step_timed(ctx, act, seqs, beams, n, NULL);
}

/* Adds the time since *t to phases[ph] and restarts the clock (no clock without phases). */
static void pdm__phase(double *phases, int ph, double *t)
{
    if (!phases) return;
    double now = pdm_now();
    phases[ph] += now - *t;
    *t = now;
}

int pdm_decode_step_timed(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs,
                          pdm_beam_kv_t *const *beams, int n, double *phases)
{
    if (n < 1) return PDM_OK;
    if (n > pdm_model_ctx_max_batch(ctx))
        return pdm_error_set(PDM_EINVAL, "decode: %d sequences exceed the batch of %d", n,
                             pdm_model_ctx_max_batch(ctx));
    int32_t tokens[n], positions[n];
    for (int i = 0; i < n; i++) {
        if (beams && beams[i]) { /* the rows of a beam search (beam.c) */
            int st = pdm_beam_step_check(ctx, beams + i, n - i);
            if (st) return st;
            for (int b = 0; b < beams[i]->n_live; b++) {
                tokens[i + b] = seqs[i + b].token;
                positions[i + b] = pdm_beam_kv_next_pos(beams[i]);
            }
            i += beams[i]->n_live - 1;
            continue;
        }
        const pdm_kv_cache_t *c = seqs[i].cache;
        if (c->n_tokens >= c->capacity)
            return pdm_error_set(PDM_EOVERFLOW, "decode: sequence %d's KV cache is full (%d "
                                 "tokens)", i, c->capacity);
        tokens[i] = seqs[i].token;
        positions[i] = c->pos0 + c->n_tokens;
    }
    /* Static-window KV: windowed layers make room for this token's row before any layer
     * runs (the Qualcomm note's copy, once every win_rows - (S - 1) steps). After the checks
     * above so that an error leaves the caches as they were (a move keeps their content). */
    for (int i = 0; i < n; i++)
        if (!(beams && beams[i]) && seqs[i].cache->windowed && !seqs[i].cache->offload)
            pdm_kv_cache_room(seqs[i].cache, 1); /* cannot fail: a slot is free, S - 1 < rows */
    double t = phases ? pdm_now() : 0;
    int st = pdm_model_embed(ctx, tokens, positions, n, act);
    if (st) return st;
    pdm__phase(phases, PDM_DECODE_PH_EMBED, &t);
    const pdm_model_hparams_t *hp = &pdm_model_ctx_model(ctx)->hp;
    const size_t qdim = (size_t)hp->n_heads * hp->head_dim;
    const size_t kvdim = (size_t)hp->n_kv_heads * hp->head_dim;
    for (int l = 0; l < (int)hp->n_layers; l++) {
        pdm_model_attn_in(ctx, l, act); /* batched: one matrix product for all sequences */
        pdm__phase(phases, PDM_DECODE_PH_ATTN_IN, &t);
        for (int i = 0; i < n; i++) {
            /* Row i of the batch, seen as a batch of one against its own cache; the rows of a
             * beam search as one batch against the shared prompt and their segments. */
            pdm_kv_cache_t *c = seqs[i].cache;
            pdm_beam_kv_t *beam = beams ? beams[i] : NULL;
            pdm_act_t row = *act;
            row.n = beam ? beam->n_live : 1;
            row.pos = act->pos + i;
            row.q = act->q + (size_t)i * qdim;
            row.k = act->k + (size_t)i * kvdim;
            row.v = act->v + (size_t)i * kvdim;
            row.o = act->o + (size_t)i * qdim;
            row.lse = act->lse + (size_t)i * hp->n_heads;
            if (beam) {
                pdm_beam_kv_attend(ctx, beam, l, &row);
                i += row.n - 1;
                continue;
            }
            if (c->offload) { /* head-wise offload: store + attention by head group */
                st = pdm_kvoff_attention(c->offload, ctx, l, &row);
                if (st) return st;
                continue;
            }
            pdm_model_kv_store(ctx, c, l, &row, c->n_tokens);
            pdm_kv_view_t view;
            pdm_kv_cache_view(c, (uint32_t)l, 0, c->n_tokens + 1, &view);
            pdm_model_attention(ctx, l, &row, &view, 1);
        }
        pdm__phase(phases, PDM_DECODE_PH_ATTN, &t);
        pdm_model_attn_out_ffn(ctx, l, act); /* batched */
        pdm__phase(phases, PDM_DECODE_PH_FFN, &t);
    }
    /* Logits in one product when the outputs are rows of one array (the decode node's
     * layout), else row by row. */
    int contiguous = 1;
    for (int i = 1; i < n; i++)
        contiguous &= seqs[i].logits == seqs[0].logits + (size_t)i * hp->n_vocab;
    if (contiguous)
        pdm_model_logits_batch(ctx, act, n, seqs[0].logits);
    for (int i = 0; i < n; i++) {
        if (!contiguous) pdm_model_logits(ctx, act, i, seqs[i].logits);
        if (beams && beams[i]) {
            if (i == 0 || beams[i - 1] != beams[i]) pdm_beam_kv_commit(beams[i]);
            continue;
        }
        seqs[i].cache->n_tokens++;
    }
    pdm__phase(phases, PDM_DECODE_PH_LOGITS, &t);
    return PDM_OK;
}
