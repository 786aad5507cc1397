/*
 * batch.h - batched prefill in the router, the pure parts: which queued requests join a batch
 * task and the queue's order. (schedule.c forms batches with them, request.c sends a batch's
 * PrefillTask once every member's decode node reserved its KV; prefill_node/batch.c runs it.)
 *
 * The queue is kept in deadline order (earliest deadline first, admission order among equal
 * deadlines): requests are dispatched, and batches packed, in that order. A batch task goes
 * to one rank (a solo rank of a load-adaptive group, or the only rank of a 1-rank group) and
 * holds its lead request - the first request of the queue that the scheduler placed there -
 * and then the following eligible requests in queue order while both bounds hold:
 *   members <= prefill_batch_max, and the sum of their prompt tokens <= prefill_batch_tokens.
 * A candidate that would pass the token budget is skipped and later, shorter ones may still
 * join (first fit in deadline order). The lead always goes, even alone over the budget.
 */
#ifndef RT_BATCH_H
#define RT_BATCH_H

#include <stdint.h>

#define RT_BATCH_MAX 8 /* members of a batch task (PDM_PREFILL_BATCH_MAX on the ranks) */

/* A queued request as the packer sees it. */
typedef struct {
    uint32_t n_tokens; /* prompt tokens */
    int eligible;      /* may join a batch (no prompt log-probabilities, not a migration, not
                        * prefilled locally) */
} rt_batch_cand_t;

/* Picks a batch from cand[0..n) (queue order, cand[0] the lead, always taken): writes the
 * chosen indices, ascending, to out[RT_BATCH_MAX] and returns their count (0 for n < 1, else
 * 1..max_requests). max_requests is clamped to [1, RT_BATCH_MAX]. */
int rt_batch_pack(const rt_batch_cand_t *cand, int n, int max_requests, uint32_t max_tokens,
                  int *out);

/* Deadline order: 1 when a request with (deadline_a, id_a) goes before one with
 * (deadline_b, id_b): earlier deadline first, then the earlier admission (lower id). */
static inline int rt_batch_before(double deadline_a, uint64_t id_a, double deadline_b,
                                  uint64_t id_b)
{
    return deadline_a < deadline_b || (deadline_a == deadline_b && id_a < id_b);
}

#endif /* RT_BATCH_H */
