/*
 * partition_search.c - KV-Runahead's partition search (KV-Runahead §4.2, Fig. 6): which
 * chunk sizes of a chain give the lowest measured TTFT at one prompt length. TTFT is
 * measured, not modelled (the paper's point: the best split depends on the hardware and the
 * network), through the caller's callback.
 */
#include "prefill_node/partition_search.h"

#include <string.h>

#include "common/pdm.h"
#include "prefill_node/plan.h"

typedef struct {
    const pdm_partition_search_params_t *p;
    int evaluations;
} pdm__search_t;

/* One measurement, counted. */
static double pdm__measure(pdm__search_t *s, const int *chunks)
{
    s->evaluations++;
    return s->p->measure(s->p->data, chunks);
}

/* Chunk sizes from chain boundaries 0 < b[0] < ... < b[R-2] < n. */
static int pdm__boundaries_to_chunks(const int *b, int ranks, int n, int *chunks)
{
    int prev = 0;
    for (int i = 0; i < ranks - 1; i++) {
        if (b[i] <= prev || b[i] >= n) return -1;
        chunks[i] = b[i] - prev;
        prev = b[i];
    }
    chunks[ranks - 1] = n - prev;
    return chunks[ranks - 1] >= 1 ? 0 : -1;
}

/* Fig. 6a, two ranks: the single boundary, narrowed towards the side where TTFT falls. */
static double pdm__search_boundary(pdm__search_t *s, int n, int min_stride, double best_t,
                                   int *best)
{
    int lo = 1, hi = n - 1;
    while (hi - lo > min_stride) {
        int mid = lo + (hi - lo) / 2, step = PDM_MAX(1, min_stride / 2);
        int c1[2] = {mid, n - mid}, c2[2] = {mid + step, n - mid - step};
        if (c2[1] < 1) break;
        double t1 = pdm__measure(s, c1), t2 = pdm__measure(s, c2);
        if (t1 < best_t) best_t = t1, memcpy(best, c1, sizeof(c1));
        if (t2 < best_t) best_t = t2, memcpy(best, c2, sizeof(c2));
        if (t2 < t1)
            lo = mid; /* TTFT still falls as rank 0 takes more */
        else
            hi = mid + step;
    }
    return best_t;
}

/* Fig. 6b-d, three ranks or more: a grid of `points` values per boundary around `center`,
 * re-centred on the best point with half the stride at every level down to min_stride. A
 * grid point whose boundaries are not strictly increasing inside (0, n) is skipped
 * unmeasured. */
static double pdm__search_grid(pdm__search_t *s, int R, int n, int min_stride,
                               const int *even_bounds, double best_t, int *best)
{
    const int points = R <= 3 ? 5 : 3, half = points / 2;
    int stride = PDM_MAX(min_stride, n / (2 * R));
    int center[PDM_PREFILL_MAX_RANKS], chunks[PDM_PREFILL_MAX_RANKS];
    memcpy(center, even_bounds, sizeof(int) * (size_t)(R - 1));
    for (;;) {
        int total = 1;
        for (int d = 0; d < R - 1; d++) total *= points;
        int level_best[PDM_PREFILL_MAX_RANKS];
        memcpy(level_best, center, sizeof(int) * (size_t)(R - 1));
        for (int g = 0; g < total; g++) {
            int code = g, cand[PDM_PREFILL_MAX_RANKS];
            for (int d = 0; d < R - 1; d++) {
                cand[d] = center[d] + (code % points - half) * stride;
                code /= points;
            }
            if (pdm__boundaries_to_chunks(cand, R, n, chunks)) continue;
            double t = pdm__measure(s, chunks);
            if (t < best_t) {
                best_t = t;
                memcpy(best, chunks, sizeof(int) * (size_t)R);
                memcpy(level_best, cand, sizeof(int) * (size_t)(R - 1));
            }
        }
        memcpy(center, level_best, sizeof(int) * (size_t)(R - 1));
        if (stride <= min_stride) break;
        stride = PDM_MAX(min_stride, stride / 2);
    }
    return best_t;
}

double pdm_partition_search(const pdm_partition_search_params_t *p, int *best, int *evaluations)
{
    const int R = p->ranks, n = p->n_tokens;
    pdm__search_t s = {p, 0};
    int b[PDM_PREFILL_MAX_RANKS], chunks[PDM_PREFILL_MAX_RANKS];
    pdm_prefill_split_even(n, R, chunks);
    for (int i = 0, acc = 0; i < R - 1; i++) b[i] = (acc += chunks[i]);
    memcpy(best, chunks, sizeof(int) * (size_t)R);
    double best_t = pdm__measure(&s, chunks);
    if (R == 2)
        best_t = pdm__search_boundary(&s, n, p->min_stride, best_t, best);
    else if (R > 2)
        best_t = pdm__search_grid(&s, R, n, p->min_stride, b, best_t, best);
    *evaluations = s.evaluations;
    return best_t;
}
