/*
 * test_disagg.c - end to end: a prefill group of pdmesh-prefill processes streams KV into a
 * pdmesh-decode process, which generates; greedy output must equal the single-process
 * engine's for several concurrent requests, for every prefill method. And failures: a full
 * decode node, a dead prefill rank (before and during streaming), a dead decode node; each
 * reported as an error, none hanging, none leaving KV reserved on the decode node.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "prefill_node/prefill.h"
#include "tests.h"

static char model_path[600];

static void make_model(void)
{
    snprintf(model_path, sizeof(model_path), "%s/disagg-model.gguf", pdm_test_tmpdir());
    if (access(model_path, R_OK) == 0) return;
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_layers = 3;
    p.d_model = 96;
    p.n_heads = 6;
    p.n_kv_heads = 2;
    p.n_ff = 160;
    p.n_ctx = 1024;
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    p.seed = 21;
    if (pdm_testmodel_write(model_path, &p)) abort();
}

static const char *bin(const char *env, const char *def)
{
    const char *v = getenv(env);
    return v && *v ? v : def;
}

static const char *decode_kv_dtype; /* NULL: the ranks' */
static const char *decode_kv_window; /* NULL: the node's default */

static pdm_launch_t *start_mesh(const char *model, int ranks, const char *kv_dtype, long budget,
                                double timeout)
{
    pdm_launch_params_t lp;
    pdm_launch_params_default(&lp);
    lp.bin = bin("PDMESH_PREFILL_BIN", "build/bin/pdmesh-prefill");
    lp.decode_bin = bin("PDMESH_DECODE_BIN", "build/bin/pdmesh-decode");
    lp.model = model;
    lp.ranks = ranks;
    lp.ctx_tokens = 1024;
    lp.kv_dtype = kv_dtype;
    lp.timeout = timeout;
    lp.decode_batch = 8;
    lp.decode_kv_budget = budget;
    lp.decode_kv_dtype = decode_kv_dtype;
    lp.decode_kv_window = decode_kv_window;
    pdm_launch_t *l = NULL;
    ck_assert_msg(pdm_launch_start(&lp, &l) == 0, "mesh: %s", pdm_error_last());
    return l;
}

/* Greedy continuation by the single-process engine: max_new tokens or up to an EOG token. */
static int engine_greedy(const char *path, pdm_dtype_t kv, const int32_t *ids, int n,
                         int max_new, int32_t *out)
{
    pdm_model_t *m;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 64, &ctx), 0);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n + max_new, kv, &cache), 0);
    float *logits = malloc(sizeof(float) * m->hp.n_vocab);
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, ids, n, logits), 0);
    int k = 0;
    for (;;) {
        int32_t best = 0;
        for (uint32_t i = 1; i < m->hp.n_vocab; i++)
            if (logits[i] > logits[best]) best = (int32_t)i;
        out[k++] = best;
        if (k == max_new || pdm_tokenizer_is_eog(m->tokenizer, best)) break;
        ck_assert_int_eq(pdm_model_decode(ctx, cache, best, logits), 0);
    }
    free(logits);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return k;
}

static void random_ids(int32_t *ids, int n, uint32_t vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(3 + pdm_splitmix64(&seed) % (vocab - 3));
}

static void assert_idle(pdm_launch_t *l)
{
    int held = -1;
    long slots = -1;
    ck_assert_msg(pdm_launch_decode_usage(l, &held, &slots) == 0, "%s", pdm_error_last());
    ck_assert_msg(held == 0 && slots == 0, "decode node still holds %d sequences, %ld KV slots",
                  held, slots);
}

/* Three concurrent requests per method, R ranks, against the engine with the same KV dtype
 * (q8: the engine fixes the scales from the whole prompt; the ranks all-reduce theirs, stream
 * int8 rows with the scales in the block headers, and the decode node appends with them). */
