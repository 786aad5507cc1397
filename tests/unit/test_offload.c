/*
 * test_offload.c - head-wise KV offload (decode_node/offload.c): tier budgets and peaks,
 * decode output with offload equal to the all-resident cache (tiny test model and the real
 * model, several budgets, group sizes, contexts, both slow tiers), and `pdmesh plan`'s
 * prediction against the tier allocator's measured peaks.
 *
 * Tolerance: none. The offloaded path feeds the same attention kernel the same bytes (a copy
 * of the head's K/V) with the same split of the key range, so logits must be bit-identical
 * (memcmp), and so the greedy tokens.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "decode_node/offload.h"
#include "tests.h"

static pdm_model_t *tiny(int n_kv_heads, int n_layers)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/offload-model-%d-%d.gguf", pdm_test_tmpdir(), n_kv_heads,
             n_layers);
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_layers = (uint32_t)n_layers;
    p.d_model = 64;
    p.n_heads = 8;
    p.n_kv_heads = (uint32_t)n_kv_heads;
    p.n_ff = 96;
    p.n_ctx = 4096;
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    p.seed = 5;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    return m;
}

START_TEST(tier_budget_and_peak)
{
    pdm_kvtier_t *t;
    ck_assert_int_eq(pdm_kvtier_create("ram", 1000, &t), 0);
    void *a, *b, *c;
    ck_assert_int_eq(pdm_kvtier_alloc(t, 600, &a), 0);
    ck_assert_int_eq(pdm_kvtier_alloc(t, 500, &b), PDM_EOVERFLOW);
    ck_assert_int_eq(pdm_kvtier_alloc(t, 400, &b), 0);
    pdm_kvtier_stats_t st;
    pdm_kvtier_stats(t, &st);
    ck_assert_int_eq(st.used, 1000);
    ck_assert_int_eq(st.peak, 1000);
    ck_assert_int_eq(st.refused, 1);
    pdm_kvtier_free(t, a, 600);
    ck_assert_int_eq(pdm_kvtier_alloc(t, 100, &c), 0);
    pdm_kvtier_stats(t, &st);
    ck_assert_int_eq(st.used, 500);
    ck_assert_int_eq(st.peak, 1000);
    pdm_kvtier_free(t, b, 400);
    pdm_kvtier_free(t, c, 100);
    pdm_kvtier_destroy(t);

    char spec[600];
    snprintf(spec, sizeof(spec), "file:%s", pdm_test_tmpdir());
    ck_assert_int_eq(pdm_kvtier_create(spec, 0, &t), 0);
    ck_assert_int_eq(pdm_kvtier_alloc(t, 1 << 20, &a), 0);
    memset(a, 7, 1 << 20);
    ck_assert_int_eq(((unsigned char *)a)[12345], 7);
    pdm_kvtier_free(t, a, 1 << 20);
    pdm_kvtier_destroy(t);
    ck_assert_int_eq(pdm_kvtier_create("disk", 0, &t), PDM_EINVAL);
    ck_assert_int_eq(pdm_kvtier_create("file:/nonexistent/dir", 0, &t), PDM_EINVAL);

    pdm_kvoff_params_t p;
    pdm_kvoff_params_default(&p);
    ck_assert_int_eq(pdm_kvoff_parse_groups("100:0,2000:2", &p), 0);
    ck_assert_int_eq(pdm_kvoff_group_for(&p, 50, 4), 4);
    ck_assert_int_eq(pdm_kvoff_group_for(&p, 1000, 4), 2);
    ck_assert_int_eq(pdm_kvoff_group_for(&p, 5000, 4), 1);
    ck_assert_int_eq(pdm_kvoff_parse_groups("100:0,50:2", &p), PDM_EINVAL);
    ck_assert_int_eq(pdm_kvoff_parse_groups("x", &p), PDM_EINVAL);
}
END_TEST

/* One configuration of the offload engine. budget_heads < 0: unbounded (all resident);
 * otherwise the budget is that many head pairs (K + V arrays of the capacity). */
