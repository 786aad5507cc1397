/*
 * offload_bench.c - decode time per token with head-wise KV offload against all-resident KV,
 * and the longest context each placement serves under a fixed fast budget (HeadInfer Table 3
 * analogue). Driven by bench/decode-memory/run.py; prints one JSON object per line.
 *
 *   offload_bench --model FILE --contexts 4096,32768,131072 [--steps N] [--threads T]
 *                 [--groups 0|G,G,...] [--slow ram|file:DIR] [--budget BYTES]
 *                 [--kv-dtype f16|q8]   (decode timing; q8 rows with per-head scales)
 *
 * The KV is filled with synthetic values (random f16 rows repeated) instead of prefilling
 * 128K tokens: a decode step's time does not depend on the values. For each context the
 * all-resident cache is timed first, then the offload store with a fast budget of exactly one
 * head group's ping-pong buffer (no resident heads), for the policy's group size or each size
 * of --groups (the sweep that chose the policy's thresholds).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "decode_node/offload.h"

static void fill(pdm_model_ctx_t *ctx, pdm_kv_cache_t *c, int32_t n)
{
    const size_t row = pdm_dtype_row_bytes(c->dtype, c->head_dim);
    enum { PAT = 64 };
    float src[PDM_MAX_HEAD_DIM];
    char *pat = malloc(row * PAT);
    uint64_t seed = 99;
    for (int r = 0; r < PAT; r++) {
        for (uint32_t i = 0; i < c->head_dim; i++)
            src[i] = (float)((double)(pdm_splitmix64(&seed) % 2001) / 1000.0 - 1.0);
        if (c->dtype == PDM_DT_I8) /* values in [-1, 1]: scale 1/127 for every head */
            pdm_q8_quantize_row(src, (int8_t *)(pat + (size_t)r * row), c->head_dim, 1.0f / 127);
        else
            pdm_model_ctx_ops(ctx)->kv_store(c->dtype, src, pat + (size_t)r * row,
                                             (int)c->head_dim);
    }
    if (c->dtype == PDM_DT_I8) {
        for (size_t i = 0; i < 2 * (size_t)c->n_layers * c->n_kv_heads; i++) c->scale[i] = 1.0f / 127;
        c->scales_fixed = 1;
    }
    for (uint32_t a = 0; a < c->n_layers * c->n_kv_heads; a++)
        for (int32_t t = 0; t < n; t += PAT) {
            size_t k = (size_t)PDM_MIN(PAT, n - t);
            memcpy((char *)c->k[a] + (size_t)t * row, pat, k * row);
            memcpy((char *)c->v[a] + (size_t)t * row, pat, k * row);
        }
    c->n_tokens = n;
    c->pos0 = 0;
    free(pat);
}