static void run_methods_kv_on(const char *path, int R, const char *kv_name,
                              pdm_dtype_t kv_dtype)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    pdm_model_free(m);
    pdm_launch_t *l = start_mesh(path, R, kv_name, 1 << 16, 60);
    pdm_model_load(path, &m);
    const size_t kv_row_bytes = (size_t)m->hp.n_layers * m->hp.n_kv_heads * 2 * m->hp.head_dim *
                                pdm_dtype_row_bytes(kv_dtype, 1); /* per prompt token */
    pdm_model_free(m);
    const int lens[3] = {9, 23, 40}, max_new = 10;
    int32_t ids[3][64], want[3][16];
    int n_want[3];
    for (int i = 0; i < 3; i++) {
        random_ids(ids[i], lens[i], vocab, 500 + (uint64_t)(R * 10 + i));
        n_want[i] = engine_greedy(path, kv_dtype, ids[i], lens[i], max_new, want[i]);
    }
    for (int mi = 0; mi < PDM_PREFILL_AUTO; mi++) {
        pdm_prefill_method_t meth = (pdm_prefill_method_t)mi;
        /* kvr-p runs on a table's predicted partition: for q8 it is given directly */
        if ((meth == PDM_PREFILL_KVR_P && kv_dtype != PDM_DT_I8) ||
            (meth == PDM_PREFILL_SINGLE) != (R == 1))
            continue;
        int chunks[3][PDM_KVT_MAX_RANKS];
        pdm_launch_request_t reqs[3];
        for (int i = 0; i < 3; i++) {
            reqs[i] = (pdm_launch_request_t){.tokens = ids[i], .n_tokens = lens[i],
                                             .method = meth, .max_new = max_new};
            pdm_sampler_params_default(&reqs[i].sp);
            reqs[i].sp.temperature = 0;
            if (pdm_prefill_method_is_kvr(meth) || meth == PDM_PREFILL_TSP) {
                uint64_t s = 77 + (uint64_t)i; /* uneven for kvr-s, even otherwise */
                for (int r = 0; r < R; r++) chunks[i][r] = 1;
                for (int left = lens[i] - R; left > 0; left--)
                    chunks[i][meth == PDM_PREFILL_KVR_S || meth == PDM_PREFILL_KVR_P
                                  ? (int)(pdm_splitmix64(&s) % (uint64_t)R)
                                  : left % R]++;
                if (meth != PDM_PREFILL_TSP) reqs[i].chunks = chunks[i];
            }
        }
        pdm_launch_response_t out[3];
        ck_assert_msg(pdm_launch_generate(l, reqs, 3, out) == 0, "%s: %s",
                      pdm_prefill_method_name(meth), pdm_error_last());
        for (int i = 0; i < 3; i++) {
            ck_assert_msg(out[i].ok, "R=%d %s prompt %d: %s", R, pdm_prefill_method_name(meth), i,
                          out[i].error);
            ck_assert_msg(out[i].n_tokens == n_want[i], "R=%d %s prompt %d: %d tokens, engine %d",
                          R, pdm_prefill_method_name(meth), i, out[i].n_tokens, n_want[i]);
            for (int k = 0; k < n_want[i]; k++)
                ck_assert_msg(out[i].tokens[k] == want[i][k], "R=%d %s prompt %d token %d: %d, "
                              "engine %d", R, pdm_prefill_method_name(meth), i, k,
                              out[i].tokens[k], want[i][k]);
            ck_assert_msg(out[i].kv_bytes == (double)(kv_row_bytes * (size_t)lens[i]),
                          "R=%d %s %s prompt %d: %.0f KV bytes, expected %zu", R, kv_name,
                          pdm_prefill_method_name(meth), i, out[i].kv_bytes,
                          kv_row_bytes * (size_t)lens[i]);
            pdm_launch_response_free(&out[i]);
        }
    }
    assert_idle(l);
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}

static void run_methods_kv(int R, const char *kv_name, pdm_dtype_t kv_dtype)
{
    run_methods_kv_on(model_path, R, kv_name, kv_dtype);
}

