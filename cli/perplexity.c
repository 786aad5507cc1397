/*
 * perplexity.c - `pdmesh perplexity` and `pdmesh kld`: how close pdmesh's logits are to the
 * model's, measured the way llama.cpp measures it.
 *
 * The method is llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp, perplexity()
 * and kl_divergence()); this is pdmesh's own code following it:
 *   - the whole text is tokenized once, with the model's BOS in front when its vocabulary adds
 *     one (common_tokenize(ctx, text, add_special = true), special tokens not parsed);
 *   - it is cut into n_chunk = min(--chunks, n_tokens / n_ctx) chunks of n_ctx tokens; at least
 *     2 * n_ctx tokens are needed;
 *   - every chunk is evaluated from an empty KV cache, with its first token replaced by BOS
 *     when the vocabulary adds BOS;
 *   - only the second half is scored: the logits at positions first = n_ctx/2 .. n_ctx-2
 *     predict tokens first+1 .. n_ctx-1, so every scored token has at least n_ctx/2 tokens of
 *     context; nll = max_logit + log(sum exp(logit - max_logit)) - logit[token];
 *   - the running estimate exp(sum nll / count) is printed after each chunk as "[k]x.xxxx,",
 *     and the end is "Final estimate: PPL = exp(mean nll) +/- ppl * sqrt(var(nll) / (count-1))"
 *     with var(nll) = mean(nll^2) - mean(nll)^2.
 * The last token of a chunk is only ever a target, so pdmesh evaluates n_ctx - 1 tokens.
 *
 * --kl-divergence-base FILE writes the scored positions' log-probabilities in llama.cpp's own
 * file format (cli/kldbase.h); --kl-divergence reads such a file (written by pdmesh, by
 * llama-perplexity or by tests/golden/make_kld_base.py), evaluates its tokens and reports
 * KL(base || pdmesh) per position, the same-top-token rate and both perplexities. --exact
 * runs the f64 reference forward (model/reference.c) instead of the engine, so a base of the
 * exact model can be written; `pdmesh kld A B` compares two base files.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/kldbase.h"
#include "common/pdm.h"
#include "model/model.h"

#define PPL__MAX_TEXT (256u << 20)

typedef struct {
    const char *model_path;
    const char *text_path;
    const char *base_path; /* --kl-divergence-base / --kld-base */
    long n_ctx;            /* 0: 512, or the base file's with --kl-divergence */
    long batch;            /* 0: min(512, n_ctx) */
    long chunks;           /* -1: all */
    long threads;
    int json, exact, kl_divergence;
    int per_token;         /* --per-token (with --json): each chunk's tokens and scored
                            * log-probabilities */
    pdm_model_ref_params_t ref; /* --exact: act_q8 (--exact-q8) and perturb (--perturb) */
    pdm_dtype_t kv_dtype;
} ppl_opts_t;

/* One way of computing logits: the engine (a context and a KV cache of n_ctx slots) or the
 * exact reference forward. */
typedef struct {
    const pdm_model_t *model;
    int exact, threads;
    pdm_model_ref_params_t ref;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
} ppl_eval_t;

static int ppl_eval_init(ppl_eval_t *ev, const pdm_model_t *model, const ppl_opts_t *o, int n_ctx)
{
    memset(ev, 0, sizeof(*ev));
    ev->model = model;
    ev->exact = o->exact;
    ev->threads = (int)o->threads;
    ev->ref = o->ref;
    ev->ref.n_threads = ev->threads;
    if (o->exact) return PDM_OK;
    int batch = (int)PDM_MIN(o->batch ? o->batch : 512, (long)n_ctx);
    int rc = pdm_model_ctx_create(model, ev->threads, batch, &ev->ctx);
    if (rc) return rc;
    if ((rc = pdm_kv_cache_create(&model->hp, n_ctx, o->kv_dtype, &ev->cache))) {
        pdm_model_ctx_destroy(ev->ctx);
        ev->ctx = NULL;
    }
    return rc;
}

static void ppl_eval_fini(ppl_eval_t *ev)
{
    pdm_kv_cache_destroy(ev->cache);
    pdm_model_ctx_destroy(ev->ctx);
    memset(ev, 0, sizeof(*ev));
}

