/*
 * test_arch.c - the forward pass of every architecture against llama.cpp, on random-weight
 * models, and the loader's errors for what it does not support.
 *
 * tests/golden/arch_golden.json comes from tests/golden/make_arch_golden.py: for each preset of
 * `pdmesh make-test-model --arch` (llama, llama3, qwen2, qwen3, gemma3; F32 weights, seed 1),
 * the sha256 of the model file, a 48-token prompt of ids, llama.cpp's top-16 logits at every
 * prompt position (one batch) and a 16-token greedy continuation with each step's top-16.
 * Here the same model is written again (the sha256 must match, so a change to the writer is
 * caught rather than compared against stale numbers) and run three ways, each against the
 * recorded logits:
 *   - prefill: the prompt in one batch through the per-layer steps, logits of every row;
 *   - decode: the prompt one token at a time through pdm_model_decode (the decode step's
 *     attention, with its KV-range split, and the sliding window at positions beyond it);
 *   - greedy: after the prompt, llama.cpp's greedy tokens fed back one by one; our argmax
 *     must be llama.cpp's token unless the two are within PDM_ARCH_TIE_GAP.
 * Each with the default kernels and with the scalar reference. The gemma3 prompt is three
 * times its sliding window, so local layers mask. The prompt's perplexity (every token's
 * negative log-likelihood given the ones before it, from the prefill's logits) must equal
 * llama.cpp's within PDM_ARCH_NLL_TOL per token.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire.h"
#include "model/model.h"
#include "tests.h"

#ifndef PDM_ARCH_GOLDEN_PATH
#define PDM_ARCH_GOLDEN_PATH "tests/golden/arch_golden.json"
#endif

/* Largest allowed |logit difference| against llama.cpp on the recorded top-16 of each
 * position. Both run F32 weights with F16 KV; what remains is summation order, llama.cpp's
 * F16 rounding of Q and of the softmax weights in its attention, and for gemma3 its GELU
 * looked up in an F16 table (ggml-cpu vec.h, GGML_GELU_FP16). The measured maxima are
 * printed (docs/models.md lists them). */
#define PDM_ARCH_LOGIT_TOL 0.01f
/* Gap between our best logit and llama.cpp's greedy token's below which they may part. */
#define PDM_ARCH_TIE_GAP 0.01f
/* Largest |negative log-likelihood difference| per token against llama.cpp: a logit error e
 * moves a log-softmax by at most 2e. */
#define PDM_ARCH_NLL_TOL (2 * PDM_ARCH_LOGIT_TOL)

static const char *const pdm__archs[] = {"llama", "llama3", "qwen2", "qwen3", "gemma3"};

static void sha256_hex(const char *path, char out[65])
{
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    uint8_t d[32];
    pdm_sha256(buf, (size_t)n, d);
    free(buf);
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* Writes the preset `arch` as make_arch_golden.py does (F32, seed 1) and loads it. */
static pdm_model_t *arch_model(const char *arch, const cJSON *g)
{
    pdm_testmodel_params_t p;
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, arch), PDM_OK);
    p.wtype = p.embtype = PDM_DT_F32;
    p.seed = 1;
    char path[512], sha[65];
    snprintf(path, sizeof(path), "%s/arch_%s.gguf", pdm_test_tmpdir(), arch);
    ck_assert_msg(pdm_testmodel_write(path, &p) == PDM_OK, "%s", pdm_error_last());
    sha256_hex(path, sha);
    const char *want = cJSON_GetObjectItem(g, "model_sha256")->valuestring;
    ck_assert_msg(!strcmp(sha, want), "%s: the test model's sha256 %s differs from the one "
                  "llama.cpp's reference was made with (%s): rerun "
                  "tests/golden/make_arch_golden.py", arch, sha, want);
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    return m;
}

