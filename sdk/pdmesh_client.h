/*
 * pdmesh_client.h - libpdmesh, the C client of a pdmesh router (proto/pdmesh.proto, client API).
 *
 * Usage:
 *
 *     pdm_client_t *c;
 *     if (pdm_client_create("tcp://127.0.0.1:7700", NULL, &c)) { ...pdm_client_last_error()... }
 *     pdm_client_request_t req;
 *     pdm_client_request_init(&req);
 *     req.prompt = "Why is the sky blue?";
 *     req.max_tokens = 64;
 *     pdm_client_result_t res;
 *     int rc = pdm_client_generate(c, &req, &res);      // or pdm_client_generate_stream
 *     if (rc == PDM_CLIENT_OK) puts(res.text); else fprintf(stderr, "%s\n", res.error);
 *     pdm_client_result_fini(&res);
 *     pdm_client_destroy(c);
 *
 * Threading model (why: ZeroMQ sockets must not be shared between threads, and one connection
 * per call would cost a TCP handshake per request and defeat the router's per-client limits):
 *
 *   - A client owns ONE ZeroMQ DEALER socket, connected to the router's client ROUTER socket,
 *     and ONE I/O thread that is the only thread ever touching that socket. Every call of
 *     every thread is multiplexed over it by request id.
 *   - Calling threads never touch ZeroMQ: they pack their request, put it on a bounded command
 *     queue under the client's mutex and wake the I/O thread through an eventfd. The I/O
 *     thread sends, receives, unpacks (size cap and allocation budget, common/wire.h) and
 *     hands each reply to its call under the same mutex, waking the caller with a condition
 *     variable.
 *   - Streaming callbacks run on the CALLING thread (the one inside
 *     pdm_client_generate_stream), never on the I/O thread: a slow callback delays only its own
 *     call. Tokens that arrive meanwhile are queued per call (bounded, see below).
 *   - Timeouts are measured by the calling thread (CLOCK_MONOTONIC); on expiry the call ends
 *     with PDM_CLIENT_ETIMEOUT and a CancelRequest is sent so the router frees the work.
 *
 * Hence every function below is safe to call from any thread at the same time, including
 * pdm_client_cancel on a call that another thread is blocked in. pdm_client_destroy must not
 * race with other calls on the same client (calls still open end with PDM_CLIENT_ECLOSED).
 *
 * Errors: every function returns PDM_CLIENT_OK (0) or a negative pdm_client_status_t. Errors
 * the router reports are its ErrorCode negated (ERR_OVERLOADED = 6 -> PDM_CLIENT_EOVERLOADED
 * = -6); errors detected on this side (timeout, unreachable router, bad arguments, garbage
 * from the peer) have their own codes. A sentence describing the failure is in
 * result->error, and for every call in pdm_client_last_error() of the calling thread.
 */
#ifndef PDMESH_CLIENT_H
#define PDMESH_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One list gives the enum, the names and the messages. */
#define PDM_CLIENT_STATUS_MAP(X)                                                                \
    X(OK, 0, "ok")                                                                              \
    /* reported by the router: -(proto ErrorCode) */                                            \
    X(EBAD_MESSAGE, -1, "the router could not parse the request")                               \
    X(EUNKNOWN_TYPE, -2, "the router does not know the message type")                           \
    X(ETOO_LARGE, -3, "request frame over the router's size limit")                             \
    X(EINVALID_ARGUMENT, -4, "invalid argument")                                                \
    X(EUNAUTHORIZED, -5, "unauthorized")                                                        \
    X(EOVERLOADED, -6, "router overloaded")                                                     \
    X(EDEADLINE_EXCEEDED, -7, "deadline exceeded on the router")                                \
    X(ECANCELLED, -8, "cancelled")                                                              \
    X(EUNAVAILABLE, -9, "no node can serve the request")                                        \
    X(EINTERNAL, -10, "internal router error")                                                  \
    X(ENOT_FOUND, -11, "not found")                                                             \
    X(ESTALE_EPOCH, -12, "stale epoch")                                                         \
    X(ENODE_FULL, -13, "decode node full")                                                      \
    X(EKV_TRANSFER, -14, "KV transfer failed")                                                  \
    /* detected by the client */                                                                \
    X(ETIMEOUT, -100, "timed out waiting for the router")                                       \
    X(EUNREACHABLE, -101, "router unreachable")                                                 \
    X(ENOMEM, -102, "out of memory")                                                            \
    X(EPROTOCOL, -103, "malformed reply from the router")                                       \
    X(ECLOSED, -104, "client closed")                                                           \
    X(EBUSY, -105, "too many open calls on this client")                                        \
    X(ESYSTEM, -106, "system error")

