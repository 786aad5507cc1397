/*
 * prefill_internal.h - what the files of one prefill rank share (not for use outside
 * prefill_node/): the rank object, the per-layer steps every method is built from
 * (rank_steps.c), and the methods' entry points, one file each. It does not include
 * rank.h: the methods sit below rank.c, which dispatches to them.
 *
 * A method only changes where a layer's KV comes from and which KV the local queries see
 * (KV-Runahead §4.3, Fig. 7): embed -> per layer [attn_in -> exchange -> attention ->
 * attn_out_ffn] -> logits on the rank that owns the last token. KV lives in one head-major
 * cache per rank with slot == absolute position, so received KV lands at its final place and
 * views over it need no copies.
 *
 * Files: rank.c (object, validation, dispatch, streaming set-up), rank_steps.c (shared
 * steps), tsp.c, kvr.c, ring.c + ring_pass_kv.c + ring_pass_q.c (the methods), kvfile.c (KV
 * dumps). Every method function runs one validated task on this rank: it returns PDM_OK
 * with r->logits filled on the rank that computed the last token, or the first error of a
 * step (a communication error fails the task; rank.c then resets the conversation).
 */
#ifndef PDM_PREFILL_INTERNAL_H
#define PDM_PREFILL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "common/pdm.h"
#include "kvtransfer/kvtransfer.h"
#include "model/model.h"
#include "prefill_node/conv.h"
#include "prefill_node/plan.h"
#include "prefill_node/pool.h"
#include "prefill_node/task.h"

_Static_assert(PDM_PREFILL_MAX_RANKS == PDM_KVT_MAX_RANKS,
               "the planner's and kvtransfer's group sizes must agree");

/* Batch tasks' scratch state (batch.c), freed with the rank. */
typedef struct pdm_prefill__batch pdm_prefill__batch_t;
void pdm_prefill__batch_free(pdm_prefill__batch_t *b);

#define PDM_PREFILL__MAX_SPANS 32 /* owned position ranges of one rank in one conversation */

/* A run of positions [start, start + len) one rank owns. */
typedef struct {
    int32_t start, len;
} pdm_prefill__span_t;

/* The ring methods' view of the conversation (ring.c): every rank's KV block, the positions
 * it owns among [0, start + T), cached and new. */
typedef struct {
    pdm_prefill__span_t ranges[PDM_KVT_MAX_RANKS][PDM_PREFILL__MAX_SPANS]; /* each rank's
                                                                     * KV block */
    int n_ranges[PDM_KVT_MAX_RANKS];
    size_t bytes[PDM_KVT_MAX_RANKS];
    int n_new[PDM_KVT_MAX_RANKS]; /* new tokens (queries) of each rank */
    size_t max_bytes;
} pdm_prefill__ring_layout_t;

struct pdm_prefill_rank {
    /* Fault injection for tests (PDMESH_FAULT_STALL_AFTER_LAYER=L[:MS]): after streaming
     * layer L the rank stalls for MS milliseconds (default 60000), so a test can kill it, or
     * its decode node, while its request is certainly mid-stream; layer -1 = off. */
    int fault_stall_layer;
    int fault_stall_ms;
    const pdm_model_t *model;
    pdm_kvt_group_t *g;
    pdm_prefill_rank_params_t p;
    const pdm_model_hparams_t *hp;

    pdm_model_ctx_t *ctx; /* recreated when a task needs a larger batch */
    int ctx_batch;
    pdm_kv_cache_t *cache; /* [capacity = ctx_tokens], slot == absolute position */
    pdm_kv_cache_t *solo_cache; /* solo tasks' scratch KV [capacity: the longest solo prompt
                                 * so far, at most ctx_tokens], NULL until the first one; the
                                 * group's `cache` is never written by a solo task */
    pdm_prefill__batch_t *batch; /* batch tasks' scratch caches (batch.c), NULL until one */
    pdm_act_t act;         /* this rank's new tokens */
    int act_cap;
    float *logits; /* [n_vocab] */

