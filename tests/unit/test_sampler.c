/*
 * test_sampler.c - sampling: greedy ties, determinism per seed, each filter's effect, the
 * empirical distribution at temperature 1, parameter validation, logit_bias and OpenAI's
 * penalties and log-probabilities against a direct computation, and a run resumed at step k
 * (a migration) against the uninterrupted one.
 */
#include <math.h>
#include <stdio.h>
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
    ck_assert_int_eq(pdm_sampler_sample(s, logits, NULL, 0, NULL), 1); /* lowest id among ties */
    pdm_sampler_destroy(s);
    /* repetition penalty pushes a repeated token below the next one */
    s = make(0.0f, 0, 1.0f, 0.0f, 1.5f, 1, 6);
    int32_t hist[2] = {1, 3};
    ck_assert_int_eq(pdm_sampler_sample(s, logits, hist, 2, NULL), 4);
    pdm_sampler_destroy(s);
}
END_TEST

START_TEST(test_seeded_and_filters)
{
    enum { V = 100 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = (float)(V - i) * 0.05f;
    int32_t a[50], b[50];
    static int32_t steps[1000]; /* the step index is the history's length (penalties off) */
    pdm_sampler_t *s1 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, V), *s2 = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42, V);
    for (int i = 0; i < 50; i++) {
        a[i] = pdm_sampler_sample(s1, logits, steps, i, NULL);
        b[i] = pdm_sampler_sample(s2, logits, steps, i, NULL);
    }
    ck_assert_mem_eq(a, b, sizeof(a));
    int distinct = 0; /* the draws differ from step to step */
    for (int i = 1; i < 50; i++) distinct += a[i] != a[0];
    ck_assert_int_gt(distinct, 10);
    pdm_sampler_destroy(s1);
    pdm_sampler_destroy(s2);

    pdm_sampler_t *k = make(1.0f, 3, 1.0f, 0.0f, 1.0f, 7, V);
    for (int i = 0; i < 500; i++)
        ck_assert_int_lt(pdm_sampler_sample(k, logits, steps, i, NULL), 3);
    pdm_sampler_destroy(k);

    /* top-p: with one dominant token holding > 90 % of the mass, p = 0.9 keeps only it */
    float peaked[V];
    for (int i = 0; i < V; i++) peaked[i] = i == 17 ? 10.0f : 0.0f;
    pdm_sampler_t *p = make(1.0f, 0, 0.9f, 0.0f, 1.0f, 7, V);
    for (int i = 0; i < 200; i++)
        ck_assert_int_eq(pdm_sampler_sample(p, peaked, steps, i, NULL), 17);
    pdm_sampler_destroy(p);

    /* min-p: tokens below min_p * p_max are cut */
    pdm_sampler_t *mp = make(1.0f, 0, 1.0f, 0.5f, 1.0f, 7, V);
    for (int i = 0; i < 500; i++) {
        int32_t t = pdm_sampler_sample(mp, logits, steps, i, NULL);
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
    enum { N = 40000 };
    static int32_t steps[N];
    for (int i = 0; i < N; i++) count[pdm_sampler_sample(s, logits, steps, i, NULL)]++;
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
    pdm_sampler_params_default(&p);
    p.presence_penalty = 2.5f;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "presence_penalty"));
    pdm_sampler_params_default(&p);
    p.frequency_penalty = -2.01f;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "frequency_penalty"));
    pdm_sampler_params_default(&p);
    p.logprobs = 21;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    pdm_sampler_params_default(&p);
    const int32_t id = 1;
    const float big = 100.5f;
    p.bias_ids = &id;
    p.bias_values = &big;
    p.n_bias = 1;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    p.n_bias = PDM_SAMPLER_MAX_LOGIT_BIAS + 1;
    ck_assert_int_eq(pdm_sampler_params_check(&p), PDM_EINVAL);
    pdm_sampler_destroy(NULL);
}
END_TEST

/* Steps 1-4 of model.h "Sampling" computed directly: the adjusted logits and their
 * log-softmax. */