typedef enum {
#define PDM_CLIENT__ENUM(name, code, msg) PDM_CLIENT_##name = code,
    PDM_CLIENT_STATUS_MAP(PDM_CLIENT__ENUM)
#undef PDM_CLIENT__ENUM
} pdm_client_status_t;

/* Static description of a status ("router unreachable"); "unknown status" for others. */
const char *pdm_client_strerror(int status);
/* Static symbolic name without the prefix ("EUNREACHABLE"), for bindings and logs. */
const char *pdm_client_status_name(int status);
/* The calling thread's message for its last failed pdm_client_* call. Never NULL. */
const char *pdm_client_last_error(void);

typedef struct pdm_client pdm_client_t;

typedef struct {
    int timeout_ms;          /* default per-call timeout; 0 = 60000 */
    int connect_timeout_ms;  /* a call fails with EUNREACHABLE once the router has been
                                unreachable (no TCP connection) this long; 0 = 3000 */
    int max_open_calls;      /* calls open at once on this client (EBUSY beyond); 0 = 1024 */
    size_t max_frame;        /* largest reply accepted, bytes; 0 = 16 MiB */
    size_t max_buffered;     /* stream bytes queued for one slow callback; 0 = 64 MiB */
    /* CURVE (docs/router.md, "CURVE"): the router's public key file (line 1: Z85 key) and
     * this client's key file (line 1 public, line 2 secret; mode 0600). Both NULL:
     * $PDMESH_CURVE_SERVER_KEY_FILE / $PDMESH_CURVE_KEY_FILE, else a plain connection. Read
     * during pdm_client_create only. A key the router does not allow (or CURVE on one side
     * only) fails the security handshake: open and new calls end at once with
     * EUNAUTHORIZED. */
    const char *curve_server_key_file;
    const char *curve_key_file;
} pdm_client_options_t;

/* Creates a client and starts connecting to `endpoint` (a ZeroMQ endpoint such as
 * "tcp://127.0.0.1:7700"; NULL: $PDMESH_ROUTER or the default above). Connecting is
 * asynchronous: an unreachable router is reported by the first call (or pdm_client_ping).
 * opts may be NULL. On error nothing is left allocated and *out is not written. */
int pdm_client_create(const char *endpoint, const pdm_client_options_t *opts,
                      pdm_client_t **out);
/* Ends every open call with PDM_CLIENT_ECLOSED, stops the I/O thread, closes the socket
 * (linger 0) and frees the client. NULL is accepted. */
void pdm_client_destroy(pdm_client_t *c);

/* Round trip to the router (MSG_PING/MSG_PONG): OK, ETIMEOUT or EUNREACHABLE. */
int pdm_client_ping(pdm_client_t *c, int timeout_ms);

typedef struct {
    const char *role;        /* "system", "user", "assistant" or "tool" */
    const char *content;
    const char *tool_calls_json; /* assistant: the calls it made, OpenAI's tool_calls list as
                                    JSON text (a result's tool_calls_json), or NULL */
    const char *tool_call_id; /* tool: the call this message answers (its "id"), or NULL */
} pdm_client_message_t;

/* A generation request. Exactly one of prompt / prompt_tokens / messages must be set.
 * Every pointer is borrowed for the duration of the call only. */