typedef struct {
    double budget_heads;
    int force_group;
    int no_resident;
    int file_tier;
} cfg_t;

/* Prefills `n_seq` random prompts of lengths plen[] into an all-resident cache and into an
 * offload store each, then decodes `steps` greedy steps of all sequences in one batch (both
 * sides) and compares the logits bit for bit. */
static void run_equal(pdm_model_t *m, const cfg_t *cf, const int *plen, int n_seq, int steps,
                      pdm_dtype_t kvt, int threads)
{
    const uint32_t V = m->hp.n_vocab;
    int32_t cap = 0;
    for (int s = 0; s < n_seq; s++) cap = PDM_MAX(cap, plen[s] + steps);
    const size_t hb = 2 * ((((size_t)cap * m->hp.head_dim * pdm_dtype_row_bytes(kvt, 1)) + 63) &
                           ~(size_t)63);
    pdm_kvoff_params_t p;
    pdm_kvoff_params_default(&p);
    p.fast_budget = cf->budget_heads < 0 ? (int64_t)1 << 40
                                         : (int64_t)(cf->budget_heads * (double)hb) * n_seq;
    p.force_group = cf->force_group;
    p.no_resident = cf->no_resident;
    p.wait_timeout = 60;
    p.resident_share = 1; /* greedy: the budgets below count heads for one store at a time */
    char spec[600];
    snprintf(spec, sizeof(spec), "file:%s", pdm_test_tmpdir());
    p.slow_tier = cf->file_tier ? spec : "ram";
    pdm_kvoff_engine_t *e;
    ck_assert_int_eq(pdm_kvoff_engine_create(&p, &e), 0);
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, threads, 64, &ctx), 0);
    pdm_act_t act;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, n_seq, &act), 0);
    pdm_kv_cache_t *ref[4];
    pdm_kvoff_t *off[4];
    int32_t next_r[4], next_o[4];
    float *lr = malloc(sizeof(float) * V * (size_t)n_seq), *lo = malloc(sizeof(float) * V * (size_t)n_seq);
    uint64_t seed = 17;
    for (int s = 0; s < n_seq; s++) {
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)plen[s]);
        for (int i = 0; i < plen[s]; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % V);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, cap, kvt, &ref[s]), 0);
        ck_assert_int_eq(pdm_kvoff_create(e, &m->hp, cap, kvt, &off[s]), 0);
        /* The prompt's KV lands directly in each head's home tier. */
        ck_assert_int_eq(pdm_model_prefill(ctx, ref[s], ids, plen[s], lr), 0);
        ck_assert_int_eq(pdm_model_prefill(ctx, pdm_kvoff_cache(off[s]), ids, plen[s], lo), 0);
        ck_assert_int_eq(memcmp(lr, lo, sizeof(float) * V), 0);
        next_r[s] = next_o[s] = pdm_test_argmax(lr, V);
        free(ids);
    }
    for (int step = 0; step < steps; step++) {
        pdm_decode_seq_t br[4], bo[4];
        for (int s = 0; s < n_seq; s++) {
            br[s] = (pdm_decode_seq_t){ref[s], next_r[s], lr + (size_t)s * V};
            bo[s] = (pdm_decode_seq_t){pdm_kvoff_cache(off[s]), next_o[s], lo + (size_t)s * V};
        }
        ck_assert_int_eq(pdm_decode_step(ctx, &act, br, n_seq), 0);
        ck_assert_int_eq(pdm_decode_step(ctx, &act, bo, n_seq), 0);
        for (int s = 0; s < n_seq; s++) {
            ck_assert_msg(memcmp(lr + (size_t)s * V, lo + (size_t)s * V, sizeof(float) * V) == 0,
                          "logits differ at step %d, sequence %d (budget %.1f heads, group %d)",
                          step, s, cf->budget_heads, cf->force_group);
            next_r[s] = pdm_test_argmax(lr + (size_t)s * V, V);
            next_o[s] = pdm_test_argmax(lo + (size_t)s * V, V);
            ck_assert_int_eq(next_r[s], next_o[s]);
        }
    }
    pdm_kvoff_stats_t st;
    pdm_kvoff_engine_stats(e, &st);
    /* The fast tier never exceeds its budget; offloading configurations really offload. */
    ck_assert_int_le(st.fast.peak, p.fast_budget);
    if (cf->budget_heads >= 0 && cf->budget_heads < 20) {
        ck_assert_int_gt(st.offloaded_heads, 0);
        ck_assert_int_gt(st.prefetches, 0);
        ck_assert_int_gt(st.writeback_bytes, 0);
    }
    /* After the write-backs every home (fast or slow) holds the same rows as the reference. */
    for (int s = 0; s < n_seq; s++) {
        ck_assert_int_eq(pdm_kvoff_sync(off[s]), 0);
        pdm_kv_cache_t *oc = pdm_kvoff_cache(off[s]);
        ck_assert_int_eq(oc->n_tokens, ref[s]->n_tokens);
        const size_t bytes = (size_t)ref[s]->n_tokens * m->hp.head_dim * pdm_dtype_row_bytes(kvt, 1);
        for (uint32_t l = 0; l < m->hp.n_layers; l++)
            for (uint32_t h = 0; h < m->hp.n_kv_heads; h++) {
                ck_assert(memcmp(pdm_kv_cache_k(oc, l, h), pdm_kv_cache_k(ref[s], l, h), bytes) == 0);
                ck_assert(memcmp(pdm_kv_cache_v(oc, l, h), pdm_kv_cache_v(ref[s], l, h), bytes) == 0);
            }
    }
    for (int s = 0; s < n_seq; s++) {
        pdm_kv_cache_destroy(ref[s]);
        pdm_kvoff_destroy(off[s]);
    }
    pdm_kvoff_engine_stats(e, &st);
    ck_assert_int_eq(st.fast.used, 0);
    ck_assert_int_eq(st.slow.used, 0);
    free(lr);
    free(lo);
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx);
    pdm_kvoff_engine_destroy(e);
}

