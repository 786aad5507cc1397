/*
 * test_prefill.c - prefill groups of real pdmesh-prefill processes against the single-process
 * engine: every method, group sizes 1/2/3/4/8, short and uneven lengths, random partitions,
 * partial prefill, the complete KV cache and the last token's logits; and failures (a killed
 * or frozen rank) that must end in an error, not a hang.
 *
 * Tolerances. Tiny models with f32 weights (f32 activations into every matmul) and f32 KV:
 * logits within 1e-3 * max(1, |logit|max), every K and V element within 1e-4. The ranks run
 * the same kernels on the same token rows as the engine; only the order in which partial
 * attention results are merged differs (last-bit differences).
 * The real model (Q4_1 weights, activations quantized to 8 bits per row as llama.cpp does, f16
 * KV): a last-bit difference can move one activation across a quantization step, which shifts
 * a layer's output by a step's worth (the effect measured against llama.cpp in the golden
 * test), so there: logits within 0.05 * |logit|max (about 1.0, as the golden test), K/V within
 * 0.5, and the same greedy first token. Measured: see docs/prefill.md.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/pdm.h"
#include "prefill_node/prefill.h"
#include "tests.h"

static char model_path[600];

static void make_model(void)
{
    snprintf(model_path, sizeof(model_path), "%s/prefill-model.gguf", pdm_test_tmpdir());
    if (access(model_path, R_OK) == 0) return;
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_layers = 3;
    p.d_model = 96;
    p.n_heads = 6;
    p.n_kv_heads = 2; /* GQA 3 */
    p.n_ff = 160;
    p.n_ctx = 1024;
    p.wtype = PDM_DT_F32; /* no 8-bit activations: see the tolerances above */
    p.embtype = PDM_DT_F32;
    p.seed = 7;
    if (pdm_testmodel_write(model_path, &p)) abort();
}

static const char *prefill_bin(void)
{
    const char *env = getenv("PDMESH_PREFILL_BIN");
    return env && *env ? env : "build/bin/pdmesh-prefill";
}

static void tokens_random(int32_t *ids, int n, uint32_t vocab, uint64_t seed)
{
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % vocab);
}

/* Single-process reference: logits of the last token and the KV of every position. */
typedef struct {
    float *logits; /* [n_vocab] */
    float *kv;     /* [layer][head][2][n][head_dim] as in KV files */
    float *scale;  /* q8: [layer][head][2] the engine's K and V scales */
    int n;
} reference_t;

static void reference(const char *path, pdm_dtype_t kv_dtype, const int32_t *ids, int n,
                      reference_t *ref)
{
    pdm_model_t *m;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0); /* chunked: 16 per batch */
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, kv_dtype, &cache), 0);
    const pdm_model_hparams_t *hp = &m->hp;
    ref->n = n;
    ref->logits = malloc(sizeof(float) * hp->n_vocab);
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, ids, n, ref->logits), 0);
    size_t plane = (size_t)n * hp->head_dim;
    ref->kv = malloc(sizeof(float) * plane * 2 * hp->n_layers * hp->n_kv_heads);
    for (uint32_t l = 0; l < hp->n_layers; l++)
        for (uint32_t h = 0; h < hp->n_kv_heads; h++)
            for (int v = 0; v < 2; v++) {
                const void *src = v ? pdm_kv_cache_v(cache, l, h) : pdm_kv_cache_k(cache, l, h);
                float *dst = ref->kv + ((size_t)(l * hp->n_kv_heads + h) * 2 + v) * plane;
                float sc = cache->scale[(size_t)(l * hp->n_kv_heads + h) * 2 + v];
                for (size_t e = 0; e < plane; e++)
                    dst[e] = kv_dtype == PDM_DT_F32  ? ((const float *)src)[e]
                             : kv_dtype == PDM_DT_I8 ? sc * (float)((const int8_t *)src)[e]
                                                     : pdm_f16_to_f32(((const uint16_t *)src)[e]);
            }
    ref->scale = malloc(sizeof(float) * 2 * hp->n_layers * hp->n_kv_heads);
    memcpy(ref->scale, cache->scale, sizeof(float) * 2 * hp->n_layers * hp->n_kv_heads);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}

static void reference_free(reference_t *r)
{
    free(r->scale);
    free(r->logits);
    free(r->kv);
}

static pdm_launch_t *start_group(int ranks, const char *model, const char *kv_dtype,
                                 double timeout)
{
    pdm_launch_params_t lp;
    pdm_launch_params_default(&lp);
    lp.bin = prefill_bin();
    lp.model = model;
    lp.ranks = ranks;
    lp.ctx_tokens = 1024;
    lp.kv_dtype = kv_dtype;
    lp.timeout = timeout;
    pdm_launch_t *l = NULL;
    int st = pdm_launch_start(&lp, &l);
    ck_assert_msg(st == 0, "launch: %s", pdm_error_last());
    return l;
}

/* Compares a task's logits file and KV dump (the whole conversation, n positions) with the
 * reference: logits within logit_tol * max(1, |logit|max), the same greedy first token, every
 * K and V element within kv_tol. Removes both files. */
static void compare_output(const pdm_model_hparams_t *hp, int n, const char *kv_path,
                           const char *logits_path, const pdm_launch_result_t *res,
                           const reference_t *ref, double kv_tol, double logit_tol,
                           const char *what)
{
    float *logits = malloc(sizeof(float) * hp->n_vocab);
    FILE *f = fopen(logits_path, "rb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fread(logits, sizeof(float), hp->n_vocab, f), hp->n_vocab);
    fclose(f);
    double max_ref = 1, max_diff = 0;
    int32_t best = 0;
    for (uint32_t i = 0; i < hp->n_vocab; i++) {
        max_ref = fmax(max_ref, fabs(ref->logits[i]));
        max_diff = fmax(max_diff, fabs(logits[i] - ref->logits[i]));
        if (ref->logits[i] > ref->logits[best]) best = (int32_t)i;
    }
    ck_assert_msg(max_diff <= logit_tol * max_ref, "%s: logits differ by %g (tolerance %g)",
                  what, max_diff, logit_tol * max_ref);
    ck_assert_msg(res->first_token == best, "%s: first token %d, engine %d", what,
                  res->first_token, best);
    free(logits);

    int32_t n_file;
    float *kv;
    ck_assert_msg(pdm_kvfile_read(kv_path, hp, &n_file, &kv) == 0, "%s: %s", what,
                  pdm_error_last());
    ck_assert_int_eq(n_file, n);
    size_t total = (size_t)hp->n_layers * hp->n_kv_heads * 2 * (size_t)n * hp->head_dim;
    double kv_diff = 0;
    size_t worst = 0;
    for (size_t e = 0; e < total; e++) {
        double d = fabs(kv[e] - ref->kv[e]);
        if (!(d <= kv_diff)) {
            kv_diff = d;
            worst = e;
        }
    }
    ck_assert_msg(kv_diff <= kv_tol, "%s: KV differs by %g at element %zu (tolerance %g)", what,
                  kv_diff, worst, kv_tol);
    if (getenv("PDM_TEST_VERBOSE"))
        fprintf(stderr, "%s: max logit diff %.3g, max KV diff %.3g\n", what, max_diff, kv_diff);
    free(kv);
    unlink(kv_path);
    unlink(logits_path);
}

/* Runs [0, P) (if P > 0) and then [P, n) with `method` and compares logits and the whole KV
 * with the reference. */
static void check_task(pdm_launch_t *l, const pdm_model_hparams_t *hp, pdm_prefill_method_t m,
                       const int32_t *ids, int n, int P, const int *chunks, const reference_t *ref,
                       double kv_tol, double logit_tol, const char *what)
{
    char kv_path[700], logits_path[700];
    snprintf(kv_path, sizeof(kv_path), "%s/kv-%d.bin", pdm_test_tmpdir(), (int)getpid());
    snprintf(logits_path, sizeof(logits_path), "%s/logits-%d.bin", pdm_test_tmpdir(),
             (int)getpid());
    pdm_launch_result_t res;
    if (P > 0) {
        pdm_prefill_task_t first = {
            .method = pdm_prefill_method_is_kvr(m) ? PDM_PREFILL_KVR_E : m, .tokens = ids,
            .n_tokens = P};
        ck_assert_msg(pdm_launch_task(l, &first, NULL, NULL, &res) == 0, "%s: first turn: %s",
                      what, pdm_error_last());
    }
    pdm_prefill_task_t t = {.method = m, .start = P, .tokens = ids + P, .n_tokens = n - P,
                            .chunks = chunks};
    int st = pdm_launch_task(l, &t, kv_path, logits_path, &res);
    ck_assert_msg(st == 0, "%s: %s", what, pdm_error_last());

    compare_output(hp, n, kv_path, logits_path, &res, ref, kv_tol, logit_tol, what);
}

/* Every method on a group of `R` ranks, at lengths 1, R-1, R, 2R+1 and 45 and with partial
 * prefill, on the model at `model_path`. */
static void run_group_case_on(int R, const char *path)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(R, path, "f32", 60);
    int lengths[] = {1, R - 1, R, 2 * R + 1, 45};
    uint64_t seed = 100 + (uint64_t)R;
    for (size_t li = 0; li < PDM_ARRAY_SIZE(lengths); li++) {
        int n = lengths[li];
        if (n < 1) continue;
        int32_t ids[64];
        tokens_random(ids, n, hp.n_vocab, seed++);
        reference_t ref;
        reference(path, PDM_DT_F32, ids, n, &ref);
        for (int mi = 0; mi < PDM_PREFILL_AUTO; mi++) {
            pdm_prefill_method_t meth = (pdm_prefill_method_t)mi;
            char what[128];
            snprintf(what, sizeof(what), "R=%d n=%d %s", R, n, pdm_prefill_method_name(meth));
            int chunks[PDM_KVT_MAX_RANKS], *ck = NULL;
            if (meth == PDM_PREFILL_KVR_P) continue; /* needs a table: covered by kvr-s */
            if (meth == PDM_PREFILL_KVR_S && n >= R) {
                /* A random uneven partition with every chunk >= 1. */
                uint64_t s = seed * 31;
                for (int i = 0; i < R; i++) chunks[i] = 1;
                for (int left = n - R; left > 0; left--) chunks[pdm_splitmix64(&s) % R]++;
                ck = chunks;
            }
            int expect_error = (meth == PDM_PREFILL_SINGLE && R != 1) ||
                               ((meth == PDM_PREFILL_TSP || pdm_prefill_method_is_kvr(meth)) &&
                                n < R);
            if (expect_error) {
                pdm_prefill_task_t t = {.method = meth, .tokens = ids, .n_tokens = n,
                                        .chunks = ck};
                pdm_launch_result_t res;
                ck_assert_msg(pdm_launch_task(l, &t, NULL, NULL, &res) != 0,
                              "%s: should be refused", what);
                ck_assert_msg(strstr(pdm_error_last(), "rank") != NULL, "%s: %s", what,
                              pdm_error_last());
                continue;
            }
            check_task(l, &hp, meth, ids, n, 0, ck, &ref, 1e-4, 1e-3, what);
        }
        reference_free(&ref);
    }
    /* Partial prefill: P cached tokens from an earlier turn, then T new ones. */
    const int partial[][2] = {{20, 13}, {7, 1}, {30, 2 * R + 3}};
    for (size_t pi = 0; pi < PDM_ARRAY_SIZE(partial); pi++) {
        int P = partial[pi][0], n = P + partial[pi][1];
        int32_t ids[64];
        tokens_random(ids, n, hp.n_vocab, seed++);
        reference_t ref;
        reference(path, PDM_DT_F32, ids, n, &ref);
        const pdm_prefill_method_t ms[] = {PDM_PREFILL_KVR_E, PDM_PREFILL_CP_KV, PDM_PREFILL_CP_Q};
        for (size_t mi = 0; mi < PDM_ARRAY_SIZE(ms); mi++) {
            if (pdm_prefill_method_is_kvr(ms[mi]) && (n - P < R || P < R)) continue;
            char what[128];
            snprintf(what, sizeof(what), "R=%d P=%d T=%d %s", R, P, n - P,
                     pdm_prefill_method_name(ms[mi]));
            check_task(l, &hp, ms[mi], ids, n, P, NULL, &ref, 1e-4, 1e-3, what);
        }
        reference_free(&ref);
    }
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}