static const char *ppl_eval_name(const ppl_eval_t *ev)
{
    if (!ev->exact) return pdm_model_ctx_ops(ev->ctx)->name;
    if (ev->ref.perturb != 0)
        return ev->ref.act_q8 ? "exact-f64+q8act+perturbed" : "exact-f64+perturbed";
    return ev->ref.act_q8 ? "exact-f64+q8act" : "exact-f64";
}

/* Logits of positions first .. n_ctx-2 of one chunk (chunk[0] already BOS if need be) into
 * logits[n_ctx - 1 - first][n_vocab], from an empty cache. */
static int ppl_eval_chunk(ppl_eval_t *ev, const int32_t *chunk, int n_ctx, float *logits)
{
    const int first = n_ctx / 2;
    if (ev->exact)
        return pdm_model_reference_logits(ev->model, &ev->ref, chunk, n_ctx - 1, first, logits);
    pdm_kv_cache_clear(ev->cache);
    return pdm_model_prefill_logits(ev->ctx, ev->cache, chunk, n_ctx - 1, first, logits);
}

/* Chunk k of tokens with llama-perplexity's BOS substitution. */
static void ppl_chunk_tokens(const pdm_tokenizer_t *tok, const int32_t *tokens, int k, int n_ctx,
                             int32_t *chunk)
{
    memcpy(chunk, tokens + (size_t)k * n_ctx, (size_t)n_ctx * sizeof(int32_t));
    if (pdm_tokenizer_add_bos(tok) && pdm_tokenizer_bos(tok) >= 0)
        chunk[0] = pdm_tokenizer_bos(tok);
}

/* -log softmax(row)[token], as llama.cpp's log_softmax: float differences, a double sum of
 * expf, so the same logits give the same nll. */
static double ppl_nll(const float *row, int n_vocab, int32_t token)
{
    float max_logit = row[0];
    for (int i = 1; i < n_vocab; i++) max_logit = fmaxf(max_logit, row[i]);
    double sum_exp = 0;
    for (int i = 0; i < n_vocab; i++) sum_exp += expf(row[i] - max_logit);
    return -((double)(row[token] - max_logit) - log(sum_exp));
}

static void ppl_usage(FILE *f)
{
    fprintf(
        f, "usage: pdmesh perplexity [--model M] --file TEXT [--ctx N] [--batch N] [--chunks K]\n"
           "                         [--threads T] [--kv-dtype f16|f32] [--json [--per-token]]\n"
           "                         [--exact | --exact-q8 [--perturb REL]]\n"
           "                         [--kl-divergence-base FILE]\n"
           "       pdmesh perplexity [--model M] --kl-divergence --kl-divergence-base FILE\n"
           "                         [--chunks K] [--batch N] [--threads T] [--exact] [--json]\n"
           "       pdmesh kld BASE OTHER [--chunks K] [--json]\n"
           "\n"
           "Perplexity as llama.cpp's llama-perplexity computes it: chunks of --ctx tokens (512),\n"
           "each from an empty KV cache, BOS first when the model adds BOS, the second half of\n"
           "each chunk scored. --kl-divergence-base FILE alone saves the scored positions'\n"
           "log-probabilities (llama-perplexity's file format); with --kl-divergence (or\n"
           "--kld-base FILE) the text and tokens come from FILE and KL(FILE || this run) is\n"
           "reported. --exact uses the f64 reference forward instead of the engine (slow);\n"
           "--exact-q8 also rounds matrix inputs to 8 bits as the engines do, and --perturb REL\n"
           "multiplies them by 1 + REL*u (u fixed in [-0.5, 0.5)): experiments on where the\n"
           "engines' error comes from (docs/fidelity.md).\n"
           "`pdmesh kld BASE OTHER` reports KL(BASE || OTHER) between two such files.\n"
           "--per-token adds each chunk's tokens and its scored tokens' log-probabilities to\n"
           "the JSON (what a request's prompt log-probabilities are compared with).\n");
}

/* ---- output ------------------------------------------------------------------------------ */

