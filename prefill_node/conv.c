/*
 * conv.c - the KV a prefill group holds for its conversation (conv.h), as pure bookkeeping
 * shared by the ranks (rank.c), the router's mirror (router/core.c) and the launcher's
 * (launch.c).
 *
 * A follow-up turn reuses the cached prefix (partial prefill, KV-Runahead §4 / context
 * parallelism §3.2 "persistent KV"): the group computes only the new tokens, and when the KV
 * goes to a decode node every rank also streams the cached positions it computed. Both ends
 * derive where the turn starts and that plan from this state, so they agree without another
 * round trip. Uses plan.c (ranges of a task); plan.c knows nothing of conversations.
 */
#include "prefill_node/conv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

int pdm_prefill_conv_reserve(pdm_prefill_conv_t *c, int32_t cap)
{
    if (cap <= c->cap) return PDM_OK;
    int8_t *owner = realloc(c->owner, (size_t)cap);
    if (!owner) return pdm_error_set(PDM_ENOMEM, "prefix cache: out of memory");
    c->owner = owner;
    int32_t *tokens = realloc(c->tokens, sizeof(int32_t) * (size_t)cap);
    if (!tokens) return pdm_error_set(PDM_ENOMEM, "prefix cache: out of memory");
    c->tokens = tokens;
    c->cap = cap;
    return PDM_OK;
}

void pdm_prefill_conv_free(pdm_prefill_conv_t *c)
{
    free(c->owner);
    free(c->tokens);
    memset(c, 0, sizeof(*c));
}

void pdm_prefill_conv_reset(pdm_prefill_conv_t *c)
{
    c->n = 0;
    c->last_owner = 0;
    memset(c->held, 0, sizeof(c->held));
}

int32_t pdm_prefill_conv_common(const pdm_prefill_conv_t *c, const int32_t *tokens, int32_t n)
{
    int32_t k = 0, m = PDM_MIN(c->n, n);
    while (k < m && c->tokens[k] == tokens[k]) k++;
    return k;
}

int pdm_prefill_conv_chain_head(const pdm_prefill_conv_t *c, int ranks, int32_t start)
{
    if (start == 0) return 0;
    for (int j = 0; j < ranks; j++) {
        int r = (c->last_owner + j) % ranks;
        if (c->held[r] >= start) return r;
    }
    return -1;
}

int pdm_prefill_conv_prefix_runs(const pdm_prefill_conv_t *c, int32_t start,
                                 pdm_prefill_range_t *out, int max)
{
    int n = 0;
    for (int32_t p = 0; p < start && p < c->n;) {
        int32_t q = p;
        while (q < start && c->owner[q] == c->owner[p]) q++;
        if (n == max) return -1;
        if (out)
            out[n] = (pdm_prefill_range_t){.start = p, .len = q - p, .rank = c->owner[p],
                                           .chunk = PDM_PREFILL_PREFIX_CHUNK + n};
        n++;
        p = q;
    }
    return n;
}

int32_t pdm_prefill_conv_followup_start(const pdm_prefill_conv_t *c,
                                        const pdm_prefill_followup_params_t *p)
{
    if (!p->reuse || p->explicit_chunks || p->n_tokens < 1 || p->method == PDM_PREFILL_TSP)
        return 0;
    /* At least one token is computed: its logits give the first token. */
    int32_t start = PDM_MIN(pdm_prefill_conv_common(c, p->tokens, p->n_tokens), p->n_tokens - 1);
    if (pdm_prefill_method_is_kvr(p->method)) {
        /* A token per rank; the chain starts at a rank that holds all of [0, start). */
        start = PDM_MIN(start, p->n_tokens - p->ranks);
        if (start > 0 && pdm_prefill_conv_chain_head(c, p->ranks, start) < 0) return 0;
    }
    if (start > 0 &&
        pdm_prefill_conv_prefix_runs(c, start, NULL, PDM_PREFILL_MAX_PREFIX_RUNS) < 0)
        return 0;
    return start >= PDM_MAX(p->min_cached, 1) ? start : 0;
}

int pdm_prefill_conv_plan(const pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                          int32_t start, int32_t n_new, const int *chunks, int with_prefix,
                          pdm_prefill_range_t *out, int *n_prefix)
{
    *n_prefix = 0;
    if (start < 0 || start > c->n || n_new < 1)
        return pdm_error_set(PDM_ESTATE, "prefix cache: a task at %d does not continue %d held "
                             "tokens", start, c->n), -1;
    if (start > 0 && m == PDM_PREFILL_TSP)
        return pdm_error_set(PDM_EUNSUPPORTED, "prefix cache: 'tsp' has no partial prefill"), -1;
    const int head = pdm_prefill_method_is_kvr(m) ? pdm_prefill_conv_chain_head(c, ranks, start)
                                                  : 0;
    if (head < 0)
        return pdm_error_set(PDM_EUNSUPPORTED, "prefix cache: no rank holds the whole cached "
                             "prefix of %d tokens for a KV-Runahead chain", start), -1;
    int n = 0;
    if (with_prefix && start > 0) {
        n = pdm_prefill_conv_prefix_runs(c, start, out, PDM_PREFILL_MAX_PREFIX_RUNS);
        if (n < 0)
            return pdm_error_set(PDM_EOVERFLOW, "prefix cache: the cached prefix is split into "
                                 "more than %d runs", PDM_PREFILL_MAX_PREFIX_RUNS), -1;
        *n_prefix = n;
    }
    int even[PDM_PREFILL_MAX_RANKS];
    if (!chunks) {
        pdm_prefill_split_even(n_new, ranks, even);
        chunks = even;
    }
    return n + pdm_prefill_plan_ranges(m, ranks, start, n_new, chunks, head, out + n);
}