typedef struct {
    uint64_t id;                     /* 0: assigned by the client. To cancel from another
                                        thread, take one from pdm_client_new_id first. */
    const char *prompt;              /* text, tokenized by the router (BOS added) */
    const int32_t *prompt_tokens;    /* ... or token ids */
    size_t n_prompt_tokens;
    const pdm_client_message_t *messages; /* ... or a chat (the model's chat template) */
    size_t n_messages;
    /* sampling; temperature 0 = greedy */
    float temperature;
    int32_t top_k;                   /* 0 = off */
    float top_p;                     /* 0 or 1 = off */
    float min_p;                     /* 0 = off */
    float repeat_penalty;            /* 0 or 1 = off */
    uint64_t seed;
    uint32_t max_tokens;             /* 0 = router default */
    const char *const *stop;         /* stop strings (at most 16, none empty) */
    size_t n_stop;
    uint32_t beams;                  /* 0/1 = no beam search; at most 64 (the router's limit,
                                        default 8, applies). A beam search is not streamed:
                                        use pdm_client_generate; the result's tokens/text are
                                        the best beam's and beams[] holds the n best. Stop
                                        strings and ignore_eos are refused with it. */
    uint32_t n_best;                 /* beams returned (<= beams; 0: 1) */
    float length_penalty;            /* score = logprob / length^length_penalty (0: 1) */
    const char *early_stopping;      /* beam search: NULL/"heuristic", "early" or "never" */
    int ignore_eos;                  /* generate past end-of-generation tokens (until max_tokens,
                                        a stop string or the deadline) */
    const char *model;               /* optional: must match the served model */
    uint32_t deadline_ms;            /* router-side deadline; 0 = the call's timeout */
    int timeout_ms;                  /* client-side; 0 = the client's default */
    /* OpenAI's sampling adjustments (docs/http.md "Sampling"): logit[t] -= presence_penalty
     * * (count[t] > 0) + frequency_penalty * count[t] over the completion's tokens, each in
     * [-2, 2]; logit_bias adds logit_bias_values[i] ([-100, 100]) to token logit_bias_ids[i]
     * (at most 300). The draw of step i depends on (seed, i) only: the same seed gives the
     * same completion, also across a migration to another decode node. */
    float presence_penalty;
    float frequency_penalty;
    const int32_t *logit_bias_ids;   /* (n_logit_bias) */
    const float *logit_bias_values;  /* (n_logit_bias) */
    size_t n_logit_bias;
    int logprobs;                    /* nonzero: each token's log-probability in the result
                                        and the chunks (not with beam search) */
    uint32_t top_logprobs;           /* with logprobs: the most likely alternatives, <= 20 */
    int prompt_logprobs;             /* nonzero: every prompt token's log-probability given the
                                        tokens before it (result.prompt_logprobs; the first is
                                        NAN), with top_logprobs alternatives when logprobs is
                                        set; computed where the prompt is prefilled (each
                                        group rank for its tokens, or the decode node), never
                                        from a cached prefix. Raw logits: no bias, penalty or
                                        temperature */
    int prompt_only;                 /* with prompt_logprobs: generate nothing, only score the
                                        prompt (a text's log-likelihood; max_tokens ignored) */
    /* Structured output (OpenAI's response_format; docs/http.md "Structured output"): the
     * completion is JSON valid against json_schema (a JSON Schema's text, the subset
     * docs/http.md lists), or any JSON object with json_object set; at most one of the two.
     * Enforced by masking the vocabulary at every step, on the prefill group and the decode
     * node, and across a migration. A schema the router cannot compile is refused with
     * PDM_CLIENT_EINVALID_ARGUMENT and a message naming the keyword. Not with beam search. */
    const char *json_schema;
    int json_object;
    /* OpenAI's n (docs/http.md "n"): choices of the prompt, 0/1 = one, at most 8. They share
     * one prefill, one KV transfer and the decode node's prompt KV; choice i samples with the
     * seed pdm_sampler_seed_for_choice(seed, i) (choice 0 keeps `seed`). The result holds each
     * in choices[] (its tokens/text are choice 0's); streamed chunks name their choice. Not
     * with beams or prompt_only. With several routers, a call whose router is lost after a
     * choice delivered tokens goes on per choice at the next router (docs/sdk.md
     * "Failover"): each unfinished choice as its own request with its seed and delivered
     * tokens, one after the other; chunks stay contiguous per choice, the result the same. */
    uint32_t n;
    /* Tools (chat only; docs/http.md "Tools"): OpenAI's tools list as JSON text ([{"type":
     * "function", "function": {"name", "description", "parameters"}}]), rendered by the
     * model's chat template (Qwen 2.5/3, Llama 3.x); tool_choice NULL/"auto", "none",
     * "required" or a function's name ("required" and a name are enforced with the grammar;
     * not with json_schema). Calls found in the output come back parsed: a choice's
     * tool_calls_json. */
    const char *tools_json;
    const char *tool_choice;
} pdm_client_request_t;

/* Fills r with the defaults (greedy, router defaults for the rest). */
void pdm_client_request_init(pdm_client_request_t *r);

typedef enum {
    PDM_CLIENT_FINISH_NONE = 0,
    PDM_CLIENT_FINISH_EOS = 1,
    PDM_CLIENT_FINISH_LENGTH = 2,
    PDM_CLIENT_FINISH_STOP = 3,
} pdm_client_finish_t;

typedef struct {
    int32_t *tokens;                 /* (n_tokens) */
    size_t n_tokens;
    char *text;
    double score;                    /* length-penalised log probability */
    double logprob;                  /* sum of the tokens' log probabilities */
    pdm_client_finish_t finish;      /* EOS: ended with end-of-generation; LENGTH: max_tokens */
} pdm_client_beam_t;

/* A token's log-probability (request.logprobs): log_softmax of the logits after logit_bias
 * and the penalties, at temperature 1, before top-k/top-p/min-p (docs/http.md). */
typedef struct pdm_client_logprob {
    int32_t token;
    float logprob;                   /* NAN when the router has none for this token */
    const char *text;                /* the token's bytes, NUL-terminated (text_len bytes; may
                                        be part of a UTF-8 character) */
    size_t text_len;
    const struct pdm_client_logprob *top; /* (n_top) the most likely tokens, most likely first;
                                        their own top is empty */
    size_t n_top;
} pdm_client_logprob_t;

