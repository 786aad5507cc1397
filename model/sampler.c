/*
 * sampler.c - next-token selection (the rule is stated once, in model.h "Sampling"):
 * logit_bias -> repetition penalty -> presence/frequency penalties -> [logprobs] -> greedy, or
 * top-k -> top-p -> min-p -> temperature -> one draw, llama.cpp's default chain after OpenAI's
 * adjustments. The draw depends on (seed, step) only, so a resumed sequence continues as the
 * uninterrupted one. Buffers are allocated once; sampling never allocates.
 */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "proto/pdmesh.pb-c.h"

typedef struct {
    int32_t id;
    float logit;
} pdm__cand_t;

struct pdm_sampler {
    pdm_sampler_params_t p; /* bias_ids / bias_values point into bias_ids_, bias_values_ */
    int32_t n_vocab;
    pdm__cand_t *cand;      /* [n_vocab] */
    int32_t *count;         /* [n_vocab] occurrences in the history, all 0 between calls */
    float *bias;            /* [n_vocab] dense logit_bias, or NULL without one */
    int32_t bias_ids_[PDM_SAMPLER_MAX_LOGIT_BIAS];
    float bias_values_[PDM_SAMPLER_MAX_LOGIT_BIAS];
    pdm_gmatch_t *grammar;  /* borrowed, or NULL */
};

void pdm_sampler_params_default(pdm_sampler_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->seed = PDM_SEED_DEFAULT;
    p->logprobs = -1;
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
    if (!(fabsf(p->presence_penalty) <= PDM_SAMPLER_PENALTY_MAX))
        return pdm_error_set(PDM_EINVAL, "presence_penalty %g is outside [-%g, %g]",
                             p->presence_penalty, PDM_SAMPLER_PENALTY_MAX,
                             PDM_SAMPLER_PENALTY_MAX);
    if (!(fabsf(p->frequency_penalty) <= PDM_SAMPLER_PENALTY_MAX))
        return pdm_error_set(PDM_EINVAL, "frequency_penalty %g is outside [-%g, %g]",
                             p->frequency_penalty, PDM_SAMPLER_PENALTY_MAX,
                             PDM_SAMPLER_PENALTY_MAX);
    if (p->n_bias < 0 || p->n_bias > PDM_SAMPLER_MAX_LOGIT_BIAS ||
        (p->n_bias && (!p->bias_ids || !p->bias_values)))
        return pdm_error_set(PDM_EINVAL, "logit_bias has %d entries (at most %d)", p->n_bias,
                             PDM_SAMPLER_MAX_LOGIT_BIAS);
    for (int32_t i = 0; i < p->n_bias; i++) {
        if (p->bias_ids[i] < 0)
            return pdm_error_set(PDM_EINVAL, "logit_bias names token %d", p->bias_ids[i]);
        if (!(fabsf(p->bias_values[i]) <= PDM_SAMPLER_BIAS_MAX))
            return pdm_error_set(PDM_EINVAL, "logit_bias of token %d is %g, outside [-%g, %g]",
                                 p->bias_ids[i], p->bias_values[i], PDM_SAMPLER_BIAS_MAX,
                                 PDM_SAMPLER_BIAS_MAX);
    }
    if (p->logprobs > PDM_SAMPLER_MAX_TOP_LOGPROBS)
        return pdm_error_set(PDM_EINVAL, "top_logprobs %d is over %d", p->logprobs,
                             PDM_SAMPLER_MAX_TOP_LOGPROBS);
    return PDM_OK;
}