static void run_group_case(int R) { run_group_case_on(R, model_path); }

/* Prompt log-probabilities (PrefillTask.prompt_logprobs): every method on groups of 1, 2 and 3
 * ranks, each rank scoring the tokens its rows predict, merged by position, equal the
 * engine's log_softmax of every row (pdm_model_prefill_logits) within 1e-4 on the f32 model
 * (the same last-bit tolerance as the logits). */
START_TEST(test_group_prompt_logprobs)
{
    make_model();
    enum { N = 45 };
    pdm_model_t *m;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const uint32_t V = m->hp.n_vocab;
    int32_t ids[N];
    tokens_random(ids, N, V, 4242);
    float *logits = malloc(sizeof(float) * V * N);
    double ref[N];
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, N, PDM_DT_F32, &cache), 0);
    ck_assert_int_eq(pdm_model_prefill_logits(ctx, cache, ids, N, 0, logits), 0);
    for (int p = 1; p < N; p++) {
        const float *row = logits + (size_t)(p - 1) * V;
        double mx = row[0], sum = 0;
        for (uint32_t i = 1; i < V; i++) mx = fmax(mx, row[i]);
        for (uint32_t i = 0; i < V; i++) sum += exp(row[i] - mx);
        ref[p] = row[ids[p]] - mx - log(sum);
    }
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    free(logits);
    for (int R = 1; R <= 3; R++) {
        pdm_launch_t *l = start_group(R, model_path, "f32", 60);
        for (int mi = 0; mi < PDM_PREFILL_AUTO; mi++) {
            pdm_prefill_method_t meth = (pdm_prefill_method_t)mi;
            if (meth == PDM_PREFILL_KVR_P || (meth == PDM_PREFILL_SINGLE) != (R == 1)) continue;
            pdm_prefill_task_t t = {.method = meth, .tokens = ids, .n_tokens = N,
                                    .prompt_logprobs = 1, .prompt_top = 3};
            pdm_launch_result_t res;
            int st = pdm_launch_task(l, &t, NULL, NULL, &res);
            ck_assert_msg(st == 0, "R=%d %s: %s", R, pdm_prefill_method_name(meth),
                          pdm_error_last());
            ck_assert(isnan(res.prompt_logprobs[0]));
            double worst = 0;
            for (int p = 1; p < N; p++) {
                ck_assert_msg(!isnan(res.prompt_logprobs[p]), "R=%d %s: position %d missing", R,
                              pdm_prefill_method_name(meth), p);
                worst = fmax(worst, fabs(res.prompt_logprobs[p] - ref[p]));
            }
            ck_assert_msg(worst <= 1e-4, "R=%d %s: prompt log-probabilities differ by %g", R,
                          pdm_prefill_method_name(meth), worst);
            free(res.prompt_logprobs);
        }
        /* a partial prefill cannot score the cached tokens: refused */
        pdm_prefill_task_t first = {.method = PDM_PREFILL_CP_KV, .tokens = ids, .n_tokens = 20};
        pdm_launch_result_t res;
        ck_assert_int_eq(pdm_launch_task(l, &first, NULL, NULL, &res), 0);
        pdm_prefill_task_t part = {.method = PDM_PREFILL_CP_KV, .start = 20, .tokens = ids + 20,
                                   .n_tokens = N - 20, .prompt_logprobs = 1};
        ck_assert(pdm_launch_task(l, &part, NULL, NULL, &res) != 0);
        ck_assert_msg(strstr(pdm_error_last(), "start 0"), "%s", pdm_error_last());
        free(res.prompt_logprobs);
        ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
    }
}
END_TEST

/* The other architectures' per-layer differences (Q/K norms, biases, NEOX RoPE, post norms,
 * GeGLU, sliding-window layers) live in the steps every method calls, and the window is a
 * mask on absolute positions, so every method holds for them too. The gemma3 preset's window
 * (16) is shorter than the longest prompts here (45 tokens, partial prefills of 33). */
static void run_arch_group_case(const char *arch, int R)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/prefill-%s.gguf", pdm_test_tmpdir(), arch);
    pdm_testmodel_params_t p;
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, arch), 0);
    p.wtype = PDM_DT_F32; /* as the llama model above: see the tolerances */
    p.embtype = PDM_DT_F32;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    run_group_case_on(R, path);
}

START_TEST(test_group_gemma3_r2) { run_arch_group_case("gemma3", 2); }
END_TEST
START_TEST(test_group_qwen3_r3) { run_arch_group_case("qwen3", 3); }
END_TEST
START_TEST(test_group_qwen2_r2) { run_arch_group_case("qwen2", 2); }
END_TEST

START_TEST(test_group_r1) { run_group_case(1); }
END_TEST
START_TEST(test_group_r2) { run_group_case(2); }
END_TEST
/* The same over TCP (what ranks on different hosts use; same-host ranks use shared memory). */
START_TEST(test_group_r2_tcp)
{
    setenv("UCX_TLS", "tcp", 1); /* this test's process only (Check forks per test) */
    run_group_case(2);
}
END_TEST
START_TEST(test_group_r3) { run_group_case(3); }
END_TEST
START_TEST(test_group_r4) { run_group_case(4); }
END_TEST
START_TEST(test_group_r8) { run_group_case(8); }
END_TEST

/* int8 KV: every method's q8 KV equals the single-process q8 engine's. Both fix the scales
 * from the whole prompt (the engine directly, the ranks by an all-reduce max), so the int8
 * values are the same up to rounding moved by last-bit float differences (only cp-* merge
 * partial attention in another order; the other methods match bit for bit): every element
 * within one quantization step of its head, at most 0.5 % of elements a step off (scales
 * equal to 1e-4 relative), and the same greedy first token. The dumped file holds
 * scale * int8, so a scale that differed by more would move every element. */
