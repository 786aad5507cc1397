/*
 * kldbase.c - llama-perplexity's log-probability file and KL-divergence statistics
 * (cli/kldbase.h). The encoding and the statistics follow llama.cpp's
 * tools/perplexity/perplexity.cpp (log_softmax with a uint16 output, kl_divergence(),
 * mean_and_uncertainty, percentile); the code is pdmesh's own.
 */
#include "cli/kldbase.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

static const char cli_kld_magic[8] = {'_', 'l', 'o', 'g', 'i', 't', 's', '_'};

/* Largest accepted header values: a 16M-token context or a 4M-token vocabulary is not a file
 * this tool wrote. */
#define CLI_KLD_MAX_CTX (1u << 24)
#define CLI_KLD_MAX_VOCAB (1 << 22)

static size_t cli_kld_nv(int32_t n_vocab) { return 2 * (((size_t)n_vocab + 1) / 2) + 4; }

static int cli_kld_alloc(cli_kld_file_t *kf)
{
    size_t n_tok = (size_t)kf->n_chunk * kf->n_ctx;
    kf->nv = cli_kld_nv(kf->n_vocab);
    kf->tokens = malloc((n_tok ? n_tok : 1) * sizeof(int32_t));
    kf->rec = malloc(kf->nv * sizeof(uint16_t));
    if (!kf->tokens || !kf->rec) {
        free(kf->tokens);
        free(kf->rec);
        return pdm_error_set(PDM_ENOMEM, "out of memory for %s", kf->path);
    }
    return PDM_OK;
}

int cli_kld_file_open(const char *path, cli_kld_file_t *out)
{
    cli_kld_file_t kf = {.path = path};
    char magic[8];
    int status;
    if (!(kf.f = fopen(path, "rb")))
        return pdm_error_set(PDM_EIO, "cannot open %s: %s", path, strerror(errno));
    if (fread(magic, 1, 8, kf.f) != 8 || memcmp(magic, cli_kld_magic, 8)) {
        status = pdm_error_set(PDM_EFORMAT,
                               "%s is not a log-probability file (no _logits_ "
                               "magic; write one with --kl-divergence-base)",
                               path);
        goto err_close;
    }
    if (fread(&kf.n_ctx, sizeof(kf.n_ctx), 1, kf.f) != 1 ||
        fread(&kf.n_vocab, sizeof(kf.n_vocab), 1, kf.f) != 1 ||
        fread(&kf.n_chunk, sizeof(kf.n_chunk), 1, kf.f) != 1) {
        status = pdm_error_set(PDM_EFORMAT, "%s: truncated header", path);
        goto err_close;
    }
    if (kf.n_ctx < 4 || kf.n_ctx > CLI_KLD_MAX_CTX || kf.n_vocab < 1 ||
        kf.n_vocab > CLI_KLD_MAX_VOCAB || kf.n_chunk < 1 || kf.n_chunk > (1 << 20)) {
        status = pdm_error_set(PDM_EFORMAT,
                               "%s: implausible header (n_ctx %u, n_vocab %d, "
                               "%d chunks)",
                               path, kf.n_ctx, kf.n_vocab, kf.n_chunk);
        goto err_close;
    }
    if ((status = cli_kld_alloc(&kf))) goto err_close;
    size_t n_tok = (size_t)kf.n_chunk * kf.n_ctx;
    if (fread(kf.tokens, sizeof(int32_t), n_tok, kf.f) != n_tok) {
        status = pdm_error_set(PDM_EFORMAT, "%s: truncated token list (%zu tokens expected)", path,
                               n_tok);
        goto err_free;
    }
    for (size_t i = 0; i < n_tok; i++)
        if (kf.tokens[i] < 0 || kf.tokens[i] >= kf.n_vocab) {
            status = pdm_error_set(PDM_EFORMAT, "%s: token %zu is %d, outside the vocabulary", path,
                                   i, kf.tokens[i]);
            goto err_free;
        }
    *out = kf;
    return PDM_OK;

err_free:
    free(kf.tokens);
    free(kf.rec);
err_close:
    fclose(kf.f);
    return status;
}