/* The other architectures end to end (their per-layer differences live in the steps every
 * process runs; gemma3's 16-token window is shorter than the 23- and 40-token prompts, and the
 * decode node's steps go past it): random-weight presets, F32 weights. */
static void run_arch_methods(const char *arch, int R, const char *kv_name, pdm_dtype_t kv_dtype)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/disagg-%s.gguf", pdm_test_tmpdir(), arch);
    pdm_testmodel_params_t p;
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, arch), 0);
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    run_methods_kv_on(path, R, kv_name, kv_dtype);
}

START_TEST(test_disagg_gemma3_r2) { run_arch_methods("gemma3", 2, "f32", PDM_DT_F32); }
END_TEST
START_TEST(test_disagg_qwen3_q8_r2) { run_arch_methods("qwen3", 2, "q8", PDM_DT_I8); }
END_TEST
START_TEST(test_disagg_llama3_r3) { run_arch_methods("llama3", 3, "f16", PDM_DT_F16); }
END_TEST

/* Windowed local layers on the decode node (decode.h, --kv-window): a gemma3 model with a
 * 16-token window, a 70-token prompt (its local layers' rows land in staging, the last 15
 * are kept) and a 25-token one (received in place), 60 new tokens each, generated in one
 * batch: the greedy output equals the single-process engine's (full KV + mask) with r = 2,
 * r = 1.5 and the window off. The node counts the smaller footprint: a budget one slot short
 * of the full KV of both requests refuses the second with the window off and takes both with
 * it on. */
START_TEST(test_disagg_gemma3_window)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/disagg-gemma3-window.gguf", pdm_test_tmpdir());
    pdm_testmodel_params_t p;
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "gemma3"), 0);
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    p.n_ctx = 1024;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    enum { NREQ = 2, MAX_NEW = 60 };
    const int lens[NREQ] = {70, 25};
    pdm_kvwin_plan_t wp[NREQ];
    for (int i = 0; i < NREQ; i++)
        ck_assert_int_eq(pdm_kvwin_plan(m, PDM_DT_F32, 2, lens[i], MAX_NEW, &wp[i]), 0);
    /* the DONE report's cache bytes per layer kind: local layers in their window rows */
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) n_local += m->layers[l].window > 0;
    const double row = (double)m->hp.head_dim * 4 * 2 * m->hp.n_kv_heads; /* f32, K and V */
    const uint32_t n_layers = m->hp.n_layers;
    pdm_model_free(m);
    ck_assert_int_gt(wp[0].stage_slots, 0);  /* staged */
    ck_assert_int_eq(wp[1].stage_slots, 0);  /* in place */
    const long budget = lens[0] + lens[1] + 2 * MAX_NEW - 1;
    ck_assert_int_le(wp[0].slots + wp[0].stage_slots + wp[1].slots, budget);
    int32_t ids[NREQ][80], want[NREQ][MAX_NEW];
    int n_want[NREQ];
    for (int i = 0; i < NREQ; i++) {
        random_ids(ids[i], lens[i], vocab, 700 + (uint64_t)i);
        n_want[i] = engine_greedy(path, PDM_DT_F32, ids[i], lens[i], MAX_NEW, want[i]);
    }
    const char *windows[] = {"2", "1.5", "0"};
    for (int w = 0; w < 3; w++) {
        decode_kv_window = windows[w];
        const int R = w == 0 ? 2 : 1;
        pdm_launch_t *l = start_mesh(path, R, "f32", budget, 60);
        decode_kv_window = NULL;
        pdm_launch_request_t reqs[NREQ];
        for (int i = 0; i < NREQ; i++) {
            reqs[i] = (pdm_launch_request_t){.tokens = ids[i], .n_tokens = lens[i],
                                             .method = R == 2 ? PDM_PREFILL_KVR_E
                                                              : PDM_PREFILL_SINGLE,
                                             .max_new = MAX_NEW};
            pdm_sampler_params_default(&reqs[i].sp);
            reqs[i].sp.temperature = 0;
        }
        pdm_launch_response_t out[NREQ];
        ck_assert_msg(pdm_launch_generate(l, reqs, NREQ, out) == 0, "%s", pdm_error_last());
        for (int i = 0; i < NREQ; i++) {
            if (w == 2 && i == 1) { /* full KV: the second does not fit */
                ck_assert_msg(!out[i].ok && strstr(out[i].error, "full"), "window off: %s",
                              out[i].ok ? "accepted" : out[i].error);
                pdm_launch_response_free(&out[i]);
                continue;
            }
            ck_assert_msg(out[i].ok, "window %s prompt %d: %s", windows[w], i, out[i].error);
            ck_assert_msg(out[i].n_tokens == n_want[i], "window %s prompt %d: %d tokens, engine "
                          "%d", windows[w], i, out[i].n_tokens, n_want[i]);
            for (int k = 0; k < n_want[i]; k++)
                ck_assert_msg(out[i].tokens[k] == want[i][k], "window %s prompt %d token %d: %d, "
                              "engine %d", windows[w], i, k, out[i].tokens[k], want[i][k]);
            const int cap = lens[i] + MAX_NEW;
            const int rows = w == 2 ? cap : w == 0 ? 30 : 23; /* ceil(r * 15) */
            ck_assert_msg(out[i].kv_local_bytes == n_local * rows * row &&
                          out[i].kv_global_bytes == (n_layers - n_local) * cap * row,
                          "window %s prompt %d: local %.0f global %.0f bytes", windows[w], i,
                          out[i].kv_local_bytes, out[i].kv_global_bytes);
            pdm_launch_response_free(&out[i]);
        }
        assert_idle(l);
        ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
    }
}
END_TEST

