/*
 * conv.h - the group's conversation (prefix reuse): what KV a prefill group holds after its
 * tasks, and how a follow-up turn continues it.
 *
 * A follow-up turn of a conversation whose first P tokens are cached is a partial prefill of
 * the T new tokens (context parallelism §3.2, "persistent KV"): the group computes only the
 * new tokens, and when the KV goes to a decode node every rank also streams the cached
 * positions it computed. The state: the tokens, the rank that computed each position, and
 * per rank the prefix [0, held) it holds whole (KV-Runahead passes the prefix down the
 * chain, so after a chain its last rank holds everything, §4; cp-* leave each rank only its
 * own shares, context parallelism §3.5). Every rank keeps one; the router and the launcher
 * keep a mirror built from the same tasks with the same functions, so both ends compute the
 * same plan for a follow-up turn: where it starts, which rank streams which cached
 * positions. Pure bookkeeping like plan.h: no I/O, no UCX.
 */
#ifndef PDM_PREFILL_CONV_H
#define PDM_PREFILL_CONV_H

#include <stdint.h>

#include "prefill_node/plan.h"

typedef struct {
    int32_t n;                           /* positions held: [0, n) */
    int32_t cap;                         /* capacity of owner and tokens */
    int8_t *owner;                       /* [cap] rank that computed each position */
    int32_t *tokens;                     /* [cap] token at each position */
    int32_t held[PDM_PREFILL_MAX_RANKS]; /* rank r holds all KV of positions [0, held[r]) */
    int last_owner;                      /* rank that computed position n - 1 */
} pdm_prefill_conv_t;

/* Cached positions travel to a decode node as runs of one owner; run i is chunk
 * PDM_PREFILL_PREFIX_CHUNK + i of the request's plan (new tokens use chunks below it). */
#define PDM_PREFILL_PREFIX_CHUNK 128
#define PDM_PREFILL_MAX_PREFIX_RUNS 64

/* Grows the arrays to hold `cap` positions (keeps what is held). */
int pdm_prefill_conv_reserve(pdm_prefill_conv_t *c, int32_t cap);
void pdm_prefill_conv_free(pdm_prefill_conv_t *c);
/* Forgets everything held (a failed task leaves the group's KV incomplete). */
void pdm_prefill_conv_reset(pdm_prefill_conv_t *c);
/* Length of the longest common prefix of the held tokens and tokens[0, n). */
int32_t pdm_prefill_conv_common(const pdm_prefill_conv_t *c, const int32_t *tokens, int32_t n);
/* KVR: the rank to start a chain continuing at `start` (the first one from the last owner on
 * that holds all of [0, start)); 0 for start 0; -1 if no rank does (after cp-*). */
int pdm_prefill_conv_chain_head(const pdm_prefill_conv_t *c, int ranks, int32_t start);
/* The held positions [0, start) as maximal runs of one owner, in position order, with chunk
 * ids PDM_PREFILL_PREFIX_CHUNK + i (out may be NULL: count only). Returns the number of
 * runs, -1 if more than `max`. */
int pdm_prefill_conv_prefix_runs(const pdm_prefill_conv_t *c, int32_t start,
                                 pdm_prefill_range_t *out, int max);

/* What a follow-up turn asks for (pdm_prefill_conv_followup_start). */
typedef struct {
    pdm_prefill_method_t method; /* the method asked for; AUTO allowed: with a cached prefix
                                  * pdm_prefill_resolve makes it single (1 rank) or cp-kv /
                                  * cp-q, which continue anywhere */
    int ranks;                   /* ranks of the group */
    const int32_t *tokens;       /* [n_tokens] the turn's whole prompt, from position 0 */
    int32_t n_tokens;
    int32_t min_cached;          /* reuse only a prefix of at least this many tokens (the
                                  * router: its block_tokens; the launcher: 1) */
    int explicit_chunks;         /* the caller gives KVR chunk sizes for the whole prompt, so
                                  * the task must start at 0 */
    int reuse;                   /* 0: no reuse. The caller sets it only while the mirror is
                                  * what the ranks will hold when the task arrives (the
                                  * router: reuse enabled, group idle, no reuse pending) */
} pdm_prefill_followup_params_t;

