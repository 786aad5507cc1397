/*
 * pdmesh-router: the core's interface to its front ends.
 *
 * The router core (registry, scheduling, request lifecycle; router/core.c and friends) accepts
 * generation requests from two front ends: the ZeroMQ client socket (router/main.c) and the
 * OpenAI-compatible HTTP server (router/http.c). Both call pdm_router_submit with a sink; the
 * core reports the request's progress through the sink, from the router's libuv loop thread
 * (the only thread that touches router state).
 *
 * Sink contract:
 *  - on_tokens is called zero or more times, in order, with consecutive token indexes;
 *  - then exactly one of on_result / on_error ends the request; after it the core never
 *    touches the sink again and the front end may free ctx;
 *  - a front end whose client went away calls pdm_router_cancel(id); the request then ends
 *    with on_error(ERR_CANCELLED) (still exactly once).
 */
#ifndef PDM_ROUTER_H
#define PDM_ROUTER_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "proto/pdmesh.pb-c.h"

typedef struct pdm_router pdm_router_t;

typedef struct {
    void *ctx;
    /* Tokens [index, index + n) of the completion, with the text they complete (UTF-8 safe;
     * stop strings already cut) and, when the request asked for logprobs, their
     * log-probabilities (logprobs[n], else NULL; valid during the call). */
    void (*on_tokens)(void *ctx, uint32_t index, const int32_t *tokens, size_t n,
                      const char *text, Pdmesh__TokenLogprob *const *logprobs);
    /* Final success. res->text is the whole completion; res->usage is filled; res->logprobs
     * has one entry per token when the request asked for logprobs. */
    void (*on_result)(void *ctx, const Pdmesh__GenerateResult *res);
    /* Final failure: code is a Pdmesh__ErrorCode, message a clear sentence. */
    void (*on_error)(void *ctx, int code, const char *message);
    /* May be NULL. With GenerateRequest.prompt_logprobs: called once, before any on_tokens,
     * with the log-probabilities of the n prompt tokens (lps[0] is missing: nothing predicts
     * the first token; valid during the call). res->prompt_logprobs repeats them. */
    void (*on_prompt)(void *ctx, Pdmesh__TokenLogprob *const *lps, size_t n);
} pdm_router_sink_t;

/* Submits a request. `client` identifies the caller for per-client limits (ZeroMQ identity in
 * hex, or "http:<peer address>"). sinks and ids hold one entry per choice: req->n of them
 * (OpenAI's n, 2..8), else one. Each choice is a request of its own towards its sink (its
 * tokens, its one end, cancelled by its id) while they share one prefill, one KV transfer and
 * the decode node's prompt KV where a node can (docs/http.md "n"); choice i samples with
 * pdm_sampler_seed_for_choice(seed, i). On acceptance returns PDM_OK and the choices' router
 * ids in ids[] (the sinks will be called later, never from inside this call). On refusal
 * (invalid arguments, limits, overloaded, not ready) returns an error status, sets *code to
 * the Pdmesh__ErrorCode and pdm_error_last() to the message; no sink is ever called. */
int pdm_router_submit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, const char *client,
                      const pdm_router_sink_t *sinks, uint64_t *ids, int *code);

/* Cancels a request by router id: PDM_ENOTFOUND if it already ended. */
int pdm_router_cancel(pdm_router_t *r, uint64_t id);

/* The loop everything runs on. */
uv_loop_t *pdm_router_loop(pdm_router_t *r);

/* Model served (the name shown by /v1/models, e.g. "SmolLM2-135M-Instruct.Q4_1"). */
const char *pdm_router_model_name(const pdm_router_t *r);

/* 1 when the router can serve a request now: at least one live decode node (prefill by a
 * group, or locally by the decode node under conditional disaggregation). */
int pdm_router_ready(const pdm_router_t *r);

/* Limits the front ends enforce before submitting (0 = unlimited). */
typedef struct {
    size_t max_body_bytes;      /* HTTP request body */
    uint32_t max_prompt_tokens;
    uint32_t max_tokens;
    uint32_t max_beams;
} pdm_router_limits_t;
const pdm_router_limits_t *pdm_router_limits(const pdm_router_t *r);

/* The router's metrics registry (router/metrics.h); the HTTP front end renders it. */
struct pdm_metrics;
struct pdm_metrics *pdm_router_metrics(pdm_router_t *r);

/* Renders a chat conversation with the served model's template (ChatML for SmolLM2) into
 * prompt tokens: the core does this for GenerateRequest.messages; exposed for front ends that
 * need the token count up front. *out is malloc'ed. */
int pdm_router_render_chat(pdm_router_t *r, const Pdmesh__ChatMessage *const *msgs, size_t n,
                           int32_t **out, size_t *n_out);

/* The served model's tokenizer, for the front ends' /tokenize, /detokenize and
 * /tokenizer_info (vLLM's shapes, which lm-evaluation-harness's remote tokenizer uses).
 * tokenize: text -> ids (*out malloc'ed), special-token texts parsed, BOS prepended when
 * add_special and the model adds one; PDM_EINVAL with a message otherwise. token_text: the
 * bytes of token `id` (control tokens rendered), their length, or a negative status for an
 * id outside the vocabulary. special_token: the BOS (which 0) or EOS (1) id, -1 if none. */
int pdm_router_tokenize(pdm_router_t *r, const char *text, size_t len, int add_special,
                        int32_t **out, size_t *n_out);
int pdm_router_token_text(pdm_router_t *r, int32_t id, char *buf, size_t cap);
int32_t pdm_router_special_token(pdm_router_t *r, int which);

#endif