static void run_methods(int R) { run_methods_kv(R, "f32", PDM_DT_F32); }

START_TEST(test_disagg_r1) { run_methods(1); }
END_TEST
START_TEST(test_disagg_r2) { run_methods(2); }
END_TEST
START_TEST(test_disagg_r3) { run_methods(3); }
END_TEST
/* Prefix reuse: a follow-up turn prefills only what follows the prefix the group still holds,
 * the ranks stream the cached positions along, and the decode node's greedy output equals the
 * engine's on the whole prompt. Turns: a first prompt; a longer one extending it (reuses all
 * of it); one that leaves it at position 17 (the group's conversation is cut there); a
 * request with a different start (nothing reused). Then a task naming a prefix the group
 * does not hold is refused as a miss, and the group keeps serving. */
static void run_prefix_reuse(int R, pdm_prefill_method_t first, pdm_prefill_method_t next)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    const size_t kv_row_bytes = (size_t)m->hp.n_layers * m->hp.n_kv_heads * 2 * m->hp.head_dim *
                                sizeof(float);
    pdm_model_free(m);
    pdm_launch_t *l = start_mesh(model_path, R, "f32", 1 << 16, 60);
    int32_t turn[4][64];
    const int lens[4] = {30, 45, 41, 33}, want_cached[4] = {0, 30, 17, 0}, max_new = 8;
    random_ids(turn[0], 64, vocab, 900 + (uint64_t)R);
    memcpy(turn[1], turn[0], sizeof(turn[0]));
    memcpy(turn[2], turn[0], sizeof(turn[0]));
    random_ids(turn[2] + 17, 64 - 17, vocab, 950 + (uint64_t)R);
    random_ids(turn[3], 64, vocab, 990 + (uint64_t)R);
    for (int t = 0; t < 4; t++) {
        int32_t want[16];
        int n_want = engine_greedy(model_path, PDM_DT_F32, turn[t], lens[t], max_new, want);
        pdm_launch_request_t q = {.tokens = turn[t], .n_tokens = lens[t],
                                  .method = t == 0 ? first : next, .max_new = max_new,
                                  .reuse_prefix = 1};
        pdm_sampler_params_default(&q.sp);
        q.sp.temperature = 0;
        pdm_launch_response_t out;
        ck_assert_msg(pdm_launch_generate(l, &q, 1, &out) == 0, "%s", pdm_error_last());
        const char *mn = pdm_prefill_method_name(q.method);
        ck_assert_msg(out.ok, "R=%d %s turn %d: %s", R, mn, t, out.error);
        ck_assert_msg(out.cached == want_cached[t], "R=%d %s turn %d: %d cached tokens, want %d",
                      R, mn, t, out.cached, want_cached[t]);
        ck_assert_msg(out.n_tokens == n_want, "R=%d %s turn %d: %d tokens, engine %d", R, mn, t,
                      out.n_tokens, n_want);
        for (int k = 0; k < n_want; k++)
            ck_assert_msg(out.tokens[k] == want[k], "R=%d %s turn %d token %d: %d, engine %d", R,
                          mn, t, k, out.tokens[k], want[k]);
        /* The decode node got the whole prompt's KV, cached positions included. */
        ck_assert_msg(out.kv_bytes == (double)(kv_row_bytes * (size_t)lens[t]),
                      "R=%d %s turn %d: %.0f KV bytes", R, mn, t, out.kv_bytes);
        pdm_launch_response_free(&out);
    }
    /* A prefix the group does not hold (it holds turn 3 now). */
    pdm_prefill_task_t miss = {.method = next, .start = 10, .prefix = turn[0],
                               .tokens = turn[0] + 10, .n_tokens = 20};
    pdm_launch_result_t res;
    ck_assert_int_ne(pdm_launch_task(l, &miss, NULL, NULL, &res), 0);
    ck_assert_msg(strstr(pdm_error_last(), "prefix miss"), "%s", pdm_error_last());
    pdm_prefill_task_t ok = {.method = next, .start = 10, .prefix = turn[3],
                             .tokens = turn[3] + 10, .n_tokens = 20};
    ck_assert_msg(pdm_launch_task(l, &ok, NULL, NULL, &res) == 0, "%s", pdm_error_last());
    assert_idle(l);
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}