/* Median seconds per decode step over `steps` steps (after one warm-up step). */
static double time_steps(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_kv_cache_t *c, int steps,
                         float *logits)
{
    double t[64];
    int32_t tok = 42;
    pdm_decode_seq_t s = {c, tok, logits};
    if (pdm_decode_step(ctx, act, &s, 1)) return -1;
    for (int i = 0; i < steps; i++) {
        double t0 = pdm_now();
        if (pdm_decode_step(ctx, act, &s, 1)) return -1;
        t[i] = pdm_now() - t0;
    }
    for (int i = 1; i < steps; i++) /* insertion sort: a few values */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[steps / 2];
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path(), *contexts = "4096,32768,131072";
    const char *groups = "0", *slow = "ram";
    int steps = 5, threads = 1;
    long long table_budget = 256LL << 20;
    pdm_dtype_t kvt = PDM_DT_F16;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model_path = argv[i + 1];
        else if (!strcmp(argv[i], "--contexts")) contexts = argv[i + 1];
        else if (!strcmp(argv[i], "--groups")) groups = argv[i + 1];
        else if (!strcmp(argv[i], "--slow")) slow = argv[i + 1];
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--budget")) table_budget = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv-dtype")) {
            if (pdm_kv_dtype_parse(argv[i + 1], &kvt)) {
                fprintf(stderr, "offload_bench: %s\n", pdm_error_last());
                return 2;
            }
        }
        else {
            fprintf(stderr, "offload_bench: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (steps < 1 || steps > 63 || threads < 1) return 2;
    pdm_model_t *m;
    if (pdm_model_load(model_path, &m)) {
        fprintf(stderr, "offload_bench: %s\n", pdm_error_last());
        return 1;
    }
    const pdm_model_hparams_t *hp = &m->hp;
    pdm_model_ctx_t *ctx;
    pdm_act_t act;
    float *logits = malloc(sizeof(float) * hp->n_vocab);
    if (pdm_model_ctx_create(m, threads, 1, &ctx) || pdm_act_alloc(hp, 1, &act) || !logits) {
        fprintf(stderr, "offload_bench: %s\n", pdm_error_last());
        return 1;
    }
    pdm_kvoff_params_t base;
    pdm_kvoff_params_default(&base);

    /* Longest context per placement under a fixed fast budget, from the plan, each checked
     * against the allocator: the store is placed at that context and refused just above. */
    {
        pdm_kvplan_row_t rows[4];
        int n = pdm_kvplan(m, 4096, 1, table_budget, 512, kvt, &base, rows);
        for (int w = 0; w < 3 && w < n; w++) {
            int32_t lo = 0, hi = 1 << 24;
            while (lo < hi) {
                int32_t mid = lo + (hi - lo + 1) / 2;
                pdm_kvplan_row_t r[4];
                int k = pdm_kvplan(m, mid, 1, table_budget, 512, kvt, &base, r);
                if (k > w && r[w].kv_fast <= table_budget) lo = mid;
                else hi = mid - 1;
            }
            int verified = -1;
            if (w > 0) { /* offloading placements: place the store for real */
                pdm_kvoff_params_t p = base;
                p.fast_budget = table_budget;
                p.no_resident = 1;
                if (w == 1) p.force_group = (int)hp->n_kv_heads;
                pdm_kvoff_engine_t *e;
                pdm_kvoff_t *s = NULL, *s2 = NULL;
                if (!pdm_kvoff_engine_create(&p, &e)) {
                    int ok_at = pdm_kvoff_create(e, hp, lo, kvt, &s) == PDM_OK;
                    int group_at = 0;
                    if (s) pdm_kvoff_placement(s, &group_at, NULL, NULL, NULL);
                    pdm_kvoff_destroy(s);
                    /* just above: refused, or only with a smaller group than planned */
                    int st2 = pdm_kvoff_create(e, hp, lo + 64, kvt, &s2);
                    int group_above = 0;
                    if (s2) pdm_kvoff_placement(s2, &group_above, NULL, NULL, NULL);
                    pdm_kvoff_destroy(s2);
                    verified = ok_at && (st2 != PDM_OK || group_above < group_at);
                    pdm_kvoff_engine_destroy(e);
                }
            }
            printf("{\"kind\":\"max_context\",\"placement\":\"%s\",\"fast_budget\":%lld,"
                   "\"max_context\":%d,\"verified\":%d}\n",
                   rows[w].name, table_budget, lo, verified);
        }
        fflush(stdout);
    }

    char list[256];
    snprintf(list, sizeof(list), "%s", contexts);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        const int32_t n_ctx = atoi(tok);
        const int32_t cap = n_ctx + steps + 2;
        pdm_kv_cache_t *c;
        if (pdm_kv_cache_create(hp, cap, kvt, &c)) {
            fprintf(stderr, "offload_bench: %s\n", pdm_error_last());
            return 1;
        }
        fill(ctx, c, n_ctx);
        double t_res = time_steps(ctx, &act, c, steps, logits);
        double kv_bytes = (double)pdm_kv_cache_bytes(c);
        pdm_kv_cache_destroy(c);
        char glist[128];
        snprintf(glist, sizeof(glist), "%s", groups);
        char *save = NULL;
        for (char *g = strtok_r(glist, ",", &save); g; g = strtok_r(NULL, ",", &save)) {
            pdm_kvoff_params_t p = base;
            p.force_group = atoi(g);
            p.no_resident = 1;
            p.slow_tier = slow;
            int G = pdm_kvoff_group_for(&p, cap, hp->n_kv_heads);
            const size_t arr =
                ((size_t)cap * hp->head_dim * pdm_dtype_row_bytes(kvt, 1) + 63) & ~(size_t)63;
            p.fast_budget = (int64_t)(2 * (size_t)G * 2 * arr); /* one group's ping-pong */
            pdm_kvoff_engine_t *e;
            pdm_kvoff_t *s;
            if (pdm_kvoff_engine_create(&p, &e) || pdm_kvoff_create(e, hp, cap, kvt, &s)) {
                fprintf(stderr, "offload_bench: %s\n", pdm_error_last());
                return 1;
            }
            fill(ctx, pdm_kvoff_cache(s), n_ctx);
            double t_off = time_steps(ctx, &act, pdm_kvoff_cache(s), steps, logits);
            pdm_kvoff_stats_t st;
            pdm_kvoff_engine_stats(e, &st);
            printf("{\"kind\":\"decode\",\"kv_dtype\":\"%s\",\"context\":%d,\"group\":%d,\"threads\":%d,\"steps\":%d,"
                   "\"slow_tier\":\"%s\",\"kv_bytes\":%.0f,\"fast_budget\":%lld,\"fast_peak\":%lld,"
                   "\"resident_s\":%.6f,\"offload_s\":%.6f,\"ratio\":%.3f,\"prefetch_waits\":%lld,"
                   "\"prefetches\":%lld,\"wait_s\":%.6f}\n",
                   pdm_dtype_name(kvt), n_ctx, G, threads, steps, slow, kv_bytes, (long long)p.fast_budget,
                   (long long)st.fast.peak, t_res, t_off, t_off / t_res,
                   (long long)st.prefetch_waits, (long long)st.prefetches, st.wait_seconds);
            fflush(stdout);
            pdm_kvoff_destroy(s);
            pdm_kvoff_engine_destroy(e);
        }
    }
    free(logits);
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return 0;
}
