/*
 * Internal to the HTTP front end (router/http.c, router/http_openai.c): the translation
 * between OpenAI-style JSON and the pdmesh client messages, kept free of I/O so that the unit
 * tests can drive it directly.
 */
#ifndef PDM_HTTP_INTERNAL_H
#define PDM_HTTP_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "proto/pdmesh.pb-c.h"
#include "router/router.h"

/* Hard caps of the front end, applied even when the router's limits say "unlimited". */
#define PDM_HTTP_MAX_BODY_DEFAULT (1u << 20)  /* request body when the router sets none */
#define PDM_HTTP_MAX_STOP 16                  /* stop strings per request */
#define PDM_HTTP_MAX_STOP_LEN 256             /* bytes per stop string */
#define PDM_HTTP_MAX_MESSAGES 1024            /* chat messages per request */
#define PDM_HTTP_MAX_TOKENS_HARD 1000000u     /* max_tokens ceiling when the router has none */
#define PDM_HTTP_COMPLETIONS_DEFAULT_TOKENS 16 /* OpenAI's default for /v1/completions */
#define PDM_HTTP_MAX_PROMPTS 64               /* prompts in one completions request */
#define PDM_HTTP_MAX_TOOLS 128                /* tools in one chat request */

/* What a parsed request needs besides the GenerateRequest itself. */
typedef struct {
    int chat;            /* 1: /v1/chat/completions */
    int stream;          /* stream: true */
    int include_usage;   /* stream_options.include_usage */
    int logprobs;        /* -1: none; else alternatives per token (completions' logprobs: N,
                          * chat's top_logprobs) */
    int echo;            /* completions' echo: true */
    int n_prompts;       /* prompts of the request (one GenerateRequest each) */
    int n_samples;       /* OpenAI's n: choices per prompt (GenerateRequest.n; 1: none) */
    int tools;           /* chat with tools and tool_choice other than "none": the output is
                          * parsed for tool calls */
} pdm_http_opts_t;

/* The log-probabilities a response or chunk carries: lps[n] (one per token, in order);
 * text_offset is the completions' text_offset of the first (bytes into the completion). */
typedef struct {
    Pdmesh__TokenLogprob *const *lps;
    size_t n;
    size_t text_offset;
} pdm_http_logprobs_t;

/* A parse failure: the HTTP status, an OpenAI error code string and a message. */
typedef struct {
    int status;
    const char *code;    /* static string */
    char message[256];
} pdm_http_err_t;

/* Parses an OpenAI completions (chat = 0) or chat completions (chat = 1) body into a
 * GenerateRequest (*out, free with pdm_http__request_free). Checks types and ranges of every
 * field it knows, the front end's caps and the router's limits `lim` (may be NULL);
 * `model_name` (may be NULL) is the served model: a different "model" is a 404.
 * Returns PDM_OK, or PDM_EINVAL with *err filled (nothing allocated). */
int pdm_http__parse_request(const char *body, size_t len, int chat,
                            const pdm_router_limits_t *lim, const char *model_name,
                            Pdmesh__GenerateRequest **out, pdm_http_opts_t *opts,
                            pdm_http_err_t *err);
void pdm_http__request_free(Pdmesh__GenerateRequest *req);

/* pdm_http__parse_request for a body that may hold a list of prompts (completions): one
 * GenerateRequest per prompt, in order, in *out[*n_out] (free with pdm_http__batch_free), each
 * with n = opts->n_samples when OpenAI's n > 1 (choice index = prompt * n + sample).
 * pdm_http__parse_request keeps the first of them. */
int pdm_http__parse_batch(const char *body, size_t len, int chat, const pdm_router_limits_t *lim,
                          const char *model_name, Pdmesh__GenerateRequest ***out, size_t *n_out,
                          pdm_http_opts_t *opts, pdm_http_err_t *err);
void pdm_http__batch_free(Pdmesh__GenerateRequest **reqs, size_t n);

/* HTTP status and OpenAI error type/code for a Pdmesh__ErrorCode. */
int pdm_http__status_for_code(int code);
const char *pdm_http__code_name(int code);
const char *pdm_http__type_for_status(int status);
const char *pdm_http__reason(int status);

/* s[0..len) as valid UTF-8: each ill-formed sequence (its longest well-formed prefix, or one
 * byte) becomes U+FFFD. Returns a malloc'ed NUL-terminated string, NULL when out of memory. */
char *pdm_http__utf8_sanitize(const char *s, size_t len);

/* {"error":{"message":..,"type":..,"param":null,"code":..}} as a malloc'ed string; the
 * message is sanitized (pdm_http__utf8_sanitize) since it may quote the client. */
char *pdm_http__error_json(int status, const char *code, const char *message);

/* OpenAI finish_reason of a FinishReason ("stop", "length"), NULL for FINISH_NONE. */
const char *pdm_http__finish_reason(int finish);