int pdm_sampler_params_from_msg(const Pdmesh__SamplingParams *m, pdm_sampler_params_t *p)
{
    pdm_sampler_params_t sp;
    pdm_sampler_params_default(&sp);
    sp.temperature = m ? m->temperature : 0;
    sp.top_k = m && m->top_k > 0 ? m->top_k : 0;
    sp.top_p = m && m->top_p > 0 && m->top_p < 1 ? m->top_p : 1;
    sp.min_p = m ? m->min_p : 0;
    sp.repeat_penalty = m && m->repeat_penalty > 0 ? m->repeat_penalty : 1;
    sp.seed = m && m->seed ? m->seed : sp.seed;
    if (m) {
        sp.presence_penalty = m->presence_penalty;
        sp.frequency_penalty = m->frequency_penalty;
        if (m->n_logit_bias_ids != m->n_logit_bias_values)
            return pdm_error_set(PDM_EINVAL, "logit_bias: %zu token ids but %zu values",
                                 m->n_logit_bias_ids, m->n_logit_bias_values);
        if (m->n_logit_bias_ids > PDM_SAMPLER_MAX_LOGIT_BIAS)
            return pdm_error_set(PDM_EINVAL, "logit_bias has %zu entries (at most %d)",
                                 m->n_logit_bias_ids, PDM_SAMPLER_MAX_LOGIT_BIAS);
        sp.bias_ids = m->logit_bias_ids;
        sp.bias_values = m->logit_bias_values;
        sp.n_bias = (int32_t)m->n_logit_bias_ids;
        if (m->json_schema && m->json_schema[0]) sp.json_schema = m->json_schema;
        if (m->logprobs) {
            if (m->top_logprobs > PDM_SAMPLER_MAX_TOP_LOGPROBS)
                return pdm_error_set(PDM_EINVAL, "top_logprobs %u is over %d", m->top_logprobs,
                                     PDM_SAMPLER_MAX_TOP_LOGPROBS);
            sp.logprobs = (int32_t)m->top_logprobs;
        }
    }
    int st = pdm_sampler_params_check(&sp);
    if (st) return st;
    *p = sp;
    return PDM_OK;
}

void pdm_sampler_params_to_msg(const pdm_sampler_params_t *p, Pdmesh__SamplingParams *m)
{
    m->temperature = p->temperature;
    m->top_k = p->top_k;
    m->top_p = p->top_p;
    m->min_p = p->min_p;
    m->repeat_penalty = p->repeat_penalty;
    m->seed = p->seed;
    m->presence_penalty = p->presence_penalty;
    m->frequency_penalty = p->frequency_penalty;
    m->logit_bias_ids = (int32_t *)p->bias_ids;
    m->n_logit_bias_ids = (size_t)p->n_bias;
    m->logit_bias_values = (float *)p->bias_values;
    m->n_logit_bias_values = (size_t)p->n_bias;
    m->logprobs = p->logprobs >= 0;
    m->top_logprobs = p->logprobs > 0 ? (uint32_t)p->logprobs : 0;
    m->json_schema = p->json_schema ? (char *)p->json_schema : (char *)protobuf_c_empty_string;
}

/* u_i of the rule in model.h: uniform in [0, 1) with 53 bits, from (seed, step) alone. */
static double pdm__step_uniform(uint64_t seed, uint64_t step)
{
    uint64_t x = seed ^ ((step + 1) * 0x9E3779B97F4A7C15ull);
    return (double)(pdm_splitmix64(&x) >> 11) * 0x1.0p-53;
}

uint64_t pdm_sampler_seed_for_choice(uint64_t seed, int i)
{
    return pdm_seed_for_choice(seed, i);
}