START_TEST(test_disagg_prefix_reuse)
{
    run_prefix_reuse(1, PDM_PREFILL_SINGLE, PDM_PREFILL_SINGLE);
    run_prefix_reuse(2, PDM_PREFILL_KVR_E, PDM_PREFILL_KVR_E);
    run_prefix_reuse(2, PDM_PREFILL_CP_KV, PDM_PREFILL_CP_Q);
    run_prefix_reuse(3, PDM_PREFILL_KVR_E, PDM_PREFILL_CP_KV);
}
END_TEST

/* int8 KV end to end: every method's greedy output equals the single-process q8 engine's,
 * and the stream carries one byte per element. */
START_TEST(test_disagg_q8_r1) { run_methods_kv(1, "q8", PDM_DT_I8); }
END_TEST
START_TEST(test_disagg_q8_r3) { run_methods_kv(3, "q8", PDM_DT_I8); }
END_TEST

/* A decode node reserving q8 KV while the prefill ranks stream f16 (the two sides started
 * with different --kv-dtype): the blocks are rejected with an error naming both dtypes, and
 * nothing stays reserved. */
START_TEST(test_disagg_dtype_mismatch)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    pdm_model_free(m);
    /* {ranks, decode node}: a larger block than planned fails in the transport (the header
     * never lands); a smaller one lands and its header names the dtype */
    const char *pairs[2][2] = {{"f16", "q8"}, {"q8", "f16"}};
    for (int p = 0; p < 2; p++) {
        decode_kv_dtype = pairs[p][1]; /* this test's process only (Check forks per test) */
        pdm_launch_t *l = start_mesh(model_path, 1, pairs[p][0], 1 << 16, 20);
        int32_t ids[12];
        random_ids(ids, 12, vocab, 3);
        pdm_launch_request_t req = {.tokens = ids, .n_tokens = 12,
                                    .method = PDM_PREFILL_SINGLE, .max_new = 4};
        pdm_sampler_params_default(&req.sp);
        pdm_launch_response_t out;
        pdm_launch_generate(l, &req, 1, &out);
        ck_assert_msg(!out.ok, "a mismatched KV dtype must fail the request");
        ck_assert_msg(strstr(out.error, "block rejected") &&
                          strstr(out.error, pairs[p][1]) &&
                          (p == 0 ? strstr(out.error, "kv-dtype") != NULL
                                  : strstr(out.error, pairs[p][0]) != NULL),
                      "%s", out.error);
        pdm_launch_response_free(&out);
        assert_idle(l);
        pdm_launch_stop(l);
    }
}
END_TEST