/* Where a follow-up turn starts: the number P of the prompt's first tokens the group reuses
 * from `c` (it computes positions [P, n_tokens)); 0 means "prefill the whole prompt". The one
 * rule for the router and the launcher. P is the longest common prefix of the held tokens
 * and the prompt, then cut down until every condition below holds, or 0 when it cannot be:
 *   - reuse is on and no explicit chunks are given;
 *   - at least one token is computed: P <= n_tokens - 1 (its logits give the first token);
 *   - tsp has no partial prefill: 0;
 *   - kvr-*: at least one new token per rank, P <= n_tokens - ranks (a shorter P keeps the
 *     rest of the reuse; the task names its prefix, so the ranks cut their conversation
 *     there), and some rank holds the whole [0, P) to head the chain
 *     (pdm_prefill_conv_chain_head; not after cp-*): else 0;
 *   - the cached prefix streams to a decode node in at most PDM_PREFILL_MAX_PREFIX_RUNS runs
 *     of one owner: else 0;
 *   - P >= min_cached (at least 1): else 0.
 * A method that resolves differently at P (kvr-s needs a table entry for exactly
 * n_tokens - P) is the caller's to retry at 0. Never fails; reads `c` only. */
int32_t pdm_prefill_conv_followup_start(const pdm_prefill_conv_t *c,
                                        const pdm_prefill_followup_params_t *p);

/* The plan of a task continuing the conversation at `start` with `n_new` tokens computed by
 * method `m` (chunks: KVR/TSP sizes, NULL for an even split): with `with_prefix`, first the
 * held runs of [0, start) (what a partial prefill streams besides its new tokens), then the
 * new tokens' ranges (pdm_prefill_plan_ranges, KVR chains starting at the chain head).
 * `out` holds PDM_PREFILL_MAX_PREFIX_RUNS + PDM_PREFILL_MAX_RANGES. Returns the number of
 * ranges and sets *n_prefix to how many of them are cached runs; -1 with the error set when
 * the method cannot continue this conversation. */
#define PDM_PREFILL_MAX_PLAN (PDM_PREFILL_MAX_PREFIX_RUNS + PDM_PREFILL_MAX_RANGES)
int pdm_prefill_conv_plan(const pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                          int32_t start, int32_t n_new, const int *chunks, int with_prefix,
                          pdm_prefill_range_t *out, int *n_prefix);
/* Records a task that succeeded: the conversation is cut at `start` and continues with the
 * `n_new` tokens computed as `ranges` (from pdm_prefill_plan_ranges) by method `m`. */
int pdm_prefill_conv_commit(pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                            int32_t start, const int32_t *tokens, int32_t n_new,
                            const pdm_prefill_range_t *ranges, int n_ranges);

/* ---- The plan of a task: one function for the router and the local harness ------------ */

typedef struct {
    pdm_prefill_followup_params_t followup; /* where it may start; .method is the method asked
                                             * for (AUTO allowed); .explicit_chunks is set
                                             * from `chunks` */
    const pdm_model_hparams_t *hp;          /* the model's shapes (used by AUTO) */
    const int *chunks;                      /* KVR chunk sizes for the whole prompt, or NULL */
    const pdm_partition_table_t *table;     /* KVR-P / KVR-S / AUTO, or NULL */
    const pdm_calibration_t *calib;         /* AUTO with a cached prefix, or NULL */
    int fallback;                           /* a method that cannot run this task falls back
                                             * to kvr-e (single on one rank) instead of failing
                                             * (the router's policy; the harness runs what it
                                             * is told or fails) */
} pdm_prefill_task_plan_params_t;

typedef struct {
    pdm_prefill_method_t method;            /* resolved */
    int32_t start;                          /* P: cached tokens the task continues after */
    int chunks[PDM_PREFILL_MAX_RANKS];      /* chunk sizes of the T = n_tokens - P new tokens */
    int has_chunks;                         /* the chunks came from the caller or the table */
    char why[160];                          /* why this method (pdm_prefill_resolve) */
    pdm_prefill_range_t ranges[PDM_PREFILL_MAX_PLAN]; /* who streams which tokens: the cached
                                             * runs, then the new tokens (pdm_prefill_conv_plan) */
    int n_ranges, n_prefix;
} pdm_prefill_task_plan_t;

/* Plans a group task for a prompt on a group whose conversation is `c`: where it starts
 * (pdm_prefill_conv_followup_start), the method and partition at that start
 * (pdm_prefill_resolve; a start the method cannot continue from, such as kvr-s without a
 * table entry for n - P, is retried at 0) and the ranges (pdm_prefill_conv_plan). The router
 * (router/request.c) and the local harness (prefill_node/launch.c) both plan with it, so a
 * request plans the same whichever of them runs it. Pure: reads `c`, no I/O. On error
 * (nothing can run: the message says why) *out is undefined. */
int pdm_prefill_conv_plan_task(const pdm_prefill_conv_t *c,
                               const pdm_prefill_task_plan_params_t *p,
                               pdm_prefill_task_plan_t *out);

#endif /* PDM_PREFILL_CONV_H */
