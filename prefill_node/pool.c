/*
 * pool.c - the group's pool of conversations (pool.h): the same bookkeeping for the ranks
 * (rank.c, with ops that copy KV rows) and the router's mirror (router/request.c, without).
 */
#include "prefill_node/pool.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/pdm.h"

uint64_t pdm_prefill_conv_id(const pdm_prefill_conv_t *c)
{
    if (c->n <= 0) return 0;
    uint64_t h = XXH3_64bits_withSeed(c->tokens, sizeof(int32_t) * (size_t)c->n,
                                      (uint64_t)c->n);
    return h ? h : 1;
}

void pdm_prefill_pool_init(pdm_prefill_pool_t *p, int64_t budget_tokens,
                           const pdm_prefill_pool_ops_t *ops)
{
    memset(p, 0, sizeof(*p));
    p->budget_tokens = budget_tokens > 0 ? budget_tokens : 0;
    if (ops) p->ops = *ops;
}

/* Removes entry i (ops.drop, its conversation freed); the last entry takes its place. */
static void pdm__pool_remove(pdm_prefill_pool_t *p, int i)
{
    pdm_prefill_pool_entry_t *e = &p->e[i];
    if (p->ops.drop && e->kv) p->ops.drop(p->ops.ctx, e);
    p->tokens -= e->conv.n;
    pdm_prefill_conv_free(&e->conv);
    if (i != p->n - 1) p->e[i] = p->e[p->n - 1];
    memset(&p->e[p->n - 1], 0, sizeof(p->e[0]));
    p->n--;
}

void pdm_prefill_pool_clear(pdm_prefill_pool_t *p)
{
    while (p->n > 0) pdm__pool_remove(p, p->n - 1);
    p->tokens = 0;
}

void pdm_prefill_pool_fini(pdm_prefill_pool_t *p)
{
    pdm_prefill_pool_clear(p);
}

/* Evicts least recently used entries, never the one with id `keep` (0: none), until
 * `extra_tokens` more fit the budget and (keep_slot) a slot is free. Returns 0 when that was
 * reached, -1 when only `keep` is left and it still does not fit. */
static int pdm__pool_evict(pdm_prefill_pool_t *p, int64_t extra_tokens, int keep_slot,
                           uint64_t keep)
{
    while (p->tokens + extra_tokens > p->budget_tokens ||
           (keep_slot && p->n >= PDM_PREFILL_POOL_MAX_ENTRIES)) {
        int lru = -1;
        for (int i = 0; i < p->n; i++)
            if ((!keep || p->e[i].id != keep) && (lru < 0 || p->e[i].stamp < p->e[lru].stamp))
                lru = i;
        if (lru < 0) return -1;
        pdm__pool_remove(p, lru);
        p->evictions++;
    }
    return 0;
}

void pdm_prefill_pool_set_budget(pdm_prefill_pool_t *p, int64_t budget_tokens)
{
    p->budget_tokens = budget_tokens > 0 ? budget_tokens : 0;
    (void)pdm__pool_evict(p, 0, 0, 0);
}

/* Copies the bookkeeping of conversation src [0, n) into dst (grown as needed). */
static int pdm__conv_copy(pdm_prefill_conv_t *dst, const pdm_prefill_conv_t *src)
{
    int st = pdm_prefill_conv_reserve(dst, PDM_MAX(src->n, 1));
    if (st) return st;
    memcpy(dst->tokens, src->tokens, sizeof(int32_t) * (size_t)src->n);
    memcpy(dst->owner, src->owner, (size_t)src->n);
    memcpy(dst->held, src->held, sizeof(dst->held));
    dst->n = src->n;
    dst->last_owner = src->last_owner;
    return PDM_OK;
}

/* Keeps a copy of conversation c (with its rows, ops.save): entries it extends are dropped;
 * nothing is kept (and nothing dropped) when an entry already extends it (that one becomes
 * the most recently used), when it alone exceeds the budget, or when it would fit only by
 * evicting the entry with id `keep` (the source of the running task; 0: none). Out of memory
 * only loses the copy. */