/* max |logits[id] - ref| over the recorded (id, logit) pairs of one position. */
static float top_diff(const cJSON *top, const float *logits)
{
    float worst = 0.0f;
    for (int i = 0; i < cJSON_GetArraySize(top); i++) {
        const cJSON *e = cJSON_GetArrayItem(top, i);
        int id = (int)cJSON_GetArrayItem(e, 0)->valuedouble;
        float ref = (float)cJSON_GetArrayItem(e, 1)->valuedouble;
        float d = fabsf(logits[id] - ref);
        if (!(d <= worst)) worst = d; /* NaN propagates */
    }
    return worst;
}

/* Logits of every prompt position through the per-layer steps in one batch. */
/* Positions p0 .. p0+n-1 (tokens[0..n-1]) in one batch after the p0 already in the cache,
 * through the per-layer steps; the logits of every row into logits (n x n_vocab). */
static void prefill_span(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens,
                         int p0, int n, float *logits)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    pdm_act_t act;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, n, &act), PDM_OK);
    int32_t *pos = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) pos[i] = p0 + i;
    ck_assert_int_eq(pdm_model_embed(ctx, tokens, pos, n, &act), PDM_OK);
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        pdm_model_attn_in(ctx, (int)l, &act);
        pdm_model_kv_store(ctx, cache, (int)l, &act, p0);
        pdm_kv_view_t view;
        pdm_kv_cache_view(cache, l, 0, p0 + n, &view);
        pdm_model_attention(ctx, (int)l, &act, &view, 1);
        pdm_model_attn_out_ffn(ctx, (int)l, &act);
    }
    cache->n_tokens = p0 + n;
    pdm_model_logits_batch(ctx, &act, n, logits);
    free(pos);
    pdm_act_free(&act);
}

static void prefill_all(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens,
                        int n, float *logits)
{
    prefill_span(ctx, cache, tokens, 0, n, logits);
}

/* -log softmax(logits)[token], in f64. */
static double token_nll(const float *logits, uint32_t n_vocab, int32_t token)
{
    double mx = logits[0], sum = 0;
    for (uint32_t i = 1; i < n_vocab; i++) mx = fmax(mx, logits[i]);
    for (uint32_t i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - mx);
    return mx + log(sum) - logits[token];
}

/* Compares the negative log-likelihood of tokens[i + 1] from logits row i (rows first..last-1)
 * with the recorded list `want` (entry i for token i + 1); returns the largest difference and
 * adds our NLLs to *sum. */
static double nll_rows(const float *logits, uint32_t n_vocab, const int32_t *tokens, int first,
                       int last, const cJSON *want, double *sum)
{
    double worst = 0;
    for (int i = first; i < last; i++) {
        double nll = token_nll(logits + (size_t)(i - first) * n_vocab, n_vocab, tokens[i + 1]);
        *sum += nll;
        worst = fmax(worst, fabs(nll - cJSON_GetArrayItem(want, i)->valuedouble));
    }
    return worst;
}

/* One architecture, one kernel variant: the three comparisons of the file comment. Returns
 * the largest difference seen. */