static void ppl_print_kld_summary(const cli_kld_summary_t *s, const char *q_name,
                                  const char *base_name)
{
    printf("\n====== Perplexity statistics (%zu positions) ======\n", s->count);
    printf("Mean PPL(Q)                   : %10.6f ± %10.6f   (Q = %s)\n", s->ppl, s->ppl_err,
           q_name);
    printf("Mean PPL(base)                : %10.6f ± %10.6f   (base = %s)\n", s->ppl_base,
           s->ppl_base_err, base_name);
    printf("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", s->ln_ppl_ratio,
           s->ln_ppl_ratio_err);
    printf("Mean PPL(Q)/PPL(base)         : %10.6f\n", exp(s->ln_ppl_ratio));
    printf("\n====== KL divergence statistics ======\n");
    printf("Mean    KLD: %10.6f ± %10.6f\n", s->kld_mean, s->kld_err);
    printf("Maximum KLD: %10.6f\n", s->kld_max);
    printf("99.9%%   KLD: %10.6f\n", s->kld_p999);
    printf("99.0%%   KLD: %10.6f\n", s->kld_p99);
    printf("90.0%%   KLD: %10.6f\n", s->kld_p90);
    printf("Median  KLD: %10.6f\n", s->kld_median);
    printf("Minimum KLD: %10.6f\n", s->kld_min);
    printf("Same top p: %7.3f ± %5.3f %%\n", 100.0 * s->same_top, 100.0 * s->same_top_err);
}

static cJSON *ppl_kld_json(const cli_kld_summary_t *s, const char *q_name, const char *base_name)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "q", q_name);
    cJSON_AddStringToObject(o, "base", base_name);
    cJSON_AddNumberToObject(o, "positions", (double)s->count);
    cJSON_AddNumberToObject(o, "ppl", s->ppl);
    cJSON_AddNumberToObject(o, "ppl_err", s->ppl_err);
    cJSON_AddNumberToObject(o, "ppl_base", s->ppl_base);
    cJSON_AddNumberToObject(o, "ppl_base_err", s->ppl_base_err);
    cJSON_AddNumberToObject(o, "ppl_ratio", exp(s->ln_ppl_ratio));
    cJSON_AddNumberToObject(o, "ln_ppl_ratio", s->ln_ppl_ratio);
    cJSON_AddNumberToObject(o, "ln_ppl_ratio_err", s->ln_ppl_ratio_err);
    cJSON_AddNumberToObject(o, "kld_mean", s->kld_mean);
    cJSON_AddNumberToObject(o, "kld_err", s->kld_err);
    cJSON_AddNumberToObject(o, "kld_max", s->kld_max);
    cJSON_AddNumberToObject(o, "kld_p999", s->kld_p999);
    cJSON_AddNumberToObject(o, "kld_p99", s->kld_p99);
    cJSON_AddNumberToObject(o, "kld_p90", s->kld_p90);
    cJSON_AddNumberToObject(o, "kld_median", s->kld_median);
    cJSON_AddNumberToObject(o, "kld_min", s->kld_min);
    cJSON_AddNumberToObject(o, "same_top", s->same_top);
    cJSON_AddNumberToObject(o, "same_top_err", s->same_top_err);
    return o;
}

/* One line per chunk of a KL comparison; per-chunk figures go into `chunks` (JSON). */
static void ppl_kld_chunk_line(const cli_kld_stats_t *st, size_t count0, double kld0, size_t same0,
                               double nll0, double nll_base0, int k, int json, cJSON *chunks)
{
    size_t n = st->count - count0;
    double ppl = exp((st->sum_nll - nll0) / (double)n);
    double ppl_base = exp((st->sum_nll_base - nll_base0) / (double)n);
    double kld = (st->sum_kld - kld0) / (double)n;
    double same = (double)(st->n_same_top - same0) / (double)n;
    if (json) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddNumberToObject(c, "ppl", ppl);
        cJSON_AddNumberToObject(c, "ppl_base", ppl_base);
        cJSON_AddNumberToObject(c, "kld_mean", kld);
        cJSON_AddNumberToObject(c, "same_top", same);
        cJSON_AddItemToArray(chunks, c);
        return;
    }
    if (k == 1) printf("chunk      PPL(Q)   PPL(base)    mean KLD   same top\n");
    printf("%5d  %10.4f  %10.4f  %10.6f   %6.2f %%\n", k, ppl, ppl_base, kld, 100.0 * same);
    fflush(stdout);
}