/* The non-streaming response body (malloc'ed JSON). `id` like "cmpl-..."; created is unix
 * seconds. logprobs: the request asked for them (res->logprobs is then rendered, an empty list
 * when there are none); else "logprobs": null. */
char *pdm_http__result_json(int chat, const char *id, long created, const char *model,
                            const Pdmesh__GenerateResult *res, int logprobs);

struct cJSON;

/* The pieces of a response with several choices (a list of prompts): one choice (index,
 * text, logprobs, finish_reason; echo non-NULL: the completions' echo, the text after `echo`
 * and the prompt's log-probabilities res->prompt_logprobs before the completion's), a usage
 * object (pdm_http__usage_add sums another choice's counts into it), and the body made of a
 * choices array and a usage object (both taken; either may be NULL). */
struct cJSON *pdm_http__choice_json(int chat, uint32_t index, const Pdmesh__GenerateResult *res,
                                    int logprobs, const char *echo);
struct cJSON *pdm_http__usage_json(const Pdmesh__Usage *u);
void pdm_http__usage_add(struct cJSON *usage, uint32_t prompt_tokens, uint32_t completion_tokens);
char *pdm_http__response_json(int chat, const char *id, long created, const char *model,
                              struct cJSON *choices, struct cJSON *usage);

/* The text an echoed choice starts with: the prompt as the client sent it (prompt non-NULL),
 * else its tokens' texts lps[n] made valid UTF-8. malloc'ed; NULL when out of memory. */
char *pdm_http__echo_text(const char *prompt, Pdmesh__TokenLogprob *const *lps, size_t n);

/* pdm_http__chunk_json of choice `index`; usage (taken; NULL: none) makes the usage chunk. */
char *pdm_http__chunk_json_at(int chat, const char *id, long created, const char *model,
                              uint32_t index, const char *text, const char *finish,
                              int role_delta, struct cJSON *usage, const pdm_http_logprobs_t *lp);

/* One streamed chunk as JSON (malloc'ed). text may be NULL (no content); finish may be NULL;
 * role_delta adds "role":"assistant" to a chat delta. usage (may be NULL) produces the
 * include_usage chunk (empty choices). lp (may be NULL: "logprobs": null) the log-
 * probabilities of the chunk's tokens. */
char *pdm_http__chunk_json(int chat, const char *id, long created, const char *model,
                           const char *text, const char *finish, int role_delta,
                           const Pdmesh__Usage *usage, const pdm_http_logprobs_t *lp);

/* Bytes of the completion's text the tokens lps[0..n) stand for (the sum of their texts):
 * advances a stream's text_offset. */
size_t pdm_http__logprobs_text_len(Pdmesh__TokenLogprob *const *lps, size_t n);

/* Chat with tools (model/chat.h): the tool calls in a choice built by pdm_http__choice_json
 * move from message.content into message.tool_calls ([{id, type: "function", function: {name,
 * arguments: JSON text}}]), content keeps the text outside the calls (null when none) and
 * finish_reason becomes "tool_calls". A choice without calls is left as it is. PDM_OK or
 * PDM_ENOMEM. */
int pdm_http__choice_tools(struct cJSON *choice);

/* A tool call id as OpenAI spells them: "call_" and 24 random letters and digits. */
#define PDM_HTTP_TOOL_CALL_ID_LEN 30
void pdm_http__tool_call_id(char out[PDM_HTTP_TOOL_CALL_ID_LEN]);

/* A streamed chat chunk carrying one tool call delta (OpenAI's shape): with call_id, the
 * call's first delta {index, id, type, function: {name, arguments}}; without, an arguments
 * fragment {index, function: {arguments}}. Malloc'd JSON or NULL. */
char *pdm_http__tool_chunk_json(const char *id, long created, const char *model, uint32_t index,
                                int call_index, const char *call_id, const char *name,
                                const char *arguments);

/* Streaming with tools: the generated text goes through feed() as it arrives; content comes
 * out as soon as it cannot be the start of a call (a suffix that may begin "<tool_call>", and
 * trailing whitespace, are held back); a call comes out whole once its closing tag arrived.
 * emit(ctx, content, NULL, NULL) for text, emit(ctx, NULL, name, arguments) for a call
 * (strings valid during the call). final = 1 at the end: everything held back is settled (an
 * unclosed call is text). PDM_OK or PDM_ENOMEM. */
typedef void (*pdm_http_tool_emit_cb)(void *ctx, const char *content, const char *name,
                                      const char *arguments);
typedef struct {
    char *buf;   /* [n + 1] text not yet emitted */
    size_t n;
    int calls;   /* calls emitted so far */
    int content; /* content emitted so far */
    int content_after; /* content emitted since the last call */
} pdm_http_tool_stream_t;
int pdm_http__tool_stream_feed(pdm_http_tool_stream_t *ts, const char *text, int final,
                               pdm_http_tool_emit_cb emit, void *ctx);
void pdm_http__tool_stream_fini(pdm_http_tool_stream_t *ts);

#endif
