/*
 * ring_pass_q.c - ring pass-Q (context parallelism §3.5.3, Alg. 3): the queries travel
 * instead of the KV. Each rank attends every rank's query rows (with their positions)
 * against its own KV block as they pass; then an All2All sends the partial outputs back to
 * the ranks that own the queries, which merge them with the lse formula. Wins when few new
 * tokens follow a long cached prefix (§3.4, Alg. 1 and 5).
 */
#include <string.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

int pdm_prefill__ring_pass_q(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                             const pdm_prefill__span_t *mine, int n_mine, int n_local,
                             const pdm_prefill__ring_layout_t *L)
{
    const int N = r->g->size, me = r->g->rank;
    const int prev = (me - 1 + N) % N, next = (me + 1) % N;
    const size_t qdim = (size_t)r->hp->n_heads * r->hp->head_dim, nh = r->hp->n_heads;
    int max_new = 0, total_new = 0;
    size_t q_off[PDM_KVT_MAX_RANKS]; /* row offset of each rank's partials */
    for (int j = 0; j < N; j++) {
        q_off[j] = (size_t)total_new;
        total_new += L->n_new[j];
        max_new = PDM_MAX(max_new, L->n_new[j]);
    }
    /* Scratch: two Q stages [max_new] x (qdim floats + 1 position), partial outputs of every
     * rank's queries against our KV [total_new] x (qdim + nh), and the partials of our own
     * queries computed by every other rank [N][n_local] x (qdim + nh). */
    const size_t stage_floats = (size_t)PDM_MAX(max_new, 1) * (qdim + 1);
    const size_t part_floats = (size_t)PDM_MAX(total_new, 1) * (qdim + nh);
    const size_t in_floats = (size_t)N * PDM_MAX(n_local, 1) * (qdim + nh);
    float *mem =
        pdm_prefill__scratch(r, sizeof(float) * (2 * stage_floats + part_floats + in_floats));
    if (!mem) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    float *stage[2] = {mem, mem + stage_floats};
    float *part_o = mem + 2 * stage_floats, *part_lse = part_o + (size_t)total_new * qdim;
    float *in_o = part_o + part_floats, *in_lse = in_o + (size_t)N * n_local * qdim;

    int st = PDM_OK;
    pdm_kv_view_t views[PDM_PREFILL__MAX_SPANS];
    pdm_kvt_msg_t *a2a_send = r->send_msgs, *a2a_recv = r->recv_msgs;
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) {
        if (n_local) PDM_PREFILL__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm_prefill__q8_scales(r, t, l, n_local))) break;
        if (n_local) PDM_PREFILL__COMPUTE(r, pdm_prefill__store_local(r, l, mine, n_mine));
        if ((st = pdm_prefill__stream_layer(r, l))) break;
        for (int i = 0; i < L->n_ranges[me]; i++)
            pdm_kv_cache_view(r->cache, (uint32_t)l, L->ranges[me][i].start,
                              L->ranges[me][i].len, &views[i]);
        pdm_kvt_req_t send = PDM_KVT_REQ_NONE, recv = PDM_KVT_REQ_NONE;
        /* A Q message: the query rows, then their absolute positions (as int32). */
        if (N > 1) {
            int from = prev;
            pdm_kvt_iov_t in[2] = {
                {stage[0], sizeof(float) * qdim * L->n_new[from]},
                {stage[0] + qdim * L->n_new[from], sizeof(int32_t) * L->n_new[from]}};
            pdm_kvt_iov_t out[2] = {{r->act.q, sizeof(float) * qdim * n_local},
                                    {r->act.pos, sizeof(int32_t) * n_local}};
            st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, 1, in, 2, &recv);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, 1, out, 2, &send);
            if (st) break;
        }
        if (n_local) {
            pdm_act_t part = r->act;
            part.o = part_o + q_off[me] * qdim;
            part.lse = part_lse + q_off[me] * nh;
            PDM_PREFILL__COMPUTE(r, pdm_prefill__attend(r, l, &part, views, L->n_ranges[me]));
        }
        for (int s = 1; s < N && !st; s++) {
            const int origin = (me - s + N) % N, cur = (s - 1) & 1, nq = L->n_new[origin];
            if ((st = pdm_prefill__wait(r, &recv, 1))) break;
            if ((st = pdm_prefill__wait(r, &send, 1))) break;
            if (s < N - 1) {
                int from = (origin - 1 + N) % N;
                pdm_kvt_iov_t in[2] = {
                    {stage[cur ^ 1], sizeof(float) * qdim * L->n_new[from]},
                    {stage[cur ^ 1] + qdim * L->n_new[from], sizeof(int32_t) * L->n_new[from]}};
                pdm_kvt_iov_t out[2] = {{stage[cur], sizeof(float) * qdim * nq},
                                        {stage[cur] + qdim * nq, sizeof(int32_t) * nq}};
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, s + 1, in, 2, &recv);
                if (!st)
                    st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, s + 1, out, 2,
                                            &send);
                if (st) break;
            }
            if (!nq) continue;
            pdm_act_t foreign = {
                .n = nq,
                .pos = (int32_t *)(stage[cur] + qdim * nq),
                .q = stage[cur],
                .o = part_o + q_off[origin] * qdim,
                .lse = part_lse + q_off[origin] * nh,
            };
            PDM_PREFILL__COMPUTE(r, pdm_prefill__attend(r, l, &foreign, views, L->n_ranges[me]));
        }
        pdm_kvt_req_t left[2] = {send, recv};
        int st2 = pdm_prefill__wait(r, left, 2);
        if (!st) st = st2;
        if (st) break;
        /* All2All: partial outputs go back to the ranks that own the queries (§3.5.3). */
        for (int j = 0; j < N; j++) {
            a2a_send[j] = (pdm_kvt_msg_t){
                .iov = {{part_o + q_off[j] * qdim, sizeof(float) * qdim * L->n_new[j]},
                        {part_lse + q_off[j] * nh, sizeof(float) * nh * L->n_new[j]}},
                .n_iov = 2};
            a2a_recv[j] = (pdm_kvt_msg_t){
                .iov = {{in_o + (size_t)j * n_local * qdim, sizeof(float) * qdim * n_local},
                        {in_lse + (size_t)j * n_local * nh, sizeof(float) * nh * n_local}},
                .n_iov = 2};
        }
        double t0 = pdm_now();
        st = pdm_kvt_group_alltoall(r->g, l, a2a_send, a2a_recv);
        r->t_wait += pdm_now() - t0;
        if (st || !n_local) continue;
        PDM_PREFILL__COMPUTE(r, {
            memcpy(r->act.o, part_o + q_off[me] * qdim, sizeof(float) * qdim * n_local);
            memcpy(r->act.lse, part_lse + q_off[me] * nh, sizeof(float) * nh * n_local);
            for (int j = 0; j < N; j++)
                if (j != me)
                    pdm_prefill__merge_rows(r, r->act.o, r->act.lse,
                                            in_o + (size_t)j * n_local * qdim,
                                            in_lse + (size_t)j * n_local * nh, n_local);
            pdm_model_attn_out_ffn(r->ctx, l, &r->act);
        });
    }
    return st;
}
