/*
 * ring.c - context parallelism's ring (context parallelism §3.5): what pass-KV
 * (ring_pass_kv.c) and pass-Q (ring_pass_q.c) share. The new tokens are cut into 2N chunks
 * and rank i holds chunks i and 2N-1-i, which balances the causal work (§3.5.1;
 * pdm_prefill_plan_ranges); with a cached prefix (partial prefill, §3.2) every rank's block
 * is all positions it owns, cached and new. After the N ring steps the rank holding the last
 * token computes the logits.
 */
#include <string.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

/* Every rank's block: the positions it owns among [0, start + T), cached and new. */
static int pdm__ring_layout(const pdm_prefill_rank_t *r, int32_t end, pdm_prefill__ring_layout_t *L)
{
    memset(L, 0, sizeof(*L));
    for (int j = 0; j < r->g->size; j++) {
        int n = pdm_prefill__owned_ranges(r, j, 0, end, L->ranges[j], PDM_PREFILL__MAX_SPANS);
        if (n < 0 || (size_t)n * 2 * r->hp->n_kv_heads > PDM_KVT_MAX_IOV)
            return pdm_error_set(PDM_EOVERFLOW, "prefill: rank %d's share of the conversation "
                                 "is too fragmented for one message", j);
        L->n_ranges[j] = n;
        L->bytes[j] = pdm_prefill__block_bytes(r, L->ranges[j], n);
        if (L->bytes[j] > L->max_bytes) L->max_bytes = L->bytes[j];
    }
    return PDM_OK;
}

int pdm_prefill__run_ring(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    const int me = r->g->rank;
    const int32_t end = t->start + t->n_tokens;
    pdm_prefill__ring_layout_t *L = r->layout;
    int st = pdm__ring_layout(r, end, L);
    if (st) return st;
    pdm_prefill__span_t mine[PDM_PREFILL__MAX_SPANS];
    int n_mine = pdm_prefill__owned_ranges(r, me, t->start, end, mine, PDM_PREFILL__MAX_SPANS);
    int n_local = 0;
    for (int i = 0; i < n_mine; i++) n_local += mine[i].len;
    for (int j = 0; j < r->g->size; j++) {
        pdm_prefill__span_t tmp[PDM_PREFILL__MAX_SPANS];
        int n = pdm_prefill__owned_ranges(r, j, t->start, end, tmp, PDM_PREFILL__MAX_SPANS);
        for (int i = 0; i < n; i++) L->n_new[j] += tmp[i].len;
    }
    st = pdm_prefill__ensure_ctx(r, n_local);
    if (!st && n_local)
        PDM_PREFILL__COMPUTE(r, st = pdm_prefill__embed_local(r, t, mine, n_mine, n_local));
    if (st) return st;
    if (t->method == PDM_PREFILL_CP_KV)
        st = pdm_prefill__ring_pass_kv(r, t, mine, n_mine, n_local, L);
    else
        st = pdm_prefill__ring_pass_q(r, t, mine, n_mine, n_local, L);
    if (st) return st;
    if (r->conv.owner[end - 1] == me)
        PDM_PREFILL__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, n_local - 1, r->logits));
    return PDM_OK;
}