static void check_q8(pdm_launch_t *l, const pdm_model_hparams_t *hp, pdm_prefill_method_t meth,
                     const int32_t *ids, int n, int P, const int *chunks, const reference_t *ref,
                     const char *what)
{
    char kv_path[700];
    snprintf(kv_path, sizeof(kv_path), "%s/kvq8-%d.bin", pdm_test_tmpdir(), (int)getpid());
    pdm_launch_result_t res;
    if (P > 0) {
        pdm_prefill_task_t first = {.method = meth, .tokens = ids, .n_tokens = P};
        ck_assert_msg(pdm_launch_task(l, &first, NULL, NULL, &res) == 0, "%s: %s", what,
                      pdm_error_last());
    }
    pdm_prefill_task_t t = {.method = meth, .start = P, .tokens = ids + P, .n_tokens = n - P,
                            .chunks = chunks};
    ck_assert_msg(pdm_launch_task(l, &t, kv_path, NULL, &res) == 0, "%s: %s", what,
                  pdm_error_last());
    int32_t best = 0;
    for (uint32_t i = 1; i < hp->n_vocab; i++)
        if (ref->logits[i] > ref->logits[best]) best = (int32_t)i;
    ck_assert_msg(res.first_token == best, "%s: first token %d, engine %d", what,
                  res.first_token, best);
    int32_t n_file;
    float *kv;
    ck_assert_msg(pdm_kvfile_read(kv_path, hp, &n_file, &kv) == 0, "%s", pdm_error_last());
    ck_assert_int_eq(n_file, n);
    const size_t plane = (size_t)n * hp->head_dim;
    size_t off = 0, total = 0;
    for (size_t hk = 0; hk < (size_t)hp->n_layers * hp->n_kv_heads * 2; hk++) {
        const float step = ref->scale[hk];
        for (size_t e = 0; e < plane; e++, total++) {
            float a = kv[hk * plane + e], b = ref->kv[hk * plane + e];
            /* same int8 value; the scale itself may differ in its last bits where the
             * method's merge order moved the layer's input (cp-*) */
            if (fabsf(a - b) <= 1e-4f * fmaxf(fabsf(b), step)) continue;
            off++;
            ck_assert_msg(fabsf(a - b) <= step * 1.0001f, "%s: q8 KV element %zu of head-plane "
                          "%zu: %g vs %g (step %g)", what, e, hk, a, b, step);
        }
    }
    ck_assert_msg(off * 200 <= total, "%s: %zu of %zu q8 KV elements differ", what, off, total);
    if (getenv("PDM_TEST_VERBOSE"))
        fprintf(stderr, "%s: %zu of %zu q8 elements one step off\n", what, off, total);
    free(kv);
    unlink(kv_path);
}

static void run_q8_case(int R)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(R, model_path, "q8", 60);
    const int lengths[] = {2 * R + 1, 45};
    uint64_t seed = 900 + (uint64_t)R;
    for (size_t li = 0; li < PDM_ARRAY_SIZE(lengths); li++) {
        int n = lengths[li];
        int32_t ids[64];
        tokens_random(ids, n, hp.n_vocab, seed++);
        reference_t ref;
        reference(model_path, PDM_DT_I8, ids, n, &ref); /* chunks of 16: the layer-wise path */
        for (int mi = 0; mi < PDM_PREFILL_AUTO; mi++) {
            pdm_prefill_method_t meth = (pdm_prefill_method_t)mi;
            if ((meth == PDM_PREFILL_SINGLE) != (R == 1)) continue;
            int chunks[PDM_KVT_MAX_RANKS], *ck = NULL;
            /* kvr-p: the partition a table would predict, given directly (uneven) */
            if (meth == PDM_PREFILL_KVR_S || meth == PDM_PREFILL_KVR_P) {
                uint64_t s = seed * 17;
                for (int i = 0; i < R; i++) chunks[i] = 1;
                for (int left = n - R; left > 0; left--) chunks[pdm_splitmix64(&s) % R]++;
                ck = chunks;
            }
            char what[128];
            snprintf(what, sizeof(what), "q8 R=%d n=%d %s", R, n, pdm_prefill_method_name(meth));
            check_q8(l, &hp, meth, ids, n, 0, ck, &ref, what);
        }
        reference_free(&ref);
    }
    /* Partial prefill: the second turn keeps the first turn's scales (saturating). */
    {
        int P = 20, n = 33;
        int32_t ids[64];
        tokens_random(ids, n, hp.n_vocab, seed++);
        pdm_model_t *mm;
        pdm_model_ctx_t *ctx;
        pdm_kv_cache_t *cache;
        ck_assert_int_eq(pdm_model_load(model_path, &mm), 0);
        ck_assert_int_eq(pdm_model_ctx_create(mm, 1, 16, &ctx), 0);
        ck_assert_int_eq(pdm_kv_cache_create(&mm->hp, n, PDM_DT_I8, &cache), 0);
        float *lg = malloc(sizeof(float) * hp.n_vocab);
        ck_assert_int_eq(pdm_model_prefill(ctx, cache, ids, P, lg), 0);
        ck_assert_int_eq(cache->scales_fixed, 1);
        float first_scale = cache->scale[0];
        ck_assert_int_eq(pdm_model_prefill(ctx, cache, ids + P, n - P, lg), 0);
        ck_assert_float_eq(cache->scale[0], first_scale); /* never re-quantized */
        free(lg);
        pdm_kv_cache_destroy(cache);
        pdm_model_ctx_destroy(ctx);
        pdm_model_free(mm);
        reference_t ref;
        reference(model_path, PDM_DT_I8, ids, P, &ref); /* scales of the first turn */
        /* the group's first turn must fix the same scales: its KV equals the reference's */
        const pdm_prefill_method_t ms[] = {PDM_PREFILL_CP_KV, PDM_PREFILL_CP_Q};
        for (size_t mi = 0; mi < PDM_ARRAY_SIZE(ms) && R > 1; mi++) {
            char what[128];
            snprintf(what, sizeof(what), "q8 R=%d first turn P=%d %s", R, P,
                     pdm_prefill_method_name(ms[mi]));
            check_q8(l, &hp, ms[mi], ids, P, 0, NULL, &ref, what);
            pdm_prefill_task_t t2 = {.method = ms[mi], .start = P, .tokens = ids + P,
                                     .n_tokens = n - P};
            pdm_launch_result_t res;
            ck_assert_msg(pdm_launch_task(l, &t2, NULL, NULL, &res) == 0, "%s: %s", what,
                          pdm_error_last());
        }
        reference_free(&ref);
    }
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}

START_TEST(test_group_q8_r1) { run_q8_case(1); }
END_TEST
START_TEST(test_group_q8_r2) { run_q8_case(2); }
END_TEST
START_TEST(test_group_q8_r3) { run_q8_case(3); }
END_TEST

/* The group's pool of conversations (pool.h) on real ranks: conversations A and B (B's
 * first turn evicts nothing, the pool keeps A), then A's follow-up continues A from the pool
 * (pool_source = A's id, only the new tokens computed) with logits and the whole KV equal to
 * the engine's on the whole prompt; then B's follow-up likewise. Methods kvr-e (a chain
 * continues at the rank that holds A's prefix) and cp-kv (scattered shares), 2 ranks. A task
 * naming a conversation the pool does not hold is refused (prefix miss), and the group stays
 * usable. */
static void pool_conv_id(const int32_t *ids, int n, uint64_t *id)
{
    pdm_prefill_conv_t c = {0};
    ck_assert_int_eq(pdm_prefill_conv_reserve(&c, n), 0);
    memcpy(c.tokens, ids, sizeof(int32_t) * (size_t)n);
    c.n = n;
    *id = pdm_prefill_conv_id(&c);
    pdm_prefill_conv_free(&c);
}

