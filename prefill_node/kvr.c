/*
 * kvr.c - KV-Runahead (KV-Runahead §4, App. C): ranks 0..p-1 form a chain with contiguous,
 * uneven chunks (kvr-e even, kvr-s searched by partition_search.c, kvr-p interpolated from
 * the partition table, §4.2). Per layer, rank i receives the layer's KV of [0, start_i) from
 * rank i-1, the receive posted before the QKV projection so that it overlaps with it; it
 * appends its own rows, sends [0, end_i) on to rank i+1 at once and asynchronously, then
 * computes attention (§4.3, Fig. 7). Only the last rank ends with the whole KV (§4), and
 * computes the logits of the last token.
 *
 * A follow-up turn starts the chain at a rank that holds the whole cached prefix
 * (pdm_prefill_conv_chain_head; `head`), so the prefix needs no transfer first.
 */
#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

int pdm_prefill__run_kvr(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks,
                         int head)
{
    const int R = r->g->size, me = r->g->rank;
    const int pos_in_chain = (me - head + R) % R;
    const int prev = (me - 1 + R) % R, next = (me + 1) % R;
    int32_t my_start = t->start;
    for (int c = 0; c < pos_in_chain; c++) my_start += chunks[c];
    const int n_local = chunks[pos_in_chain];
    const int32_t my_end = my_start + n_local;
    pdm_prefill__span_t mine = {my_start, n_local};

    int st = pdm_prefill__ensure_ctx(r, n_local);
    if (!st) PDM_PREFILL__COMPUTE(r, st = pdm_prefill__embed_local(r, t, &mine, 1, n_local));
    if (st) return st;

    const int n_layers = (int)r->hp->n_layers;
    pdm_kvt_req_t *sends = pdm_prefill__scratch(r, sizeof(pdm_kvt_req_t) * (size_t)n_layers);
    if (!sends) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    for (int l = 0; l < n_layers; l++) sends[l] = PDM_KVT_REQ_NONE;
    pdm_kvt_msg_t msg;
    for (int l = 0; l < n_layers && !st; l++) {
        /* (a) Post the receive of [0, my_start) before the QKV projection so that it
         * overlaps with it (Fig. 7, first blue box). */
        pdm_kvt_req_t recv = PDM_KVT_REQ_NONE;
        if (pos_in_chain > 0) {
            msg.n_iov = 0;
            st = pdm_prefill__iov_cache_rows(r, l, 0, my_start, &msg);
            if (!st)
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_CHAIN, l, 0, msg.iov, msg.n_iov,
                                        &recv);
            if (st) break;
        }
        PDM_PREFILL__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm_prefill__q8_scales(r, t, l, n_local))) {
            pdm_kvt_cancel(r->g->kvt, &recv, 1); /* NONE is skipped */
            break;
        }
        PDM_PREFILL__COMPUTE(r, pdm_prefill__store_local(r, l, &mine, 1));
        if ((st = pdm_prefill__stream_layer(r, l))) break;
        if (recv != PDM_KVT_REQ_NONE && (st = pdm_prefill__wait(r, &recv, 1))) break;
        /* (b) Forward the concatenated cache [0, my_end) at once and without waiting
         * (second blue box); the rows are final, so the send can run during attention. */
        if (pos_in_chain < R - 1) {
            msg.n_iov = 0;
            st = pdm_prefill__iov_cache_rows(r, l, 0, my_end, &msg);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_CHAIN, l, 0, msg.iov,
                                        msg.n_iov, &sends[l]);
            if (st) break;
        }
        pdm_kv_view_t view;
        pdm_kv_cache_view(r->cache, (uint32_t)l, 0, my_end, &view);
        PDM_PREFILL__COMPUTE(r, pdm_model_attention(r->ctx, l, &r->act, &view, 1);
                     pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    int st2 = pdm_prefill__wait(r, sends, n_layers); /* also releases the handles after an error */
    if (st) return st;
    if (st2) return st2;
    if (pos_in_chain == R - 1)
        PDM_PREFILL__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, n_local - 1, r->logits));
    return PDM_OK;
}
