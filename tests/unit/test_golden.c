/*
 * test_golden.c - the engine and tokenizer against llama.cpp on the real model.
 *
 * tests/golden/golden.json is produced by tests/golden/make_golden.py (llama.cpp through
 * llama-cpp-python). Checked here: token ids of every recorded string; the chat template's
 * rendering; for every prompt, the top-20 logits of the first generated position (tolerance
 * PDM_GOLDEN_LOGIT_TOL, the largest difference is printed) and the greedy continuation token
 * for token. Skips with a message when the model is not present.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests.h"

/* Largest allowed |logit difference| against llama.cpp on the top-20 entries. Both quantize
 * activations to 8 bits and keep KV in f16, but llama.cpp also rounds Q and the softmax
 * weights to f16 in its attention products, which we do not, and single quantization steps
 * on outlier channels amplify any such difference (measured: up to ~0.6 between our own
 * scalar and AVX2 kernels, which differ only in summation order). */
#define PDM_GOLDEN_LOGIT_TOL 1.0f
/* Largest gap between our best and llama.cpp's greedy choice where the two may part. The gap
 * is the criterion, not the rank: where three candidates lie within it (a three-way near-tie,
 * seen in long_essay_question), llama.cpp's choice may rank third here. */
#define PDM_GOLDEN_TIE_GAP 0.5f

#ifndef PDM_GOLDEN_PATH
#define PDM_GOLDEN_PATH "tests/golden/golden.json"
#endif

static pdm_model_t *load_real_model(void)
{
    const char *path = pdm_test_model_path();
    if (!path) {
        fprintf(stderr, "golden: SKIP, the real model is not present (run 'make model')\n");
        return NULL;
    }
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    return m;
}

static int32_t *json_ids(const cJSON *arr, int *n)
{
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc((size_t)(*n ? *n : 1) * sizeof(int32_t));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valuedouble;
    return ids;
}

START_TEST(test_golden_tokenize)
{
    pdm_model_t *m = load_real_model();
    if (!m) return;
    cJSON *root = pdm_test_load_json(PDM_GOLDEN_PATH);
    const cJSON *list = cJSON_GetObjectItem(root, "tokenize");
    int n_cases = cJSON_GetArraySize(list), failed = 0;
    ck_assert_int_ge(n_cases, 50);
    for (int c = 0; c < n_cases; c++) {
        const cJSON *e = cJSON_GetArrayItem(list, c);
        const char *text = cJSON_GetObjectItem(e, "text")->valuestring;
        int special = cJSON_IsTrue(cJSON_GetObjectItem(e, "special"));
        int n_want;
        int32_t *want = json_ids(cJSON_GetObjectItem(e, "ids"), &n_want);
        int32_t got[4096];
        size_t n_got = 0;
        int rc = pdm_tokenizer_encode(m->tokenizer, text, strlen(text),
                                      special ? PDM_TOKENIZE_SPECIAL : 0, got, 4096, &n_got);
        if (rc != PDM_OK || (int)n_got != n_want ||
            memcmp(got, want, (size_t)n_want * sizeof(int32_t))) {
            failed++;
            fprintf(stderr, "golden tokenize mismatch (special=%d): \"%s\"\n  llama.cpp:", special,
                    text);
            for (int i = 0; i < n_want; i++) fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  pdmesh:   ");
            for (size_t i = 0; i < n_got; i++) fprintf(stderr, " %d", got[i]);
            fprintf(stderr, "\n");
        }
        free(want);
    }
    ck_assert_msg(failed == 0, "%d of %d strings tokenize differently from llama.cpp", failed,
                  n_cases);
    /* the same set of end-of-generation tokens */
    const cJSON *eog = cJSON_GetObjectItem(root, "eog_ids");
    int n_eog = 0;
    for (int32_t id = 0; id < (int32_t)m->hp.n_vocab; id++) {
        int want = 0;
        for (int i = 0; i < cJSON_GetArraySize(eog); i++)
            if ((int32_t)cJSON_GetArrayItem(eog, i)->valuedouble == id) want = 1;
        ck_assert_msg(pdm_tokenizer_is_eog(m->tokenizer, id) == want, "token %d: eog %d, "
                      "llama.cpp %d", id, pdm_tokenizer_is_eog(m->tokenizer, id), want);
        n_eog += want;
    }
    ck_assert_int_ge(n_eog, 1);
    cJSON_Delete(root);
    pdm_model_free(m);
}
END_TEST