static float check_arch(const char *arch, const cJSON *g, const pdm_kern_ops_t *ops)
{
    pdm_model_t *m = arch_model(arch, g);
    const uint32_t nv = m->hp.n_vocab;
    int n = 0;
    const cJSON *jprompt = cJSON_GetObjectItem(g, "prompt");
    n = cJSON_GetArraySize(jprompt);
    int32_t *prompt = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) prompt[i] = (int32_t)cJSON_GetArrayItem(jprompt, i)->valuedouble;
    const cJSON *ptop = cJSON_GetObjectItem(g, "prompt_top");
    const cJSON *greedy = cJSON_GetObjectItem(g, "greedy");
    const cJSON *gtop = cJSON_GetObjectItem(g, "greedy_top");
    const int n_greedy = cJSON_GetArraySize(greedy);

    pdm_model_ctx_t *ctx = NULL;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 64, &ctx), PDM_OK);
    if (ops) pdm_model_ctx_set_ops(ctx, ops);
    pdm_kv_cache_t *cache = NULL;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 128, PDM_DT_F16, &cache), PDM_OK);
    float *logits = malloc((size_t)n * nv * sizeof(float));
    float worst_prefill = 0, worst_decode = 0, worst_greedy = 0;

    /* prefill: one batch */
    prefill_all(ctx, cache, prompt, n, logits);
    for (int i = 0; i < n; i++) {
        float d = top_diff(cJSON_GetArrayItem(ptop, i), logits + (size_t)i * nv);
        if (!(d <= worst_prefill)) worst_prefill = d;
    }
    /* the prompt's perplexity */
    double nll_sum = 0;
    const double nll_diff = nll_rows(logits, nv, prompt, 0, n - 1,
                                     cJSON_GetObjectItem(g, "prompt_nll"), &nll_sum);
    const double ppl = exp(nll_sum / (n - 1));
    const double ppl_want = cJSON_GetObjectItem(g, "prompt_ppl")->valuedouble;
    printf("arch %-7s %-8s prompt perplexity %.4f (llama.cpp %.4f), max |nll diff| %.2e\n", arch,
           ops ? ops->name : pdm_model_ctx_ops(ctx)->name, ppl, ppl_want, nll_diff);
    ck_assert_msg(nll_diff <= PDM_ARCH_NLL_TOL, "%s: token NLL differs from llama.cpp's by %g",
                  arch, nll_diff);
    /* greedy continuation after the batch prefill: llama.cpp's tokens fed back */
    const float *last = logits + (size_t)(n - 1) * nv;
    float *step = malloc(nv * sizeof(float));
    memcpy(step, last, nv * sizeof(float));
    for (int s = 0; s < n_greedy; s++) {
        int32_t want = (int32_t)cJSON_GetArrayItem(greedy, s)->valuedouble;
        int32_t got = pdm_test_argmax(step, nv);
        ck_assert_msg(got == want || step[got] - step[want] <= PDM_ARCH_TIE_GAP,
                      "%s (%s): greedy step %d: %d (%.4f) instead of llama.cpp's %d (%.4f)",
                      arch, ops ? ops->name : "default", s, got, step[got], want, step[want]);
        ck_assert_int_eq(pdm_model_decode(ctx, cache, want, step), PDM_OK);
        float d = top_diff(cJSON_GetArrayItem(gtop, s), step);
        if (!(d <= worst_greedy)) worst_greedy = d;
    }
    /* decode: the prompt token by token */
    pdm_kv_cache_clear(cache);
    for (int i = 0; i < n; i++) {
        ck_assert_int_eq(pdm_model_decode(ctx, cache, prompt[i], step), PDM_OK);
        float d = top_diff(cJSON_GetArrayItem(ptop, i), step);
        if (!(d <= worst_decode)) worst_decode = d;
    }
    printf("arch %-7s %-8s max |logit - llama.cpp|: prefill %.2e, decode %.2e, greedy %.2e\n",
           arch, ops ? ops->name : pdm_model_ctx_ops(ctx)->name, worst_prefill, worst_decode,
           worst_greedy);
    ck_assert_msg(worst_prefill <= PDM_ARCH_LOGIT_TOL && worst_decode <= PDM_ARCH_LOGIT_TOL &&
                      worst_greedy <= PDM_ARCH_LOGIT_TOL,
                  "%s: logits differ from llama.cpp by up to %g / %g / %g (prefill / decode / "
                  "greedy; tolerance %g)", arch, worst_prefill, worst_decode, worst_greedy,
                  PDM_ARCH_LOGIT_TOL);
    free(step);
    free(logits);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    free(prompt);
    pdm_model_free(m);
    return PDM_MAX(worst_prefill, PDM_MAX(worst_decode, worst_greedy));
}

