/*
 * plan.c - the prefill planner (plan.h): method names, the even split, who computes which
 * tokens, the KVR partition lookup table (KV-Runahead §4.2), and the method choice of `auto`
 * (context parallelism §3.4, Alg. 1 and 5). Pure: no I/O, no UCX, no model weights; the
 * router, the launcher and the ranks link the same code.
 */
#include "prefill_node/plan.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "common/pdm.h"
#include "proto/pdmesh.pb-c.h"

/* ---- Methods ---------------------------------------------------------------------------- */

static const char *const pdm__method_names[PDM_PREFILL_METHOD_COUNT_] = {
    "single", "tsp", "kvr-e", "kvr-s", "kvr-p", "cp-kv", "cp-q", "auto"};

const char *pdm_prefill_method_name(pdm_prefill_method_t m)
{
    return (unsigned)m < PDM_PREFILL_METHOD_COUNT_ ? pdm__method_names[m] : "?";
}

int pdm_prefill_method_parse(const char *name, pdm_prefill_method_t *out)
{
    for (int m = 0; m < PDM_PREFILL_METHOD_COUNT_; m++)
        if (name && !strcmp(name, pdm__method_names[m])) {
            *out = (pdm_prefill_method_t)m;
            return PDM_OK;
        }
    return pdm_error_set(PDM_EINVAL, "unknown prefill method '%s' (single, tsp, kvr-e, kvr-s, "
                         "kvr-p, cp-kv, cp-q, auto)", name ? name : "");
}

void pdm_prefill_split_even(int n, int r, int *chunks)
{
    for (int i = 0; i < r; i++) chunks[i] = n / r + (i >= r - n % r ? 1 : 0);
}

/* ---- Who computes what ---------------------------------------------------------------- */

int pdm_prefill_plan_ranges(pdm_prefill_method_t m, int ranks, int32_t start, int32_t n,
                            const int *chunks, int head, pdm_prefill_range_t *out)
{
    int count = 0;
    int32_t p = start;
    if (m == PDM_PREFILL_SINGLE) {
        out[0] = (pdm_prefill_range_t){start, n, 0, 0};
        return 1;
    }
    if (m == PDM_PREFILL_TSP || pdm_prefill_method_is_kvr(m)) {
        for (int c = 0; c < ranks; c++) {
            int rank = m == PDM_PREFILL_TSP ? c : (head + c) % ranks;
            out[count++] = (pdm_prefill_range_t){p, chunks[c], rank, c};
            p += chunks[c];
        }
        return count;
    }
    /* cp-kv, cp-q: 2N chunks, rank i holds i and 2N-1-i (load balance of causal work). */
    int cp[PDM_PREFILL_MAX_RANGES];
    pdm_prefill_split_even(n, 2 * ranks, cp);
    for (int c = 0; c < 2 * ranks; c++) {
        out[count++] = (pdm_prefill_range_t){p, cp[c], c < ranks ? c : 2 * ranks - 1 - c, c};
        p += cp[c];
    }
    return count;
}

/* ---- Partition tables (KV-Runahead §4.2) ----------------------------------------------- */

int pdm_partition_table_put(pdm_partition_table_t *t, int length, const int *chunks, double ttft,
                            double ttft_cp)
{
    if (length < 1 || t->ranks < 1 || t->ranks > PDM_PREFILL_MAX_RANKS)
        return pdm_error_set(PDM_EINVAL, "partition table: bad entry");
    int i = 0;
    while (i < t->n_entries && t->entries[i].length < length) i++;
    if (i == t->n_entries || t->entries[i].length != length) {
        if (t->n_entries == (int)PDM_ARRAY_SIZE(t->entries))
            return pdm_error_set(PDM_EOVERFLOW, "partition table: more than %zu lengths",
                                 PDM_ARRAY_SIZE(t->entries));
        memmove(&t->entries[i + 1], &t->entries[i],
                sizeof(t->entries[0]) * (size_t)(t->n_entries - i));
        t->n_entries++;
    }
    t->entries[i].length = length;
    t->entries[i].ttft = ttft;
    t->entries[i].ttft_cp = ttft_cp;
    for (int r = 0; r < t->ranks; r++) t->entries[i].frac[r] = (double)chunks[r] / length;
    return PDM_OK;
}