START_TEST(test_golden_chat_template)
{
    pdm_model_t *m = load_real_model();
    if (!m) return;
    cJSON *root = pdm_test_load_json(PDM_GOLDEN_PATH);
    const cJSON *list = cJSON_GetObjectItem(root, "generate");
    int checked = 0;
    for (int c = 0; c < cJSON_GetArraySize(list); c++) {
        const cJSON *e = cJSON_GetArrayItem(list, c);
        const cJSON *msgs = cJSON_GetObjectItem(e, "messages");
        if (!cJSON_IsTrue(cJSON_GetObjectItem(e, "chat")) || !cJSON_IsArray(msgs)) continue;
        int n = cJSON_GetArraySize(msgs);
        const char *roles[16], *contents[16];
        ck_assert_int_le(n, 16);
        for (int i = 0; i < n; i++) {
            const cJSON *msg = cJSON_GetArrayItem(msgs, i);
            roles[i] = cJSON_GetObjectItem(msg, "role")->valuestring;
            contents[i] = cJSON_GetObjectItem(msg, "content")->valuestring;
        }
        char *out = pdm_tokenizer_chat_render(m->tokenizer, roles, contents, n, 1);
        ck_assert_msg(out != NULL, "%s", pdm_error_last());
        ck_assert_str_eq(out, cJSON_GetObjectItem(e, "prompt")->valuestring);
        free(out);
        checked++;
    }
    ck_assert_int_ge(checked, 1);
    cJSON_Delete(root);
    pdm_model_free(m);
}
END_TEST

/* The golden prompts through one kernel variant. */
static void golden_generate(pdm_model_t *m, cJSON *root, const pdm_kern_ops_t *ops)
{
    const cJSON *list = cJSON_GetObjectItem(root, "generate");
    int n_cases = cJSON_GetArraySize(list);
    ck_assert_int_ge(n_cases, 6);
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 512, &ctx), PDM_OK);
    pdm_model_ctx_set_ops(ctx, ops);
    float *logits = malloc(m->hp.n_vocab * sizeof(float));
    float worst = 0.0f;
    int diverged = 0, total_identical = 0, total_tokens = 0;
    for (int c = 0; c < n_cases; c++) {
        const cJSON *e = cJSON_GetArrayItem(list, c);
        const char *name = cJSON_GetObjectItem(e, "name")->valuestring;
        int n_prompt, n_greedy;
        int32_t *prompt = json_ids(cJSON_GetObjectItem(e, "prompt_ids"), &n_prompt);
        int32_t *greedy = json_ids(cJSON_GetObjectItem(e, "greedy"), &n_greedy);
        /* The scalar reference is ~10x slower than the SIMD variants: it runs the short
         * prompts and their first 16 tokens, so that the suite stays within its timeout under
         * the sanitizers. The long prompt runs with every SIMD variant. */
        if (!strcmp(ops->name, "generic")) {
            if (n_prompt > 64) {
                free(prompt);
                free(greedy);
                continue;
            }
            n_greedy = PDM_MIN(n_greedy, 16);
        }
        pdm_kv_cache_t *cache;
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n_prompt + n_greedy + 1, PDM_DT_F16, &cache),
                         PDM_OK);
        ck_assert_msg(pdm_model_prefill(ctx, cache, prompt, n_prompt, logits) == PDM_OK, "%s",
                      pdm_error_last());

        const cJSON *top = cJSON_GetObjectItem(e, "top_logits");
        float case_worst = 0.0f;
        for (int i = 0; i < cJSON_GetArraySize(top); i++) {
            const cJSON *pair = cJSON_GetArrayItem(top, i);
            int id = (int)cJSON_GetArrayItem(pair, 0)->valuedouble;
            float want = (float)cJSON_GetArrayItem(pair, 1)->valuedouble;
            case_worst = fmaxf(case_worst, fabsf(logits[id] - want));
        }
        worst = fmaxf(worst, case_worst);
        ck_assert_msg(case_worst <= PDM_GOLDEN_LOGIT_TOL, "%s [%s]: top-20 logits differ by %g",
                      name, ops->name, case_worst);

        /* Greedy continuation, token for token. Both engines quantize activations to 8 bits,
         * and this model carries outlier channels, so a last-bit difference in a sum can
         * move a whole quantization step and shift logits by tenths. Two engines can
         * therefore only part ways where the top two candidates are nearly tied: if the
         * sequences diverge, llama.cpp's token must be our runner-up within
         * PDM_GOLDEN_TIE_GAP of our best, and comparison of that prompt stops there (the
         * check vLLM applies to its own greedy tests). */
        int identical = n_greedy;
        for (int i = 0; i < n_greedy; i++) {
            int best = 0;
            for (uint32_t v = 1; v < m->hp.n_vocab; v++)
                if (logits[v] > logits[best]) best = (int)v;
            if (best != greedy[i]) {
                float gap = logits[best] - logits[greedy[i]];
                int rank = 0;
                for (uint32_t v = 0; v < m->hp.n_vocab; v++)
                    if (logits[v] > logits[greedy[i]]) rank++;
                ck_assert_msg(gap <= PDM_GOLDEN_TIE_GAP,
                              "%s [%s]: greedy token %d is %d, llama.cpp has %d (its rank here "
                              "%d, gap %.3f): not a near-tie", name, ops->name, i, best,
                              greedy[i], rank, gap);
                fprintf(stderr, "golden [%s] %-24s diverges at token %d at a near-tie (rank %d, "
                                "gap %.3f)\n", ops->name, name, i, rank, gap);
                identical = i;
                diverged++;
                break;
            }
            if (i + 1 < n_greedy)
                ck_assert_int_eq(pdm_model_decode(ctx, cache, best, logits), PDM_OK);
        }
        total_identical += identical;
        total_tokens += n_greedy;
        fprintf(stderr, "golden [%s] %-24s prompt %4d tokens, %2d of %2d greedy tokens equal, "
                        "max top-20 |logit diff| %.4f\n", ops->name, name, n_prompt, identical,
                n_greedy, case_worst);
        pdm_kv_cache_destroy(cache);
        free(prompt);
        free(greedy);
    }
    fprintf(stderr, "golden [%s]: %d of %d greedy tokens equal; %d prompt(s) part at a "
                    "near-tie; largest top-20 logit difference %.4f\n", ops->name,
            total_identical, total_tokens, diverged, worst);
    free(logits);
    pdm_model_ctx_destroy(ctx);
}