START_TEST(test_arch_vs_llama_cpp)
{
    const char *arch = pdm__archs[_i];
    cJSON *root = pdm_test_load_json(PDM_ARCH_GOLDEN_PATH);
    const cJSON *g = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "archs"), arch);
    ck_assert_msg(g != NULL, "%s has no entry for %s", PDM_ARCH_GOLDEN_PATH, arch);
    check_arch(arch, g, NULL);
    check_arch(arch, g, &pdm_kern_ops_generic);
    cJSON_Delete(root);
}
END_TEST

/* The real Gemma 3 270M (the PyPI file, Q4_K_M) on the recorded 600-token prompt of
 * ids, longer than its 512-token window: the top-20 logits of the last prompt position, then
 * llama.cpp's greedy tokens fed back one at a time, each step's top-20; our argmax must be
 * llama.cpp's token unless within the tie gap. Two files, each skipped when absent:
 *   - the Q4_K_M file as served: Q4_K/Q5_0/Q6_K/Q8_0 products with 8-bit activations on both
 *     sides, so test_golden.c's tolerances (SmolLM2: 1.0, gap 0.5);
 *   - the same model with every layer tensor dequantized to F32 (make_arch_golden.py writes
 *     it next to the Q4_K_M file): the architecture's math alone, tolerance 0.2, gap 0.1
 *     (measured 0.09 over the whole vocabulary at every step).
 * Paths: $PDMESH_GEMMA_MODEL / $PDMESH_GEMMA_F32_MODEL, else models/. */
typedef struct {
    const char *entry, *env, *path;
    float tol, gap;
} gemma_case_t;

static const gemma_case_t gemma_cases[] = {
    {"gemma3_270m", "PDMESH_GEMMA_MODEL", "models/gemma-3-270m-q4_k_m.gguf", 1.0f, 0.5f},
    {"gemma3_270m_f32layers", "PDMESH_GEMMA_F32_MODEL", "models/gemma-3-270m-f32layers.gguf",
     0.2f, 0.1f},
};

START_TEST(test_arch_gemma3_270m)
{
    const gemma_case_t *gc = &gemma_cases[_i];
    const char *env = getenv(gc->env);
    const char *path = env && *env ? env : gc->path;
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("arch: SKIP %s: %s is not present (tests/golden/README.md)\n", gc->entry, path);
        return;
    }
    fclose(f);
    cJSON *root = pdm_test_load_json(PDM_ARCH_GOLDEN_PATH);
    const cJSON *g = cJSON_GetObjectItem(root, gc->entry);
    ck_assert_msg(g != NULL, "%s has no %s entry", PDM_ARCH_GOLDEN_PATH, gc->entry);
    char sha[65];
    sha256_hex(path, sha);
    ck_assert_msg(!strcmp(sha, cJSON_GetObjectItem(g, "model_sha256")->valuestring),
                  "%s: sha256 %s is not the file the reference was made with", path, sha);
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    ck_assert_int_eq(m->hp.arch, PDM_ARCH_GEMMA3);
    const cJSON *jp = cJSON_GetObjectItem(g, "prompt");
    const int n = cJSON_GetArraySize(jp);
    int32_t *prompt = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) prompt[i] = (int32_t)cJSON_GetArrayItem(jp, i)->valuedouble;
    const cJSON *greedy = cJSON_GetObjectItem(g, "greedy");
    const cJSON *gtop = cJSON_GetObjectItem(g, "greedy_top");
    const int n_greedy = cJSON_GetArraySize(greedy);
    pdm_model_ctx_t *ctx = NULL;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 128, &ctx), PDM_OK);
    pdm_kv_cache_t *cache = NULL;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n + n_greedy + 1, PDM_DT_F16, &cache), PDM_OK);
    float *logits = malloc(m->hp.n_vocab * sizeof(float));
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, prompt, n, logits), PDM_OK);
    float worst = top_diff(cJSON_GetObjectItem(g, "first_top"), logits);
    int same = 0;
    for (int s = 0; s < n_greedy; s++) {
        int32_t want = (int32_t)cJSON_GetArrayItem(greedy, s)->valuedouble;
        int32_t got = pdm_test_argmax(logits, m->hp.n_vocab);
        same += got == want;
        ck_assert_msg(got == want || logits[got] - logits[want] <= gc->gap,
                      "%s greedy step %d: %d (%.3f) instead of llama.cpp's %d (%.3f)",
                      gc->entry, s, got, logits[got], want, logits[want]);
        ck_assert_int_eq(pdm_model_decode(ctx, cache, want, logits), PDM_OK);
        float d = top_diff(cJSON_GetArrayItem(gtop, s), logits); /* after greedy[s] */
        if (!(d <= worst)) worst = d;
    }
    printf("arch %s: %d-token prompt, %d of %d greedy tokens equal, max top-20 "
           "|logit - llama.cpp| %.3f\n", gc->entry, n, same, n_greedy, worst);
    ck_assert_msg(worst <= gc->tol, "%s: logits differ by %g (tolerance %g)", gc->entry, worst,
                  gc->tol);
    free(logits);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    free(prompt);
    pdm_model_free(m);
    cJSON_Delete(root);
}
END_TEST

