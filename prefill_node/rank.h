/*
 * rank.h - one rank of a prefill group: R processes that compute one prompt's KV together
 * over kvtransfer, with the methods of plan.h.
 *
 * Every rank owns the new tokens of its share (it computed their KV); the group as a whole
 * keeps a conversation's KV between tasks so that a follow-up turn is a partial prefill of T
 * new tokens after P cached ones (context-parallelism §3.2). Every rank tracks the same
 * deterministic group state (conv.h: who owns which position, which rank holds which
 * prefix), so no extra messages are needed to agree on it.
 *
 * A solo task (task.h, load-adaptive groups) is run by one rank alone: the engine's single
 * prefill of a whole prompt into a scratch cache, streamed to the decode node; it keeps
 * nothing and leaves the group's state as it was, so the other ranks need not see it.
 *
 * The methods' per-layer schedules each live in a file named for them: tsp.c (KV-Runahead
 * §4.1), kvr.c (KV-Runahead §4), ring_pass_kv.c and ring_pass_q.c (context parallelism
 * §3.5.2-3.5.3, sharing ring.c); rank.c validates a task and dispatches it.
 */
#ifndef PDM_PREFILL_RANK_H
#define PDM_PREFILL_RANK_H

#include <stdint.h>

#include "kvtransfer/kvtransfer.h"
#include "model/model.h"
#include "prefill_node/task.h"

/* Defaults: 1 thread, 8192 tokens of KV, f16, 30 s per communication step. */
void pdm_prefill_rank_params_default(pdm_prefill_rank_params_t *p);

/* A rank of a group already connected (`group` stays owned by the caller and must outlive
 * the rank). */
int pdm_prefill_rank_create(const pdm_model_t *model, pdm_kvt_group_t *group,
                            const pdm_prefill_rank_params_t *p, pdm_prefill_rank_t **out);
void pdm_prefill_rank_destroy(pdm_prefill_rank_t *r);

/* Runs the task. Validation errors (method cannot run this task on this group, lengths too
 * short, cache capacity) are reported before any communication, identically on every rank.
 * A communication failure fails the task (PDM_ETIMEOUT / PDM_EPEER) and resets the group's
 * conversation state; the rank stays usable for new tasks after the group is rebuilt. */
int pdm_prefill_rank_run(pdm_prefill_rank_t *r, const pdm_prefill_task_t *task,
                         pdm_prefill_result_t *res);

/* Runs n (1..PDM_PREFILL_BATCH_MAX) solo tasks as one batch on this rank (batch.c): their
 * tokens go through the layers together (model.h, pdm_model_prefill_seqs), each into its own
 * scratch KV cache, each streamed layer by layer to its own decode node. out[i] is member i's
 * outcome: a member with bad input, an unreachable or failing decode node or a passed
 * deadline fails alone. Returns PDM_OK, or PDM_EINVAL / PDM_ENOMEM for the batch as a whole
 * (then no member ran). The group's cache and conversation stay as they were. */
int pdm_prefill_rank_run_batch(pdm_prefill_rank_t *r, const pdm_prefill_batch_member_t *in,
                               int n, pdm_prefill_batch_out_t *out);

/* Conversation length the group holds (P for the next task). */
int32_t pdm_prefill_rank_seq_len(const pdm_prefill_rank_t *r);

#endif /* PDM_PREFILL_RANK_H */