/* Every kernel variant this CPU supports must pass on its own (issue 3: the engine's golden
 * tests pass with each forced variant): loop index _i is the variant's place in
 * pdm_kern_ops_list(), each in its own forked test with its own timeout. */
START_TEST(test_golden_generate)
{
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; v < _i; v++)
        if (!list[v]) return; /* fewer variants on this CPU */
    if (!list[_i]) return;
    pdm_model_t *m = load_real_model();
    if (!m) return;
    cJSON *root = pdm_test_load_json(PDM_GOLDEN_PATH);
    golden_generate(m, root, list[_i]);
    cJSON_Delete(root);
    pdm_model_free(m);
}
END_TEST

/* ---- int8 KV accuracy ------------------------------------------------------------------- *
 * The cost of --kv-dtype q8 against f16 KV on the golden prompts, with the default kernels
 * (f32 KV against f16 is measured alongside, for scale). Both caches see the same tokens: the
 * prompt, then f16's greedy tokens (teacher forcing), so every step compares the two on the
 * same prefix. Per step all n_vocab logits are compared (max and mean |difference|; step 0
 * is the prompt's KV alone, later steps add response rows quantized with the prompt's
 * scales, saturating); "greedy agreement" counts the tokens both choose alike before the
 * first step where they differ (what free-running greedy decoding would share).
 * Tolerances, set from the numbers measured on this model (docs/decode-memory.md, "Quantized
 * KV (int8)") with margin. Prompts shorter than 16 tokens fix their scales from a handful of
 * rows, so response rows saturate much more: they get wider bounds. */
#define PDM_Q8_MAX_LOGIT_DIFF 5.0f        /* largest |diff| of any logit, any step */
#define PDM_Q8_MEAN_LOGIT_DIFF 0.8f       /* mean |diff| over all logits and steps */
#define PDM_Q8_SHORT_MAX_LOGIT_DIFF 25.0f /* the same for prompts of < 16 tokens */
#define PDM_Q8_SHORT_MEAN_LOGIT_DIFF 4.0f
#define PDM_Q8_TIE_GAP 1.0f       /* where they part, f16's margin of its token over q8's */
#define PDM_Q8_MIN_AGREEMENT 0.1  /* share of all greedy tokens before the first divergence */