/* Rounds fractions of n to chunk sizes >= 1 that sum to n (largest remainders). */
static int pdm__fracs_to_chunks(const double *frac, int ranks, int n, int *chunks)
{
    if (n < ranks)
        return pdm_error_set(PDM_EINVAL, "a prompt of %d tokens cannot be split over %d ranks",
                             n, ranks);
    double rem[PDM_PREFILL_MAX_RANKS];
    int sum = 0;
    for (int r = 0; r < ranks; r++) {
        double x = frac[r] * n;
        chunks[r] = PDM_MAX(1, (int)floor(x));
        rem[r] = x - floor(x);
        sum += chunks[r];
    }
    while (sum < n) { /* give the missing tokens to the largest remainders */
        int best = 0;
        for (int r = 1; r < ranks; r++)
            if (rem[r] > rem[best]) best = r;
        chunks[best]++;
        rem[best] = -1;
        sum++;
        if (rem[best] == -1) {
            int any = 0;
            for (int r = 0; r < ranks; r++) any |= rem[r] >= 0;
            if (!any)
                for (int r = 0; r < ranks; r++) rem[r] = 0;
        }
    }
    while (sum > n) { /* minimum-1 rounding overshot: take from the largest chunks */
        int best = 0;
        for (int r = 1; r < ranks; r++)
            if (chunks[r] > chunks[best]) best = r;
        chunks[best]--;
        sum--;
    }
    return PDM_OK;
}

int pdm_partition_table_lookup(const pdm_partition_table_t *t, int length, int exact,
                               int *chunks)
{
    if (t->n_entries == 0)
        return pdm_error_set(PDM_ENOTFOUND, "the partition table is empty (run pdmesh "
                             "partition-search)");
    int hi = 0;
    while (hi < t->n_entries && t->entries[hi].length < length) hi++;
    if (hi < t->n_entries && t->entries[hi].length == length)
        return pdm__fracs_to_chunks(t->entries[hi].frac, t->ranks, length, chunks);
    if (exact)
        return pdm_error_set(PDM_ENOTFOUND, "no searched partition for %d tokens (kvr-s needs "
                             "one: run pdmesh partition-search, or use kvr-p)", length);
    /* §4.2: interpolate the two nearest known entries (clamped at the ends). */
    double frac[PDM_PREFILL_MAX_RANKS];
    if (hi == 0 || hi == t->n_entries) {
        const int e = hi == 0 ? 0 : t->n_entries - 1;
        memcpy(frac, t->entries[e].frac, sizeof(frac));
    } else {
        const double a = t->entries[hi - 1].length, b = t->entries[hi].length;
        const double w = (length - a) / (b - a);
        for (int r = 0; r < t->ranks; r++)
            frac[r] = (1 - w) * t->entries[hi - 1].frac[r] + w * t->entries[hi].frac[r];
    }
    return pdm__fracs_to_chunks(frac, t->ranks, length, chunks);
}


void pdm_partition_table_ttft(const pdm_partition_table_t *t, int length, double *kvr,
                              double *cp)
{
    *kvr = *cp = 0;
    if (t->n_entries == 0) return;
    int hi = 0;
    while (hi < t->n_entries && t->entries[hi].length < length) hi++;
    if (hi == t->n_entries || hi == 0 || t->entries[hi].length == length) {
        /* Outside the table: scale the nearest entry by the quadratic attention term. */
        const int e = hi == t->n_entries ? hi - 1 : hi;
        const double s = (double)length * length /
                         ((double)t->entries[e].length * t->entries[e].length);
        *kvr = t->entries[e].ttft * (t->entries[e].length == length ? 1 : s);
        *cp = t->entries[e].ttft_cp * (t->entries[e].length == length ? 1 : s);
        return;
    }
    const double a = t->entries[hi - 1].length, b = t->entries[hi].length;
    const double w = (length - a) / (b - a);
    *kvr = (1 - w) * t->entries[hi - 1].ttft + w * t->entries[hi].ttft;
    if (t->entries[hi - 1].ttft_cp > 0 && t->entries[hi].ttft_cp > 0)
        *cp = (1 - w) * t->entries[hi - 1].ttft_cp + w * t->entries[hi].ttft_cp;
}

