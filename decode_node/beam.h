/*
 * beam.h - beam search on the decode node over a segmented KV cache (included by decode.h).
 *
 * Segment KV cache (Wu et al., "Efficient LLM inference solution on Intel GPU", §3.2-3.3):
 * the prompt's KV is stored once per sequence, exactly as it arrived from the prefill ranks,
 * and shared by every beam; the response KV lives in segments of PDM_BEAM_STEP decode steps,
 * each shaped [PDM_BEAM_STEP][width][head_dim] per (layer, kv head) ("sequence first", the
 * paper's [N_step, BS x BW, H, D] with BS = 1 and one head per array). A beam-indirection
 * table gives, for every beam and response step, the row of that step's segment holding the
 * beam's KV; reordering beams rewrites the table (integers), never KV, and the attention reads
 * the response KV through the table (pdm_kern_ops_t.attention_rows).
 *
 * Memory, eq. (1)-(3) of the paper with BS = 1:
 *   cache_token    = 2 * L * H_kv * D * sizeof(dtype)                                    (1)
 *   cache_standard = BW * (N_prompt + N_response) * cache_token                           (2)
 *   cache_segment  = (N_prompt + BW * ceil(N_response / step) * step) * cache_token       (3)
 * pdm_beam_kv_t allocates exactly (3): the prompt once, and one segment of step = 16 response
 * tokens for all beams at a time. Unlike the paper, which reallocates a larger response buffer
 * every 16 steps and copies the old one into it, segments are chained: growing never copies.
 *
 * Beam search (the rule users of HF transformers / vLLM expect, stated exactly):
 *   - A hypothesis is a list of generated tokens y_1..y_n (the first generated token included);
 *     logprob = sum of log softmax(logits)[y_i] over its tokens (raw logits: temperature,
 *     top-k/p and penalties do not apply), score = logprob / n^length_penalty.
 *   - Step: every live beam b proposes its tokens; a candidate (b, y) has logprob_b + log p(y).
 *     Candidates are ranked by that sum (ties: lower beam, then lower token id). Walking the
 *     ranking, an end-of-generation candidate of rank < width becomes a finished hypothesis
 *     (EOS token included in its tokens, length and logprob); other candidates become the next
 *     live beams until `width` of them are found. All live beams always have the same length.
 *   - Finished hypotheses are kept in an n-best heap of `width` entries ordered by score (a
 *     new one replaces the worst when the heap is full and it scores higher).
 *   - When the live beams reach max_new tokens they all join the heap and the search ends.
 *   - Early stopping, checked after each step once the heap holds `width` hypotheses, with
 *     best = the highest live logprob and n = the live beams' length:
 *       early:     stop at once;
 *       heuristic: stop when worst kept score >= best / n^length_penalty (HF's default,
 *                  early_stopping=False);
 *       never:     stop when worst kept score >= best / m^length_penalty with m = max_new if
 *                  length_penalty > 0 else n: no live beam can still beat the heap (exact).
 *   - The result is the n_best highest-scoring hypotheses of the heap, best first.
 *   - The first generated token is chosen by the search too: the decode node recomputes the
 *     last prompt token (its KV is already there; only its logits are needed), so beam search
 *     needs that token's id. Width 1 is greedy decoding.
 */
#ifndef PDM_DECODE_BEAM_H
#define PDM_DECODE_BEAM_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#define PDM_BEAM_MAX_WIDTH 8
#define PDM_BEAM_STEP 16 /* response tokens per segment (the paper's step) */

typedef enum {
    PDM_BEAM_STOP_HEURISTIC = 0,
    PDM_BEAM_STOP_EARLY,
    PDM_BEAM_STOP_NEVER
} pdm_beam_stop_t;

typedef struct {
    int width;              /* beams, 1..PDM_BEAM_MAX_WIDTH; 0: no beam search (sampling) */
    float length_penalty;   /* exponent of the length in the score; default 1 */
    int n_best;             /* hypotheses returned, 1..width; default 1 */
    pdm_beam_stop_t early_stopping;
} pdm_beam_params_t;

