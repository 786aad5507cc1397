/*
 * test_sampler.c - sampling: greedy ties, determinism per seed, each filter's effect, the
 * empirical distribution at temperature 1, parameter validation.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "tests.h"

static pdm_sampler_t *make(float temp, int top_k, float top_p, float min_p, float rep,
                           uint64_t seed, int n_vocab)
{
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repeat_penalty = rep;
    p.seed = seed;
    pdm_sampler_t *s = NULL;
    ck_assert_int_eq(pdm_sampler_create(&p, n_vocab, &s), PDM_OK);
    return s;
}

START_TEST(test_greedy)
{
    float logits[6] = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f};
    pdm_sampler_t *s = make(0.0f, 0, 1.0f, 0.0f, 1.0f, 1, 6);
    ck_assert_int_eq(pdm_sampler_sample(s, logits, NULL, 0), 1); /* lowest id among ties */
    pdm_sampler_destroy(s);
    /* repetition penalty pushes a repeated token below the next one */
    s = make(0.0f, 0, 1.0f, 0.0f, 1.5f, 1, 6);
    int32_t hist[2] = {1, 3};
    ck_assert_int_eq(pdm_sampler_sample(s, logits, hist, 2), 4);
    pdm_sampler_destroy(s);
}
END_TEST

START_TEST(test_seeded_and_filters)
{
    enum { V = 100 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = (float)(V - i) * 0.05f;
    int32_t a[50], b[50];
    pdm_sampler_t *s1 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, V), *s2 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, V);
    for (int i = 0; i < 50; i++) {
        a[i] = pdm_sampler_sample(s1, logits, NULL, 0);
        b[i] = pdm_sampler_sample(s2, logits, NULL, 0);
    }
    ck_assert_mem_eq(a, b, sizeof(a));
    pdm_sampler_destroy(s1);
    pdm_sampler_destroy(s2);

    pdm_sampler_t *k = make(1.0f, 3, 1.0f, 0.0f, 1.0f, 7, V);
    for (int i = 0; i < 500; i++) ck_assert_int_lt(pdm_sampler_sample(k, logits, NULL, 0), 3);
    pdm_sampler_destroy(k);

    /* top-p: with one dominant token holding > 90 % of the mass, p = 0.9 keeps only it */
    float peaked[V];
    for (int i = 0; i < V; i++) peaked[i] = i == 17 ? 10.0f : 0.0f;
    pdm_sampler_t *p = make(1.0f, 0, 0.9f, 0.0f, 1.0f, 7, V);
    for (int i = 0; i < 200; i++) ck_assert_int_eq(pdm_sampler_sample(p, peaked, NULL, 0), 17);
    pdm_sampler_destroy(p);

    /* min-p: tokens below min_p * p_max are cut */
    pdm_sampler_t *mp = make(1.0f, 0, 1.0f, 0.5f, 1.0f, 7, V);
    for (int i = 0; i < 500; i++) {
        int32_t t = pdm_sampler_sample(mp, logits, NULL, 0);
        ck_assert_msg(logits[t] >= logits[0] + logf(0.5f) - 1e-6f, "min-p let %d through", t);
    }
    pdm_sampler_destroy(mp);
}
END_TEST

START_TEST(test_distribution)
{
    /* at temperature 1 without filters, frequencies follow softmax(logits) */
    float logits[4] = {0.0f, 1.0f, 2.0f, -1.0f};
    double z = 0, prob[4];
    for (int i = 0; i < 4; i++) z += exp(logits[i]);
    for (int i = 0; i < 4; i++) prob[i] = exp(logits[i]) / z;
    pdm_sampler_t *s = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 99, 4);
    int count[4] = {0};
    const int N = 40000;
    for (int i = 0; i < N; i++) count[pdm_sampler_sample(s, logits, NULL, 0)]++;
    for (int i = 0; i < 4; i++)
        ck_assert_msg(fabs((double)count[i] / N - prob[i]) < 0.01, "token %d: %g vs %g", i,
                      (double)count[i] / N, prob[i]);
    pdm_sampler_destroy(s);
}
END_TEST

START_TEST(test_params_invalid)
{
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_OK);
    p.temperature = -1.0f;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "temperature"));
    pdm_sampler_params_default(&p);
    p.top_p = 0.0f;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    pdm_sampler_params_default(&p);
    p.min_p = 2.0f;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    pdm_sampler_params_default(&p);
    p.temperature = NAN;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    pdm_sampler_t *s = NULL;
    ck_assert_int_eq(pdm_sampler_create(&p, 10, &s), PDM_EINVAL);
    ck_assert_ptr_null(s);
    pdm_sampler_destroy(NULL);
}
END_TEST

Suite *suite_sampler(void)
{
    Suite *s = suite_create("sampler");
    TCase *tc = tcase_create("sampler");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_greedy);
    tcase_add_test(tc, test_seeded_and_filters);
    tcase_add_test(tc, test_distribution);
    tcase_add_test(tc, test_params_invalid);
    suite_add_tcase(s, tc);
    return s;
}