int pdm_prefill_conv_commit(pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                            int32_t start, const int32_t *tokens, int32_t n_new,
                            const pdm_prefill_range_t *ranges, int n_ranges)
{
    const int32_t end = start + n_new;
    if (start < 0 || start > c->n || n_new < 1 || ranks < 1 || ranks > PDM_PREFILL_MAX_RANKS)
        return pdm_error_set(PDM_EINVAL, "prefix cache: a task at %d + %d does not continue "
                             "%d held tokens", start, n_new, c->n);
    int st = pdm_prefill_conv_reserve(c, end);
    if (st) return st;
    /* Positions from start on are recomputed: nobody holds a prefix longer than start. */
    for (int i = 0; i < PDM_PREFILL_MAX_RANKS; i++) c->held[i] = PDM_MIN(c->held[i], start);
    memcpy(c->tokens + start, tokens, sizeof(int32_t) * (size_t)n_new);
    for (int i = 0; i < n_ranges; i++) {
        if (ranges[i].len <= 0) continue;
        memset(c->owner + ranges[i].start, ranges[i].rank, (size_t)ranges[i].len);
    }
    switch (m) {
    case PDM_PREFILL_SINGLE:
        c->held[0] = end;
        break;
    case PDM_PREFILL_TSP: /* everyone gathered everything */
        for (int i = 0; i < ranks; i++) c->held[i] = end;
        break;
    case PDM_PREFILL_KVR_E:
    case PDM_PREFILL_KVR_S:
    case PDM_PREFILL_KVR_P: /* a chain rank holds [0, its range's end) once the chain passed */
        for (int i = 0; i < n_ranges; i++)
            c->held[ranges[i].rank] = ranges[i].start + ranges[i].len;
        break;
    default: /* cp-kv, cp-q: shares are scattered */
        for (int i = 0; i < ranks; i++) c->held[i] = 0;
        break;
    }
    c->n = end;
    c->last_owner = c->owner[end - 1];
    return PDM_OK;
}

int pdm_prefill_conv_plan_task(const pdm_prefill_conv_t *c,
                               const pdm_prefill_task_plan_params_t *p,
                               pdm_prefill_task_plan_t *out)
{
    const int ranks = p->followup.ranks;
    const int32_t n = p->followup.n_tokens;
    if (ranks < 1 || ranks > PDM_PREFILL_MAX_RANKS || n < 1)
        return pdm_error_set(PDM_EINVAL, "plan: %d tokens on %d ranks", n, ranks);
    pdm_prefill_followup_params_t fp = p->followup;
    fp.explicit_chunks = p->chunks != NULL;
    const int32_t start0 = pdm_prefill_conv_followup_start(c, &fp);
    for (int k = 0; k < 2; k++) {
        const int32_t start = k ? 0 : start0;
        if (k && !start0) break; /* 0 was tried already */
        const int32_t T = n - start;
        pdm_prefill_method_t m;
        int st = pdm_prefill_resolve(p->followup.method, p->hp, ranks, T, start, p->chunks,
                                     p->table, p->calib, &m, out->chunks, &out->has_chunks,
                                     out->why, sizeof(out->why));
        if (st && start > 0) continue;
        if (st) {
            if (!p->fallback) return st;
            m = ranks == 1 ? PDM_PREFILL_SINGLE : PDM_PREFILL_KVR_E;
            out->has_chunks = 0;
            snprintf(out->why, sizeof(out->why), "fallback (%s)", pdm_error_last());
        }
        if (!out->has_chunks) pdm_prefill_split_even(T, ranks, out->chunks);
        int nr = pdm_prefill_conv_plan(c, m, ranks, start, T, out->chunks, 1, out->ranges,
                                       &out->n_prefix);
        if (nr < 0) {
            if (start > 0) continue;
            return PDM_EINVAL; /* conv_plan's message stays the calling thread's */
        }
        out->method = m;
        out->start = start;
        out->n_ranges = nr;
        return PDM_OK;
    }
    return pdm_error_set(PDM_EINVAL, "plan: no method can run this task");
}