    /* Group state, identical on every rank (capacity ctx_tokens). */
    pdm_prefill_conv_t conv;
    /* The group's other conversations (pool.h): each entry's kv holds this rank's rows
     * [0, n) of every layer and kv head, K then V, in the cache's dtype, then (q8) the
     * scales; fault_corrupt_pool (tests, PDMESH_FAULT_CORRUPT_POOL=1) flips a byte of an
     * entry before it is checked. */
    pdm_prefill_pool_t pool;
    int fault_corrupt_pool;

    /* Message descriptors of the collectives and the CP layout (large: on the heap). */
    pdm_kvt_msg_t *send_msgs, *recv_msgs; /* [PDM_KVT_MAX_RANKS] */
    pdm_prefill__ring_layout_t *layout;

    /* Per-task scratch (grown as needed, never shrunk). */
    void *scratch;
    size_t scratch_bytes;

    /* Statistics of the running task. */
    double t_wait, t_compute;

    /* Streaming of the running task (NULL: none) and this rank's ranges of it. */
    pdm_kvt_stream_tx_t *tx;
    pdm_prefill_range_t mine[PDM_PREFILL_MAX_RANGES];
    int n_mine;
    pdm_prefill_range_t prefix_mine[PDM_PREFILL_MAX_PREFIX_RUNS]; /* cached runs it streams */
    int n_prefix_mine;

    /* Prompt log-probabilities of the running task (task.prompt_logprobs), grown as needed. */
    int32_t *plp_pos;             /* [plp_cap] positions scored */
    pdm_token_logprobs_t *plp;    /* [plp_cap] their log-probabilities */
    int32_t n_plp, plp_cap;
    float *plp_logits;            /* [PDM_PREFILL__SCORE_ROWS][n_vocab] logits of a block of rows */
};

#define PDM_PREFILL__SCORE_ROWS 32 /* rows whose logits are computed at once for scoring */

/* Runs `stmt` and counts its time as compute. */
#define PDM_PREFILL__COMPUTE(r, stmt)                                                          \
    do {                                                                                        \
        double t0_ = pdm_now();                                                                 \
        stmt;                                                                                   \
        (r)->t_compute += pdm_now() - t0_;                                                      \
    } while (0)

/* Checks a solo task (a whole prompt, method single, valid tokens, a stream target, within
 * --ctx) as rank.c runs it and batch.c takes it as a member (rank_steps.c, below both). */
int pdm_prefill__solo_check(const pdm_prefill_rank_t *r, const pdm_prefill_task_t *t);

/* ---- Per-layer steps (rank_steps.c) ------------------------------------------------------ */

/* A model context for `batch` rows (at least 1), recreated only when it must grow. */
int pdm_prefill__ensure_ctx(pdm_prefill_rank_t *r, int batch);
/* Per-task scratch of at least `bytes` (grown, never shrunk; owned by the rank); NULL when
 * out of memory. */
void *pdm_prefill__scratch(pdm_prefill_rank_t *r, size_t bytes);
/* Ranges of positions in [lo, hi) owned by `rank`. Returns the count or -1 if more than
 * `max`. */
int pdm_prefill__owned_ranges(const pdm_prefill_rank_t *r, int rank, int32_t lo, int32_t hi,
                              pdm_prefill__span_t *out, int max);
/* Bytes of one cache row (one token of one kv head's K or V) in the cache's dtype. */
size_t pdm_prefill__row_bytes(const pdm_prefill_rank_t *r);
/* iov over cache rows [start, start + len) of every kv head's K and V of `layer`, appended
 * to msg (head-major: for each head K then V). PDM_EOVERFLOW past PDM_KVT_MAX_IOV pieces. */
int pdm_prefill__iov_cache_rows(const pdm_prefill_rank_t *r, int layer, int32_t start,
                                int32_t len, pdm_kvt_msg_t *msg);