int pdm_sampler_create(const pdm_sampler_params_t *p, int32_t n_vocab, pdm_sampler_t **out)
{
    int rc = pdm_sampler_params_check(p);
    if (rc) return rc;
    if (n_vocab < 1) return pdm_error_set(PDM_EINVAL, "vocabulary of %d tokens", n_vocab);
    for (int32_t i = 0; i < p->n_bias; i++)
        if (p->bias_ids[i] >= n_vocab)
            return pdm_error_set(PDM_EINVAL, "logit_bias names token %d, outside the vocabulary "
                                 "of %d", p->bias_ids[i], n_vocab);
    pdm_sampler_t *s = calloc(1, sizeof(*s));
    if (!s) return pdm_error_set(PDM_ENOMEM, "out of memory");
    s->cand = malloc((size_t)n_vocab * sizeof(*s->cand));
    s->count = calloc((size_t)n_vocab, sizeof(*s->count));
    if (p->n_bias) s->bias = calloc((size_t)n_vocab, sizeof(*s->bias));
    if (!s->cand || !s->count || (p->n_bias && !s->bias)) {
        pdm_sampler_destroy(s);
        return pdm_error_set(PDM_ENOMEM, "out of memory");
    }
    s->p = *p;
    s->n_vocab = n_vocab;
    if (p->n_bias) {
        memcpy(s->bias_ids_, p->bias_ids, sizeof(int32_t) * (size_t)p->n_bias);
        memcpy(s->bias_values_, p->bias_values, sizeof(float) * (size_t)p->n_bias);
        for (int32_t i = 0; i < p->n_bias; i++) s->bias[p->bias_ids[i]] = p->bias_values[i];
    }
    s->p.bias_ids = s->bias_ids_;
    s->p.bias_values = s->bias_values_;
    s->p.json_schema = NULL; /* borrowed by the caller, never read here */
    *out = s;
    return PDM_OK;
}

void pdm_sampler_destroy(pdm_sampler_t *s)
{
    if (!s) return;
    free(s->cand);
    free(s->count);
    free(s->bias);
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

/* c[0..*sorted) are the *sorted largest of c[0..n) in pdm__cand_desc order (logit
 * descending, lower id first among ties); extends that prefix to at least `want` (at least 64
 * more, at most n): the largest of the rest moved up by quickselect and sorted, plus every
 * remaining candidate tied with the smallest of them, so the prefix is exactly the first
 * entries of a full sort. */
static void pdm__sort_prefix(pdm__cand_t *c, int n, int *sorted, int want)
{
    if (want < *sorted + 64) want = *sorted + 64;
    if (want > n) want = n;
    if (want <= *sorted) return;
    pdm__select_top(c + *sorted, n - *sorted, want - *sorted);
    float low = c[*sorted].logit;
    for (int i = *sorted + 1; i < want; i++) low = c[i].logit < low ? c[i].logit : low;
    for (int i = want; i < n; i++)
        if (c[i].logit == low) {
            pdm__cand_t tmp = c[want];
            c[want++] = c[i];
            c[i] = tmp;
        }
    qsort(c + *sorted, (size_t)(want - *sorted), sizeof(*c), pdm__cand_desc);
    *sorted = want;
}

/* Steps 1-3 of the rule: c[i] = (i, adjusted logit i). */
static void pdm__adjust(pdm_sampler_t *s, const float *logits, const int32_t *history,
                        int n_history)
{
    const pdm_sampler_params_t *p = &s->p;
    const int n = s->n_vocab;
    pdm__cand_t *c = s->cand;
    for (int i = 0; i < n; i++) c[i] = (pdm__cand_t){i, logits[i]};
    if (s->bias)
        for (int32_t i = 0; i < p->n_bias; i++) /* a repeated id: its last value, once */
            c[p->bias_ids[i]].logit = logits[p->bias_ids[i]] + s->bias[p->bias_ids[i]];
    if (p->repeat_penalty != 1.0f && n_history > 0) {
        /* recomputed from the biased logit, so a token seen twice is penalised once */
        int from = n_history > p->repeat_last_n ? n_history - p->repeat_last_n : 0;
        for (int i = from; i < n_history; i++) {
            int32_t id = history[i];
            if (id < 0 || id >= n) continue;
            float l = logits[id] + (s->bias ? s->bias[id] : 0.0f);
            c[id].logit = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        }
    }
    if ((p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) && n_history > 0) {
        for (int i = 0; i < n_history; i++)
            if (history[i] >= 0 && history[i] < n) s->count[history[i]]++;
        for (int i = 0; i < n_history; i++) {
            int32_t id = history[i];
            if (id < 0 || id >= n || !s->count[id]) continue;
            c[id].logit -= p->presence_penalty + p->frequency_penalty * (float)s->count[id];
            s->count[id] = 0; /* applied once; leaves the counts zeroed for the next call */
        }
    }
}

/* Step 4: log-sum-exp of c[0..n) and the k best (logit desc, id asc) into lp. */
static double pdm__logprobs_top(const pdm__cand_t *c, int n, int k, pdm_token_logprobs_t *lp)
{
    float maxl = c[0].logit;
    for (int i = 1; i < n; i++) maxl = c[i].logit > maxl ? c[i].logit : maxl;
    /* expf (each term is in (0, 1], its rounding far below the float logprob's), summed in
     * double: a third of the time of exp() over a 49k vocabulary */
    double total = 0.0;
    for (int i = 0; i < n; i++) total += (double)expf(c[i].logit - maxl);
    const double lse = maxl + log(total);
    if (k > n) k = n;
    int have = 0;
    pdm__cand_t best[PDM_SAMPLER_MAX_TOP_LOGPROBS];
    for (int i = 0; i < n && k > 0; i++) {
        /* insertion into the sorted k best; ids come in ascending order, so a tie stays
         * behind the earlier (lower) id */
        if (have == k && !(c[i].logit > best[k - 1].logit)) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && c[i].logit > best[j - 1].logit) {
            best[j] = best[j - 1];
            j--;
        }
        best[j] = c[i];
    }
    lp->n_top = have;
    for (int j = 0; j < have; j++) {
        lp->top_ids[j] = best[j].id;
        lp->top_logprobs[j] = (float)((double)best[j].logit - lse);
    }
    return lse;
}