/* ---- pass-KV or pass-Q (context parallelism §3.4, Alg. 1 and 5) ------------------------ */

pdm_prefill_method_t pdm_prefill_choose_cp(const pdm_model_hparams_t *hp,
                                           const pdm_calibration_t *c, int n, int32_t T,
                                           int32_t P, char *why, size_t why_size)
{
    const double NH = hp->n_heads, NKV = hp->n_kv_heads, D = hp->head_dim;
    const double miss = (double)T / ((double)T + P);
    /* Eq. 1: Q is the smaller message iff T/(T+P) <= 2 NKV/NH; above it pass-KV always wins. */
    if (miss >= 2 * NKV / NH || n <= 1) {
        snprintf(why, why_size, "miss rate %.3f >= 2*NKV/NH = %.3f: pass-KV", miss,
                 2 * NKV / NH);
        return PDM_PREFILL_CP_KV;
    }
    /* Per ring step and layer: attention compute of T/N queries against (T+P)/N keys, and
     * the messages each variant moves (our wire formats: KV in f16, Q and partial outputs in
     * f32). */
    const double q_rows = (double)T / n, kv_rows = ((double)T + P) / n;
    const double t_step = 4.0 * D * NH * q_rows * kv_rows / c->flops;
    const double kv_msg = kv_rows * NKV * D * 2 * 2, q_msg = q_rows * (NH * D * 4 + 4);
    const double t_kv = c->latency + kv_msg / c->bandwidth, t_q = c->latency + q_msg / c->bandwidth;
    /* Eq. 2: pass-KV's SendRecv hides under compute when T >= N C NKV e / (2 NH BW). */
    if (t_kv <= t_step) {
        snprintf(why, why_size, "pass-KV messages (%.2g s) hide under compute (%.2g s)", t_kv,
                 t_step);
        return PDM_PREFILL_CP_KV;
    }
    /* Alg. 5: pass-Q also pays an All2All of partial outputs (T/N rows of NH x (D+1) floats
     * to each of N-1 ranks) that nothing hides. */
    const double a2a = (n - 1) * (c->latency + q_rows * NH * (D + 1) * 4 / c->bandwidth);
    const double exposed_kv = (n - 1) * (t_kv - t_step);
    const double exposed_q = (n - 1) * PDM_MAX(0.0, t_q - t_step) + a2a;
    snprintf(why, why_size, "miss rate %.3f; exposed communication per layer: pass-KV %.2g s, "
             "pass-Q %.2g s (All2All %.2g s)", miss, exposed_kv, exposed_q, a2a);
    return exposed_q < exposed_kv ? PDM_PREFILL_CP_Q : PDM_PREFILL_CP_KV;
}