/* Views of a packed block (ranges in order; per range, per head: K rows then V rows). */
void pdm_prefill__block_views(const pdm_prefill_rank_t *r, int layer, const void *block,
                              const pdm_prefill__span_t *ranges, int n_ranges,
                              pdm_kv_view_t *views);
/* Bytes of a packed block of these ranges. */
size_t pdm_prefill__block_bytes(const pdm_prefill_rank_t *r, const pdm_prefill__span_t *ranges,
                                int n);
/* Waits for requests until the group's deadline, counting the time as waiting. */
int pdm_prefill__wait(pdm_prefill_rank_t *r, pdm_kvt_req_t *reqs, int n);
/* Merges partial attention results (o2, lse2) into (o1, lse1) for n rows of every head. */
void pdm_prefill__merge_rows(pdm_prefill_rank_t *r, float *o1, float *lse1, const float *o2,
                             const float *lse2, int n);
/* Embeds this rank's new tokens (given as ranges of positions in ascending order) into
 * r->act. */
int pdm_prefill__embed_local(pdm_prefill_rank_t *r, const pdm_prefill_task_t *task,
                             const pdm_prefill__span_t *mine, int n_mine, int n_local);
/* Stores the new K and V rows of r->act (laid out as `mine`) into the cache. */
void pdm_prefill__store_local(pdm_prefill_rank_t *r, int layer, const pdm_prefill__span_t *mine,
                              int n_mine);
/* Attention of act's queries against `views`; with no view at all every row is empty
 * (o = 0, lse = -inf), the neutral element of the merge. */
void pdm_prefill__attend(pdm_prefill_rank_t *r, int layer, pdm_act_t *act,
                         const pdm_kv_view_t *views, int n_views);
/* q8 KV: fixes the scales of `layer` for a new conversation (an all-reduce max over the
 * ranks' new rows); no-op otherwise. Every rank calls it for every layer. */
int pdm_prefill__q8_scales(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int layer,
                           int n_local);
/* Streams this rank's final rows of `layer` to the decode node (no-op without a stream). */
int pdm_prefill__stream_layer(pdm_prefill_rank_t *r, int layer);

/* Prompt log-probabilities (task.prompt_logprobs): logits[n][n_vocab] are the rows of
 * positions pos[n]; every row whose next position is still in the task scores that token
 * into r->plp. PDM_ENOMEM when the entries cannot grow. */
int pdm_prefill__score_logits(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                              const float *logits, const int32_t *pos, int n);
/* The same for rows [0, n) of r->act after the last layer (their logits computed here, in
 * blocks of PDM_PREFILL__SCORE_ROWS). */
int pdm_prefill__score_act(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int n);

/* ---- The methods, one file each ----------------------------------------------------------- */

/* tsp.c: even split, all-gather of every layer's K and V (KV-Runahead §4.1, Fig. 4). */
int pdm_prefill__run_tsp(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks);
/* kvr.c: KV-Runahead chain starting at rank `head` with chunk sizes in chain order (§4). */
int pdm_prefill__run_kvr(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks,
                         int head);
/* ring.c: context parallelism's ring (§3.5): layout, embedding, then pass-KV or pass-Q by
 * t->method. */
int pdm_prefill__run_ring(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t);
/* ring_pass_kv.c: pass-KV (§3.5.2, Alg. 2) over the layout `L`, this rank's new tokens
 * embedded in r->act as `mine`. */
int pdm_prefill__ring_pass_kv(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                              const pdm_prefill__span_t *mine, int n_mine, int n_local,
                              const pdm_prefill__ring_layout_t *L);
/* ring_pass_q.c: pass-Q (§3.5.3, Alg. 3) with the All2All of partial outputs. */
int pdm_prefill__ring_pass_q(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                             const pdm_prefill__span_t *mine, int n_mine, int n_local,
                             const pdm_prefill__ring_layout_t *L);

#endif /* PDM_PREFILL_INTERNAL_H */
