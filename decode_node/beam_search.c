/*
 * beam_search.c - the beam search itself: candidate selection, the n-best heap of finished
 * hypotheses, early stopping. The rule is stated in beam.h; this file only keeps token lists
 * and scores (the KV side is beam.c).
 */
#include "decode_node/decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

typedef struct {
    double logprob;
    int beam;
    int32_t token;
} pdm__cand_t;

struct pdm_beam_search {
    pdm_beam_params_t p;
    int32_t n_vocab, max_new;
    int32_t *eog;        /* [n_eog] sorted */
    int n_eog;
    int n_live;          /* live beams */
    int len;             /* tokens of every live beam */
    int32_t *live;       /* [width][max_new] tokens of the live beams */
    int32_t *live_tmp;   /* [width][max_new] */
    double live_lp[PDM_BEAM_MAX_WIDTH], live_lp_tmp[PDM_BEAM_MAX_WIDTH];
    int32_t prime_token; /* input of the first step */
    pdm__cand_t *cands;  /* [width * (width + n_eog)] */
    pdm_beam_hyp_t heap[PDM_BEAM_MAX_WIDTH]; /* finished hypotheses, sorted best first */
    int n_heap;
    int done;
};

static int pdm__is_eog(const pdm_beam_search_t *bs, int32_t tok)
{
    for (int i = 0; i < bs->n_eog; i++)
        if (bs->eog[i] == tok) return 1;
    return 0;
}

int pdm_beam_search_create(const pdm_beam_params_t *p, int32_t n_vocab, int32_t max_new,
                           const int32_t *eog, int n_eog, pdm_beam_search_t **out)
{
    int st = pdm_beam_params_check(p);
    if (st) return st;
    if (p->width < 1 || max_new < 1 || n_eog < 0 || n_vocab < p->width + n_eog + 1)
        return pdm_error_set(PDM_EINVAL, "beam search: width %d, max_new %d, %d eog tokens, "
                             "vocabulary of %d", p->width, max_new, n_eog, n_vocab);
    pdm_beam_search_t *bs = calloc(1, sizeof(*bs));
    if (!bs) return pdm_error_set(PDM_ENOMEM, "beam search: out of memory");
    bs->p = *p;
    bs->n_vocab = n_vocab;
    bs->max_new = max_new;
    bs->n_eog = n_eog;
    bs->n_live = 1;
    const size_t toks = (size_t)p->width * (size_t)max_new;
    bs->eog = malloc(sizeof(int32_t) * (size_t)(n_eog ? n_eog : 1));
    bs->live = calloc(toks, sizeof(int32_t));
    bs->live_tmp = calloc(toks, sizeof(int32_t));
    bs->cands = malloc(sizeof(pdm__cand_t) * (size_t)p->width * (size_t)(p->width + n_eog));
    for (int i = 0; i < PDM_BEAM_MAX_WIDTH; i++) {
        bs->heap[i].tokens = malloc(sizeof(int32_t) * (size_t)max_new);
        if (!bs->heap[i].tokens) bs->cands = (free(bs->cands), NULL);
    }
    if (!bs->eog || !bs->live || !bs->live_tmp || !bs->cands) {
        pdm_beam_search_destroy(bs);
        return pdm_error_set(PDM_ENOMEM, "beam search: out of memory");
    }
    if (n_eog) memcpy(bs->eog, eog, sizeof(int32_t) * (size_t)n_eog);
    *out = bs;
    return PDM_OK;
}

void pdm_beam_search_destroy(pdm_beam_search_t *bs)
{
    if (!bs) return;
    for (int i = 0; i < PDM_BEAM_MAX_WIDTH; i++) free(bs->heap[i].tokens);
    free(bs->eog);
    free(bs->live);
    free(bs->live_tmp);
    free(bs->cands);
    free(bs);
}

void pdm_beam_search_prime(pdm_beam_search_t *bs, int32_t last_prompt_token)
{
    bs->prime_token = last_prompt_token;
}

int pdm_beam_search_inputs(const pdm_beam_search_t *bs, int32_t *tokens)
{
    if (bs->len == 0) {
        tokens[0] = bs->prime_token;
        return 1;
    }
    for (int b = 0; b < bs->n_live; b++) tokens[b] = bs->live[(size_t)b * bs->max_new + bs->len - 1];
    return bs->n_live;
}

int pdm_beam_search_length(const pdm_beam_search_t *bs) { return bs->len; }

static double pdm__score(const pdm_beam_search_t *bs, double logprob, int n)
{
    return logprob / pow((double)n, (double)bs->p.length_penalty);
}

/* Adds a finished hypothesis to the n-best heap (kept sorted best first, at most width). */
static void pdm__heap_add(pdm_beam_search_t *bs, const int32_t *tokens, int n, double logprob,
                          int eos)
{
    const double score = pdm__score(bs, logprob, n);
    const int cap = bs->p.width;
    if (bs->n_heap == cap && !(score > bs->heap[cap - 1].score)) return;
    int at = bs->n_heap < cap ? bs->n_heap++ : cap - 1; /* the worst is dropped when full */
    pdm_beam_hyp_t slot = bs->heap[at];                 /* reuse its token buffer */
    while (at > 0 && bs->heap[at - 1].score < score) {   /* earlier entries win ties */
        bs->heap[at] = bs->heap[at - 1];
        at--;
    }
    memcpy(slot.tokens, tokens, sizeof(int32_t) * (size_t)n);
    slot.n_tokens = n;
    slot.logprob = logprob;
    slot.score = score;
    slot.eos = eos;
    bs->heap[at] = slot;
}