/* The real Gemma 3 270M on a 1,000-token document (llama.cpp's tokenization of docs/prefill.md,
 * ids recorded): every token's negative log-likelihood from prefills of PDM_DOC_CHUNK tokens
 * at a time (local layers mask across chunks) against llama.cpp's from one batch, and the
 * document's perplexity. Q4_K_M products with 8-bit activations on both sides, so the logits
 * may differ by up to test_golden.c's 1.0, so a token's NLL (its logit against the log-sum-exp
 * of all) by up to 2.0 (measured 0.79-0.91 with gcc -O2, 1.13 with the clang -O1 sanitizer build:
 * the kernels' summation order moves 8-bit activation rounding); the perplexity, where such
 * errors average out, by 1 % (measured -0.10 % and +0.08 %). */
#define PDM_DOC_CHUNK 256
START_TEST(test_arch_gemma3_270m_doc)
{
    const char *env = getenv("PDMESH_GEMMA_MODEL");
    const char *path = env && *env ? env : "models/gemma-3-270m-q4_k_m.gguf";
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("arch: SKIP gemma3_270m_doc: %s is not present (tests/golden/README.md)\n", path);
        return;
    }
    fclose(f);
    cJSON *root = pdm_test_load_json(PDM_ARCH_GOLDEN_PATH);
    const cJSON *g = cJSON_GetObjectItem(root, "gemma3_270m_doc");
    ck_assert_msg(g != NULL, "%s has no gemma3_270m_doc entry", PDM_ARCH_GOLDEN_PATH);
    char sha[65];
    sha256_hex(path, sha);
    ck_assert_msg(!strcmp(sha, cJSON_GetObjectItem(g, "model_sha256")->valuestring),
                  "%s: sha256 %s is not the file the reference was made with", path, sha);
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    const cJSON *jt = cJSON_GetObjectItem(g, "tokens");
    const int n = cJSON_GetArraySize(jt);
    int32_t *doc = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) doc[i] = (int32_t)cJSON_GetArrayItem(jt, i)->valuedouble;
    const uint32_t nv = m->hp.n_vocab;
    pdm_model_ctx_t *ctx = NULL;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, PDM_DOC_CHUNK, &ctx), PDM_OK);
    pdm_kv_cache_t *cache = NULL;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, PDM_DT_F16, &cache), PDM_OK);
    float *logits = malloc((size_t)PDM_DOC_CHUNK * nv * sizeof(float));
    double worst = 0, sum = 0;
    for (int p0 = 0; p0 < n; p0 += PDM_DOC_CHUNK) {
        const int len = PDM_MIN(PDM_DOC_CHUNK, n - p0);
        prefill_span(ctx, cache, doc + p0, p0, len, logits);
        /* rows p0 .. p0+len-1 predict tokens p0+1 ..; the last row of the document none */
        worst = fmax(worst, nll_rows(logits, nv, doc, p0, PDM_MIN(p0 + len, n - 1),
                                     cJSON_GetObjectItem(g, "nll"), &sum));
    }
    const double ppl = exp(sum / (n - 1)), want = cJSON_GetObjectItem(g, "ppl")->valuedouble;
    printf("arch gemma3_270m_doc: %d tokens, perplexity %.4f (llama.cpp %.4f, %+.3f %%), max "
           "|token nll diff| %.3f\n", n, ppl, want, 100 * (ppl / want - 1), worst);
    fflush(stdout);
    ck_assert_msg(worst <= 2.0, "a token's NLL differs from llama.cpp's by %g", worst);
    ck_assert_msg(fabs(ppl / want - 1) <= 0.01, "perplexity %g vs llama.cpp's %g", ppl, want);
    free(logits);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    free(doc);
    pdm_model_free(m);
    cJSON_Delete(root);
}
END_TEST

