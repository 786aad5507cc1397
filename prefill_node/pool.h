/*
 * pool.h - the group's pool of conversations (issue 19, "KV cache pool"): besides the one
 * conversation its ranks are working on (the "active" one, conv.h), a prefill group keeps
 * the KV of recently finished conversations, so that a follow-up of any of them - not only of
 * the last one - is a partial prefill of its new tokens.
 *
 * Entries are whole conversations (tokens, who computed each position, who holds which
 * prefix: a pdm_prefill_conv_t), identified by a hash of their tokens (pdm_prefill_conv_id).
 * A conversation that extends another subsumes it (the shorter entry is dropped), so a shared
 * system prompt followed by different questions gives one entry per question, each of them
 * usable for any prompt starting with the system prompt. The budget counts tokens (the same
 * number on every rank and in the router, whatever the KV dtype and rank count); least
 * recently used entries go first (LRU, as the decode node's pool, decode_node/node.c).
 *
 * One module for the ranks and the router: the router keeps a mirror (metadata only, no
 * ops), the ranks keep the same entries with their KV rows (ops). Both apply the same
 * operations in the same order - pdm_prefill_pool_begin before a task, with the source the
 * task names (PrefillTask.pool_source) - so the router knows which conversations each group
 * holds without being told. When they get out of step (a failure the ranks did not see) the
 * task's named source is missing or its tokens differ: the rank refuses it (prefix miss), the
 * router resets its mirror and has the ranks clear theirs (PrefillTask.pool_reset) and the
 * request is prefilled in full. A rank checks each entry's XXH3 checksum before its rows are
 * used: a mismatch drops it and fails the task, never uses it.
 *
 * Pure bookkeeping apart from the ops callbacks: no I/O, no UCX.
 */
#ifndef PDM_PREFILL_POOL_H
#define PDM_PREFILL_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "prefill_node/conv.h"

#define PDM_PREFILL_POOL_MAX_ENTRIES 64 /* entries per group, whatever the budget */

typedef struct {
    pdm_prefill_conv_t conv; /* the conversation: tokens, owners, held prefixes */
    uint64_t id;             /* pdm_prefill_conv_id(&conv) */
    uint64_t stamp;          /* last use (the least recently used is evicted first) */
    void *kv;                /* rank only: its KV rows of the conversation (ops.save); NULL in
                              * the router's mirror */
    size_t kv_bytes;
    uint64_t checksum;       /* rank only: XXH3 of kv, checked by ops.load */
} pdm_prefill_pool_entry_t;

/* What a rank does with KV rows (the router passes none). */
typedef struct {
    /* Copies the active cache's rows of conversation `c` into e->kv (e->kv_bytes,
     * e->checksum). PDM_ENOMEM when it cannot: the entry is not kept. */
    int (*save)(void *ctx, const pdm_prefill_conv_t *c, pdm_prefill_pool_entry_t *e);
    /* Copies e's rows into the active cache after checking e->checksum: PDM_ECHECKSUM (the
     * cache untouched) when they differ. */
    int (*load)(void *ctx, const pdm_prefill_pool_entry_t *e);
    /* Frees e->kv. */
    void (*drop)(void *ctx, pdm_prefill_pool_entry_t *e);
    void *ctx;
} pdm_prefill_pool_ops_t;

typedef struct {
    pdm_prefill_pool_entry_t e[PDM_PREFILL_POOL_MAX_ENTRIES]; /* [n] in no order */
    int n;
    int64_t budget_tokens;  /* sum of the entries' tokens at most this; 0: no pool (the group
                             * keeps only its active conversation, as before issue 19) */
    int64_t tokens;         /* sum of the entries' tokens */
    uint64_t clock;         /* stamps */
    pdm_prefill_pool_ops_t ops; /* all NULL in the router's mirror */
    /* Counters since init. */
    uint64_t saves, loads, evictions, corrupt, misses;
} pdm_prefill_pool_t;

/* A non-zero 64-bit hash of c's tokens [0, n) (0 for an empty conversation). */
uint64_t pdm_prefill_conv_id(const pdm_prefill_conv_t *c);

/* Caller storage; `ops` may be NULL (a mirror). */
void pdm_prefill_pool_init(pdm_prefill_pool_t *p, int64_t budget_tokens,
                           const pdm_prefill_pool_ops_t *ops);
/* Drops every entry (ops.drop on each); the counters stay. */
void pdm_prefill_pool_clear(pdm_prefill_pool_t *p);
void pdm_prefill_pool_fini(pdm_prefill_pool_t *p);
/* A new budget (negative taken as 0): entries are evicted, least recently used first, until
 * they fit. */
void pdm_prefill_pool_set_budget(pdm_prefill_pool_t *p, int64_t budget_tokens);

/* Where a follow-up prompt should continue: the conversation among `active` and the pool's
 * entries with the largest pdm_prefill_conv_followup_start for `fp` (ties: active, then the
 * most recently used entry). Sets *source to its id (0 for the active conversation, also when
 * nothing can be reused) and returns it; the caller plans the task on it
 * (pdm_prefill_conv_plan_task). Reads only. */
const pdm_prefill_conv_t *pdm_prefill_pool_pick(const pdm_prefill_pool_t *p,
                                                const pdm_prefill_conv_t *active,
                                                const pdm_prefill_followup_params_t *fp,
                                                uint64_t *source);

/* Before a task at `start` whose cached prefix comes from conversation `source` (0: the
 * active one), on every rank and in the router's mirror alike:
 *   - start 0: the active conversation goes into the pool, the active one is emptied;
 *   - source is the active conversation: it stays; if the task cuts it (start < its length),
 *     a copy goes into the pool first, so its tail is not lost;
 *   - else: the active conversation goes into the pool and the entry `source` is copied into
 *     the active cache (ops.load; the entry stays, as the most recently used).
 * Saving drops entries the saved conversation extends and is skipped when an entry extends
 * it; then entries are evicted LRU to the budget. Errors (nothing used): PDM_ESTATE when
 * `source` is not held or holds fewer than `start` tokens (prefix miss), PDM_ECHECKSUM when
 * its rows fail their checksum (the entry is dropped). In both cases the active conversation
 * is emptied. *loaded is set to 1 when an entry was loaded (a rank then agrees with the others
 * that every load succeeded), else 0. Callers apply the task's budget (set_budget) after
 * begin, so that a smaller budget never evicts the source of the task that brings it. */
int pdm_prefill_pool_begin(pdm_prefill_pool_t *p, pdm_prefill_conv_t *active, uint64_t source,
                           int32_t start, int *loaded);

#endif /* PDM_PREFILL_POOL_H */