static void run_pool_case(pdm_prefill_method_t meth)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(2, model_path, "f32", 60);
    enum { P = 24, T = 11 };
    int32_t a[P + T], b[P + T];
    tokens_random(a, P + T, hp.n_vocab, 71);
    tokens_random(b, P + T, hp.n_vocab, 72);
    memcpy(b, a, sizeof(int32_t) * 6); /* a shared "system prompt" of 6 tokens */
    pdm_launch_result_t res;
    for (int c = 0; c < 2; c++) { /* first turns of A and B */
        pdm_prefill_task_t t = {.method = meth, .tokens = c ? b : a, .n_tokens = P,
                                .pool_tokens = 1000};
        ck_assert_msg(pdm_launch_task(l, &t, NULL, NULL, &res) == 0, "%s", pdm_error_last());
    }
    char kv_path[700], logits_path[700];
    snprintf(kv_path, sizeof(kv_path), "%s/kvpool-%d.bin", pdm_test_tmpdir(), (int)getpid());
    snprintf(logits_path, sizeof(logits_path), "%s/lgpool-%d.bin", pdm_test_tmpdir(),
             (int)getpid());
    for (int c = 0; c < 2; c++) { /* A's follow-up from the pool, then B's */
        const int32_t *ids = c ? b : a;
        uint64_t id;
        pool_conv_id(ids, P, &id);
        pdm_prefill_task_t t = {.method = meth, .start = P, .prefix = ids, .tokens = ids + P,
                                .n_tokens = T, .pool_source = id, .pool_tokens = 1000};
        ck_assert_msg(pdm_launch_task(l, &t, kv_path, logits_path, &res) == 0, "%s: %s",
                      c ? "B" : "A", pdm_error_last());
        ck_assert_int_eq(res.rank[0].n_local + res.rank[1].n_local, T); /* only new tokens */
        reference_t ref;
        reference(model_path, PDM_DT_F32, ids, P + T, &ref);
        char what[64];
        snprintf(what, sizeof(what), "pool %s follow-up of %s", pdm_prefill_method_name(meth),
                 c ? "B" : "A");
        compare_output(&hp, P + T, kv_path, logits_path, &res, &ref, 1e-4, 1e-3, what);
        reference_free(&ref);
    }
    /* A conversation nobody holds: refused, never guessed. */
    int32_t z[P + T];
    tokens_random(z, P + T, hp.n_vocab, 73);
    uint64_t zid;
    pool_conv_id(z, P, &zid);
    pdm_prefill_task_t miss = {.method = meth, .start = P, .prefix = z, .tokens = z + P,
                               .n_tokens = T, .pool_source = zid, .pool_tokens = 1000};
    ck_assert_int_ne(pdm_launch_task(l, &miss, NULL, NULL, &res), 0);
    ck_assert_msg(strstr(pdm_error_last(), "prefix miss"), "%s", pdm_error_last());
    pdm_prefill_task_t again = {.method = meth, .tokens = z, .n_tokens = P + T,
                                .pool_tokens = 1000, .pool_reset = 1};
    ck_assert_msg(pdm_launch_task(l, &again, NULL, NULL, &res) == 0, "%s", pdm_error_last());
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}

START_TEST(test_group_pool_kvr) { run_pool_case(PDM_PREFILL_KVR_E); }
END_TEST

START_TEST(test_group_pool_cp) { run_pool_case(PDM_PREFILL_CP_KV); }
END_TEST

/* A pooled conversation corrupted on one rank (PDMESH_FAULT_CORRUPT_POOL=1 flips a byte of
 * every entry it loads): the checksum catches it, every rank refuses the task at once (no
 * rank waits for a peer until its timeout), the entry is never used, and the group prefills
 * the prompt in full afterwards with the engine's logits and KV. */
START_TEST(test_group_pool_corrupt)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    pdm_model_free(m);
    setenv("PDMESH_FAULT_CORRUPT_POOL", "1", 1);
    pdm_launch_t *l = start_group(2, model_path, "f32", 20);
    unsetenv("PDMESH_FAULT_CORRUPT_POOL");
    enum { P = 20, T = 9 };
    int32_t a[P + T], b[P];
    tokens_random(a, P + T, hp.n_vocab, 81);
    tokens_random(b, P, hp.n_vocab, 82);
    pdm_launch_result_t res;
    pdm_prefill_task_t ta = {.method = PDM_PREFILL_CP_KV, .tokens = a, .n_tokens = P,
                             .pool_tokens = 1000};
    pdm_prefill_task_t tb = {.method = PDM_PREFILL_CP_KV, .tokens = b, .n_tokens = P,
                             .pool_tokens = 1000};
    ck_assert_int_eq(pdm_launch_task(l, &ta, NULL, NULL, &res), 0);
    ck_assert_int_eq(pdm_launch_task(l, &tb, NULL, NULL, &res), 0);
    uint64_t id;
    pool_conv_id(a, P, &id);
    pdm_prefill_task_t f = {.method = PDM_PREFILL_CP_KV, .start = P, .prefix = a,
                            .tokens = a + P, .n_tokens = T, .pool_source = id,
                            .pool_tokens = 1000};
    double t0 = pdm_now();
    ck_assert_int_ne(pdm_launch_task(l, &f, NULL, NULL, &res), 0);
    ck_assert_msg(strstr(pdm_error_last(), "pooled KV"), "%s", pdm_error_last());
    ck_assert_msg(pdm_now() - t0 < 10, "the refusal took %.1f s", pdm_now() - t0);
    char kv_path[700], logits_path[700];
    snprintf(kv_path, sizeof(kv_path), "%s/kvcor-%d.bin", pdm_test_tmpdir(), (int)getpid());
    snprintf(logits_path, sizeof(logits_path), "%s/lgcor-%d.bin", pdm_test_tmpdir(),
             (int)getpid());
    pdm_prefill_task_t full = {.method = PDM_PREFILL_CP_KV, .tokens = a, .n_tokens = P + T,
                               .pool_tokens = 1000, .pool_reset = 1};
    ck_assert_msg(pdm_launch_task(l, &full, kv_path, logits_path, &res) == 0, "%s",
                  pdm_error_last());
    reference_t ref;
    reference(model_path, PDM_DT_F32, a, P + T, &ref);
    compare_output(&hp, P + T, kv_path, logits_path, &res, &ref, 1e-4, 1e-3, "after corrupt");
    reference_free(&ref);
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}
END_TEST

/* ---- The pool's bookkeeping (pool.h), pure ------------------------------------------------ */

static void conv_turn(pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks, int32_t start,
                      const int32_t *tokens, int32_t n);

/* A conversation of n tokens by 'single' on one rank, as begin + commit record it. */
static void pool_turn(pdm_prefill_pool_t *p, pdm_prefill_conv_t *active, uint64_t source,
                      int32_t start, const int32_t *tokens, int32_t n)
{
    int loaded;
    ck_assert_msg(pdm_prefill_pool_begin(p, active, source, start, &loaded) == 0, "%s",
                  pdm_error_last());
    conv_turn(active, PDM_PREFILL_SINGLE, 1, start, tokens, n);
}

static int32_t pool_followup(const pdm_prefill_pool_t *p, const pdm_prefill_conv_t *active,
                             const int32_t *tokens, int32_t n, uint64_t *source)
{
    pdm_prefill_followup_params_t fp = {.method = PDM_PREFILL_SINGLE, .ranks = 1,
                                        .tokens = tokens, .n_tokens = n, .min_cached = 4,
                                        .reuse = 1};
    return pdm_prefill_conv_followup_start(pdm_prefill_pool_pick(p, active, &fp, source), &fp);
}

/* Fake rank ops: the "rows" of an entry are its tokens; load checks a sum. */
static int fake_loads, fake_drops, fake_corrupt;
static int fake_save(void *ctx, const pdm_prefill_conv_t *c, pdm_prefill_pool_entry_t *e)
{
    (void)ctx;
    e->kv = malloc(sizeof(int32_t) * (size_t)c->n);
    memcpy(e->kv, c->tokens, sizeof(int32_t) * (size_t)c->n);
    e->kv_bytes = sizeof(int32_t) * (size_t)c->n;
    e->checksum = 0;
    for (int32_t i = 0; i < c->n; i++) e->checksum += (uint64_t)c->tokens[i];
    return 0;
}
static int fake_load(void *ctx, const pdm_prefill_pool_entry_t *e)
{
    (void)ctx;
    if (fake_corrupt) ((int32_t *)e->kv)[0] ^= 1;
    uint64_t sum = 0;
    for (int32_t i = 0; i < e->conv.n; i++) sum += (uint64_t)((int32_t *)e->kv)[i];
    fake_loads++;
    return sum == e->checksum ? 0 : PDM_ECHECKSUM;
}
static void fake_drop(void *ctx, pdm_prefill_pool_entry_t *e)
{
    (void)ctx;
    free(e->kv);
    e->kv = NULL;
    fake_drops++;
}

/* Many conversations: three conversations sharing a 10-token system prompt, each continued
 * later from the pool (not only the last one); the pick names the right source; an extended
 * conversation replaces its shorter self; LRU eviction under a budget (the source of the
 * running task is never evicted to make room); a miss and a corrupt entry are refused and
 * the active conversation emptied; budget 0 keeps only the active conversation (as before). */