/* The real model (f16 KV): tsp and kvr-e give the engine's KV exactly, so greedy text must be
 * identical; cp-kv's merged attention differs in the last bits (see test_prefill.c), checked
 * on its first tokens. */
START_TEST(test_disagg_real_model)
{
    const char *path = pdm_test_model_path();
    if (!path) {
        fprintf(stderr, "disagg: real model not present, skipping\n");
        return;
    }
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const char *texts[2] = {"The three primary colors are", "def fibonacci(n):"};
    int32_t ids[2][64], want[2][24];
    size_t n[2];
    int n_want[2];
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(pdm_tokenizer_encode(m->tokenizer, texts[i], strlen(texts[i]),
                                              PDM_TOKENIZE_ADD_BOS, ids[i], 64, &n[i]), 0);
    pdm_model_free(m);
    for (int i = 0; i < 2; i++)
        n_want[i] = engine_greedy(path, PDM_DT_F16, ids[i], (int)n[i], 16, want[i]);
    pdm_launch_t *l = start_mesh(path, 2, "f16", 1 << 16, 120);
    const pdm_prefill_method_t ms[] = {PDM_PREFILL_TSP, PDM_PREFILL_KVR_E, PDM_PREFILL_CP_KV};
    for (size_t mi = 0; mi < PDM_ARRAY_SIZE(ms); mi++) {
        pdm_launch_request_t reqs[2];
        for (int i = 0; i < 2; i++) {
            reqs[i] = (pdm_launch_request_t){.tokens = ids[i], .n_tokens = (int32_t)n[i],
                                             .method = ms[mi], .max_new = 16};
            pdm_sampler_params_default(&reqs[i].sp);
            reqs[i].sp.temperature = 0;
        }
        pdm_launch_response_t out[2];
        ck_assert_msg(pdm_launch_generate(l, reqs, 2, out) == 0, "%s", pdm_error_last());
        for (int i = 0; i < 2; i++) {
            ck_assert_msg(out[i].ok, "%s: %s", pdm_prefill_method_name(ms[mi]), out[i].error);
            int must = ms[mi] == PDM_PREFILL_CP_KV ? 4 : n_want[i];
            ck_assert_int_ge(out[i].n_tokens, must);
            for (int k = 0; k < must; k++)
                ck_assert_msg(out[i].tokens[k] == want[i][k], "%s prompt %d token %d: %d, "
                              "engine %d", pdm_prefill_method_name(ms[mi]), i, k,
                              out[i].tokens[k], want[i][k]);
            pdm_launch_response_free(&out[i]);
        }
    }
    assert_idle(l);
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}
END_TEST

/* A decode node without room refuses with "full"; the other requests still run. (Request 1
 * alone exceeds the budget, so the outcome does not depend on request 0 finishing first.) */