/* ---- pdmesh perplexity ------------------------------------------------------------------- */

/* Perplexity of a text; optionally writes the base file. Returns an exit status. */
static int ppl_run_text(const ppl_opts_t *o, const pdm_model_t *model)
{
    const int n_ctx = (int)(o->n_ctx ? o->n_ctx : 512), first = n_ctx / 2;
    const int n_vocab = (int)model->hp.n_vocab, scored = cli_kld_scored((uint32_t)n_ctx);
    int status = 1;
    char *text = NULL;
    size_t text_len = 0, n_tokens = 0;
    int32_t *tokens = NULL, *chunk = NULL;
    float *logits = NULL;
    cJSON *root = NULL, *per_chunk = NULL;
    cli_kld_file_t base = {0};
    ppl_eval_t ev = {0};

    if (pdm_file_read(o->text_path, PPL__MAX_TEXT, &text, &text_len))
        return cli_runtime_error("cannot read the text");
    if (cli_tokenize_alloc(model->tokenizer, text, text_len, PDM_TOKENIZE_ADD_BOS, &tokens,
                           &n_tokens)) {
        cli_runtime_error("cannot tokenize the text");
        goto out;
    }
    if (n_tokens < 2 * (size_t)n_ctx) {
        fprintf(stderr,
                "%s: %s tokenizes to %zu tokens; perplexity with a context of %d needs "
                "at least %d (llama-perplexity's rule): use a longer text or a smaller "
                "--ctx\n",
                cli_prog, o->text_path, n_tokens, n_ctx, 2 * n_ctx);
        goto out;
    }
    long n_chunk = (long)(n_tokens / (size_t)n_ctx);
    if (o->chunks > 0) n_chunk = PDM_MIN(n_chunk, o->chunks);
    if (n_ctx > (int)model->hp.n_ctx_train)
        fprintf(stderr, "%s: warning: the model was trained on %u tokens of context, --ctx is %d\n",
                cli_prog, model->hp.n_ctx_train, n_ctx);
    chunk = malloc((size_t)n_ctx * sizeof(int32_t));
    logits = malloc((size_t)scored * n_vocab * sizeof(float));
    if (!chunk || !logits) {
        fprintf(stderr, "%s: out of memory for %d x %d logits\n", cli_prog, scored, n_vocab);
        goto out;
    }
    if (ppl_eval_init(&ev, model, o, n_ctx)) {
        cli_runtime_error("cannot set up the evaluation");
        goto out;
    }
    if (o->base_path && cli_kld_file_create(o->base_path, (uint32_t)n_ctx, n_vocab,
                                            (int32_t)n_chunk, tokens, &base)) {
        cli_runtime_error("cannot write the log-probability file");
        goto out;
    }
    if (o->json) {
        root = cJSON_CreateObject();
        per_chunk = cJSON_CreateArray();
    }
    fprintf(stderr, "%s: %zu tokens, %ld chunks of %d (scoring %d per chunk), %s, %ld threads\n",
            cli_prog, n_tokens, n_chunk, n_ctx, scored, ppl_eval_name(&ev), o->threads);

    double nll = 0, nll2 = 0, t0 = pdm_now();
    long count = 0;
    for (int k = 0; k < n_chunk; k++) {
        ppl_chunk_tokens(model->tokenizer, tokens, k, n_ctx, chunk);
        if (ppl_eval_chunk(&ev, chunk, n_ctx, logits)) {
            cli_runtime_error("evaluation failed");
            goto out;
        }
        double chunk_nll = 0;
        cJSON *lps = o->per_token ? cJSON_CreateArray() : NULL;
        for (int i = 0; i < scored; i++) {
            const float *row = logits + (size_t)i * n_vocab;
            double v = ppl_nll(row, n_vocab, chunk[first + 1 + i]);
            if (lps) cJSON_AddItemToArray(lps, cJSON_CreateNumber(-v));
            chunk_nll += v;
            nll2 += v * v;
            if (base.f && cli_kld_file_write(&base, row)) {
                cli_runtime_error("cannot write the log-probability file");
                goto out;
            }
        }
        nll += chunk_nll;
        count += scored;
        if (o->json) {
            cJSON *c = cJSON_CreateObject();
            cJSON_AddNumberToObject(c, "ppl", exp(chunk_nll / scored));
            cJSON_AddNumberToObject(c, "running_ppl", exp(nll / (double)count));
            if (lps) {
                /* the chunk as evaluated (BOS substituted) and log p(tokens[first + 1 + i] |
                 * tokens[0 .. first + i]) for i < scored */
                cJSON_AddItemToObject(c, "tokens", cJSON_CreateIntArray(chunk, n_ctx));
                cJSON_AddNumberToObject(c, "first_scored", first + 1);
                cJSON_AddItemToObject(c, "token_logprobs", lps);
                lps = NULL;
            }
            cJSON_AddItemToArray(per_chunk, c);
        } else {
            printf("[%d]%.4f,", k + 1, exp(nll / (double)count));
            fflush(stdout);
        }
        cJSON_Delete(lps);
        if (k == 0) fprintf(stderr, "%s: %.2f seconds per chunk\n", cli_prog, pdm_now() - t0);
    }
    if (base.f) {
        int rc = cli_kld_file_close(&base);
        if (rc) {
            cli_runtime_error("cannot write the log-probability file");
            goto out;
        }
        fprintf(stderr, "%s: wrote the log-probabilities of %ld positions to %s\n", cli_prog, count,
                o->base_path);
    }

    /* llama-perplexity's final estimate and its error */
    double mean = nll / (double)count, var = nll2 / (double)count - mean * mean;
    double ppl = exp(mean), err = var > 0 ? ppl * sqrt(var / (double)(count - 1)) : 0.0;
    if (o->json) {
        cJSON_AddNumberToObject(root, "ppl", ppl);
        cJSON_AddNumberToObject(root, "ppl_err", err);
        cJSON_AddNumberToObject(root, "chunks", (double)n_chunk);
        cJSON_AddNumberToObject(root, "tokens", (double)n_tokens);
        cJSON_AddNumberToObject(root, "scored", (double)count);
        cJSON_AddNumberToObject(root, "n_ctx", n_ctx);
        cJSON_AddBoolToObject(root, "bos", pdm_tokenizer_add_bos(model->tokenizer));
        cJSON_AddStringToObject(root, "forward", ppl_eval_name(&ev));
        cJSON_AddNumberToObject(root, "threads", (double)o->threads);
        cJSON_AddNumberToObject(root, "seconds", pdm_now() - t0);
        cJSON_AddItemToObject(root, "per_chunk", per_chunk);
        per_chunk = NULL;
        cli_print_json_line(root);
        root = NULL;
    } else {
        printf("\nFinal estimate: PPL = %.4f +/- %.5f\n", ppl, err);
    }
    if (var <= 0) fprintf(stderr, "%s: unexpected non-positive variance of log(prob)\n", cli_prog);
    status = 0;

out:
    if (base.f) {
        cli_kld_file_close(&base);
        if (status) remove(o->base_path); /* an incomplete file must not pass for a base */
    }
    cJSON_Delete(per_chunk);
    cJSON_Delete(root);
    ppl_eval_fini(&ev);
    free(logits);
    free(chunk);
    free(tokens);
    free(text);
    return status;
}