START_TEST(test_pool_bookkeeping)
{
    int32_t conv[3][80];
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 80; i++) conv[c][i] = i < 10 ? 7 + i : 1000 * (c + 1) + i;
    pdm_prefill_pool_ops_t ops = {fake_save, fake_load, fake_drop, NULL};
    pdm_prefill_pool_t p;
    pdm_prefill_pool_init(&p, 200, &ops);
    pdm_prefill_conv_t active = {0};
    uint64_t src;
    /* turn 1 of each: the system prompt is found in the previous one (start 10 after the
     * first), but the plain rule here starts each at 0 */
    for (int c = 0; c < 3; c++) {
        if (c > 0) ck_assert_int_eq(pool_followup(&p, &active, conv[c], 30, &src), 10);
        pool_turn(&p, &active, 0, 0, conv[c], 30);
    }
    ck_assert_int_eq(p.n, 2); /* conversations 0 and 1; 2 is the active one */
    ck_assert_int_eq(p.tokens, 60);
    /* turn 2 of conversation 0: held in the pool, 30 tokens reused */
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 50, &src), 30);
    ck_assert(src != 0);
    fake_loads = 0;
    pool_turn(&p, &active, src, 30, conv[0], 50);
    ck_assert_int_eq(fake_loads, 1);
    /* conversation 2 went to the pool; continuing it from there copies its entry (which
     * stays), and saving conversation 0's 50 tokens replaced its 30-token entry */
    ck_assert_int_eq(pool_followup(&p, &active, conv[2], 40, &src), 30);
    ck_assert(src != 0);
    pool_turn(&p, &active, src, 30, conv[2], 40);
    ck_assert_int_eq(p.n, 3); /* 0 (50 tokens), 1 (30), 2 (30) */
    ck_assert_int_eq(p.tokens, 110);
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 60, &src), 50);
    ck_assert_int_eq(pool_followup(&p, &active, conv[1], 60, &src), 30);
    /* budget 90: the least recently used (conversation 1) goes */
    uint64_t evicted0 = p.evictions;
    pdm_prefill_pool_set_budget(&p, 90);
    ck_assert_uint_eq(p.evictions, evicted0 + 1);
    ck_assert_int_eq(p.tokens, 80);
    ck_assert_int_eq(pool_followup(&p, &active, conv[1], 60, &src), 10); /* system prompt only */
    /* conversation 0 again: the active conversation 2 (40) replaces its 30-token entry */
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 60, &src), 50);
    pool_turn(&p, &active, src, 50, conv[0], 60);
    ck_assert_uint_eq(p.evictions, evicted0 + 1);
    ck_assert_int_eq(p.tokens, 90);
    ck_assert_int_eq(pool_followup(&p, &active, conv[2], 60, &src), 40);
    /* a new conversation: saving conversation 0 (60, replacing its 50) must evict 2 (40) */
    pool_turn(&p, &active, 0, 0, conv[1], 30);
    ck_assert_uint_eq(p.evictions, evicted0 + 2);
    ck_assert_int_eq(p.tokens, 60);
    ck_assert_int_eq(pool_followup(&p, &active, conv[2], 60, &src), 10);
    /* a source that is not held: refused, the active conversation emptied */
    int loaded;
    ck_assert_int_eq(pdm_prefill_pool_begin(&p, &active, 12345, 20, &loaded), PDM_ESTATE);
    ck_assert_int_eq(active.n, 0);
    ck_assert_int_eq(loaded, 0);
    /* a corrupt entry: refused, dropped, counted */
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 70, &src), 60);
    fake_corrupt = 1;
    int n0 = p.n;
    ck_assert_int_eq(pdm_prefill_pool_begin(&p, &active, src, 60, &loaded), PDM_ECHECKSUM);
    fake_corrupt = 0;
    ck_assert_int_eq(p.n, n0 - 1);
    ck_assert_uint_eq(p.corrupt, 1);
    ck_assert_int_eq(active.n, 0);
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 70, &src), 0);
    /* budget 0: nothing kept, the active conversation alone as before */
    pdm_prefill_pool_set_budget(&p, 0);
    ck_assert_int_eq(p.n, 0);
    pool_turn(&p, &active, 0, 0, conv[1], 30);
    pool_turn(&p, &active, 0, 0, conv[2], 30);
    ck_assert_int_eq(p.n, 0);
    ck_assert_int_eq(pool_followup(&p, &active, conv[1], 40, &src), 10);
    ck_assert_int_eq(pool_followup(&p, &active, conv[2], 40, &src), 30);
    ck_assert(src == 0);
    fake_drops = 0;
    pdm_prefill_pool_set_budget(&p, 100);
    pool_turn(&p, &active, 0, 0, conv[0], 30);
    pdm_prefill_pool_fini(&p);
    ck_assert_int_eq(fake_drops, 1);
    pdm_prefill_conv_free(&active);
}
END_TEST

/* A conversation too long for the budget is not kept, and the shorter entry of it that the
 * pool holds stays (it used to be dropped before the fit was checked). */
START_TEST(test_pool_keeps_prefix_of_unfit)
{
    int32_t conv[3][80];
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 80; i++) conv[c][i] = i < 10 ? 7 + i : 1000 * (c + 1) + i;
    pdm_prefill_pool_ops_t ops = {fake_save, fake_load, fake_drop, NULL};
    pdm_prefill_pool_t p;
    pdm_prefill_pool_init(&p, 50, &ops);
    pdm_prefill_conv_t active = {0};
    uint64_t src;
    pool_turn(&p, &active, 0, 0, conv[0], 30);
    pool_turn(&p, &active, 0, 0, conv[1], 30); /* conversation 0 (30) goes to the pool */
    ck_assert_int_eq(p.n, 1);
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 60, &src), 30);
    pool_turn(&p, &active, src, 30, conv[0], 60); /* the active one: conversation 0, 60 */
    pool_turn(&p, &active, 0, 0, conv[2], 30);    /* 60 > 50: not kept; its 30 stay */
    ck_assert_int_eq(p.n, 1);
    ck_assert_int_eq(p.tokens, 30);
    ck_assert_int_eq(pool_followup(&p, &active, conv[0], 70, &src), 30);
    ck_assert(src != 0);
    pdm_prefill_pool_fini(&p);
    pdm_prefill_conv_free(&active);
}
END_TEST

/* The router's mirror and a rank's pool stay in step on the same task sequence: the same
 * entries (ids) after every task, so the mirror's pick always names a source the rank holds. */
START_TEST(test_pool_mirror_in_step)
{
    pdm_prefill_pool_ops_t ops = {fake_save, fake_load, fake_drop, NULL};
    pdm_prefill_pool_t rank, mirror;
    pdm_prefill_pool_init(&rank, 150, &ops);
    pdm_prefill_pool_init(&mirror, 150, NULL);
    pdm_prefill_conv_t ra = {0}, ma = {0};
    int32_t conv[5][120];
    for (int c = 0; c < 5; c++)
        for (int i = 0; i < 120; i++) conv[c][i] = i < 8 ? 3 + i : 100 * (c + 1) + i;
    int len[5] = {0};
    uint64_t seed = 9;
    for (int step = 0; step < 60; step++) {
        int c = (int)(pdm_splitmix64(&seed) % 5);
        int n = PDM_MIN(len[c] + 10 + (int)(pdm_splitmix64(&seed) % 15), 120);
        if (n <= len[c]) continue;
        uint64_t src;
        int32_t start = pool_followup(&mirror, &ma, conv[c], n, &src);
        int loaded;
        ck_assert_msg(pdm_prefill_pool_begin(&rank, &ra, src, start, &loaded) == 0,
                      "step %d: %s", step, pdm_error_last());
        ck_assert_int_eq(pdm_prefill_pool_begin(&mirror, &ma, src, start, &loaded), 0);
        conv_turn(&ra, PDM_PREFILL_SINGLE, 1, start, conv[c], n);
        conv_turn(&ma, PDM_PREFILL_SINGLE, 1, start, conv[c], n);
        len[c] = n;
        ck_assert_int_eq(rank.n, mirror.n);
        ck_assert_int_eq(rank.tokens, mirror.tokens);
        ck_assert(rank.tokens <= 150);
        for (int i = 0; i < rank.n; i++) {
            int found = 0;
            for (int j = 0; j < mirror.n; j++) found |= mirror.e[j].id == rank.e[i].id;
            ck_assert(found);
        }
    }
    ck_assert(rank.loads > 0 && rank.evictions > 0);
    pdm_prefill_pool_fini(&rank);
    pdm_prefill_pool_fini(&mirror);
    pdm_prefill_conv_free(&ra);
    pdm_prefill_conv_free(&ma);
}
END_TEST