static int pdm__cand_cmp(const void *a_, const void *b_)
{
    const pdm__cand_t *a = a_, *b = b_;
    if (a->logprob != b->logprob) return a->logprob > b->logprob ? -1 : 1;
    if (a->beam != b->beam) return a->beam < b->beam ? -1 : 1;
    return a->token < b->token ? -1 : a->token > b->token;
}

void pdm_beam_search_finish(pdm_beam_search_t *bs)
{
    if (bs->done) return;
    if (bs->len > 0)
        for (int b = 0; b < bs->n_live; b++)
            pdm__heap_add(bs, bs->live + (size_t)b * bs->max_new, bs->len, bs->live_lp[b], 0);
    bs->done = 1;
}

int pdm_beam_search_advance(pdm_beam_search_t *bs, const float *logits, int *parent,
                            int *n_live_out)
{
    const int W = bs->p.width, K = W + bs->n_eog; /* per beam: enough for W non-eog picks */
    const int32_t V = bs->n_vocab;
    int n_cand = 0;
    for (int b = 0; b < bs->n_live; b++) {
        const float *x = logits + (size_t)b * V;
        /* log softmax in double: lse = max + log(sum exp(x - max)) */
        float mx = x[0];
        for (int32_t i = 1; i < V; i++) mx = fmaxf(mx, x[i]);
        double sum = 0;
        for (int32_t i = 0; i < V; i++) sum += exp((double)x[i] - mx);
        const double lse = mx + log(sum);
        /* top K tokens of this beam by logit (lower id first on ties), insertion into a
         * sorted list of at most K */
        pdm__cand_t *top = bs->cands + n_cand;
        int n_top = 0;
        for (int32_t i = 0; i < V; i++) {
            if (n_top == K && !(x[i] > x[top[K - 1].token])) continue;
            int at = n_top < K ? n_top++ : K - 1;
            while (at > 0 && x[top[at - 1].token] < x[i]) {
                top[at] = top[at - 1];
                at--;
            }
            top[at].token = i;
        }
        const double base = bs->len ? bs->live_lp[b] : 0.0;
        for (int k = 0; k < n_top; k++) {
            top[k].beam = b;
            top[k].logprob = base + ((double)x[top[k].token] - lse);
        }
        n_cand += n_top;
    }
    qsort(bs->cands, (size_t)n_cand, sizeof(pdm__cand_t), pdm__cand_cmp);
    /* Walk the ranking: eog candidates of rank < W finish, others continue until W beams. */
    const int new_len = bs->len + 1;
    int n_next = 0;
    for (int r = 0; r < n_cand && n_next < W; r++) {
        const pdm__cand_t *c = &bs->cands[r];
        const int32_t *hist = bs->live + (size_t)c->beam * bs->max_new;
        if (pdm__is_eog(bs, c->token)) {
            if (r < W) {
                int32_t *buf = bs->live_tmp + (size_t)n_next * bs->max_new; /* scratch */
                /* the heap copies the tokens; build them in the next free scratch row */
                memcpy(buf, hist, sizeof(int32_t) * (size_t)bs->len);
                buf[bs->len] = c->token;
                pdm__heap_add(bs, buf, new_len, c->logprob, 1);
            }
            continue;
        }
        int32_t *dst = bs->live_tmp + (size_t)n_next * bs->max_new;
        memcpy(dst, hist, sizeof(int32_t) * (size_t)bs->len);
        dst[bs->len] = c->token;
        bs->live_lp_tmp[n_next] = c->logprob;
        parent[n_next] = c->beam;
        n_next++;
    }
    int32_t *t = bs->live;
    bs->live = bs->live_tmp;
    bs->live_tmp = t;
    memcpy(bs->live_lp, bs->live_lp_tmp, sizeof(double) * (size_t)n_next);
    bs->n_live = n_next;
    bs->len = new_len;
    *n_live_out = n_next;
    if (new_len >= bs->max_new || n_next == 0) {
        pdm_beam_search_finish(bs);
        return 1;
    }
    if (bs->n_heap < W) return 0;
    const double best = bs->live_lp[0]; /* live beams come out of the ranking best first */
    const double worst = bs->heap[bs->n_heap - 1].score;
    int stop = 0;
    switch (bs->p.early_stopping) {
    case PDM_BEAM_STOP_EARLY: stop = 1; break;
    case PDM_BEAM_STOP_HEURISTIC: stop = worst >= pdm__score(bs, best, new_len); break;
    case PDM_BEAM_STOP_NEVER:
        stop = worst >= pdm__score(bs, best, bs->p.length_penalty > 0 ? bs->max_new : new_len);
        break;
    }
    if (stop) bs->done = 1;
    return stop;
}

int pdm_beam_search_results(const pdm_beam_search_t *bs, const pdm_beam_hyp_t **hyps)
{
    *hyps = bs->heap;
    return PDM_MIN(bs->n_heap, bs->p.n_best);
}