int pdm_prefill_resolve(pdm_prefill_method_t method, const pdm_model_hparams_t *hp, int ranks,
                        int32_t T, int32_t P, const int *explicit_chunks,
                        const pdm_partition_table_t *table, const pdm_calibration_t *calib,
                        pdm_prefill_method_t *out, int *chunks, int *has_chunks, char *why,
                        size_t why_size)
{
    *has_chunks = 0;
    snprintf(why, why_size, "requested");
    if (table && table->n_entries && table->ranks != ranks)
        return pdm_error_set(PDM_EINVAL, "the partition table is for %d ranks, the group has %d",
                             table->ranks, ranks);
    if (method == PDM_PREFILL_AUTO) {
        if (ranks == 1) {
            method = PDM_PREFILL_SINGLE;
            snprintf(why, why_size, "one rank");
        } else if (P > 0) {
            if (calib) {
                method = pdm_prefill_choose_cp(hp, calib, ranks, T, P, why, why_size);
            } else { /* without calibration only the message-size rule (Eq. 1) applies */
                double miss = (double)T / ((double)T + P);
                double limit = 2.0 * hp->n_kv_heads / hp->n_heads;
                method = miss >= limit ? PDM_PREFILL_CP_KV : PDM_PREFILL_CP_Q;
                snprintf(why, why_size, "no calibration: miss rate %.3f vs 2*NKV/NH = %.3f", miss,
                         limit);
            }
        } else {
            double kvr = 0, cp = 0;
            if (table) pdm_partition_table_ttft(table, T, &kvr, &cp);
            if (kvr > 0 && (cp == 0 || kvr <= cp)) {
                method = PDM_PREFILL_KVR_P;
                snprintf(why, why_size, "partition table: KVR %.3g s vs cp-kv %.3g s", kvr, cp);
            } else {
                method = PDM_PREFILL_CP_KV;
                snprintf(why, why_size, kvr > 0 ? "partition table: cp-kv %.3g s vs KVR %.3g s"
                                                : "no partition table: cp-kv (balanced without a "
                                                  "search)", cp, kvr);
            }
        }
    }
    if (pdm_prefill_method_is_kvr(method)) {
        int st = PDM_OK;
        if (T < ranks)
            return pdm_error_set(PDM_EINVAL, "'%s' needs at least one token per rank (%d tokens, "
                                 "%d ranks)", pdm_prefill_method_name(method), T, ranks);
        if (explicit_chunks) {
            memcpy(chunks, explicit_chunks, sizeof(int) * (size_t)ranks);
        } else if (method == PDM_PREFILL_KVR_E) {
            pdm_prefill_split_even(T, ranks, chunks);
        } else if (!table) {
            return pdm_error_set(PDM_EINVAL, "'%s' needs a partition table (--table, from "
                                 "pdmesh partition-search)%s", pdm_prefill_method_name(method),
                                 method == PDM_PREFILL_KVR_S ? " or --partition" : "");
        } else {
            st = pdm_partition_table_lookup(table, T, method == PDM_PREFILL_KVR_S, chunks);
        }
        if (st) return st;
        *has_chunks = 1;
    } else if (explicit_chunks) {
        return pdm_error_set(PDM_EINVAL, "--partition applies to kvr-* methods only");
    }
    *out = method;
    return PDM_OK;
}

void pdm_prefill_ranges_to_wire(const pdm_prefill_range_t *ranges, int n,
                                struct Pdmesh__TokenRange *msgs, struct Pdmesh__TokenRange **ptrs)
{
    for (int k = 0; k < n; k++) {
        pdmesh__token_range__init(&msgs[k]);
        msgs[k].start = (uint32_t)ranges[k].start;
        msgs[k].len = (uint32_t)ranges[k].len;
        msgs[k].rank = (uint32_t)ranges[k].rank;
        msgs[k].chunk = (uint32_t)ranges[k].chunk;
        ptrs[k] = &msgs[k];
    }
}

uint64_t pdm_prefill_formation(const void *const *addrs, const size_t *lens, int n)
{
    uint64_t h = (uint64_t)n; /* each part seeds the next: no state to allocate */
    for (int i = 0; i < n; i++) {
        const uint64_t len = lens[i];
        h = XXH64(&len, sizeof(len), h);
        h = XXH64(addrs[i], lens[i], h);
    }
    return h ? h : 1;
}

int32_t pdm_prefill_ranges_clip(pdm_prefill_range_t *ranges, int n, int32_t from)
{
    int32_t left = 0;
    for (int k = 0; k < n; k++) {
        pdm_prefill_range_t *g = &ranges[k];
        const int32_t end = g->start + g->len;
        if (g->start < from) {
            g->start = PDM_MIN(from, end);
            g->len = end - g->start;
        }
        left += g->len;
    }
    return left;
}