void pdm_sampler_score(const float *logits, int32_t n_vocab, int32_t token, int32_t top,
                       pdm_token_logprobs_t *lp)
{
    float maxl = logits[0];
    for (int32_t i = 1; i < n_vocab; i++) maxl = logits[i] > maxl ? logits[i] : maxl;
    double total = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) total += (double)expf(logits[i] - maxl);
    const double log_total = log(total);
    lp->logprob = (float)((double)(logits[token] - maxl) - log_total);
    int k = top < 0 ? 0 : top > PDM_SAMPLER_MAX_TOP_LOGPROBS ? PDM_SAMPLER_MAX_TOP_LOGPROBS : top;
    if (k > n_vocab) k = n_vocab;
    int have = 0;
    for (int32_t i = 0; i < n_vocab && k > 0; i++) {
        /* insertion into the sorted k best; a tie stays behind the earlier (lower) id */
        if (have == k && !(logits[i] > logits[lp->top_ids[k - 1]])) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && logits[i] > logits[lp->top_ids[j - 1]]) {
            lp->top_ids[j] = lp->top_ids[j - 1];
            j--;
        }
        lp->top_ids[j] = i;
    }
    lp->n_top = have;
    for (int j = 0; j < have; j++)
        lp->top_logprobs[j] = (float)((double)(logits[lp->top_ids[j]] - maxl) - log_total);
}

void pdm_sampler_set_grammar(pdm_sampler_t *s, pdm_gmatch_t *m)
{
    s->grammar = m;
}

/* Step 3b: -inf for the tokens the grammar refuses (unless it refuses every one). */
static void pdm__apply_mask(pdm_sampler_t *s)
{
    const uint32_t *mask = pdm_gmatch_mask(s->grammar);
    const int n = s->n_vocab;
    int any = 0;
    for (int w = 0; w < (n + 31) / 32 && !any; w++) any = mask[w] != 0;
    if (!any) return;
    for (int i = 0; i < n; i++)
        if (!(mask[i >> 5] >> (i & 31) & 1)) s->cand[i].logit = -INFINITY;
}

