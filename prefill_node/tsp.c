/*
 * tsp.c - the TSP baseline (KV-Runahead §4.1, Fig. 4): the prompt is split evenly and every
 * layer all-gathers K and V, so every rank attends its own query rows against the whole
 * KV. The reference KV-Runahead improves on: its all-gather puts the whole KV on every rank,
 * where a chain passes only the prefix each rank needs.
 */
#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

int pdm_prefill__run_tsp(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks)
{
    const int R = r->g->size, me = r->g->rank;
    int32_t begin[PDM_KVT_MAX_RANKS + 1];
    begin[0] = t->start;
    for (int i = 0; i < R; i++) begin[i + 1] = begin[i] + chunks[i];
    pdm_prefill__span_t mine = {begin[me], chunks[me]};
    int st = pdm_prefill__ensure_ctx(r, chunks[me]);
    if (!st) PDM_PREFILL__COMPUTE(r, st = pdm_prefill__embed_local(r, t, &mine, 1, chunks[me]));
    if (st) return st;
    pdm_kvt_msg_t *parts = r->send_msgs;
    for (int l = 0; l < (int)r->hp->n_layers; l++) {
        PDM_PREFILL__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm_prefill__q8_scales(r, t, l, chunks[me]))) return st;
        PDM_PREFILL__COMPUTE(r, pdm_prefill__store_local(r, l, &mine, 1));
        if ((st = pdm_prefill__stream_layer(r, l))) return st;
        for (int j = 0; j < R; j++) {
            parts[j].n_iov = 0;
            st = pdm_prefill__iov_cache_rows(r, l, begin[j], chunks[j], &parts[j]);
            if (st) return st;
        }
        double t0 = pdm_now();
        st = pdm_kvt_group_allgather(r->g, l, parts);
        r->t_wait += pdm_now() - t0;
        if (st) return st;
        pdm_kv_view_t view;
        pdm_kv_cache_view(r->cache, (uint32_t)l, 0, begin[R], &view);
        PDM_PREFILL__COMPUTE(r, pdm_model_attention(r->ctx, l, &r->act, &view, 1);
                     pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    if (me == R - 1)
        PDM_PREFILL__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, chunks[me] - 1, r->logits));
    return PDM_OK;
}