static void reference_logprobs(const float *logits, int n, const int32_t *bias_ids,
                               const float *bias_values, int n_bias, const int32_t *hist,
                               int n_hist, float presence, float frequency, double *out)
{
    double adj[64];
    for (int t = 0; t < n; t++) {
        adj[t] = logits[t];
        for (int b = 0; b < n_bias; b++)
            if (bias_ids[b] == t) adj[t] = (double)logits[t] + bias_values[b];
        int count = 0;
        for (int i = 0; i < n_hist; i++) count += hist[i] == t;
        adj[t] -= (count > 0 ? presence : 0.0) + frequency * count;
    }
    double m = adj[0], z = 0;
    for (int t = 1; t < n; t++) m = adj[t] > m ? adj[t] : m;
    for (int t = 0; t < n; t++) z += exp(adj[t] - m);
    for (int t = 0; t < n; t++) out[t] = adj[t] - m - log(z);
}

START_TEST(test_penalties_bias_logprobs)
{
    enum { V = 40 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = sinf((float)i * 1.7f) * 3.0f;
    const int32_t bias_ids[3] = {5, 11, 5}; /* a repeated id: the last value counts */
    const float bias_values[3] = {-100.0f, 4.5f, 2.0f};
    const int32_t hist[7] = {3, 3, 3, 11, 20, 3, 20};
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    p.temperature = 0.0f;
    p.presence_penalty = 0.7f;
    p.frequency_penalty = 1.3f;
    p.bias_ids = bias_ids;
    p.bias_values = bias_values;
    p.n_bias = 3;
    p.logprobs = 20;
    pdm_sampler_t *s = NULL;
    ck_assert_int_eq(pdm_sampler_create(&p, V, &s), PDM_OK);
    pdm_token_logprobs_t lp;
    int32_t tok = pdm_sampler_sample(s, logits, hist, 7, &lp);
    const int32_t eff_ids[2] = {5, 11};
    const float eff_values[2] = {2.0f, 4.5f};
    double ref[V];
    reference_logprobs(logits, V, eff_ids, eff_values, 2, hist, 7, 0.7f, 1.3f, ref);
    int best = 0;
    for (int t = 1; t < V; t++)
        if (ref[t] > ref[best]) best = t;
    ck_assert_int_eq(tok, best); /* greedy on the adjusted logits */
    ck_assert_msg(fabs(lp.logprob - ref[tok]) < 1e-5, "chosen %g vs %g", lp.logprob, ref[tok]);
    ck_assert_int_eq(lp.n_top, 20);
    for (int k = 0; k < lp.n_top; k++) {
        ck_assert_msg(fabs(lp.top_logprobs[k] - ref[lp.top_ids[k]]) < 1e-5, "top %d", k);
        if (k) ck_assert(lp.top_logprobs[k] <= lp.top_logprobs[k - 1]);
        /* nothing outside the list beats its last entry */
        for (int t = 0; t < V; t++) {
            int in = 0;
            for (int j = 0; j < lp.n_top; j++) in |= lp.top_ids[j] == t;
            if (!in) ck_assert(ref[t] <= lp.top_logprobs[lp.n_top - 1] + 1e-6);
        }
    }
    ck_assert_int_eq(lp.top_ids[0], tok);
    /* the counts left behind are zero: the same call gives the same answer */
    pdm_token_logprobs_t again;
    ck_assert_int_eq(pdm_sampler_sample(s, logits, hist, 7, &again), tok);
    ck_assert(again.logprob == lp.logprob);
    pdm_sampler_destroy(s);

    /* +100 forces a token, -100 removes the greedy one */
    const int32_t force_id = 17;
    const float plus = 100.0f, minus = -100.0f;
    pdm_sampler_params_default(&p);
    p.temperature = 1.0f;
    p.bias_ids = &force_id;
    p.bias_values = &plus;
    p.n_bias = 1;
    ck_assert_int_eq(pdm_sampler_create(&p, V, &s), PDM_OK);
    for (int i = 0; i < 50; i++) ck_assert_int_eq(pdm_sampler_sample(s, logits, hist, 0, NULL), 17);
    pdm_sampler_destroy(s);
    int greedy = 0;
    for (int t = 1; t < V; t++)
        if (logits[t] > logits[greedy]) greedy = t;
    pdm_sampler_params_default(&p);
    p.temperature = 0.0f;
    p.bias_ids = (const int32_t *)&greedy;
    p.bias_values = &minus;
    p.n_bias = 1;
    ck_assert_int_eq(pdm_sampler_create(&p, V, &s), PDM_OK);
    ck_assert_int_ne(pdm_sampler_sample(s, logits, NULL, 0, NULL), greedy);
    pdm_sampler_destroy(s);
    /* a bias on a token outside the vocabulary is refused at creation */
    const int32_t far = V;
    p.bias_ids = &far;
    ck_assert_int_eq(pdm_sampler_create(&p, V, &s), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "logit_bias"));
}
END_TEST