/* Refusals that depend on the group's conversation state; the group stays usable. */
START_TEST(test_group_state_errors)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(2, model_path, "f32", 30);
    int32_t ids[40];
    tokens_random(ids, 40, hp.n_vocab, 5);
    pdm_launch_result_t res;
    pdm_prefill_task_t t = {.method = PDM_PREFILL_CP_KV, .tokens = ids, .n_tokens = 20};
    ck_assert_int_eq(pdm_launch_task(l, &t, NULL, NULL, &res), 0);
    /* KVR cannot continue a prefix that only exists scattered over the ranks. */
    pdm_prefill_task_t k = {.method = PDM_PREFILL_KVR_E, .start = 20, .tokens = ids + 20,
                            .n_tokens = 10};
    ck_assert_int_ne(pdm_launch_task(l, &k, NULL, NULL, &res), 0);
    ck_assert_msg(strstr(pdm_error_last(), "cached prefix"), "%s", pdm_error_last());
    /* TSP has no partial prefill. */
    k.method = PDM_PREFILL_TSP;
    ck_assert_int_ne(pdm_launch_task(l, &k, NULL, NULL, &res), 0);
    /* Continuing at the wrong position. */
    k.method = PDM_PREFILL_CP_Q;
    k.start = 15;
    ck_assert_int_ne(pdm_launch_task(l, &k, NULL, NULL, &res), 0);
    ck_assert_msg(strstr(pdm_error_last(), "holds 20 tokens"), "%s", pdm_error_last());
    /* Out-of-vocabulary tokens and uneven partitions that do not add up. */
    int32_t bad[3] = {1, (int32_t)hp.n_vocab, 2};
    pdm_prefill_task_t b = {.method = PDM_PREFILL_CP_KV, .tokens = bad, .n_tokens = 3};
    ck_assert_int_ne(pdm_launch_task(l, &b, NULL, NULL, &res), 0);
    int chunks[2] = {3, 3};
    pdm_prefill_task_t c = {.method = PDM_PREFILL_KVR_S, .tokens = ids, .n_tokens = 10,
                            .chunks = chunks};
    ck_assert_int_ne(pdm_launch_task(l, &c, NULL, NULL, &res), 0);
    /* Still usable, and the cp conversation continued correctly after the refusals. */
    k.start = 20;
    ck_assert_msg(pdm_launch_task(l, &k, NULL, NULL, &res) == 0, "%s", pdm_error_last());
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
}
END_TEST

/* A rank killed between tasks: the next task fails quickly with an error naming a rank. */
START_TEST(test_group_dead_rank)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(3, model_path, "f32", 5);
    kill(pdm_launch_pid(l, 2), SIGKILL);
    int32_t ids[30];
    tokens_random(ids, 30, vocab, 9);
    pdm_prefill_task_t t = {.method = PDM_PREFILL_KVR_E, .tokens = ids, .n_tokens = 30};
    pdm_launch_result_t res;
    double t0 = pdm_now();
    ck_assert_int_ne(pdm_launch_task(l, &t, NULL, NULL, &res), 0);
    ck_assert_msg(pdm_now() - t0 < 15, "took %.1f s", pdm_now() - t0);
    pdm_launch_stop(l);
}
END_TEST

/* A frozen rank (SIGSTOP) never answers: its peers time out and the task fails. */
START_TEST(test_group_frozen_rank)
{
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(model_path, &m), 0);
    const uint32_t vocab = m->hp.n_vocab;
    pdm_model_free(m);
    pdm_launch_t *l = start_group(2, model_path, "f32", 3);
    kill(pdm_launch_pid(l, 0), SIGSTOP);
    int32_t ids[30];
    tokens_random(ids, 30, vocab, 11);
    pdm_prefill_task_t t = {.method = PDM_PREFILL_CP_KV, .tokens = ids, .n_tokens = 30};
    pdm_launch_result_t res;
    double t0 = pdm_now();
    ck_assert_int_ne(pdm_launch_task(l, &t, NULL, NULL, &res), 0);
    ck_assert_msg(pdm_now() - t0 < 12, "took %.1f s", pdm_now() - t0);
    kill(pdm_launch_pid(l, 0), SIGCONT);
    pdm_launch_stop(l);
}
END_TEST

/* The real model, f16 KV: every multi-rank method against the engine on a chat prompt. */
START_TEST(test_group_real_model)
{
    const char *path = pdm_test_model_path();
    if (!path) {
        fprintf(stderr, "prefill: real model not present, skipping\n");
        return;
    }
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    const pdm_model_hparams_t hp = m->hp;
    int32_t ids[128];
    size_t n = 0;
    const char *text = "Distributed prefill splits one prompt over several processes; each "
                       "layer's keys and values travel between them so that the last one can "
                       "produce the first token.";
    ck_assert_int_eq(pdm_tokenizer_encode(m->tokenizer, text, strlen(text), PDM_TOKENIZE_ADD_BOS,
                                          ids, PDM_ARRAY_SIZE(ids), &n), 0);
    pdm_model_free(m);
    reference_t ref;
    reference(path, PDM_DT_F16, ids, (int)n, &ref);
    pdm_launch_t *l = start_group(2, path, "f16", 60);
    const pdm_prefill_method_t ms[] = {PDM_PREFILL_TSP, PDM_PREFILL_KVR_E, PDM_PREFILL_CP_KV,
                                       PDM_PREFILL_CP_Q};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(ms); i++) {
        char what[64];
        snprintf(what, sizeof(what), "real model %s", pdm_prefill_method_name(ms[i]));
        /* f16 rounding of K/V differs where merged attention differs in the last bit. */
        check_task(l, &hp, ms[i], ids, (int)n, 0, NULL, &ref, 0.5, 0.05, what);
    }
    check_task(l, &hp, PDM_PREFILL_CP_Q, ids, (int)n, 12, NULL, &ref, 0.5, 0.05,
               "real model partial cp-q");
    ck_assert_msg(pdm_launch_finish(l) == 0, "%s", pdm_error_last());
    reference_free(&ref);
}
END_TEST

/* Partition tables: exact lookups, interpolation between entries, rounding, files. */
START_TEST(test_partition_table)
{
    pdm_partition_table_t t = {.ranks = 2};
    int a[2] = {600, 424}, b[2] = {1200, 848}, c[2];
    ck_assert_int_eq(pdm_partition_table_put(&t, 1024, a, 1.0, 1.2), 0);
    ck_assert_int_eq(pdm_partition_table_put(&t, 2048, b, 3.0, 2.5), 0);
    ck_assert_int_eq(pdm_partition_table_lookup(&t, 1024, 1, c), 0);
    ck_assert_int_eq(c[0], 600);
    ck_assert_int_eq(pdm_partition_table_lookup(&t, 1536, 1, c), PDM_ENOTFOUND);
    ck_assert_int_eq(pdm_partition_table_lookup(&t, 1536, 0, c), 0);
    ck_assert_int_eq(c[0] + c[1], 1536);
    ck_assert_int_ge(c[0], 898);
    ck_assert_int_le(c[0], 902);
    ck_assert_int_eq(pdm_partition_table_lookup(&t, 3, 0, c), 0); /* clamped, sizes >= 1 */
    ck_assert_int_eq(c[0] + c[1], 3);
    ck_assert_int_ge(c[1], 1);
    double kvr, cp;
    pdm_partition_table_ttft(&t, 1536, &kvr, &cp);
    ck_assert_double_eq_tol(kvr, 2.0, 1e-9);
    ck_assert_double_eq_tol(cp, 1.85, 1e-9);
    char path[700];
    snprintf(path, sizeof(path), "%s/table-%d.json", pdm_test_tmpdir(), (int)getpid());
    ck_assert_int_eq(pdm_partition_table_save(path, &t), 0);
    pdm_partition_table_t u;
    ck_assert_int_eq(pdm_partition_table_load(path, &u), 0);
    ck_assert_int_eq(u.n_entries, 2);
    ck_assert_int_eq(pdm_partition_table_lookup(&u, 2048, 1, c), 0);
    ck_assert_int_eq(c[0], 1200);
    FILE *f = fopen(path, "w");
    fputs("{\"ranks\":2,\"entries\":[{\"length\":10,\"chunks\":[3,3]}]}", f);
    fclose(f);
    ck_assert_int_eq(pdm_partition_table_load(path, &u), PDM_EFORMAT);
    unlink(path);
}
END_TEST

/* The pass-KV / pass-Q choice follows Eq. 1-2 at the extremes. */
START_TEST(test_choose_cp)
{
    pdm_model_hparams_t hp = {.n_heads = 9, .n_kv_heads = 3, .head_dim = 64};
    pdm_calibration_t slow = {.flops = 1e12, .bandwidth = 1e7, .latency = 1e-5};
    pdm_calibration_t fast = {.flops = 1e9, .bandwidth = 1e10, .latency = 1e-6};
    char why[256];
    /* Full prefill: miss rate 1 >= 2 NKV / NH. */
    ck_assert_int_eq(pdm_prefill_choose_cp(&hp, &slow, 2, 4096, 0, why, sizeof(why)),
                     PDM_PREFILL_CP_KV);
    /* 1% miss on a slow link: KV messages dominate, Q (and the All2All) are small. */
    ck_assert_int_eq(pdm_prefill_choose_cp(&hp, &slow, 4, 100, 9900, why, sizeof(why)),
                     PDM_PREFILL_CP_Q);
    /* Same miss rate, but compute is slow enough to hide the KV messages (Eq. 2). */
    ck_assert_int_eq(pdm_prefill_choose_cp(&hp, &fast, 4, 100, 9900, why, sizeof(why)),
                     PDM_PREFILL_CP_KV);
}
END_TEST

/* ---- The planner: where a follow-up turn starts (conv.h) ---------------------------------- */