START_TEST(tiny_equal_budgets)
{
    pdm_model_t *m = tiny(4, 3); /* 12 (layer, head) arrays */
    const cfg_t cfgs[] = {
        {-1, 0, 0, 0},  /* unbounded: all resident through the offload store */
        {2, 1, 1, 0},   /* one head per group, ping-pong only: the smallest budget */
        {4, 2, 1, 0},   /* groups of two */
        {6, 3, 1, 1},   /* groups of three (uneven: 3 + 1 per layer), file slow tier */
        {8, 4, 1, 0},   /* layer-wise: all heads of a layer */
        {7.5, 1, 0, 0}, /* 5 resident heads (uneven over layers) + ping-pong of one */
        {11, 2, 0, 1},  /* 7 resident + groups of two, file tier */
    };
    const int plens[][2] = {{1, 3}, {9, 40}, {200, 77}};
    for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++)
        for (int pl = 0; pl < 3; pl++) {
            run_equal(m, &cfgs[c], plens[pl], 1, 6, PDM_DT_F32, 2);
            run_equal(m, &cfgs[c], plens[pl], 2, 5, PDM_DT_F16, 2);
            run_equal(m, &cfgs[c], plens[pl], 2, 5, PDM_DT_I8, 2); /* scales with the heads */
        }
    pdm_model_free(m);
}
END_TEST

START_TEST(tiny_equal_one_layer_one_group)
{
    /* A single group in the whole store: the next visit's prefetch reads the row this visit
     * writes back, so it must be queued after the write-back. */
    pdm_model_t *m = tiny(2, 1);
    const cfg_t cf = {4, 2, 1, 0};
    const int plen[2] = {5, 30};
    run_equal(m, &cf, plen, 2, 8, PDM_DT_F32, 1);
    pdm_model_free(m);
}
END_TEST

/* The other architectures' presets: gemma3 (7 layers of one 256-wide KV head, local layers
 * with a 16-token window that the prompts and steps pass) and qwen3; offloaded decode equals
 * the all-resident one. */