/* Copies the GGUF `src` to `dst` without the metadata key `drop_key` and the tensor
 * `drop_tensor` (either may be NULL), with general.architecture set to `arch` if not NULL,
 * the string key `add_key` = `add_val` and the f32 key `f32_key` = `f32_val` added if not
 * NULL. */
static void rewrite_gguf_f32(const char *src, const char *dst, const char *drop_key,
                             const char *drop_tensor, const char *arch, const char *add_key,
                             const char *add_val, const char *f32_key, float f32_val)
{
    pdm_gguf_t *g = NULL;
    ck_assert_int_eq(pdm_gguf_open(src, &g), PDM_OK);
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    for (uint64_t i = 0; i < pdm_gguf_n_kv(g); i++) {
        const pdm_gguf_kv_t *kv = pdm_gguf_kv_at(g, i);
        if (drop_key && pdm_gguf_str_eq(kv->key, drop_key)) continue;
        if (arch && pdm_gguf_str_eq(kv->key, "general.architecture")) {
            ck_assert_int_eq(pdm_gguf_writer_set_str(w, "general.architecture", arch), PDM_OK);
            continue;
        }
        ck_assert_int_eq(pdm_gguf_writer_copy_kv(w, kv), PDM_OK);
    }
    if (add_key) ck_assert_int_eq(pdm_gguf_writer_set_str(w, add_key, add_val), PDM_OK);
    if (f32_key) ck_assert_int_eq(pdm_gguf_writer_set_f32(w, f32_key, f32_val), PDM_OK);
    for (uint64_t i = 0; i < pdm_gguf_n_tensors(g); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof(name), "%.*s", (int)t->name.len, t->name.ptr);
        if (drop_tensor && !strcmp(name, drop_tensor)) continue;
        ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data),
                         PDM_OK);
    }
    ck_assert_int_eq(pdm_gguf_writer_write(w, dst), PDM_OK);
    pdm_gguf_writer_destroy(w);
    pdm_gguf_close(g);
}

static void rewrite_gguf(const char *src, const char *dst, const char *drop_key,
                         const char *drop_tensor, const char *arch, const char *add_key,
                         const char *add_val)
{
    rewrite_gguf_f32(src, dst, drop_key, drop_tensor, arch, add_key, add_val, NULL, 0.0f);
}

/* Loading `path` fails with `status` and a message containing `needle`. */
static void expect_load_error(const char *path, int status, const char *needle)
{
    pdm_model_t *m = NULL;
    int rc = pdm_model_load(path, &m);
    ck_assert_msg(rc == status, "load of %s: status %d, expected %d (%s)", path, rc, status,
                  pdm_error_last());
    ck_assert_msg(strstr(pdm_error_last(), needle) != NULL, "error '%s' does not name '%s'",
                  pdm_error_last(), needle);
    ck_assert_ptr_null(m);
}

/* Unsupported architectures, missing required keys and tensors, and features the forward
 * pass does not implement are errors that name them. */