/* One task of `n` tokens at `start` by method `m`, recorded as the ranks record it. */
static void conv_turn(pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks, int32_t start,
                      const int32_t *tokens, int32_t n)
{
    pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
    int n_prefix;
    int nr = pdm_prefill_conv_plan(c, m, ranks, start, n - start, NULL, 0, plan, &n_prefix);
    ck_assert_msg(nr > 0, "%s", pdm_error_last());
    ck_assert_int_eq(pdm_prefill_conv_commit(c, m, ranks, start, tokens + start, n - start, plan,
                                             nr), 0);
}

static int32_t followup(const pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                        const int32_t *tokens, int32_t n, int32_t min_cached)
{
    pdm_prefill_followup_params_t p = {.method = m, .ranks = ranks, .tokens = tokens,
                                       .n_tokens = n, .min_cached = min_cached, .reuse = 1};
    return pdm_prefill_conv_followup_start(c, &p);
}

/* single (and auto on one rank): the whole common prefix, but one token is always computed;
 * reuse off, explicit chunks, a short match under min_cached or a different start: 0. */
START_TEST(test_followup_single)
{
    int32_t tok[64], other[64];
    for (int i = 0; i < 64; i++) tok[i] = 100 + i, other[i] = i < 17 ? tok[i] : 500 + i;
    pdm_prefill_conv_t c = {0};
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, tok, 30, 1), 0); /* nothing held */
    conv_turn(&c, PDM_PREFILL_SINGLE, 1, 0, tok, 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, tok, 45, 1), 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_AUTO, 1, tok, 45, 1), 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, tok, 30, 1), 29); /* same prompt */
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, tok, 12, 1), 11); /* shorter one */
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, other, 41, 1), 17);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, other + 1, 41, 1), 0);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, other, 41, 18), 0); /* block size */
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, other, 41, 17), 17);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_SINGLE, 1, tok, 1, 1), 0);
    pdm_prefill_followup_params_t p = {.method = PDM_PREFILL_SINGLE, .ranks = 1, .tokens = tok,
                                       .n_tokens = 45, .min_cached = 1, .reuse = 0};
    ck_assert_int_eq(pdm_prefill_conv_followup_start(&c, &p), 0);
    p.reuse = 1;
    p.explicit_chunks = 1;
    ck_assert_int_eq(pdm_prefill_conv_followup_start(&c, &p), 0);
    pdm_prefill_conv_free(&c);
}
END_TEST

/* Delta transfer: pdm_prefill_ranges_clip keeps exactly the rows at or after `from` of every
 * method's plan (cp's ranges are not in rank order; kvr's chain may start anywhere), each
 * range keeping its rank and chunk, with len 0 for the ranges wholly before it. */
START_TEST(test_ranges_clip)
{
    const pdm_prefill_method_t methods[] = {PDM_PREFILL_SINGLE, PDM_PREFILL_TSP,
                                            PDM_PREFILL_KVR_E, PDM_PREFILL_CP_KV};
    const int32_t start = 40, n = 61, end = start + n;
    for (size_t m = 0; m < PDM_ARRAY_SIZE(methods); m++)
        for (int32_t from = 0; from <= end; from += 7) {
            int chunks[3] = {20, 20, 21};
            pdm_prefill_range_t rg[PDM_PREFILL_MAX_RANGES], cut[PDM_PREFILL_MAX_RANGES];
            const int nr = pdm_prefill_plan_ranges(methods[m], 3, start, n, chunks, 1, rg);
            ck_assert_int_gt(nr, 0);
            memcpy(cut, rg, sizeof(rg));
            const int32_t left = pdm_prefill_ranges_clip(cut, nr, from);
            const int32_t want = end - PDM_MAX(from, start);
            ck_assert_int_eq(left, PDM_MAX(want, 0));
            uint8_t seen[128] = {0};
            for (int i = 0; i < nr; i++) {
                ck_assert_int_eq(cut[i].rank, rg[i].rank);
                ck_assert_int_eq(cut[i].chunk, rg[i].chunk);
                ck_assert_int_ge(cut[i].len, 0);
                ck_assert_int_eq(cut[i].start + cut[i].len, PDM_MAX(rg[i].start + rg[i].len,
                                                                     cut[i].start));
                for (int32_t p = cut[i].start; p < cut[i].start + cut[i].len; p++) {
                    ck_assert(p >= from && p >= rg[i].start && p < rg[i].start + rg[i].len);
                    ck_assert(!seen[p]++);
                }
            }
            for (int32_t p = PDM_MAX(from, start); p < end; p++) ck_assert(seen[p] == 1);
        }
}
END_TEST

/* tsp has no partial prefill: always 0, whatever the group holds. */
START_TEST(test_followup_tsp)
{
    int32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = 7 * i + 1;
    pdm_prefill_conv_t c = {0};
    conv_turn(&c, PDM_PREFILL_TSP, 2, 0, tok, 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_TSP, 2, tok, 45, 1), 0);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_KV, 2, tok, 45, 1), 30); /* all hold it */
    ck_assert_int_eq(followup(&c, PDM_PREFILL_KVR_E, 2, tok, 45, 1), 30);
    pdm_prefill_conv_free(&c);
}
END_TEST

/* kvr-*: a chain needs a rank holding the whole prefix (none after cp-*) and a new token per
 * rank (the start moves back to n - ranks, keeping the rest of the reuse). */
START_TEST(test_followup_kvr)
{
    int32_t tok[64];
    for (int i = 0; i < 64; i++) tok[i] = 3 * i + 2;
    pdm_prefill_conv_t c = {0};
    conv_turn(&c, PDM_PREFILL_KVR_E, 3, 0, tok, 30); /* ranks hold [0,10) [0,20) [0,30) */
    const pdm_prefill_method_t kvr[3] = {PDM_PREFILL_KVR_E, PDM_PREFILL_KVR_S,
                                         PDM_PREFILL_KVR_P};
    for (int k = 0; k < 3; k++) {
        ck_assert_int_eq(followup(&c, kvr[k], 3, tok, 45, 1), 30);
        ck_assert_int_eq(followup(&c, kvr[k], 3, tok, 31, 1), 28); /* 3 new tokens */
        ck_assert_int_eq(followup(&c, kvr[k], 3, tok, 30, 1), 27);
        ck_assert_int_eq(followup(&c, kvr[k], 3, tok, 31, 29), 0); /* 28 < min_cached */
        ck_assert_int_eq(followup(&c, kvr[k], 3, tok, 3, 1), 0);
    }
    ck_assert_int_eq(pdm_prefill_conv_chain_head(&c, 3, 28), 2);
    /* The same prompt on a group that continued with cp-kv: no rank holds [0, 45). */
    conv_turn(&c, PDM_PREFILL_CP_KV, 3, 30, tok, 45);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_KVR_E, 3, tok, 60, 1), 0);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_Q, 3, tok, 60, 1), 45);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_AUTO, 3, tok, 60, 1), 45);
    /* Explicit chunks are sizes for the whole prompt. */
    pdm_prefill_conv_reset(&c);
    conv_turn(&c, PDM_PREFILL_KVR_E, 3, 0, tok, 30);
    pdm_prefill_followup_params_t p = {.method = PDM_PREFILL_KVR_S, .ranks = 3, .tokens = tok,
                                       .n_tokens = 45, .min_cached = 1, .explicit_chunks = 1,
                                       .reuse = 1};
    ck_assert_int_eq(pdm_prefill_conv_followup_start(&c, &p), 0);
    pdm_prefill_conv_free(&c);
}
END_TEST

/* cp-kv / cp-q continue after any method; a prefix too fragmented to stream in
 * PDM_PREFILL_MAX_PREFIX_RUNS runs is not reused. */
START_TEST(test_followup_cp)
{
    int32_t tok[1024];
    for (int i = 0; i < 1024; i++) tok[i] = i;
    pdm_prefill_conv_t c = {0};
    conv_turn(&c, PDM_PREFILL_CP_KV, 2, 0, tok, 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_KV, 2, tok, 45, 1), 30);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_Q, 2, tok, 31, 1), 30); /* 1 new token */
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_Q, 2, tok, 45, 64), 0);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_KVR_P, 2, tok, 45, 1), 0);
    /* Turns of 8 tokens on 4 ranks: 2N = 8 chunks of one token, 7 runs each. */
    int32_t n = 30;
    while (pdm_prefill_conv_prefix_runs(&c, n, NULL, PDM_PREFILL_MAX_PREFIX_RUNS) >= 0) {
        conv_turn(&c, PDM_PREFILL_CP_Q, 4, n, tok, n + 8);
        n += 8;
    }
    ck_assert_int_lt(n + 8, 1024);
    ck_assert_int_eq(followup(&c, PDM_PREFILL_CP_KV, 4, tok, n + 8, 1), 0);
    pdm_prefill_conv_free(&c);
}
END_TEST

/* Whatever the history, a start the rule returns is one the planner can run: the mirror's
 * plan with the cached runs succeeds, the prefix matches, KVR keeps a token per rank. */
