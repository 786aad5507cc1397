/*
 * nsamp.c - n samples of one prompt over the segmented KV cache (the rule is in nsamp.h; the
 * KV side is beam.c, this file keeps each sample's sampler, tokens and row).
 */
#include "decode_node/decode.h"

#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

struct pdm_nsamp {
    int n;                                 /* samples */
    int32_t n_vocab, max_new;
    pdm_beam_kv_t *kv;                     /* borrowed */
    pdm_sampler_t *sampler[PDM_NSAMP_MAX]; /* sample i seeded with pdm_nsamp_seed(seed, i) */
    int32_t *tokens;                       /* [n][max_new] generated tokens of each sample */
    int32_t n_tokens[PDM_NSAMP_MAX];
    int finished[PDM_NSAMP_MAX];
    int row_sample[PDM_NSAMP_MAX];         /* sample of each row of the next step */
    int n_rows;                            /* rows of the next step (the KV's n_live) */
    int32_t prime_token;                   /* input of the priming step */
    int primed;                            /* the first tokens are drawn */
};

uint64_t pdm_nsamp_seed(uint64_t seed, int i) { return pdm_sampler_seed_for_choice(seed, i); }

int pdm_nsamp_create(const pdm_sampler_params_t *p, int n, int32_t n_vocab, int32_t max_new,
                     pdm_beam_kv_t *kv, int32_t last_prompt_token, pdm_nsamp_t **out)
{
    if (n < 1 || n > PDM_NSAMP_MAX)
        return pdm_error_set(PDM_EINVAL, "n samples: n = %d (1..%d)", n, PDM_NSAMP_MAX);
    if (!kv || kv->width < n || kv->primed)
        return pdm_error_set(PDM_EINVAL, "n samples: the response KV must be fresh and hold "
                             "%d rows per step", n);
    if (max_new < 1 || n_vocab < 1)
        return pdm_error_set(PDM_EINVAL, "n samples: max_new %d, vocabulary %d", max_new,
                             n_vocab);
    pdm_nsamp_t *g = calloc(1, sizeof(*g));
    if (!g) return pdm_error_set(PDM_ENOMEM, "n samples: out of memory");
    g->n = n;
    g->n_vocab = n_vocab;
    g->max_new = max_new;
    g->kv = kv;
    g->prime_token = last_prompt_token;
    g->n_rows = 1;
    g->tokens = malloc(sizeof(int32_t) * (size_t)n * (size_t)max_new);
    int st = g->tokens ? PDM_OK : pdm_error_set(PDM_ENOMEM, "n samples: out of memory");
    for (int i = 0; i < n && !st; i++) {
        pdm_sampler_params_t sp = *p;
        sp.seed = pdm_nsamp_seed(p->seed, i);
        st = pdm_sampler_create(&sp, n_vocab, &g->sampler[i]);
    }
    if (st) {
        pdm_nsamp_destroy(g);
        return st;
    }
    *out = g;
    return PDM_OK;
}

void pdm_nsamp_destroy(pdm_nsamp_t *g)
{
    if (!g) return;
    for (int i = 0; i < g->n; i++) pdm_sampler_destroy(g->sampler[i]);
    free(g->tokens);
    free(g);
}

int pdm_nsamp_inputs(const pdm_nsamp_t *g, int32_t *tokens)
{
    if (!g->primed) {
        tokens[0] = g->prime_token;
        return 1;
    }
    for (int r = 0; r < g->n_rows; r++) {
        const int i = g->row_sample[r];
        tokens[r] = g->tokens[(size_t)i * g->max_new + g->n_tokens[i] - 1];
    }
    return g->n_rows;
}

int pdm_nsamp_row_sample(const pdm_nsamp_t *g, int row)
{
    return g->primed && row >= 0 && row < g->n_rows ? g->row_sample[row] : -1;
}

int pdm_nsamp_sample(pdm_nsamp_t *g, const float *logits, pdm_nsamp_token_t *out)
{
    int k = 0;
    for (int i = 0; i < g->n; i++) {
        if (g->finished[i] || g->n_tokens[i] >= g->max_new) continue;
        int row = 0; /* priming: every sample draws from the one row */
        if (g->primed) {
            row = -1;
            for (int r = 0; r < g->n_rows; r++)
                if (g->row_sample[r] == i) row = r;
            if (row < 0) continue; /* not computed this step (cannot happen: all live are) */
        }
        int32_t *hist = g->tokens + (size_t)i * g->max_new;
        pdm_nsamp_token_t *t = &out[k++];
        t->sample = i;
        t->index = g->n_tokens[i];
        t->token = pdm_sampler_sample(g->sampler[i], logits + (size_t)row * g->n_vocab, hist,
                                      g->n_tokens[i], &t->lp);
        hist[g->n_tokens[i]++] = t->token;
    }
    return k;
}

void pdm_nsamp_finish(pdm_nsamp_t *g, int sample)
{
    if (sample >= 0 && sample < g->n) g->finished[sample] = 1;
}

void pdm_nsamp_advance(pdm_nsamp_t *g)
{
    /* New row r continues the old row of its sample (priming: the single row 0). Rows of
     * finished samples are dropped: only the table moves (pdm_beam_kv_reorder). */
    int parent[PDM_NSAMP_MAX], rows[PDM_NSAMP_MAX], n_next = 0;
    for (int i = 0; i < g->n; i++) {
        if (g->finished[i] || g->n_tokens[i] >= g->max_new) continue;
        int old = 0;
        for (int r = 0; g->primed && r < g->n_rows; r++)
            if (g->row_sample[r] == i) old = r;
        parent[n_next] = old;
        rows[n_next++] = i;
    }
    memcpy(g->row_sample, rows, sizeof(int) * (size_t)n_next);
    g->n_rows = n_next;
    g->primed = 1;
    if (n_next) pdm_beam_kv_reorder(g->kv, parent, n_next);
}

int pdm_nsamp_prime(pdm_nsamp_t *g, const float *logits, pdm_nsamp_token_t *out)
{
    if (g->primed) return 0;
    const int k = pdm_nsamp_sample(g, logits, out); /* unprimed: every sample from row 0 */
    pdm_beam_kv_commit(g->kv);                      /* primed, no response step stored */
    return k;
}

void pdm_nsamp_force(pdm_nsamp_t *g, int i, int32_t token)
{
    if (i < 0 || i >= g->n || g->finished[i] || g->n_tokens[i] >= g->max_new) return;
    g->tokens[(size_t)i * g->max_new + g->n_tokens[i]++] = token;
}

pdm_sampler_t *pdm_nsamp_sampler(pdm_nsamp_t *g, int i)
{
    return i >= 0 && i < g->n ? g->sampler[i] : NULL;
}

int pdm_nsamp_primed(const pdm_nsamp_t *g) { return g->primed; }

int pdm_nsamp_count(const pdm_nsamp_t *g) { return g->n; }

int pdm_nsamp_live(const pdm_nsamp_t *g) { return g->primed ? g->n_rows : g->n; }

const int32_t *pdm_nsamp_tokens(const pdm_nsamp_t *g, int sample, int *n_tokens)
{
    *n_tokens = g->n_tokens[sample];
    return g->tokens + (size_t)sample * g->max_new;
}
