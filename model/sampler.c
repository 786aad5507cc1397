/*
 * sampler.c - next-token selection: greedy, or repetition penalty -> top-k -> top-p -> min-p
 * -> temperature -> draw, the order llama.cpp's default chain uses. The candidate buffer is
 * allocated once; sampling never allocates.
 */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t id;
    float logit;
} pdm__cand_t;

struct pdm_sampler {
    pdm_sampler_params_t p;
    int32_t n_vocab;
    pdm__cand_t *cand; /* [n_vocab] */
    uint64_t rng[4];   /* xoshiro256** state */
};

void pdm_sampler_params_default(pdm_sampler_params_t *p)
{
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->seed = 0x5eed;
}

int pdm_sampler_params_check(const pdm_sampler_params_t *p)
{
    if (!(p->temperature >= 0.0f) || p->temperature > PDM_SAMPLER_TEMPERATURE_MAX)
        return pdm_error_set(PDM_EINVAL, "temperature %g is outside [0, %g]", p->temperature,
                             PDM_SAMPLER_TEMPERATURE_MAX);
    if (p->top_k < 0) return pdm_error_set(PDM_EINVAL, "top-k %d is negative", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return pdm_error_set(PDM_EINVAL, "top-p %g is outside (0, 1]", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pdm_error_set(PDM_EINVAL, "min-p %g is outside [0, 1]", p->min_p);
    if (!(p->repeat_penalty > 0.0f) || p->repeat_penalty > PDM_SAMPLER_REPEAT_PENALTY_MAX)
        return pdm_error_set(PDM_EINVAL, "repeat penalty %g is outside (0, %g]",
                             p->repeat_penalty, PDM_SAMPLER_REPEAT_PENALTY_MAX);
    if (p->repeat_last_n < 0)
        return pdm_error_set(PDM_EINVAL, "repeat-last-n %d is negative", p->repeat_last_n);
    return PDM_OK;
}

static inline uint64_t pdm__rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** (Blackman & Vigna), uniform in [0, 1) with 53 bits. */
static double pdm__uniform(uint64_t s[4])
{
    uint64_t result = pdm__rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = pdm__rotl(s[3], 45);
    return (double)(result >> 11) * 0x1.0p-53;
}

int pdm_sampler_create(const pdm_sampler_params_t *p, int32_t n_vocab, pdm_sampler_t **out)
{
    int rc = pdm_sampler_params_check(p);
    if (rc) return rc;
    if (n_vocab < 1) return pdm_error_set(PDM_EINVAL, "vocabulary of %d tokens", n_vocab);
    pdm_sampler_t *s = calloc(1, sizeof(*s));
    if (!s) return pdm_error_set(PDM_ENOMEM, "out of memory");
    s->cand = malloc((size_t)n_vocab * sizeof(*s->cand));
    if (!s->cand) {
        free(s);
        return pdm_error_set(PDM_ENOMEM, "out of memory");
    }
    s->p = *p;
    s->n_vocab = n_vocab;
    uint64_t seed = p->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = pdm_splitmix64(&seed);
    *out = s;
    return PDM_OK;
}

void pdm_sampler_destroy(pdm_sampler_t *s)
{
    if (!s) return;
    free(s->cand);
    free(s);
}

static int pdm__cand_desc(const void *a, const void *b)
{
    const pdm__cand_t *x = a, *y = b;
    if (x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Moves the k largest candidates to the front (unordered), by quickselect. */
static void pdm__select_top(pdm__cand_t *c, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = c[(lo + hi) / 2].logit;
        int i = lo, j = hi;
        while (i <= j) {
            while (c[i].logit > pivot) i++;
            while (c[j].logit < pivot) j--;
            if (i <= j) {
                pdm__cand_t tmp = c[i];
                c[i++] = c[j];
                c[j--] = tmp;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

int32_t pdm_sampler_sample(pdm_sampler_t *s, const float *logits, const int32_t *history,
                           int n_history)
{
    const pdm_sampler_params_t *p = &s->p;
    int n = s->n_vocab;
    pdm__cand_t *c = s->cand;
    for (int i = 0; i < n; i++) c[i] = (pdm__cand_t){i, logits[i]};

    /* Repetition penalty over the last repeat_last_n tokens (CTRL paper, as llama.cpp). */
    if (p->repeat_penalty != 1.0f && n_history > 0) {
        int from = n_history > p->repeat_last_n ? n_history - p->repeat_last_n : 0;
        for (int i = from; i < n_history; i++) {
            int32_t id = history[i];
            if (id < 0 || id >= n) continue;
            float l = logits[id];
            c[id].logit = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        }
    }

    if (p->temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        return c[best].id;
    }

    if (p->top_k > 0 && p->top_k < n) {
        pdm__select_top(c, n, p->top_k);
        n = p->top_k;
    }
    qsort(c, (size_t)n, sizeof(*c), pdm__cand_desc);

    /* Softmax over the survivors (at temperature 1 for the top-p/min-p cut, as llama.cpp). */
    float maxl = c[0].logit;
    double total = 0.0;
    for (int i = 0; i < n; i++) total += exp((double)(c[i].logit - maxl));
    if (p->top_p < 1.0f) {
        double cum = 0.0;
        for (int i = 0; i < n; i++) {
            cum += exp((double)(c[i].logit - maxl)) / total;
            if (cum >= p->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        /* keep tokens whose probability is at least min_p times the top one's */
        float cut = maxl + logf(p->min_p);
        int keep = 1;
        while (keep < n && c[keep].logit >= cut) keep++;
        n = keep;
    }

    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)(c[i].logit - maxl) / p->temperature);
    double r = pdm__uniform(s->rng) * sum, acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += exp((double)(c[i].logit - maxl) / p->temperature);
        if (r < acc) return c[i].id;
    }
    return c[n - 1].id;
}