int cli_kld_file_create(const char *path, uint32_t n_ctx, int32_t n_vocab, int32_t n_chunk,
                        const int32_t *tokens, cli_kld_file_t *out)
{
    cli_kld_file_t kf = {.path = path,
                         .writing = 1,
                         .n_ctx = n_ctx,
                         .n_vocab = n_vocab,
                         .n_chunk = n_chunk};
    int status;
    if ((status = cli_kld_alloc(&kf))) return status;
    size_t n_tok = (size_t)n_chunk * n_ctx;
    memcpy(kf.tokens, tokens, n_tok * sizeof(int32_t));
    if (!(kf.f = fopen(path, "wb"))) {
        status = pdm_error_set(PDM_EIO, "cannot create %s: %s", path, strerror(errno));
        goto err_free;
    }
    if (fwrite(cli_kld_magic, 1, 8, kf.f) != 8 || fwrite(&n_ctx, sizeof(n_ctx), 1, kf.f) != 1 ||
        fwrite(&n_vocab, sizeof(n_vocab), 1, kf.f) != 1 ||
        fwrite(&n_chunk, sizeof(n_chunk), 1, kf.f) != 1 ||
        fwrite(kf.tokens, sizeof(int32_t), n_tok, kf.f) != n_tok) {
        status = pdm_error_set(PDM_EIO, "cannot write %s: %s", path, strerror(errno));
        fclose(kf.f);
        goto err_free;
    }
    *out = kf;
    return PDM_OK;

err_free:
    free(kf.tokens);
    free(kf.rec);
    return status;
}

int cli_kld_file_write(cli_kld_file_t *kf, const float *logits)
{
    const int n = kf->n_vocab;
    float max_logit = logits[0], min_logit = logits[0];
    for (int i = 1; i < n; i++) {
        max_logit = fmaxf(max_logit, logits[i]);
        min_logit = fminf(min_logit, logits[i]);
    }
    min_logit = fmaxf(min_logit, max_logit - CLI_KLD_LOGP_FLOOR);
    double sum_exp = 0;
    for (int i = 0; i < n; i++) sum_exp += expf(logits[i] - max_logit);
    const float log_sum_exp = (float)log(sum_exp);
    const float min_log_prob = min_logit - max_logit - log_sum_exp;
    const float scale = (max_logit - min_logit) / 65535.f;
    memcpy(kf->rec, &scale, sizeof(float));
    memcpy(kf->rec + 2, &min_log_prob, sizeof(float));
    uint16_t *q = kf->rec + 4;
    memset(q, 0, (kf->nv - 4) * sizeof(uint16_t));
    if (scale > 0) {
        const float inv_scale = 1 / scale;
        for (int i = 0; i < n; i++) {
            /* round to nearest even, as llama.cpp's nearest_int; the top is 65535 up to a last
             * bit of rounding, which the clamp absorbs */
            long v = logits[i] > min_logit ? lrintf(inv_scale * (logits[i] - min_logit)) : 0;
            q[i] = (uint16_t)PDM_MIN(v, 65535L);
        }
    }
    if (fwrite(kf->rec, sizeof(uint16_t), kf->nv, kf->f) != kf->nv)
        return pdm_error_set(PDM_EIO, "cannot write %s: %s", kf->path, strerror(errno));
    return PDM_OK;
}

int cli_kld_file_read(cli_kld_file_t *kf, float *logp)
{
    if (fread(kf->rec, sizeof(uint16_t), kf->nv, kf->f) != kf->nv)
        return pdm_error_set(PDM_EFORMAT, "%s ends before its last record (%s)", kf->path,
                             ferror(kf->f) ? strerror(errno) : "truncated");
    float scale, min_log_prob;
    memcpy(&scale, kf->rec, sizeof(float));
    memcpy(&min_log_prob, kf->rec + 2, sizeof(float));
    if (!isfinite(scale) || !isfinite(min_log_prob) || scale < 0)
        return pdm_error_set(PDM_EFORMAT, "%s: a record has scale %g, min log-prob %g", kf->path,
                             scale, min_log_prob);
    const uint16_t *q = kf->rec + 4;
    for (int i = 0; i < kf->n_vocab; i++) logp[i] = scale * q[i] + min_log_prob;
    return PDM_OK;
}

int cli_kld_file_close(cli_kld_file_t *kf)
{
    int status = PDM_OK;
    if (kf->f) {
        int failed = kf->writing && (ferror(kf->f) || fflush(kf->f) != 0);
        if (fclose(kf->f) != 0) failed = kf->writing;
        if (failed) status = pdm_error_set(PDM_EIO, "cannot finish writing %s", kf->path);
    }
    free(kf->tokens);
    free(kf->rec);
    memset(kf, 0, sizeof(*kf));
    return status;
}

int cli_log_softmax(const float *logits, int n, float *logp)
{
    int top = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[top]) top = i;
    const double max_logit = logits[top];
    double sum_exp = 0;
    for (int i = 0; i < n; i++) sum_exp += exp((double)logits[i] - max_logit);
    const double lse = max_logit + log(sum_exp);
    for (int i = 0; i < n; i++) logp[i] = (float)((double)logits[i] - lse);
    return top;
}