void pdm_beam_params_default(pdm_beam_params_t *p);
/* PDM_EINVAL naming the bad field. width 0 is valid (off). */
int pdm_beam_params_check(const pdm_beam_params_t *p);
/* "heuristic" | "early" (also "true") | "never"; PDM_EINVAL otherwise. */
int pdm_beam_stop_parse(const char *s, pdm_beam_stop_t *out);
const char *pdm_beam_stop_name(pdm_beam_stop_t s);

/* Bytes of eq. (2) and eq. (3) for one sequence (BS = 1). */
size_t pdm_beam_bytes_standard(const pdm_model_hparams_t *hp, pdm_dtype_t dtype, int width,
                               int64_t n_prompt, int64_t n_response);
size_t pdm_beam_bytes_segment(const pdm_model_hparams_t *hp, pdm_dtype_t dtype, int width,
                              int64_t n_prompt, int64_t n_response);
/* KV token slots a beam request reserves: n_prompt + width * ceil(max_new / 16) * 16. */
int64_t pdm_beam_kv_slots(int width, int32_t n_prompt, int32_t max_new);

/* ---- Segmented response KV ------------------------------------------------------------- */

typedef struct {
    uint32_t n_layers, n_kv_heads, head_dim;
    pdm_dtype_t dtype;
    int width;                     /* beams (rows per step in every segment) */
    const pdm_kv_cache_t *prompt;  /* the shared prompt KV, slots [0, n_prompt); not owned */
    int32_t n_prompt;
    int32_t max_steps;             /* response steps that may be stored */
    int32_t n_steps;               /* response steps stored */
    int primed;                    /* 0: the next step recomputes the last prompt token */
    int n_live;                    /* rows of the next step (1 before priming, then width) */
    void **seg;                    /* [ceil(max_steps / 16)] segments, NULL until needed; each
                                    * holds per (layer, kv head) K then V, each
                                    * [PDM_BEAM_STEP][width][head_dim] of dtype */
    int n_seg;                     /* segments allocated */
    size_t head_bytes;             /* bytes of one [PDM_BEAM_STEP][width][head_dim] array */
    int32_t *table;                /* [width][max_steps]: row of the step's segment holding
                                    * beam b's KV of response step t ((t % 16) * width + slot) */
    int32_t *table_tmp;            /* [width][max_steps] scratch of reorder */
    float *resp_o;                 /* [width][n_heads * head_dim] response-part attention */
    float *resp_lse;               /* [width][n_heads] */
    float *part_o, *part_lse;      /* [n_heads * head_dim], [n_heads]: one segment's partial */
    int32_t *pos_tmp;              /* [n_heads] query positions of one beam's head group */
    int n_split;                   /* prompt key ranges per kv head (2 x threads) */
    float *prompt_q;               /* [n_kv_heads][width * group][head_dim] gathered queries */
    int32_t *prompt_pos;           /* [width * n_heads] their positions */
    float *prompt_part;            /* [n_kv_heads][n_split][width * group][head_dim + 1]
                                    * partial o and lse of each key range */
    size_t bytes;                  /* bytes of the allocated segments (measured) */
} pdm_beam_kv_t;

/* A response cache for `width` beams after the n_prompt tokens of `prompt` (which must outlive
 * it), for at most max_steps response steps. Allocates the table only; segments come with
 * pdm_beam_kv_prepare. */
int pdm_beam_kv_create(const pdm_model_hparams_t *hp, const pdm_kv_cache_t *prompt,
                       int32_t n_prompt, int width, int32_t max_steps, pdm_beam_kv_t **out);
void pdm_beam_kv_destroy(pdm_beam_kv_t *kv);
/* Makes sure the next step's rows exist (allocates a segment every 16 steps). PDM_EOVERFLOW
 * past max_steps, PDM_ENOMEM; nothing changes on error. */
int pdm_beam_kv_prepare(pdm_beam_kv_t *kv);
/* Absolute position of the next step's tokens. */
int32_t pdm_beam_kv_next_pos(const pdm_beam_kv_t *kv);
/* Inside a decode step, for one layer: `rows` holds the kv->n_live rows of this sequence
 * (beam b = row b). Stores each row's K/V at the current step (not when priming), then sets
 * o and lse of each row to its attention over the shared prompt and its own response KV read
 * through the table. Call pdm_beam_kv_prepare and pdm_beam_kv_scratch first (the batched step
 * does, through pdm_beam_step_check). */