/* Generates n tokens from a fixed "model" whose logits depend on the last token, sampling
 * steps [from, n) with a fresh sampler given out[0..from) as history (a migration at step
 * from), and returns them in out. */
static void run_from(const pdm_sampler_params_t *p, int from, int n, int32_t *out,
                     float *chosen_lp)
{
    enum { V = 64 };
    pdm_sampler_t *s = NULL;
    ck_assert_int_eq(pdm_sampler_create(p, V, &s), PDM_OK);
    for (int i = from; i < n; i++) {
        float logits[V];
        int32_t last = i ? out[i - 1] : 7;
        for (int t = 0; t < V; t++) logits[t] = cosf((float)(t * 31 + last * 17) * 0.37f) * 2.5f;
        pdm_token_logprobs_t lp;
        out[i] = pdm_sampler_sample(s, logits, out, i, &lp);
        chosen_lp[i] = lp.logprob;
    }
    pdm_sampler_destroy(s);
}

START_TEST(test_seed_resume)
{
    enum { N = 60 };
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    p.temperature = 0.9f;
    p.top_k = 0;
    p.top_p = 0.95f;
    p.min_p = 0.0f;
    p.frequency_penalty = 0.4f;
    p.presence_penalty = 0.2f;
    p.repeat_penalty = 1.1f;
    p.logprobs = 3;
    p.seed = 1234;
    int32_t straight[N], again[N], resumed[N];
    float lp_a[N], lp_b[N], lp_c[N];
    run_from(&p, 0, N, straight, lp_a);
    run_from(&p, 0, N, again, lp_b);
    ck_assert_mem_eq(straight, again, sizeof(straight)); /* same seed, same output */
    for (int k = 1; k < N; k += 7) { /* resumed at step k: the same continuation */
        memcpy(resumed, straight, sizeof(int32_t) * (size_t)k);
        run_from(&p, k, N, resumed, lp_c);
        ck_assert_mem_eq(straight, resumed, sizeof(straight));
        for (int i = k; i < N; i++) ck_assert(lp_c[i] == lp_a[i]);
    }
    p.seed = 1235; /* another seed, another output */
    run_from(&p, 0, N, again, lp_b);
    ck_assert(memcmp(straight, again, sizeof(straight)) != 0);
}
END_TEST

/* pdm_sampler_score (prompt log-probabilities): log_softmax of the raw logits at any token,
 * the same numbers as a greedy step's logprobs without adjustments, ties by lower id. */