START_TEST(test_arch_load_errors)
{
    char qwen3[512], gemma3[512], bad[512];
    pdm_testmodel_params_t p;
    snprintf(qwen3, sizeof(qwen3), "%s/errs_qwen3.gguf", pdm_test_tmpdir());
    snprintf(gemma3, sizeof(gemma3), "%s/errs_gemma3.gguf", pdm_test_tmpdir());
    snprintf(bad, sizeof(bad), "%s/errs_bad.gguf", pdm_test_tmpdir());
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "qwen3"), PDM_OK);
    ck_assert_int_eq(pdm_testmodel_write(qwen3, &p), PDM_OK);
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "gemma3"), PDM_OK);
    ck_assert_int_eq(pdm_testmodel_write(gemma3, &p), PDM_OK);
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "mamba"), PDM_EINVAL);

    rewrite_gguf(qwen3, bad, NULL, NULL, "phi3", NULL, NULL);
    expect_load_error(bad, PDM_EUNSUPPORTED, "architecture 'phi3' is not supported");
    rewrite_gguf(qwen3, bad, "qwen3.attention.layer_norm_rms_epsilon", NULL, NULL, NULL, NULL);
    expect_load_error(bad, PDM_EFORMAT, "qwen3.attention.layer_norm_rms_epsilon");
    rewrite_gguf(qwen3, bad, "qwen3.block_count", NULL, NULL, NULL, NULL);
    expect_load_error(bad, PDM_EFORMAT, "qwen3.block_count");
    rewrite_gguf(qwen3, bad, NULL, "blk.1.attn_k_norm.weight", NULL, NULL, NULL);
    expect_load_error(bad, PDM_EFORMAT, "blk.1.attn_k_norm.weight");
    /* without key_length the heads would be d_model / 4 = 16 wide, not value_length's 32 */
    rewrite_gguf(qwen3, bad, "qwen3.attention.key_length", NULL, NULL, NULL, NULL);
    expect_load_error(bad, PDM_EUNSUPPORTED, "value heads of 32 dims differ from key heads");
    rewrite_gguf(qwen3, bad, NULL, NULL, NULL, "qwen3.rope.scaling.type", "yarn");
    expect_load_error(bad, PDM_EUNSUPPORTED, "yarn");
    rewrite_gguf(gemma3, bad, NULL, "blk.6.post_ffw_norm.weight", NULL, NULL, NULL);
    expect_load_error(bad, PDM_EFORMAT, "blk.6.post_ffw_norm.weight");
}
END_TEST

/* Gemma 3's layer kinds: 5 local layers (window, rope.freq_base_swa) then a global one. */
START_TEST(test_arch_gemma3_layers)
{
    char path[512];
    pdm_testmodel_params_t p;
    snprintf(path, sizeof(path), "%s/kinds_gemma3.gguf", pdm_test_tmpdir());
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "gemma3"), PDM_OK);
    ck_assert_int_eq(pdm_testmodel_write(path, &p), PDM_OK);
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    ck_assert_int_eq(m->hp.arch, PDM_ARCH_GEMMA3);
    ck_assert_uint_eq(m->hp.head_dim, 256);
    ck_assert_int_eq(m->hp.rope_neox, 1);
    ck_assert_int_eq(m->hp.ffn_gelu, 1);
    ck_assert_float_eq_tol(m->hp.embd_scale, 8.0f, 1e-6f);
    ck_assert_float_eq_tol(m->hp.attn_scale, 1.0f / 16.0f, 1e-7f);
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        int global = l % 6 == 5;
        ck_assert_int_eq(m->layers[l].window, global ? 0 : 16);
        ck_assert_float_eq(m->layers[l].rope_theta, global ? 1e6f : 1e4f);
        ck_assert_ptr_nonnull(m->layers[l].q_norm);
        ck_assert_ptr_nonnull(m->layers[l].ffn_post_norm);
        ck_assert_ptr_null(m->layers[l].bq);
    }
    pdm_model_free(m);
}
END_TEST