START_TEST(arch_equal)
{
    static const char *const archs[] = {"gemma3", "qwen3"};
    for (size_t a = 0; a < sizeof(archs) / sizeof(archs[0]); a++) {
        char path[600];
        snprintf(path, sizeof(path), "%s/offload-%s.gguf", pdm_test_tmpdir(), archs[a]);
        pdm_testmodel_params_t p;
        ck_assert_int_eq(pdm_testmodel_params_preset(&p, archs[a]), 0);
        p.wtype = PDM_DT_F32;
        p.embtype = PDM_DT_F32;
        ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
        pdm_model_t *m;
        ck_assert_int_eq(pdm_model_load(path, &m), 0);
        /* two sequences, ping-pong of one head each and nothing resident; one sequence with
         * one resident head beside its ping-pong, file slow tier */
        const cfg_t pp_only = {3, 1, 1, 0}, some_resident = {3.5, 1, 0, 1};
        const int plen[2] = {40, 9};
        run_equal(m, &pp_only, plen, 2, 6, PDM_DT_F32, 2);
        run_equal(m, &pp_only, plen, 2, 5, PDM_DT_I8, 2);
        run_equal(m, &some_resident, plen, 1, 6, PDM_DT_F32, 2);
        run_equal(m, &some_resident, plen, 1, 5, PDM_DT_F16, 2);
        pdm_model_free(m);
    }
}
END_TEST

START_TEST(real_model_equal)
{
    const char *path = pdm_test_model_path();
    if (!path) {
        fprintf(stderr, "offload: real model not present, skipped\n");
        return;
    }
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const cfg_t cfgs[] = {{2, 1, 1, 1}, {50, 2, 0, 0}}; /* the second: one store all resident, the other 6 resident + groups of two */
    const int plen[2] = {150, 90};
    for (size_t c = 0; c < 2; c++) {
        run_equal(m, &cfgs[c], plen, 2, 5, PDM_DT_F16, 2);
        run_equal(m, &cfgs[c], plen, 2, 5, PDM_DT_I8, 2);
    }
    pdm_model_free(m);
}
END_TEST

/* `pdmesh plan` against the tier allocator: each placement's predicted fast / slow KV bytes
 * equal the peaks measured when that many stores are placed and decoded (tolerance 0 bytes;
 * the plan uses the allocator's own rounding). */