int32_t pdm_sampler_sample(pdm_sampler_t *s, const float *logits, const int32_t *history,
                           int n_history, pdm_token_logprobs_t *lp)
{
    const pdm_sampler_params_t *p = &s->p;
    int n = s->n_vocab;
    pdm__cand_t *c = s->cand;
    pdm__adjust(s, logits, history, n_history);
    pdm_token_logprobs_t unused;
    if (!lp) lp = &unused;
    const int want_lp = p->logprobs >= 0;
    if (s->grammar) {
        int fast = 0;
        if (p->temperature <= 0.0f && !want_lp) {
            /* the argmax, if the grammar takes it, is the constrained argmax */
            int best = 0;
            float top = c[0].logit; /* in a register: no load of c[best] per element */
            for (int i = 1; i < n; i++)
                if (c[i].logit > top) top = c[best = i].logit;
            fast = pdm_gmatch_allows(s->grammar, c[best].id);
            if (fast) return c[best].id;
        }
        pdm__apply_mask(s);
    }
    const double lse = want_lp ? pdm__logprobs_top(c, n, p->logprobs, lp) : 0.0;
    pdm__cand_t chosen;

    if (p->temperature <= 0.0f) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        chosen = c[best];
        goto out;
    }

    if (p->top_k > 0 && p->top_k < n) {
        pdm__select_top(c, n, p->top_k);
        n = p->top_k;
    }
    /* The survivors in descending order are needed only as far as the top-p cut and the draw
     * walk, usually a few dozen tokens: c[0..sorted) is kept sorted and extended on demand
     * (pdm__sort_prefix) instead of sorting the whole vocabulary (49152 tokens: 17 ms a draw
     * with top_k off, OpenAI's default, against 0.1 ms with top_k 40). Sums over a whole set
     * are taken in index order. */
    int sorted = 0;
    pdm__sort_prefix(c, n, &sorted, 1);
    const float maxl = c[0].logit;
    /* Softmax over the survivors (at temperature 1 for the top-p/min-p cut, as llama.cpp). */
    int kept_sorted = 0; /* the kept set is c[0..n) in sorted order (else: all of c[0..n)) */
    if (p->top_p < 1.0f) {
        double total = 0.0;
        for (int i = 0; i < n; i++) total += exp((double)(c[i].logit - maxl));
        double cum = 0.0;
        for (int i = 0; i < n; i++) {
            if (i >= sorted) pdm__sort_prefix(c, n, &sorted, 2 * sorted);
            cum += exp((double)(c[i].logit - maxl)) / total;
            if (cum >= p->top_p) {
                n = i + 1;
                kept_sorted = 1;
                break;
            }
        }
    }
    float cut = -INFINITY;
    if (p->min_p > 0.0f) {
        /* keep tokens whose probability is at least min_p times the top one's: a prefix of
         * the sorted order (the top token always stays, cut <= maxl) */
        cut = maxl + logf(p->min_p);
        if (kept_sorted) {
            int keep = 1;
            while (keep < n && c[keep].logit >= cut) keep++;
            n = keep;
        }
    }

    double sum = 0.0;
    int n_kept = 0;
    for (int i = 0; i < n; i++)
        if (c[i].logit >= cut) {
            sum += exp((double)(c[i].logit - maxl) / p->temperature);
            n_kept++;
        }
    /* The kept set is the first n_kept of the sorted order of c[0..n) (with min_p alone it
     * is spread over c[0..n) until sorted). */
    const int n_all = n;
    n = n_kept ? n_kept : 1;
    double r = pdm__step_uniform(p->seed, (uint64_t)(n_history > 0 ? n_history : 0)) * sum;
    double acc = 0.0;
    chosen.id = -1;
    for (int i = 0; i < n; i++) {
        if (i >= sorted) pdm__sort_prefix(c, n_all, &sorted, 2 * sorted);
        acc += exp((double)(c[i].logit - maxl) / p->temperature);
        if (r < acc) {
            chosen = c[i];
            break;
        }
    }
    if (chosen.id < 0) { /* rounding left r at the very end: the last kept token */
        pdm__sort_prefix(c, n_all, &sorted, n);
        chosen = c[n - 1];
    }
out:
    if (want_lp) lp->logprob = (float)((double)chosen.logit - lse);
    return chosen.id;
}