/* ---- Statistics ------------------------------------------------------------------------ */

int cli_kld_stats_add(cli_kld_stats_t *s, const float *logp_base, int top_base, const float *logp,
                      int top, int n_vocab, int32_t token)
{
    if (s->count == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 1024;
        float *v = realloc(s->kld_values, cap * sizeof(float));
        if (!v) return pdm_error_set(PDM_ENOMEM, "out of memory for KL statistics");
        s->kld_values = v;
        s->cap = cap;
    }
    double kld = 0;
    for (int i = 0; i < n_vocab; i++)
        if (logp_base[i] > -CLI_KLD_LOGP_FLOOR)
            kld += exp((double)logp_base[i]) * ((double)logp_base[i] - (double)logp[i]);
    const double nll = -(double)logp[token], nll_base = -(double)logp_base[token];
    s->sum_nll += nll;
    s->sum_nll2 += nll * nll;
    s->sum_nll_base += nll_base;
    s->sum_nll_base2 += nll_base * nll_base;
    s->sum_nll_nll_base += nll * nll_base;
    s->sum_kld += kld;
    s->sum_kld2 += kld * kld;
    s->n_same_top += top == top_base;
    s->kld_values[s->count++] = (float)kld;
    return PDM_OK;
}

void cli_kld_stats_free(cli_kld_stats_t *s)
{
    if (!s) return;
    free(s->kld_values);
    memset(s, 0, sizeof(*s));
}

/* llama.cpp's mean_and_uncertainty: the mean and the standard error of the mean. */
static void cli_kld_mean_err(double sum, double sum2, size_t count, double *mean, double *err)
{
    *mean = *err = 0;
    if (count < 1) return;
    double f = sum / (double)count, df = sum2 / (double)count - f * f;
    *mean = f;
    *err = df > 0 && count > 10 ? sqrt(df / (double)(count - 1)) : 0.0;
}

static int cli_kld_cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* llama.cpp's percentile: linear interpolation between the two nearest sorted values. */
static double cli_kld_percentile(const float *v, size_t n, double fraction)
{
    if (fraction <= 0) return v[0];
    if (fraction >= 1) return v[n - 1];
    double p = fraction * (double)(n - 1);
    size_t ip = (size_t)p;
    p -= (double)ip;
    return (1 - p) * v[ip] + p * v[PDM_MIN(ip + 1, n - 1)];
}

void cli_kld_stats_summary(cli_kld_stats_t *s, cli_kld_summary_t *out)
{
    memset(out, 0, sizeof(*out));
    out->count = s->count;
    if (s->count == 0) return;
    double ln_ppl, ln_ppl_err, ln_base, ln_base_err;
    cli_kld_mean_err(s->sum_nll, s->sum_nll2, s->count, &ln_ppl, &ln_ppl_err);
    cli_kld_mean_err(s->sum_nll_base, s->sum_nll_base2, s->count, &ln_base, &ln_base_err);
    out->ppl = exp(ln_ppl);
    out->ppl_err = out->ppl * ln_ppl_err;
    out->ppl_base = exp(ln_base);
    out->ppl_base_err = out->ppl_base * ln_base_err;
    double cov = 0;
    if (s->count >= 10)
        cov = (s->sum_nll_nll_base / (double)s->count -
               (s->sum_nll / (double)s->count) * (s->sum_nll_base / (double)s->count)) /
              (double)(s->count - 1);
    out->ln_ppl_ratio = ln_ppl - ln_base;
    double var = ln_ppl_err * ln_ppl_err + ln_base_err * ln_base_err - 2.0 * cov;
    out->ln_ppl_ratio_err = var > 0 ? sqrt(var) : 0.0;
    cli_kld_mean_err(s->sum_kld, s->sum_kld2, s->count, &out->kld_mean, &out->kld_err);
    qsort(s->kld_values, s->count, sizeof(float), cli_kld_cmp_float);
    const float *v = s->kld_values;
    const size_t n = s->count;
    out->kld_max = v[n - 1];
    out->kld_min = v[0];
    out->kld_p999 = cli_kld_percentile(v, n, 0.999);
    out->kld_p99 = cli_kld_percentile(v, n, 0.99);
    out->kld_p90 = cli_kld_percentile(v, n, 0.90);
    out->kld_median = n % 2 ? v[n / 2] : 0.5 * ((double)v[n / 2] + v[n / 2 - 1]);
    out->same_top = (double)s->n_same_top / (double)n;
    out->same_top_err = n > 1 ? sqrt(out->same_top * (1 - out->same_top) / (double)(n - 1)) : 0;
}