/* KL(base || this run) over the base file's tokens. Returns an exit status. */
static int ppl_run_kld(const ppl_opts_t *o, const pdm_model_t *model)
{
    const int n_vocab = (int)model->hp.n_vocab;
    int status = 1;
    cli_kld_file_t base = {0};
    ppl_eval_t ev = {0};
    cli_kld_stats_t st = {0};
    int32_t *chunk = NULL;
    float *logits = NULL, *logp = NULL, *logp_base = NULL;
    cJSON *per_chunk = NULL;

    if (cli_kld_file_open(o->base_path, &base)) return cli_runtime_error("cannot read the base");
    const int n_ctx = (int)base.n_ctx, first = n_ctx / 2, scored = cli_kld_scored(base.n_ctx);
    if (o->n_ctx && o->n_ctx != n_ctx) {
        fprintf(stderr, "%s: %s was computed with --ctx %d, not %ld\n", cli_prog, o->base_path,
                n_ctx, o->n_ctx);
        goto out;
    }
    if (base.n_vocab != n_vocab) {
        fprintf(stderr, "%s: %s has a vocabulary of %d tokens, the model %d: not the same model\n",
                cli_prog, o->base_path, base.n_vocab, n_vocab);
        goto out;
    }
    long n_chunk = base.n_chunk;
    if (o->chunks > 0) n_chunk = PDM_MIN(n_chunk, o->chunks);
    chunk = malloc((size_t)n_ctx * sizeof(int32_t));
    logits = malloc((size_t)scored * n_vocab * sizeof(float));
    logp = malloc((size_t)n_vocab * sizeof(float));
    logp_base = malloc((size_t)n_vocab * sizeof(float));
    if (!chunk || !logits || !logp || !logp_base) {
        fprintf(stderr, "%s: out of memory for %d x %d logits\n", cli_prog, scored, n_vocab);
        goto out;
    }
    if (ppl_eval_init(&ev, model, o, n_ctx)) {
        cli_runtime_error("cannot set up the evaluation");
        goto out;
    }
    fprintf(stderr, "%s: KL divergence against %s: %ld chunks of %d, %s, %ld threads\n", cli_prog,
            o->base_path, n_chunk, n_ctx, ppl_eval_name(&ev), o->threads);
    if (o->json) per_chunk = cJSON_CreateArray();
    for (int k = 0; k < n_chunk; k++) {
        ppl_chunk_tokens(model->tokenizer, base.tokens, k, n_ctx, chunk);
        if (ppl_eval_chunk(&ev, chunk, n_ctx, logits)) {
            cli_runtime_error("evaluation failed");
            goto out;
        }
        size_t count0 = st.count, same0 = st.n_same_top;
        double kld0 = st.sum_kld, nll0 = st.sum_nll, nllb0 = st.sum_nll_base;
        for (int i = 0; i < scored; i++) {
            if (cli_kld_file_read(&base, logp_base)) {
                cli_runtime_error("cannot read the base");
                goto out;
            }
            int top_base = 0;
            for (int j = 1; j < n_vocab; j++)
                if (logp_base[j] > logp_base[top_base]) top_base = j;
            int top = cli_log_softmax(logits + (size_t)i * n_vocab, n_vocab, logp);
            if (cli_kld_stats_add(&st, logp_base, top_base, logp, top, n_vocab,
                                  chunk[first + 1 + i])) {
                cli_runtime_error("KL statistics");
                goto out;
            }
        }
        ppl_kld_chunk_line(&st, count0, kld0, same0, nll0, nllb0, k + 1, o->json, per_chunk);
    }
    cli_kld_summary_t sum;
    cli_kld_stats_summary(&st, &sum);
    const char *q_name = o->exact ? ppl_eval_name(&ev) : "pdmesh";
    if (o->json) {
        cJSON *root = ppl_kld_json(&sum, q_name, o->base_path);
        cJSON_AddNumberToObject(root, "chunks", (double)n_chunk);
        cJSON_AddNumberToObject(root, "n_ctx", n_ctx);
        cJSON_AddStringToObject(root, "forward", ppl_eval_name(&ev));
        cJSON_AddItemToObject(root, "per_chunk", per_chunk);
        per_chunk = NULL;
        cli_print_json_line(root);
    } else {
        ppl_print_kld_summary(&sum, q_name, o->base_path);
    }
    status = 0;

out:
    cJSON_Delete(per_chunk);
    cli_kld_stats_free(&st);
    ppl_eval_fini(&ev);
    free(logp_base);
    free(logp);
    free(logits);
    free(chunk);
    cli_kld_file_close(&base);
    return status;
}