START_TEST(plan_matches_measured)
{
    pdm_model_t *m = tiny(4, 3);
    const int32_t ctxs[] = {40, 700, 3000};
    for (int ci = 0; ci < 3; ci++)
        for (int beams = 1; beams <= 2; beams++) {
            const int32_t ctx_len = ctxs[ci];
            pdm_kvoff_params_t base;
            pdm_kvoff_params_default(&base);
            ck_assert_int_eq(pdm_kvoff_parse_groups("100:0,1000:2", &base), 0);
            const size_t hb = 2 * ((((size_t)ctx_len * m->hp.head_dim * 2) + 63) & ~(size_t)63);
            const int64_t budget = (int64_t)(9.5 * (double)hb) * beams;
            pdm_kvplan_row_t rows[4];
            int n = pdm_kvplan(m, ctx_len, beams, budget, 256, PDM_DT_F16, &base, rows);
            ck_assert_int_eq(n, 4);
            for (int r = 0; r < n; r++) {
                pdm_kvoff_params_t p = base;
                p.wait_timeout = 60;
                if (!strcmp(rows[r].name, "all-resident")) p.fast_budget = (int64_t)1 << 40;
                else if (!strcmp(rows[r].name, "layer-wise")) {
                    p.fast_budget = (int64_t)1 << 40;
                    p.force_group = (int)m->hp.n_kv_heads;
                    p.no_resident = 1;
                } else if (!strcmp(rows[r].name, "head-wise")) {
                    p.fast_budget = (int64_t)1 << 40;
                    p.no_resident = 1;
                } else {
                    p.fast_budget = budget;
                }
                pdm_kvoff_engine_t *e;
                ck_assert_int_eq(pdm_kvoff_engine_create(&p, &e), 0);
                pdm_model_ctx_t *ctx;
                ck_assert_int_eq(pdm_model_ctx_create(m, 1, 8, &ctx), 0);
                pdm_act_t act;
                ck_assert_int_eq(pdm_act_alloc(&m->hp, beams, &act), 0);
                pdm_kvoff_t *off[2];
                pdm_decode_seq_t b[2];
                float *lg = malloc(sizeof(float) * m->hp.n_vocab * 2);
                for (int s = 0; s < beams; s++) {
                    ck_assert_int_eq(pdm_kvoff_create(e, &m->hp, ctx_len, PDM_DT_F16, &off[s]), 0);
                    int32_t tok[4] = {1, 2, 3, 4};
                    ck_assert_int_eq(pdm_model_prefill(ctx, pdm_kvoff_cache(off[s]), tok, 4, NULL), 0);
                    b[s] = (pdm_decode_seq_t){pdm_kvoff_cache(off[s]), 5, lg + (size_t)s * m->hp.n_vocab};
                }
                for (int step = 0; step < 3; step++)
                    ck_assert_int_eq(pdm_decode_step(ctx, &act, b, beams), 0);
                pdm_kvoff_stats_t st;
                pdm_kvoff_engine_stats(e, &st);
                ck_assert_msg(st.fast.peak == rows[r].kv_fast,
                              "%s ctx %d beams %d: predicted fast %lld, measured %lld",
                              rows[r].name, ctx_len, beams, (long long)rows[r].kv_fast,
                              (long long)st.fast.peak);
                ck_assert_msg(st.slow.peak == rows[r].kv_slow,
                              "%s ctx %d beams %d: predicted slow %lld, measured %lld",
                              rows[r].name, ctx_len, beams, (long long)rows[r].kv_slow,
                              (long long)st.slow.peak);
                if (p.fast_budget < ((int64_t)1 << 40)) ck_assert_int_le(st.fast.peak, budget);
                for (int s = 0; s < beams; s++) pdm_kvoff_destroy(off[s]);
                free(lg);
                pdm_act_free(&act);
                pdm_model_ctx_destroy(ctx);
                pdm_kvoff_engine_destroy(e);
            }
        }
    pdm_model_free(m);
}
END_TEST

START_TEST(budget_too_small_refused)
{
    pdm_model_t *m = tiny(4, 3);
    pdm_kvoff_params_t p;
    pdm_kvoff_params_default(&p);
    p.fast_budget = 1000; /* less than two heads of 100 tokens */
    pdm_kvoff_engine_t *e;
    ck_assert_int_eq(pdm_kvoff_engine_create(&p, &e), 0);
    pdm_kvoff_t *s;
    ck_assert_int_eq(pdm_kvoff_create(e, &m->hp, 100, PDM_DT_F16, &s), PDM_EOVERFLOW);
    pdm_kvoff_stats_t st;
    pdm_kvoff_engine_stats(e, &st);
    ck_assert_int_eq(st.fast.used, 0);
    ck_assert_int_eq(st.slow.used, 0);
    pdm_kvoff_engine_destroy(e);
    p.fast_budget = 0;
    ck_assert_int_eq(pdm_kvoff_engine_create(&p, &e), PDM_EINVAL);
    pdm_model_free(m);
}
END_TEST

Suite *suite_offload(void)
{
    Suite *s = suite_create("offload");
    TCase *t = tcase_create("offload");
    tcase_set_timeout(t, 600);
    tcase_add_test(t, tier_budget_and_peak);
    tcase_add_test(t, tiny_equal_budgets);
    tcase_add_test(t, tiny_equal_one_layer_one_group);
    tcase_add_test(t, arch_equal);
    tcase_add_test(t, real_model_equal);
    tcase_add_test(t, plan_matches_measured);
    tcase_add_test(t, budget_too_small_refused);
    suite_add_tcase(s, t);
    return s;
}
