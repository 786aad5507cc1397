/*
 * kldbase.h - log-probability files and KL-divergence statistics for `pdmesh perplexity` and
 * `pdmesh kld` (internal to cli/).
 *
 * The file is llama.cpp's own `llama-perplexity --kl-divergence-base` format (llama.cpp
 * tools/perplexity/perplexity.cpp: perplexity() writes it, kl_divergence() reads it), byte
 * for byte, so llama-perplexity, tests/golden/make_kld_base.py and pdmesh all read each
 * other's files:
 *
 *     char     magic[8] = "_logits_"
 *     uint32   n_ctx                       tokens per chunk
 *     int32    n_vocab
 *     int32    n_chunk
 *     int32    tokens[n_chunk * n_ctx]     the text's tokens (with the leading BOS of the
 *                                          whole text if the model adds one; the per-chunk
 *                                          BOS substitution is not stored)
 *     then, chunk after chunk, one record per scored position n_ctx/2 .. n_ctx-2 (the logits
 *     there predict tokens n_ctx/2 + 1 .. n_ctx - 1 of the chunk):
 *     uint16   rec[nv], nv = 2 * ((n_vocab + 1) / 2) + 4
 *              rec[0..1] = f32 scale, rec[2..3] = f32 min_log_prob (little-endian floats),
 *              rec[4 + j] = round((logit_j - min_logit) / scale) if logit_j > min_logit, else 0
 *              with max_logit the largest logit, min_logit = max(smallest logit,
 *              max_logit - 16), scale = (max_logit - min_logit) / 65535
 *     log p_j = scale * rec[4 + j] + min_log_prob
 *
 * So log-probabilities within 16 nats of the top are kept to 16 / 65535 = 2.4e-4 nats and
 * the rest are clamped (KL sums skip them, as llama.cpp does). A record is 98 KB for a
 * 49152-token vocabulary: 8 chunks of 512 make a 200 MB file, written under build/ and
 * never committed.
 */
#ifndef PDM_CLI_KLDBASE_H
#define PDM_CLI_KLDBASE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Log-probabilities below the top by more than this are clamped in the file and left out of
 * the KL sum (llama.cpp's constant). */
#define CLI_KLD_LOGP_FLOOR 16.0f

typedef struct {
    FILE *f;
    const char *path;
    int writing;
    uint32_t n_ctx;
    int32_t n_vocab;
    int32_t n_chunk;
    int32_t *tokens; /* [n_chunk * n_ctx] */
    size_t nv;       /* uint16 per record */
    uint16_t *rec;   /* [nv] one record */
} cli_kld_file_t;

/* Scored positions per chunk: n_ctx/2 .. n_ctx-2. */
static inline int cli_kld_scored(uint32_t n_ctx) { return (int)n_ctx - 1 - (int)(n_ctx / 2); }

/* Opens a base file for reading: header and tokens (records are read in order with
 * cli_kld_file_read). PDM_EIO / PDM_FORMAT naming the file; *out is set up only on success. */
int cli_kld_file_open(const char *path, cli_kld_file_t *out);
/* Creates a base file and writes its header and tokens[n_chunk * n_ctx] (copied). */
int cli_kld_file_create(const char *path, uint32_t n_ctx, int32_t n_vocab, int32_t n_chunk,
                        const int32_t *tokens, cli_kld_file_t *out);
/* Appends the record of one position from its raw logits[n_vocab] (encoded as llama.cpp's
 * log_softmax(..., uint16_t *) does, float for float). */
int cli_kld_file_write(cli_kld_file_t *kf, const float *logits);
/* Reads the next record into logp[n_vocab] (decoded log-probabilities). PDM_FORMAT if the file
 * ends early. */
int cli_kld_file_read(cli_kld_file_t *kf, float *logp);
/* Closes the file; for a written file returns PDM_EIO if flushing failed (then the file is
 * incomplete). Accepts a zeroed struct. */
int cli_kld_file_close(cli_kld_file_t *kf);

/* Log-softmax of logits[n] into logp[n] (double sums) and the index of the first maximum. */
int cli_log_softmax(const float *logits, int n, float *logp);

/* ---- Statistics of a model Q against a base P, position by position --------------------- */

typedef struct {
    double sum_nll, sum_nll2;           /* -log q(token) */
    double sum_nll_base, sum_nll_base2; /* -log p(token) */
    double sum_nll_nll_base;
    double sum_kld, sum_kld2; /* KL(P || Q) per position */
    size_t n_same_top;        /* argmax q == argmax p */
    size_t count;
    float *kld_values; /* [count] every position's KL, for percentiles */
    size_t cap;
} cli_kld_stats_t;

/* Adds one position: base (P) and model (Q) log-probabilities over the vocabulary, the index
 * of each one's first maximum, and the token that came next. KL(P || Q) sums
 * p_j (log p_j - log q_j) over j with log p_j > -CLI_KLD_LOGP_FLOOR (llama.cpp's rule).
 * PDM_ENOMEM only. */
int cli_kld_stats_add(cli_kld_stats_t *s, const float *logp_base, int top_base, const float *logp,
                      int top, int n_vocab, int32_t token);
void cli_kld_stats_free(cli_kld_stats_t *s);

typedef struct {
    size_t count;
    double ppl, ppl_err;           /* model (Q) */
    double ppl_base, ppl_base_err; /* base (P) */
    double ln_ppl_ratio, ln_ppl_ratio_err;
    double kld_mean, kld_err;
    double kld_max, kld_p999, kld_p99, kld_p90, kld_median, kld_min;
    double same_top, same_top_err; /* fractions */
} cli_kld_summary_t;

/* Means, uncertainties (llama.cpp's formulas) and percentiles of the positions so far (sorts
 * kld_values). */
void cli_kld_stats_summary(cli_kld_stats_t *s, cli_kld_summary_t *out);

#endif /* PDM_CLI_KLDBASE_H */