START_TEST(test_disagg_node_full)
{
    pdm_launch_t *l = start_mesh(model_path, 2, "f32", 60, 30);
    int32_t a[30], b[40];
    random_ids(a, 30, 256, 1);
    random_ids(b, 40, 256, 2);
    pdm_launch_request_t reqs[2] = {{.tokens = a, .n_tokens = 30, .method = PDM_PREFILL_CP_KV,
                                     .max_new = 8},
                                    {.tokens = b, .n_tokens = 40, .method = PDM_PREFILL_CP_KV,
                                     .max_new = 30}};
    for (int i = 0; i < 2; i++) {
        pdm_sampler_params_default(&reqs[i].sp);
        reqs[i].sp.temperature = 0;
    }
    pdm_launch_response_t out[2];
    ck_assert_int_eq(pdm_launch_generate(l, reqs, 2, out), 0);
    ck_assert_msg(out[0].ok, "%s", out[0].error);
    ck_assert(!out[1].ok);
    ck_assert_msg(strstr(out[1].error, "full") != NULL, "%s", out[1].error);
    pdm_launch_response_free(&out[0]);
    pdm_launch_response_free(&out[1]);
    assert_idle(l);
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}
END_TEST

/* A prefill rank that died: the request fails with an error and its reservation is
 * released on the decode node. */
START_TEST(test_disagg_dead_prefill_rank)
{
    pdm_launch_t *l = start_mesh(model_path, 2, "f32", 1 << 16, 5);
    kill(pdm_launch_pid(l, 1), SIGKILL);
    int32_t a[30];
    random_ids(a, 30, 256, 3);
    pdm_launch_request_t req = {.tokens = a, .n_tokens = 30, .method = PDM_PREFILL_KVR_E,
                                .max_new = 8};
    pdm_sampler_params_default(&req.sp);
    pdm_launch_response_t out;
    double t0 = pdm_now();
    pdm_launch_generate(l, &req, 1, &out);
    ck_assert(!out.ok);
    ck_assert_msg(strstr(out.error, "prefill") != NULL, "%s", out.error);
    ck_assert(pdm_now() - t0 < 20);
    pdm_launch_response_free(&out);
    usleep(200000);
    assert_idle(l);
    pdm_launch_stop(l);
}
END_TEST

typedef struct {
    pid_t pid;
    int delay_ms;
} killer_t;

static void *killer_main(void *p)
{
    killer_t *k = p;
    usleep((useconds_t)k->delay_ms * 1000);
    kill(k->pid, SIGKILL);
    return NULL;
}

/* Runs a 900-token request and kills `victim` 30 ms into it: the request must fail, quickly. */
static void run_killed_mid_stream(pdm_launch_t *l, int victim, pdm_prefill_method_t method,
                                  uint64_t seed)
{
    static int32_t a[900];
    random_ids(a, 900, 256, seed);
    pdm_launch_request_t req = {.tokens = a, .n_tokens = 900, .method = method, .max_new = 4};
    pdm_sampler_params_default(&req.sp);
    killer_t k = {victim, 30};
    pthread_t th;
    pthread_create(&th, NULL, killer_main, &k);
    pdm_launch_response_t out;
    double t0 = pdm_now();
    pdm_launch_generate(l, &req, 1, &out);
    pthread_join(th, NULL);
    ck_assert_msg(!out.ok, "the request survived the death of pid %d", victim);
    ck_assert(pdm_now() - t0 < 30);
    pdm_launch_response_free(&out);
}

/* A prefill rank killed while it streams a long prompt: the decode node sees the peer fail
 * (or its KV deadline) and reports an error; nothing stays reserved. The ranks stall after
 * streaming layer 1 (fault injection), so the kill lands mid-stream however fast the
 * transfer is. */
START_TEST(test_disagg_rank_killed_mid_stream)
{
    setenv("PDMESH_FAULT_STALL_AFTER_LAYER", "1", 1);
    pdm_launch_t *l = start_mesh(model_path, 2, "f32", 1 << 16, 5);
    unsetenv("PDMESH_FAULT_STALL_AFTER_LAYER");
    run_killed_mid_stream(l, pdm_launch_pid(l, 0), PDM_PREFILL_CP_KV, 4);
    usleep(200000);
    assert_idle(l);
    pdm_launch_stop(l);
}
END_TEST