START_TEST(test_followup_plannable)
{
    const pdm_prefill_method_t all[6] = {PDM_PREFILL_TSP, PDM_PREFILL_KVR_E, PDM_PREFILL_KVR_P,
                                         PDM_PREFILL_CP_KV, PDM_PREFILL_CP_Q, PDM_PREFILL_AUTO};
    uint64_t seed = 42;
    int32_t tok[400];
    for (int i = 0; i < 400; i++) tok[i] = (int32_t)(pdm_splitmix64(&seed) % 5);
    for (int ranks = 1; ranks <= 4; ranks++) {
        pdm_prefill_conv_t c = {0};
        for (int turn = 0; turn < 60; turn++) {
            const int32_t n = 4 + (int32_t)(pdm_splitmix64(&seed) % 300);
            if (turn % 7 == 6) tok[pdm_splitmix64(&seed) % 400] ^= 1; /* a new prompt */
            const int32_t min_cached = 1 + (int32_t)(pdm_splitmix64(&seed) % 8);
            for (int k = 0; k < 6; k++) {
                pdm_prefill_method_t m = ranks == 1 ? PDM_PREFILL_SINGLE : all[k];
                int32_t P = followup(&c, m, ranks, tok, n, min_cached);
                if (P == 0) continue;
                ck_assert_int_ge(P, min_cached);
                ck_assert_int_lt(P, n);
                ck_assert_int_le(P, pdm_prefill_conv_common(&c, tok, n));
                ck_assert(m != PDM_PREFILL_TSP);
                if (pdm_prefill_method_is_kvr(m)) ck_assert_int_ge(n - P, ranks);
                if (m == PDM_PREFILL_AUTO) m = PDM_PREFILL_CP_KV; /* auto with a prefix */
                pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
                int n_prefix;
                ck_assert_msg(pdm_prefill_conv_plan(&c, m, ranks, P, n - P, NULL, 1, plan,
                                                    &n_prefix) > 0,
                              "ranks %d turn %d %s at %d: %s", ranks, turn,
                              pdm_prefill_method_name(m), P, pdm_error_last());
            }
            /* The turn itself, by a method that can continue where the rule says. */
            const pdm_prefill_method_t m =
                ranks == 1 ? PDM_PREFILL_SINGLE : all[pdm_splitmix64(&seed) % 6];
            const pdm_prefill_method_t run = m == PDM_PREFILL_AUTO ? PDM_PREFILL_CP_Q : m;
            if (n < ranks) continue;
            conv_turn(&c, run, ranks, followup(&c, run, ranks, tok, n, 1), tok, n);
        }
        pdm_prefill_conv_free(&c);
    }
}
END_TEST

/* ---- The partition search (partition_search.h) on a synthetic TTFT ------------------------ */

typedef struct {
    int ranks, target[8], calls;
    int fail;
} synth_ttft_t;

/* A convex TTFT with its minimum at `target` (what a measured curve looks like, §4.2). */
static double synth_ttft(void *data, const int *chunks)
{
    synth_ttft_t *s = data;
    s->calls++;
    if (s->fail) return INFINITY;
    double t = 1;
    for (int r = 0; r < s->ranks; r++) t += fabs((double)chunks[r] - s->target[r]) * 1e-3;
    return t;
}

START_TEST(test_partition_search)
{
    int best[8], evals;
    /* p = 2: the boundary search (Fig. 6a) ends within min_stride of the optimum. */
    synth_ttft_t two = {.ranks = 2, .target = {700, 324}};
    pdm_partition_search_params_t p = {.ranks = 2, .n_tokens = 1024, .min_stride = 8,
                                       .measure = synth_ttft, .data = &two};
    double t = pdm_partition_search(&p, best, &evals);
    ck_assert_int_eq(best[0] + best[1], 1024);
    ck_assert_int_le(abs(best[0] - 700), 8);
    ck_assert_double_eq_tol(t, synth_ttft(&two, best), 1e-12);
    ck_assert_int_eq(evals, two.calls - 1);
    ck_assert_int_lt(evals, 40);
    /* p = 3 and 4: the hierarchical grid search (Fig. 6b-d). */
    synth_ttft_t three = {.ranks = 3, .target = {200, 300, 400}};
    p = (pdm_partition_search_params_t){.ranks = 3, .n_tokens = 900, .min_stride = 8,
                                        .measure = synth_ttft, .data = &three};
    pdm_partition_search(&p, best, &evals);
    ck_assert_int_eq(best[0] + best[1] + best[2], 900);
    ck_assert_int_le(abs(best[0] - 200), 16);
    ck_assert_int_le(abs(best[2] - 400), 16);
    ck_assert_int_eq(evals, three.calls);
    synth_ttft_t four = {.ranks = 4, .target = {400, 250, 200, 150}};
    p = (pdm_partition_search_params_t){.ranks = 4, .n_tokens = 1000, .min_stride = 4,
                                        .measure = synth_ttft, .data = &four};
    pdm_partition_search(&p, best, &evals);
    for (int r = 0; r < 4; r++) ck_assert_int_le(abs(best[r] - four.target[r]), 16);
    /* Every run failing: +inf, and the even split. */
    synth_ttft_t fail = {.ranks = 3, .fail = 1};
    p = (pdm_partition_search_params_t){.ranks = 3, .n_tokens = 30, .min_stride = 4,
                                        .measure = synth_ttft, .data = &fail};
    ck_assert(isinf(pdm_partition_search(&p, best, &evals)));
    ck_assert_int_eq(best[0], 10);
    ck_assert_int_eq(best[2], 10);
    /* One rank: the single partition, measured once. */
    synth_ttft_t one = {.ranks = 1, .target = {5}};
    p = (pdm_partition_search_params_t){.ranks = 1, .n_tokens = 5, .min_stride = 1,
                                        .measure = synth_ttft, .data = &one};
    ck_assert_double_eq_tol(pdm_partition_search(&p, best, &evals), 1, 1e-12);
    ck_assert_int_eq(evals, 1);
    ck_assert_int_eq(best[0], 5);
}
END_TEST

static void setup_model(void)
{
    make_model();
    setenv("UCX_HANDLE_ERRORS", "none", 0); /* no UCX signal handlers (ASan, core dumps) */
}

Suite *suite_prefill(void)
{
    Suite *s = suite_create("prefill");
    TCase *tc = tcase_create("groups");
    tcase_add_unchecked_fixture(tc, setup_model, NULL);
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_partition_table);
    tcase_add_test(tc, test_choose_cp);
    tcase_add_test(tc, test_group_r1);
    tcase_add_test(tc, test_group_r2);
    tcase_add_test(tc, test_group_r2_tcp);
    tcase_add_test(tc, test_group_r3);
    tcase_add_test(tc, test_group_r4);
    tcase_add_test(tc, test_group_r8);
    tcase_add_test(tc, test_group_gemma3_r2);
    tcase_add_test(tc, test_group_qwen3_r3);
    tcase_add_test(tc, test_group_qwen2_r2);
    tcase_add_test(tc, test_group_state_errors);
    tcase_add_test(tc, test_group_dead_rank);
    tcase_add_test(tc, test_group_frozen_rank);
    tcase_add_test(tc, test_group_real_model);
    suite_add_tcase(s, tc);
    TCase *pool = tcase_create("pool"); /* the group's pool of conversations on real ranks */
    tcase_add_unchecked_fixture(pool, setup_model, NULL);
    tcase_set_timeout(pool, 300);
    tcase_add_test(pool, test_group_pool_kvr);
    tcase_add_test(pool, test_group_pool_cp);
    tcase_add_test(pool, test_group_pool_corrupt);
    suite_add_tcase(s, pool);
    TCase *plp = tcase_create("prompt_logprobs"); /* each rank scores its own rows */
    tcase_add_unchecked_fixture(plp, setup_model, NULL);
    tcase_set_timeout(plp, 300);
    tcase_add_test(plp, test_group_prompt_logprobs);
    suite_add_tcase(s, plp);
    TCase *q8 = tcase_create("q8"); /* int8 KV across every method */
    tcase_add_unchecked_fixture(q8, setup_model, NULL);
    tcase_set_timeout(q8, 300);
    tcase_add_test(q8, test_group_q8_r1);
    tcase_add_test(q8, test_group_q8_r2);
    tcase_add_test(q8, test_group_q8_r3);
    suite_add_tcase(s, q8);
    TCase *plan = tcase_create("plan"); /* pure planning: no processes, no model */
    tcase_set_timeout(plan, 30);
    tcase_add_test(plan, test_followup_single);
    tcase_add_test(plan, test_ranges_clip);
    tcase_add_test(plan, test_followup_tsp);
    tcase_add_test(plan, test_followup_kvr);
    tcase_add_test(plan, test_followup_cp);
    tcase_add_test(plan, test_followup_plannable);
    tcase_add_test(plan, test_partition_search);
    tcase_add_test(plan, test_pool_bookkeeping);
    tcase_add_test(plan, test_pool_keeps_prefix_of_unfit);
    tcase_add_test(plan, test_pool_mirror_in_step);
    suite_add_tcase(s, plan);
    return s;
}