static void golden_kv_compare(pdm_model_t *m, pdm_model_ctx_t *ctx, const cJSON *list,
                              pdm_dtype_t other, int check)
{
    const int n_cases = cJSON_GetArraySize(list);
    const uint32_t nv = m->hp.n_vocab;
    const char *dn = pdm_dtype_name(other);
    float *lf = malloc(nv * sizeof(float)), *lq = malloc(nv * sizeof(float));
    int agree_total = 0, tokens_total = 0;
    double worst_max = 0, worst_mean = 0, worst0_max = 0;
    for (int c = 0; c < n_cases; c++) {
        const cJSON *e = cJSON_GetArrayItem(list, c);
        const char *name = cJSON_GetObjectItem(e, "name")->valuestring;
        int n_prompt, n_greedy;
        int32_t *prompt = json_ids(cJSON_GetObjectItem(e, "prompt_ids"), &n_prompt);
        int32_t *greedy = json_ids(cJSON_GetObjectItem(e, "greedy"), &n_greedy);
        pdm_kv_cache_t *cf, *cq;
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n_prompt + n_greedy + 1, PDM_DT_F16, &cf), 0);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n_prompt + n_greedy + 1, other, &cq), 0);
        ck_assert_int_eq(pdm_model_prefill(ctx, cf, prompt, n_prompt, lf), PDM_OK);
        ck_assert_int_eq(pdm_model_prefill(ctx, cq, prompt, n_prompt, lq), PDM_OK);
        double case_max = 0, sum = 0, max0 = 0, mean0 = 0, gap = 0;
        int agree = -1;
        for (int i = 0; i < n_greedy; i++) {
            int bf = 0, bq = 0;
            double step_max = 0, step_sum = 0;
            for (uint32_t v = 0; v < nv; v++) {
                double d = fabs((double)lf[v] - lq[v]);
                step_max = fmax(step_max, d);
                step_sum += d;
                if (lf[v] > lf[bf]) bf = (int)v;
                if (lq[v] > lq[bq]) bq = (int)v;
            }
            if (i == 0) {
                max0 = step_max;
                mean0 = step_sum / nv;
            }
            case_max = fmax(case_max, step_max);
            sum += step_sum;
            if (bf != bq && agree < 0) {
                agree = i;
                gap = lf[bf] - lf[bq];
            }
            if (i + 1 < n_greedy) {
                ck_assert_int_eq(pdm_model_decode(ctx, cf, bf, lf), PDM_OK);
                ck_assert_int_eq(pdm_model_decode(ctx, cq, bf, lq), PDM_OK);
            }
        }
        if (agree < 0) agree = n_greedy;
        const double case_mean = sum / ((double)nv * n_greedy);
        fprintf(stderr, "golden %s vs f16 %-24s prompt %4d: greedy agreement %2d of %2d "
                        "(gap %.2f), |logit diff| after the prompt max %.3f mean %.4f, over "
                        "all steps max %.3f mean %.4f\n", dn, name, n_prompt, agree, n_greedy,
                gap, max0, mean0, case_max, case_mean);
        const int is_short = n_prompt < 16;
        if (check) {
            ck_assert_msg(gap <= PDM_Q8_TIE_GAP, "%s: q8 parts from f16 at token %d by a gap of "
                          "%.3f", name, agree, gap);
            ck_assert_msg(case_max <= (is_short ? PDM_Q8_SHORT_MAX_LOGIT_DIFF
                                                : PDM_Q8_MAX_LOGIT_DIFF),
                          "%s: q8 logits differ by %.3f", name, case_max);
            ck_assert_msg(case_mean <= (is_short ? PDM_Q8_SHORT_MEAN_LOGIT_DIFF
                                                 : PDM_Q8_MEAN_LOGIT_DIFF),
                          "%s: mean q8 logit difference %.4f", name, case_mean);
        }
        if (!is_short) {
            worst_max = fmax(worst_max, case_max);
            worst_mean = fmax(worst_mean, case_mean);
            worst0_max = fmax(worst0_max, max0);
        }
        agree_total += agree;
        tokens_total += n_greedy;
        pdm_kv_cache_destroy(cf);
        pdm_kv_cache_destroy(cq);
        free(prompt);
        free(greedy);
    }
    fprintf(stderr, "golden %s vs f16: %d of %d greedy tokens before the first divergence; "
                    "prompts >= 16 tokens: worst max |logit diff| after the prompt %.3f, over "
                    "all steps %.3f, worst mean %.4f\n", dn, agree_total, tokens_total,
            worst0_max, worst_max, worst_mean);
    if (check)
        ck_assert_msg(agree_total >= PDM_Q8_MIN_AGREEMENT * tokens_total,
                      "greedy agreement %d of %d", agree_total, tokens_total);
    free(lf);
    free(lq);
}

START_TEST(test_golden_q8_accuracy)
{
    pdm_model_t *m = load_real_model();
    if (!m) return;
    cJSON *root = pdm_test_load_json(PDM_GOLDEN_PATH);
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 512, &ctx), PDM_OK);
    const cJSON *list = cJSON_GetObjectItem(root, "generate");
    golden_kv_compare(m, ctx, list, PDM_DT_I8, 1);
    if (getenv("PDM_TEST_VERBOSE")) golden_kv_compare(m, ctx, list, PDM_DT_F32, 0);
    pdm_model_ctx_destroy(ctx);
    cJSON_Delete(root);
    pdm_model_free(m);
}
END_TEST

Suite *suite_golden(void)
{
    Suite *s = suite_create("golden");
    TCase *tc = tcase_create("golden");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_golden_tokenize);
    tcase_add_test(tc, test_golden_chat_template);
    tcase_add_loop_test(tc, test_golden_generate, 0, 4); /* up to 4 kernel variants */
    suite_add_tcase(s, tc);
    TCase *q8 = tcase_create("q8"); /* int8 KV against f16 KV */
    tcase_set_timeout(q8, 300);
    tcase_add_test(q8, test_golden_q8_accuracy);
    suite_add_tcase(s, q8);
    return s;
}