/* The decode node killed: the run ends with an error instead of hanging. */
START_TEST(test_disagg_dead_decode_node)
{
    pdm_launch_t *l = start_mesh(model_path, 2, "f32", 1 << 16, 5);
    kill(pdm_launch_decode_pid(l), SIGKILL);
    int32_t a[30];
    random_ids(a, 30, 256, 5);
    pdm_launch_request_t req = {.tokens = a, .n_tokens = 30, .method = PDM_PREFILL_CP_Q,
                                .max_new = 8};
    pdm_sampler_params_default(&req.sp);
    pdm_launch_response_t out;
    double t0 = pdm_now();
    ck_assert_int_ne(pdm_launch_generate(l, &req, 1, &out), 0);
    ck_assert(!out.ok);
    ck_assert(pdm_now() - t0 < 20);
    pdm_launch_response_free(&out);
    pdm_launch_stop(l);
}
END_TEST

/* The decode node killed while the ranks stream: the run fails quickly, and the prefill group
 * still serves tasks that do not stream. The ranks pause 1 s after streaming layer 1, so the
 * kill (30 ms in) lands mid-stream even where the whole request takes less than 30 ms. */
START_TEST(test_disagg_decode_killed_mid_stream)
{
    setenv("PDMESH_FAULT_STALL_AFTER_LAYER", "1:1000", 1);
    pdm_launch_t *l = start_mesh(model_path, 2, "f32", 1 << 16, 5);
    unsetenv("PDMESH_FAULT_STALL_AFTER_LAYER");
    run_killed_mid_stream(l, pdm_launch_decode_pid(l), PDM_PREFILL_KVR_E, 6);
    int32_t a[50];
    random_ids(a, 50, 256, 7);
    pdm_prefill_task_t t = {.method = PDM_PREFILL_CP_KV, .tokens = a, .n_tokens = 50};
    pdm_launch_result_t res;
    ck_assert_msg(pdm_launch_task(l, &t, NULL, NULL, &res) == 0, "%s", pdm_error_last());
    pdm_launch_stop(l);
}
END_TEST

static void setup(void)
{
    make_model();
    setenv("UCX_HANDLE_ERRORS", "none", 0);
}

Suite *suite_disagg(void)
{
    Suite *s = suite_create("disagg");
    TCase *tc = tcase_create("end-to-end");
    tcase_add_unchecked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_disagg_r1);
    tcase_add_test(tc, test_disagg_r2);
    tcase_add_test(tc, test_disagg_r3);
    tcase_add_test(tc, test_disagg_gemma3_r2);
    tcase_add_test(tc, test_disagg_gemma3_window);
    tcase_add_test(tc, test_disagg_qwen3_q8_r2);
    tcase_add_test(tc, test_disagg_llama3_r3);
    tcase_add_test(tc, test_disagg_prefix_reuse);
    tcase_add_test(tc, test_disagg_real_model);
    tcase_add_test(tc, test_disagg_node_full);
    tcase_add_test(tc, test_disagg_dead_prefill_rank);
    tcase_add_test(tc, test_disagg_rank_killed_mid_stream);
    tcase_add_test(tc, test_disagg_dead_decode_node);
    tcase_add_test(tc, test_disagg_decode_killed_mid_stream);
    suite_add_tcase(s, tc);
    TCase *q8 = tcase_create("q8"); /* int8 KV end to end */
    tcase_add_unchecked_fixture(q8, setup, NULL);
    tcase_set_timeout(q8, 300);
    tcase_add_test(q8, test_disagg_q8_r1);
    tcase_add_test(q8, test_disagg_q8_r3);
    tcase_add_test(q8, test_disagg_dtype_mismatch);
    suite_add_tcase(s, q8);
    return s;
}