void pdm_beam_kv_attend(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv, int layer, pdm_act_t *rows);
/* For pdm_decode_step_beams: checks that beams[0..n) starts with the n_live consecutive rows
 * of beams[0] and prepares its next rows (pdm_beam_kv_prepare, pdm_beam_kv_scratch).
 * PDM_EINVAL / PDM_EOVERFLOW / PDM_ENOMEM. */
int pdm_beam_step_check(pdm_model_ctx_t *ctx, pdm_beam_kv_t *const *beams, int n);
/* Sizes the prompt-attention scratch for ctx's thread count (PDM_ENOMEM). */
int pdm_beam_kv_scratch(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv);
/* o and lse of the rows->n rows (one beam search's beams, all at one position) against one
 * contiguous view (the shared prompt) of `layer` (whose scale and sliding window apply):
 * items (kv head, key range) over ctx's pool, each with the query heads of all rows that share
 * the kv head as one block. Needs pdm_beam_kv_scratch and rows->n <= kv->width. */
void pdm_beam_attend_prompt(pdm_model_ctx_t *ctx, pdm_beam_kv_t *kv, int layer,
                            pdm_act_t *rows, const pdm_kv_view_t *view);
/* After the step: the step's rows become part of the cache. */
void pdm_beam_kv_commit(pdm_beam_kv_t *kv);
/* New beam b continues old beam parent[b] (b < n): the table rows are copied, the KV stays
 * where it is. The next step has n rows. */
void pdm_beam_kv_reorder(pdm_beam_kv_t *kv, const int *parent, int n);

/* ---- The search ------------------------------------------------------------------------ */

typedef struct {
    int32_t *tokens; /* generated tokens (the end-of-generation token included if eos) */
    int n_tokens;
    double logprob;  /* sum of the tokens' log-probabilities */
    double score;    /* logprob / n_tokens^length_penalty */
    int eos;         /* 1: ended with an end-of-generation token; 0: reached max_new */
} pdm_beam_hyp_t;

typedef struct pdm_beam_search pdm_beam_search_t;

/* A search for at most max_new tokens; eog[n_eog] are the end-of-generation token ids. */
int pdm_beam_search_create(const pdm_beam_params_t *p, int32_t n_vocab, int32_t max_new,
                           const int32_t *eog, int n_eog, pdm_beam_search_t **out);
void pdm_beam_search_destroy(pdm_beam_search_t *bs);
/* Input tokens of the live beams for the next step (beam b = tokens[b]); returns their
 * number. Before the first step that is the single last prompt token given here. */
int pdm_beam_search_inputs(const pdm_beam_search_t *bs, int32_t *tokens);
void pdm_beam_search_prime(pdm_beam_search_t *bs, int32_t last_prompt_token);
/* Takes the logits [n_live][n_vocab] of the live beams, selects the next beams (parent[b]: the
 * old beam new beam b continues, n_live_out: their number) and returns 1 when the search has
 * ended (results ready), 0 otherwise. PDM_ENOMEM on allocation failure. */
int pdm_beam_search_advance(pdm_beam_search_t *bs, const float *logits, int *parent,
                            int *n_live_out);
/* Ends the search now (deadline, cancel): the live beams join the heap. */
void pdm_beam_search_finish(pdm_beam_search_t *bs);
/* The n_best results, best first (valid until destroy). */
int pdm_beam_search_results(const pdm_beam_search_t *bs, const pdm_beam_hyp_t **hyps);
/* Number of generated tokens of the live beams. */
int pdm_beam_search_length(const pdm_beam_search_t *bs);

/* What a finished beam search reports (the decode node's DONE event). */
typedef struct {
    int width;
    float length_penalty;
    pdm_beam_stop_t early_stopping;
    const pdm_beam_hyp_t *hyps;  /* [n_hyps] the n-best list, best first */
    const char *const *texts;    /* [n_hyps] their text (end-of-generation tokens left out) */
    int n_hyps;
    int32_t n_prompt, n_response; /* prompt tokens, response steps stored */
    size_t prompt_bytes;         /* the shared prompt KV (allocated) */
    size_t response_bytes;       /* the response segments (allocated, measured) */
    size_t eq2_bytes, eq3_bytes; /* eq. (2) and (3) at n_prompt, n_response */
} pdm_beam_report_t;

#endif /* PDM_DECODE_BEAM_H */