START_TEST(test_score)
{
    enum { V = 50 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = cosf((float)i * 0.9f) * 4.0f;
    logits[7] = logits[3]; /* a tie */
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    p.temperature = 0.0f;
    p.logprobs = 5;
    pdm_sampler_t *s = NULL;
    ck_assert_int_eq(pdm_sampler_create(&p, V, &s), PDM_OK);
    pdm_token_logprobs_t step, sc;
    int32_t tok = pdm_sampler_sample(s, logits, NULL, 0, &step);
    pdm_sampler_score(logits, V, tok, 5, &sc);
    ck_assert(sc.logprob == step.logprob);
    ck_assert_int_eq(sc.n_top, step.n_top);
    for (int k = 0; k < sc.n_top; k++) {
        ck_assert_int_eq(sc.top_ids[k], step.top_ids[k]);
        ck_assert(sc.top_logprobs[k] == step.top_logprobs[k]);
    }
    double mx = logits[0], sum = 0;
    for (int i = 1; i < V; i++) mx = fmax(mx, logits[i]);
    for (int i = 0; i < V; i++) sum += exp(logits[i] - mx);
    for (int t = 0; t < V; t += 7) {
        pdm_sampler_score(logits, V, t, 0, &sc);
        ck_assert_int_eq(sc.n_top, 0);
        ck_assert_msg(fabs(sc.logprob - (logits[t] - mx - log(sum))) < 1e-5, "token %d", t);
    }
    pdm_sampler_score(logits, 3, 1, 20, &sc); /* more alternatives than the vocabulary */
    ck_assert_int_eq(sc.n_top, 3);
    pdm_sampler_destroy(s);
}
END_TEST


/* ---- the draw against a full sort ----------------------------------------------------- */

typedef struct {
    int32_t id;
    float logit;
} ref_cand_t;

static int ref_desc(const void *a, const void *b)
{
    const ref_cand_t *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Step 5 of the rule (model.h) with top_k off, the plain way: the whole vocabulary sorted
 * (logit descending, lower id first), the top-p prefix, the min-p prefix, one draw with u_i
 * walking the sorted order. */
static int32_t ref_draw(const float *logits, int n, float temperature, float top_p, float min_p,
                        uint64_t seed, int step)
{
    ref_cand_t *c = malloc(sizeof(*c) * (size_t)n);
    for (int i = 0; i < n; i++) c[i] = (ref_cand_t){i, logits[i]};
    qsort(c, (size_t)n, sizeof(*c), ref_desc);
    const float maxl = c[0].logit;
    double total = 0;
    for (int i = 0; i < n; i++) total += exp((double)(c[i].logit - maxl));
    if (top_p < 1) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            cum += exp((double)(c[i].logit - maxl)) / total;
            if (cum >= top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (min_p > 0) {
        int keep = 1;
        while (keep < n && c[keep].logit >= maxl + logf(min_p)) keep++;
        n = keep;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)(c[i].logit - maxl) / temperature);
    uint64_t x = seed ^ ((uint64_t)(step + 1) * 0x9E3779B97F4A7C15ull);
    const double r = (double)(pdm_splitmix64(&x) >> 11) * 0x1.0p-53 * sum;
    double acc = 0;
    int32_t chosen = c[n - 1].id;
    for (int i = 0; i < n; i++) {
        acc += exp((double)(c[i].logit - maxl) / temperature);
        if (r < acc) {
            chosen = c[i].id;
            break;
        }
    }
    free(c);
    return chosen;
}

/* top_k off (OpenAI's default) no longer sorts the vocabulary; the draws are those of the
 * full sort: peaked and flat logits, many ties (logits rounded to a few values), temperatures
 * 0.5..2, top_p and min_p on and off. Sums over a whole set may be taken in another order,
 * which changes a draw only when u lands within ~1e-16 of a boundary: none here. */
START_TEST(test_draw_equals_full_sort)
{
    const int V = 5003;
    float *l = malloc(sizeof(float) * V);
    uint64_t g = 77;
    int checked = 0;
    for (int shape = 0; shape < 3; shape++) {
        for (int i = 0; i < V; i++) {
            double u = (double)(pdm_splitmix64(&g) >> 11) * 0x1.0p-53;
            l[i] = shape == 0 ? (float)(20 * pow(u, 12))       /* peaked: a few large */
                   : shape == 1 ? (float)(4 * u)               /* flat */
                                : (float)floor(8 * u) * 0.5f;  /* ties everywhere */
        }
        static const float temps[] = {0.5f, 1.0f, 2.0f};
        static const float top_ps[] = {1.0f, 0.9f, 0.5f};
        static const float min_ps[] = {0.0f, 0.05f};
        for (size_t t = 0; t < 3; t++)
            for (size_t tp = 0; tp < 3; tp++)
                for (size_t mp = 0; mp < 2; mp++) {
                    pdm_sampler_params_t sp;
                    pdm_sampler_params_default(&sp);
                    sp.temperature = temps[t];
                    sp.top_k = 0;
                    sp.top_p = top_ps[tp];
                    sp.min_p = min_ps[mp];
                    sp.seed = 1000 + (uint64_t)shape;
                    pdm_sampler_t *smp;
                    ck_assert_int_eq(pdm_sampler_create(&sp, V, &smp), 0);
                    for (int step = 0; step < 20; step++) {
                        int32_t got = pdm_sampler_sample(smp, l, NULL, step, NULL);
                        ck_assert_int_eq(got, ref_draw(l, V, sp.temperature, sp.top_p,
                                                       sp.min_p, sp.seed, step));
                        checked++;
                    }
                    pdm_sampler_destroy(smp);
                }
    }
    ck_assert_int_eq(checked, 3 * 18 * 20);
    free(l);
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
    tcase_add_test(tc, test_penalties_bias_logprobs);
    tcase_add_test(tc, test_seed_resume);
    tcase_add_test(tc, test_score);
    tcase_add_test(tc, test_draw_equals_full_sort);
    suite_add_tcase(s, tc);
    return s;
}