int cmd_perplexity(int argc, char **argv)
{
    ppl_opts_t o = {.model_path = pdm_model_default_path(), .chunks = -1, .kv_dtype = PDM_DT_F16};
    pdm_model_ref_params_default(&o.ref);
    enum { O_CTX = 256, O_BATCH, O_CHUNKS, O_BASE, O_KLD, O_EXACT, O_KV, O_EXACT_Q8, O_PERTURB,
           O_PER_TOKEN };
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"file", required_argument, 0, 'f'},
                                         {"ctx", required_argument, 0, O_CTX},
                                         {"batch", required_argument, 0, O_BATCH},
                                         {"chunks", required_argument, 0, O_CHUNKS},
                                         {"threads", required_argument, 0, 't'},
                                         {"json", no_argument, 0, 'j'},
                                         {"per-token", no_argument, 0, O_PER_TOKEN},
                                         {"exact", no_argument, 0, O_EXACT},
                                         {"exact-q8", no_argument, 0, O_EXACT_Q8},
                                         {"perturb", required_argument, 0, O_PERTURB},
                                         {"kl-divergence-base", required_argument, 0, O_BASE},
                                         {"kl-divergence", no_argument, 0, O_KLD},
                                         {"kld-base", required_argument, 0, 'K'},
                                         {"kv-dtype", required_argument, 0, O_KV},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:f:t:jh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': o.model_path = optarg; break;
        case 'f': o.text_path = optarg; break;
        case 'j': o.json = 1; break;
        case O_PER_TOKEN: o.per_token = o.json = 1; break;
        case O_EXACT: o.exact = 1; break;
        case O_EXACT_Q8:
            o.exact = 1;
            o.ref.act_q8 = 1;
            break;
        case O_PERTURB:
            if (pdm_parse_double(optarg, -0.5, 0.5, &o.ref.perturb))
                return cli_usage_error("invalid --perturb '%s' (-0.5..0.5)", optarg);
            break;
        case O_BASE: o.base_path = optarg; break;
        case 'K':
            o.base_path = optarg;
            o.kl_divergence = 1;
            break;
        case O_KLD: o.kl_divergence = 1; break;
        case O_CTX:
            if (pdm_parse_long(optarg, 8, 1 << 20, &o.n_ctx))
                return cli_usage_error("invalid --ctx '%s' (8..1048576)", optarg);
            break;
        case O_BATCH:
            if (pdm_parse_long(optarg, 1, 65536, &o.batch))
                return cli_usage_error("invalid --batch '%s' (1..65536)", optarg);
            break;
        case O_CHUNKS:
            if (pdm_parse_long(optarg, 1, 1 << 20, &o.chunks))
                return cli_usage_error("invalid --chunks '%s' (1..1048576)", optarg);
            break;
        case 't':
            if (pdm_parse_long(optarg, 1, 256, &o.threads))
                return cli_usage_error("invalid --threads '%s' (1..256)", optarg);
            break;
        case O_KV:
            if (pdm_kv_dtype_parse(optarg, &o.kv_dtype) || o.kv_dtype == PDM_DT_I8)
                return cli_usage_error("invalid --kv-dtype '%s' (f16 or f32)", optarg);
            break;
        case 'h': ppl_usage(stdout); return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (optind < argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (o.kl_divergence && !o.base_path)
        return cli_usage_error("%s", "--kl-divergence needs --kl-divergence-base FILE");
    if (!o.kl_divergence && !o.text_path)
        return cli_usage_error("%s",
                               "perplexity needs --file TEXT (or --kl-divergence with a base)");
    if (o.kl_divergence && o.text_path)
        return cli_usage_error("%s", "--kl-divergence takes its tokens from the base file, not "
                                     "--file");
    if (o.ref.perturb != 0 && !o.exact)
        return cli_usage_error("%s", "--perturb applies to --exact or --exact-q8 only");
    if (o.threads == 0) o.threads = PDM_MAX(1, sysconf(_SC_NPROCESSORS_ONLN));

    pdm_model_t *model;
    if (cli_load_model(o.model_path, &model)) return 1;
    int status = o.kl_divergence ? ppl_run_kld(&o, model) : ppl_run_text(&o, model);
    pdm_model_free(model);
    return status;
}

