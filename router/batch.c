/*
 * batch.c - the router's batch packing (batch.h).
 */
#include "router/batch.h"

int rt_batch_pack(const rt_batch_cand_t *cand, int n, int max_requests, uint32_t max_tokens,
                  int *out)
{
    if (n < 1) return 0;
    if (max_requests < 1) max_requests = 1;
    if (max_requests > RT_BATCH_MAX) max_requests = RT_BATCH_MAX;
    int k = 0;
    out[k++] = 0;
    uint64_t tokens = cand[0].n_tokens;
    for (int i = 1; i < n && k < max_requests; i++) {
        if (!cand[i].eligible || tokens + cand[i].n_tokens > max_tokens) continue;
        tokens += cand[i].n_tokens;
        out[k++] = i;
    }
    return k;
}
