/*
 * ring_pass_kv.c - ring pass-KV (context parallelism §3.5.2, Alg. 2). N ring steps per layer:
 * each rank computes the partial attention of its queries against the KV block it holds
 * while sending that block on to the next rank and receiving the previous rank's; blocks are
 * staged in two buffers padded to the largest block, and the partial results are merged with
 * the lse formula. Chosen over pass-Q when the miss rate or the compute hides the KV
 * messages (§3.4, Alg. 1; pdm_prefill_choose_cp).
 */
#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

int pdm_prefill__ring_pass_kv(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                              const pdm_prefill__span_t *mine, int n_mine, int n_local,
                              const pdm_prefill__ring_layout_t *L)
{
    const int N = r->g->size, me = r->g->rank;
    const int prev = (me - 1 + N) % N, next = (me + 1) % N;
    const size_t qrows = (size_t)PDM_MAX(n_local, 1);
    const size_t o_floats = qrows * r->hp->n_heads * r->hp->head_dim;
    const size_t lse_floats = qrows * r->hp->n_heads;
    const size_t stage_bytes = (L->max_bytes + 63) / 64 * 64;
    char *mem = pdm_prefill__scratch(r, 2 * stage_bytes + sizeof(float) * (o_floats + lse_floats));
    if (!mem) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    void *stage[2] = {mem, mem + stage_bytes};
    float *tmp_o = (float *)(mem + 2 * stage_bytes), *tmp_lse = tmp_o + o_floats;

    int st = PDM_OK;
    pdm_kv_view_t views[PDM_PREFILL__MAX_SPANS];
    pdm_kvt_msg_t msg;
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) {
        if (n_local) PDM_PREFILL__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm_prefill__q8_scales(r, t, l, n_local))) break;
        if (n_local) PDM_PREFILL__COMPUTE(r, pdm_prefill__store_local(r, l, mine, n_mine));
        if ((st = pdm_prefill__stream_layer(r, l))) break;
        pdm_kvt_req_t send = PDM_KVT_REQ_NONE, recv = PDM_KVT_REQ_NONE;
        /* Step 0: post the receive of the next block, send ours (gathered straight from the
         * cache), and attend to our own KV meanwhile. */
        if (N > 1) {
            int from = prev;
            pdm_kvt_iov_t in = {stage[0], L->bytes[from]};
            st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, 1, &in, 1, &recv);
            msg.n_iov = 0;
            for (int i = 0; i < L->n_ranges[me] && !st; i++)
                st = pdm_prefill__iov_cache_rows(r, l, L->ranges[me][i].start, L->ranges[me][i].len,
                                                 &msg);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, 1, msg.iov, msg.n_iov,
                                        &send);
            if (st) break;
        }
        if (n_local) {
            for (int i = 0; i < L->n_ranges[me]; i++)
                pdm_kv_cache_view(r->cache, (uint32_t)l, L->ranges[me][i].start,
                                  L->ranges[me][i].len, &views[i]);
            PDM_PREFILL__COMPUTE(r, pdm_prefill__attend(r, l, &r->act, views, L->n_ranges[me]));
        }
        for (int s = 1; s < N && !st; s++) {
            const int origin = (me - s + N) % N, cur = (s - 1) & 1;
            if ((st = pdm_prefill__wait(r, &recv, 1))) break;
            if ((st = pdm_prefill__wait(r, &send, 1))) break;
            if (s < N - 1) { /* keep the ring moving while we compute on this block */
                int from = (origin - 1 + N) % N;
                pdm_kvt_iov_t in = {stage[cur ^ 1], L->bytes[from]};
                pdm_kvt_iov_t out = {stage[cur], L->bytes[origin]};
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, s + 1, &in, 1, &recv);
                if (!st)
                    st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, s + 1, &out, 1,
                                            &send);
                if (st) break;
            }
            if (!n_local) continue;
            pdm_prefill__block_views(r, l, stage[cur], L->ranges[origin], L->n_ranges[origin],
                                     views);
            pdm_act_t part = r->act;
            part.o = tmp_o;
            part.lse = tmp_lse;
            PDM_PREFILL__COMPUTE(r, pdm_prefill__attend(r, l, &part, views, L->n_ranges[origin]);
                         pdm_prefill__merge_rows(r, r->act.o, r->act.lse, tmp_o, tmp_lse, n_local));
        }
        pdm_kvt_req_t left[2] = {send, recv};
        int st2 = pdm_prefill__wait(r, left, 2);
        if (!st) st = st2;
        if (!st && n_local) PDM_PREFILL__COMPUTE(r, pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    return st;
}