/* ---- pdmesh kld A B ---------------------------------------------------------------------- */

int cmd_kld(int argc, char **argv)
{
    long chunks = -1;
    int json = 0;
    static const struct option opts[] = {{"chunks", required_argument, 0, 'c'},
                                         {"json", no_argument, 0, 'j'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "c:jh", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (pdm_parse_long(optarg, 1, 1 << 20, &chunks))
                return cli_usage_error("invalid --chunks '%s'", optarg);
            break;
        case 'j': json = 1; break;
        case 'h': ppl_usage(stdout); return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (argc - optind != 2)
        return cli_usage_error("%s", "kld needs two log-probability files: BASE OTHER");
    const char *path_a = argv[optind], *path_b = argv[optind + 1];
    cli_kld_file_t a = {0}, b = {0};
    cli_kld_stats_t st = {0};
    float *lp_a = NULL, *lp_b = NULL;
    cJSON *per_chunk = NULL;
    int status = 1;
    if (cli_kld_file_open(path_a, &a) || cli_kld_file_open(path_b, &b)) {
        cli_runtime_error("cannot read a log-probability file");
        goto out;
    }
    if (a.n_ctx != b.n_ctx || a.n_vocab != b.n_vocab) {
        fprintf(stderr,
                "%s: %s (n_ctx %u, vocabulary %d) and %s (n_ctx %u, vocabulary %d) do "
                "not describe the same evaluation\n",
                cli_prog, path_a, a.n_ctx, a.n_vocab, path_b, b.n_ctx, b.n_vocab);
        goto out;
    }
    long n_chunk = PDM_MIN(a.n_chunk, b.n_chunk);
    if (chunks > 0) n_chunk = PDM_MIN(n_chunk, chunks);
    const int n_ctx = (int)a.n_ctx, first = n_ctx / 2, n_vocab = a.n_vocab;
    for (size_t i = 0; i < (size_t)n_chunk * a.n_ctx; i++)
        if (a.tokens[i] != b.tokens[i]) {
            fprintf(stderr,
                    "%s: %s and %s hold different tokens (first at %zu: %d vs %d): not "
                    "the same text or tokenization\n",
                    cli_prog, path_a, path_b, i, a.tokens[i], b.tokens[i]);
            goto out;
        }
    lp_a = malloc((size_t)n_vocab * sizeof(float));
    lp_b = malloc((size_t)n_vocab * sizeof(float));
    if (!lp_a || !lp_b) {
        fprintf(stderr, "%s: out of memory\n", cli_prog);
        goto out;
    }
    if (json) per_chunk = cJSON_CreateArray();
    for (int k = 0; k < n_chunk; k++) {
        size_t count0 = st.count, same0 = st.n_same_top;
        double kld0 = st.sum_kld, nll0 = st.sum_nll, nllb0 = st.sum_nll_base;
        for (int i = 0; i < cli_kld_scored(a.n_ctx); i++) {
            if (cli_kld_file_read(&a, lp_a) || cli_kld_file_read(&b, lp_b)) {
                cli_runtime_error("cannot read a log-probability file");
                goto out;
            }
            int top_a = 0, top_b = 0;
            for (int j = 1; j < n_vocab; j++) {
                if (lp_a[j] > lp_a[top_a]) top_a = j;
                if (lp_b[j] > lp_b[top_b]) top_b = j;
            }
            if (cli_kld_stats_add(&st, lp_a, top_a, lp_b, top_b, n_vocab,
                                  a.tokens[(size_t)k * n_ctx + first + 1 + i])) {
                cli_runtime_error("KL statistics");
                goto out;
            }
        }
        ppl_kld_chunk_line(&st, count0, kld0, same0, nll0, nllb0, k + 1, json, per_chunk);
    }
    cli_kld_summary_t sum;
    cli_kld_stats_summary(&st, &sum);
    if (json) {
        cJSON *root = ppl_kld_json(&sum, path_b, path_a);
        cJSON_AddNumberToObject(root, "chunks", (double)n_chunk);
        cJSON_AddNumberToObject(root, "n_ctx", n_ctx);
        cJSON_AddItemToObject(root, "per_chunk", per_chunk);
        per_chunk = NULL;
        cli_print_json_line(root);
    } else {
        ppl_print_kld_summary(&sum, path_b, path_a);
    }
    status = 0;

out:
    cJSON_Delete(per_chunk);
    cli_kld_stats_free(&st);
    free(lp_a);
    free(lp_b);
    cli_kld_file_close(&a);
    cli_kld_file_close(&b);
    return status;
}