/* final_logit_softcapping (Gemma 2 style; gemma3 reads it when present): every logit of the
 * capped model is cap * tanh(logit / cap) of the uncapped one's, batch and single row. */
START_TEST(test_arch_softcap)
{
    char plain[512], capped[512];
    pdm_testmodel_params_t p;
    snprintf(plain, sizeof(plain), "%s/softcap_plain.gguf", pdm_test_tmpdir());
    snprintf(capped, sizeof(capped), "%s/softcap_capped.gguf", pdm_test_tmpdir());
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "gemma3"), PDM_OK);
    p.emb_range = 1.0f; /* logits of several units, so a cap of 2 bends them */
    ck_assert_int_eq(pdm_testmodel_write(plain, &p), PDM_OK);
    const float cap = 2.0f;
    rewrite_gguf_f32(plain, capped, NULL, NULL, NULL, NULL, NULL,
                     "gemma3.final_logit_softcapping", cap);
    const char *paths[2] = {plain, capped};
    float *logits[2];
    uint32_t nv = 0;
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = 3 + 11 * i;
    for (int k = 0; k < 2; k++) {
        pdm_model_t *m = NULL;
        ck_assert_msg(pdm_model_load(paths[k], &m) == PDM_OK, "%s", pdm_error_last());
        ck_assert_float_eq(m->hp.logit_softcap, k ? cap : 0.0f);
        nv = m->hp.n_vocab;
        pdm_model_ctx_t *ctx = NULL;
        pdm_kv_cache_t *cache = NULL;
        ck_assert_int_eq(pdm_model_ctx_create(m, 2, 32, &ctx), PDM_OK);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 32, PDM_DT_F32, &cache), PDM_OK);
        logits[k] = malloc((size_t)20 * nv * sizeof(float));
        prefill_all(ctx, cache, ids, 20, logits[k]);
        float *last = malloc(nv * sizeof(float));
        pdm_kv_cache_clear(cache);
        ck_assert_int_eq(pdm_model_prefill(ctx, cache, ids, 20, last), PDM_OK);
        for (uint32_t i = 0; i < nv; i++)
            ck_assert_float_eq_tol(last[i], logits[k][(size_t)19 * nv + i], 1e-4f);
        free(last);
        pdm_kv_cache_destroy(cache);
        pdm_model_ctx_destroy(ctx);
        pdm_model_free(m);
    }
    float maxabs = 0;
    for (size_t i = 0; i < (size_t)20 * nv; i++) {
        float want = cap * tanhf(logits[0][i] / cap);
        ck_assert_msg(fabsf(logits[1][i] - want) <= 1e-5f, "logit %zu: %g, want %g", i,
                      logits[1][i], want);
        maxabs = fmaxf(maxabs, fabsf(logits[0][i]));
    }
    ck_assert_msg(maxabs > 2 * cap, "logits up to %g only: the cap is not exercised", maxabs);
    free(logits[0]);
    free(logits[1]);
}
END_TEST

Suite *suite_arch(void)
{
    Suite *s = suite_create("arch");
    TCase *tc = tcase_create("llama_cpp");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_arch_vs_llama_cpp, 0,
                        (int)(sizeof(pdm__archs) / sizeof(pdm__archs[0])));
    suite_add_tcase(s, tc);
    TCase *tl = tcase_create("load");
    tcase_set_timeout(tl, 60);
    tcase_add_test(tl, test_arch_load_errors);
    tcase_add_test(tl, test_arch_gemma3_layers);
    tcase_add_test(tl, test_arch_softcap);
    suite_add_tcase(s, tl);
    TCase *tr = tcase_create("real");
    tcase_set_timeout(tr, 600); /* scalar K-quant products on x86 for now: minutes */
    tcase_add_loop_test(tr, test_arch_gemma3_270m, 0,
                        (int)(sizeof(gemma_cases) / sizeof(gemma_cases[0])));
    tcase_add_test(tr, test_arch_gemma3_270m_doc);
    suite_add_tcase(s, tr);
    return s;
}