static void pdm__pool_save(pdm_prefill_pool_t *p, const pdm_prefill_conv_t *c, uint64_t keep)
{
    if (c->n <= 0) return;
    int64_t pinned = 0; /* what no eviction may free */
    for (int i = 0; i < p->n; i++) {
        const pdm_prefill_conv_t *e = &p->e[i].conv;
        if (e->n >= c->n && pdm_prefill_conv_common(e, c->tokens, c->n) == c->n) {
            p->e[i].stamp = ++p->clock;
            return;
        }
        if (keep && p->e[i].id == keep) pinned += e->n;
    }
    /* a copy that cannot fit leaves the shorter entries it would replace in place */
    if (c->n + pinned > p->budget_tokens) return;
    for (int i = p->n - 1; i >= 0; i--) {
        const pdm_prefill_conv_t *e = &p->e[i].conv;
        if (p->e[i].id != keep && pdm_prefill_conv_common(c, e->tokens, e->n) == e->n)
            pdm__pool_remove(p, i);
    }
    if (c->n > p->budget_tokens || pdm__pool_evict(p, c->n, 1, keep)) return;
    pdm_prefill_pool_entry_t *e = &p->e[p->n];
    memset(e, 0, sizeof(*e));
    if (pdm__conv_copy(&e->conv, c) || (p->ops.save && p->ops.save(p->ops.ctx, c, e))) {
        pdm_prefill_conv_free(&e->conv);
        memset(e, 0, sizeof(*e));
        return;
    }
    e->id = pdm_prefill_conv_id(c);
    e->stamp = ++p->clock;
    p->n++;
    p->tokens += c->n;
    p->saves++;
}

const pdm_prefill_conv_t *pdm_prefill_pool_pick(const pdm_prefill_pool_t *p,
                                                const pdm_prefill_conv_t *active,
                                                const pdm_prefill_followup_params_t *fp,
                                                uint64_t *source)
{
    const pdm_prefill_conv_t *best = active;
    int32_t best_start = pdm_prefill_conv_followup_start(active, fp);
    uint64_t best_stamp = 0;
    *source = 0;
    for (int i = 0; i < p->n; i++) {
        const int32_t s = pdm_prefill_conv_followup_start(&p->e[i].conv, fp);
        if (s > best_start ||
            (s == best_start && s > 0 && best != active && p->e[i].stamp > best_stamp)) {
            best = &p->e[i].conv;
            best_start = s;
            best_stamp = p->e[i].stamp;
            *source = p->e[i].id;
        }
    }
    if (best_start == 0) {
        *source = 0;
        return active;
    }
    return best;
}

int pdm_prefill_pool_begin(pdm_prefill_pool_t *p, pdm_prefill_conv_t *active, uint64_t source,
                           int32_t start, int *loaded)
{
    *loaded = 0;
    if (start <= 0) {
        pdm__pool_save(p, active, 0);
        pdm_prefill_conv_reset(active);
        return PDM_OK;
    }
    if (source == 0 || source == pdm_prefill_conv_id(active)) {
        if (start < active->n) pdm__pool_save(p, active, 0); /* the task cuts it: keep the tail */
        return PDM_OK; /* the rank checks the prefix itself (rank.c, pdm__validate) */
    }
    int i = 0;
    while (i < p->n && p->e[i].id != source) i++;
    if (i < p->n && p->e[i].conv.n >= start) {
        /* The active conversation is kept (never at the cost of the source); the save may
         * move entries: find the source again. */
        pdm__pool_save(p, active, source);
        for (i = 0; i < p->n && p->e[i].id != source; i++) {
        }
    }
    if (i == p->n || p->e[i].conv.n < start) {
        p->misses++;
        pdm_prefill_conv_reset(active);
        return pdm_error_set(PDM_ESTATE, "prefill: the group's pool does not hold conversation "
                             "%016llx with %d tokens (prefix miss)",
                             (unsigned long long)source, start);
    }
    pdm_prefill_pool_entry_t *e = &p->e[i];
    int st = p->ops.load ? p->ops.load(p->ops.ctx, e) : PDM_OK;
    if (st == PDM_ECHECKSUM) {
        p->corrupt++;
        pdm__pool_remove(p, i);
        pdm_prefill_conv_reset(active);
        return pdm_error_set(PDM_ECHECKSUM, "prefill: the pooled KV of a conversation (%d "
                             "cached tokens) failed its checksum: dropped, never used; the "
                             "prompt is prefilled in full", start);
    }
    if (!st) st = pdm__conv_copy(active, &e->conv);
    if (st) {
        pdm_prefill_conv_reset(active);
        return st;
    }
    e->stamp = ++p->clock;
    p->loads++;
    *loaded = 1;
    return PDM_OK;
}