/* One choice of a request with n > 1 (request.n), or the only one. */
typedef struct {
    uint32_t index;                  /* its index (0..n-1) */
    pdm_client_finish_t finish;
    int32_t *tokens;                 /* (n_tokens) */
    size_t n_tokens;
    char *text;                      /* NUL-terminated, never NULL */
    pdm_client_logprob_t *logprobs;  /* (n_logprobs) request.logprobs: one per token */
    size_t n_logprobs;
    char *tool_calls_json;           /* request.tools: the calls in text, OpenAI's tool_calls
                                        list as JSON text ([{"id", "type": "function",
                                        "function": {"name", "arguments"}}]); NULL: none */
    char *tool_content;              /* with tool_calls_json: the text outside the calls */
    uint32_t completion_tokens;      /* its usage (the prompt's is shared: result.usage) */
} pdm_client_choice_t;

/* The outcome of a call, owned by the caller; release with pdm_client_result_fini. Filled on
 * success AND on failure (status, error; tokens streamed before a failure are kept). */
typedef struct {
    int status;                      /* the call's return value */
    char error[256];                 /* "" on success */
    uint64_t id;                     /* client request id */
    uint64_t router_id;              /* the router's id (pdctl requests / cancel), 0 if unknown */
    pdm_client_finish_t finish;
    int32_t *tokens;                 /* (n_tokens) completion tokens */
    size_t n_tokens;
    char *text;                      /* completion text, NUL-terminated (never NULL after a call) */
    pdm_client_beam_t *beams;        /* (n_beams) beam search: n best, best first */
    size_t n_beams;
    struct {
        uint32_t prompt_tokens, completion_tokens, attempts, cached_tokens;
        double ttft_ms, tpot_ms, total_ms;   /* measured by the router */
        uint64_t kv_bytes;
        char prefill_method[32], prefill_group[64], decode_node[64];
    } usage;
    double client_ttft_ms;           /* call start -> first token received (streaming) */
    double client_total_ms;          /* call start -> end */
    pdm_client_logprob_t *logprobs;  /* (n_logprobs) request.logprobs: one per token */
    size_t n_logprobs;
    pdm_client_logprob_t *prompt_logprobs; /* (n_prompt_logprobs) request.prompt_logprobs: one
                                        per prompt token (the first's logprob is NAN) */
    size_t n_prompt_logprobs;
    pdm_client_choice_t *choices;    /* (n_choices) every choice, in index order (one when
                                        request.n <= 1; tokens/text above are choice 0's);
                                        usage.completion_tokens sums them */
    size_t n_choices;
    char *tool_calls_json;           /* choice 0's (request.tools), or NULL */
} pdm_client_result_t;

void pdm_client_result_fini(pdm_client_result_t *r);

/* Tokens [index, index + n_tokens) of the completion and the text they complete. The
 * pointers are valid during the callback only. */
typedef struct {
    uint64_t id;
    uint32_t choice;                 /* request.n > 1: the choice these tokens belong to */
    uint32_t index;                  /* in that choice's completion */
    const int32_t *tokens;
    size_t n_tokens;
    const char *text;
    size_t text_len;
    const pdm_client_logprob_t *logprobs; /* (n_logprobs) request.logprobs: one per token */
    size_t n_logprobs;
} pdm_client_chunk_t;

/* Streaming callback, run on the calling thread; return nonzero to cancel the call (it then
 * ends with PDM_CLIENT_ECANCELLED). */
typedef int (*pdm_client_chunk_cb)(const pdm_client_chunk_t *chunk, void *data);

/* A fresh request id (never reused by this client) for pdm_client_request_t.id. */
uint64_t pdm_client_new_id(pdm_client_t *c);

/* Blocking generation: returns when the router sent the final result or an error, or the
 * call timed out / was cancelled. `result` is always initialised (fini it). */
int pdm_client_generate(pdm_client_t *c, const pdm_client_request_t *req,
                        pdm_client_result_t *result);

/* Streaming generation: like pdm_client_generate, and cb is called for each chunk of tokens
 * as the router streams them, in order per choice (chunks of different choices interleave).
 * result->text/tokens hold the whole completion (choice 0's), result->choices every choice. */
int pdm_client_generate_stream(pdm_client_t *c, const pdm_client_request_t *req,
                               pdm_client_chunk_cb cb, void *data, pdm_client_result_t *result);

/* Cancels the call with this id from any thread: the blocked call returns
 * PDM_CLIENT_ECANCELLED at once and the router is told to stop. If no call with that id is
 * open, returns PDM_CLIENT_ENOT_FOUND but remembers the id (last 64), so a call that starts
 * with it afterwards is cancelled at once: no race between starting and cancelling. */
int pdm_client_cancel(pdm_client_t *c, uint64_t id);

#ifdef __cplusplus
}
#endif

#endif /* PDMESH_CLIENT_H */
