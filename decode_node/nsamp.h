/*
 * nsamp.h - n independent samples of one prompt on the decode node (OpenAI's `n`), over the
 * segmented KV cache of beam.h (included by decode.h).
 *
 * The samples are beams that are never reordered: the prompt's KV is stored once and shared
 * (Wu et al., "Efficient LLM inference solution on Intel GPU", §3.2, the prompt segment), each
 * sample appends its own rows to the response segments (§3.2, [N_step, BW, D] with BW = n),
 * and one batched decode step computes every live sample (pdm_decode_step_beams: the linear
 * layers as one matrix product over the rows, the prompt attention with every sample's queries
 * against each prompt K/V tile once, §3.3). Memory is eq. (3) of beam.h with BW = n.
 *
 * Exact semantics:
 *   - The first step recomputes the last prompt token (as beam search does: its KV is already
 *     in the prompt, only its logits are needed) and every sample draws its first token from
 *     those logits with its own sampler. From then on sample i feeds its own last token.
 *   - Sample i draws with the request's sampling parameters and the seed
 *     pdm_nsamp_seed(seed, i): sample 0 keeps the request's seed, so n = 1 is the ordinary
 *     request, and sample i of a request equals a request with n = 1 and that derived seed.
 *     The sampler is stateless between steps (model.h "Sampling": the draw is a function of
 *     (seed, history length)), so each sample's history is its own tokens only.
 *   - A sample ends when the caller says so (pdm_nsamp_finish: end of generation, a stop
 *     string, its length); the others go on. Finished samples leave the batch: the live rows
 *     are compacted with pdm_beam_kv_reorder (the table rows move, no KV is copied), so a
 *     step costs the live samples only.
 */
#ifndef PDM_DECODE_NSAMP_H
#define PDM_DECODE_NSAMP_H

#include <stdint.h>

#include "decode_node/beam.h"
#include "model/model.h"

#define PDM_NSAMP_MAX PDM_BEAM_MAX_WIDTH /* samples per request (OpenAI's n), 1..8 */

/* The seed of sample i: pdm_sampler_seed_for_choice (model.h), the rule the router's HTTP
 * front end uses for OpenAI's n too. */
uint64_t pdm_nsamp_seed(uint64_t seed, int i);

typedef struct pdm_nsamp pdm_nsamp_t;

/* One drawn token: sample `sample`'s token number `index` (0 = its first generated token). */
typedef struct {
    int sample;
    int32_t token;
    int32_t index;
    pdm_token_logprobs_t lp; /* set when the sampling parameters ask for logprobs */
} pdm_nsamp_token_t;

/* n (1..PDM_NSAMP_MAX) samples of at most max_new tokens each with sampling parameters `p`
 * (sample i seeded with pdm_nsamp_seed(p->seed, i)) over a vocabulary of n_vocab, and their
 * response KV `kv` (width >= n, created over the prompt; borrowed, must outlive the group).
 * PDM_EINVAL naming the bad argument, PDM_ENOMEM; *out untouched on error. */
int pdm_nsamp_create(const pdm_sampler_params_t *p, int n, int32_t n_vocab, int32_t max_new,
                     pdm_beam_kv_t *kv, int32_t last_prompt_token, pdm_nsamp_t **out);
void pdm_nsamp_destroy(pdm_nsamp_t *g);

/* Input tokens of the next step's rows (row r = the r-th live sample, in sample order; the
 * priming step has one row: the last prompt token). Returns the number of rows (0: every
 * sample has finished). */
int pdm_nsamp_inputs(const pdm_nsamp_t *g, int32_t *tokens);
/* The sample of row r of the next step (-1 while priming). */
int pdm_nsamp_row_sample(const pdm_nsamp_t *g, int row);

/* After a step whose rows' logits are logits[r * n_vocab ..] (r < the rows of
 * pdm_nsamp_inputs): every live sample draws its next token (while priming, all from row 0).
 * Writes one entry per live sample to out[PDM_NSAMP_MAX] in sample order and returns their
 * count. Records the tokens (they are the next inputs). Call pdm_nsamp_finish for the samples
 * that end with their token, then pdm_nsamp_advance. */
int pdm_nsamp_sample(pdm_nsamp_t *g, const float *logits, pdm_nsamp_token_t *out);
/* Sample i ends: its last token is not fed to the model. */
void pdm_nsamp_finish(pdm_nsamp_t *g, int sample);
/* Readies the KV for the next step: the live samples become its rows (priming: the one
 * computed row fans out to every sample; after finishes: the rows are compacted). */
void pdm_nsamp_advance(pdm_nsamp_t *g);

/* Priming without a step, when the last prompt token's logits are known already (a local
 * prefill computed them): every sample draws its first token from logits[n_vocab] as the
 * priming step would, and the KV is marked primed (the next step stores each sample's first
 * token at step 0). Then pdm_nsamp_finish / pdm_nsamp_advance as after a step. Only before
 * the first step; returns the entries written to out. */
int pdm_nsamp_prime(pdm_nsamp_t *g, const float *logits, pdm_nsamp_token_t *out);
/* Sample i's next token is `token`, recorded as if drawn (no sampler call): a resumed
 * sample's delivered tokens, replayed as steps of this cache so that its later draws see the
 * logits of the undisturbed run (the decode node's migration of one of n choices). Then
 * pdm_nsamp_advance as after a draw; before the first step, mark the KV primed with
 * pdm_beam_kv_commit. */
void pdm_nsamp_force(pdm_nsamp_t *g, int i, int32_t token);
/* Sample i's sampler (borrowed), e.g. to set its structured-output matcher
 * (pdm_sampler_set_grammar): each sample has its own. */
pdm_sampler_t *pdm_nsamp_sampler(pdm_nsamp_t *g, int i);
/* Whether the priming draw happened. */
int pdm_nsamp_primed(const pdm_nsamp_t *g);

int pdm_nsamp_count(const pdm_nsamp_t *g);
int pdm_nsamp_live(const pdm_nsamp_t *g);
/* Sample i's tokens so far (*n_tokens of them); borrowed, valid until the next call. */
const int32_t *pdm_nsamp_tokens(const pdm_nsamp_t *g, int sample, int *n_tokens);

#endif
