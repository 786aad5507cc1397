/*
 * api.c - the router's interface to its front ends (router/router.h): admission of a
 * GenerateRequest (limits, tokenization, chat template, sampling and beam checks) into the
 * request state machine, cancellation, readiness, and the read-only accessors. Called by
 * zfront.c, admin.c and http.c on the loop thread.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/beams.h"
#include "router/registry.h"
#include "router/request.h"

static int rt_refuse(int *code, int c, int st, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int rt_refuse(int *code, int c, int st, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    *code = c;
    return pdm_error_set(st, "%s", msg);
}

/* Renders the conversation (with tools_json, may be NULL) and tokenizes it. Tools, tool calls
 * and tool results take the template's tool rules (model/chat.h), which only some families
 * have: the others refuse them with PDM_EUNSUPPORTED. */
static int rt_render_chat(pdm_router_t *r, const Pdmesh__ChatMessage *const *msgs, size_t n,
                          const char *tools_json, int32_t **out, size_t *n_out)
{
    if (!r->model || !r->model->tokenizer) return pdm_error_set(PDM_ESTATE, "no tokenizer");
    if (n == 0 || n > 256) return pdm_error_set(PDM_EINVAL, "chat needs 1 to 256 messages");
    const char *roles[256], *contents[256];
    pdm_chat_msg_t full[256];
    int with_tools = tools_json && tools_json[0];
    for (size_t i = 0; i < n; i++) {
        roles[i] = msgs[i]->role ? msgs[i]->role : "";
        contents[i] = msgs[i]->content ? msgs[i]->content : "";
        const char *calls = msgs[i]->tool_calls_json && msgs[i]->tool_calls_json[0]
                                ? msgs[i]->tool_calls_json : NULL;
        full[i] = (pdm_chat_msg_t){roles[i], contents[i], calls};
        if (calls || !strcmp(roles[i], "tool")) with_tools = 1;
        if (calls && strcmp(roles[i], "assistant"))
            return pdm_error_set(PDM_EINVAL, "chat message %zu has tool calls but the role "
                                 "\"%.32s\" (only assistant)", i, roles[i]);
        if (strcmp(roles[i], "system") && strcmp(roles[i], "user") &&
            strcmp(roles[i], "assistant") && strcmp(roles[i], "tool"))
            return pdm_error_set(PDM_EINVAL, "chat role \"%.32s\" is not system, user, assistant "
                                 "or tool", roles[i]);
    }
    char *text = with_tools ? pdm_tokenizer_chat_render_tools(r->model->tokenizer, full, (int)n,
                                                              tools_json, 1)
                            : pdm_tokenizer_chat_render(r->model->tokenizer, roles, contents,
                                                        (int)n, 1);
    if (!text) {
        char why[256]; /* the tokenizer's reason (no known format: names --chat-template) */
        snprintf(why, sizeof(why), "%s", pdm_error_last());
        return pdm_error_set(PDM_EUNSUPPORTED, "cannot apply the chat template: %s", why);
    }
    size_t len = strlen(text), need = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (len + 8));
    int st = ids ? pdm_tokenizer_encode(r->model->tokenizer, text, len,
                                        PDM_TOKENIZE_ADD_BOS | PDM_TOKENIZE_SPECIAL, ids, len + 8, &need)
                 : PDM_ENOMEM;
    free(text);
    if (st) {
        free(ids);
        return pdm_error_set(st, "cannot tokenize the chat");
    }
    *out = ids;
    *n_out = need;
    return PDM_OK;
}

int pdm_router_render_chat(pdm_router_t *r, const Pdmesh__ChatMessage *const *msgs, size_t n,
                           int32_t **out, size_t *n_out)
{
    return rt_render_chat(r, msgs, n, NULL, out, n_out);
}

/* tool_choice "required" or a function's name: the schema that forces one call in the
 * template's syntax, into *out (malloc'd); NULL for "", "auto" and "none". */
static int rt_tool_schema(pdm_router_t *r, const Pdmesh__GenerateRequest *req, char **out)
{
    const char *choice = req->tool_choice ? req->tool_choice : "";
    *out = NULL;
    if (!choice[0] || !strcmp(choice, "auto") || !strcmp(choice, "none")) return PDM_OK;
    if (!req->tools_json || !req->tools_json[0])
        return pdm_error_set(PDM_EINVAL, "tool_choice \"%.64s\" needs tools", choice);
    if (req->sampling && req->sampling->json_schema && req->sampling->json_schema[0])
        return pdm_error_set(PDM_EINVAL, "tool_choice \"%.64s\" cannot be combined with "
                             "response_format", choice);
    char *schema = pdm_chat_tool_call_schema(pdm_tokenizer_chat_format(r->model->tokenizer),
                                             req->tools_json,
                                             strcmp(choice, "required") ? choice : NULL);
    if (!schema) return PDM_EINVAL;
    pdm_grammar_t *gr = NULL;
    if (pdm_grammar_compile(schema, strlen(schema), &gr)) {
        char why[400];
        snprintf(why, sizeof(why), "%s", pdm_error_last());
        free(schema);
        return pdm_error_set(PDM_EINVAL, "tools: a function's parameters: %s", why);
    }
    pdm_grammar_destroy(gr);
    *out = schema;
    return PDM_OK;
}

static int rt_tokenize(pdm_router_t *r, const char *text, int32_t **out, size_t *n_out)
{
    size_t len = strlen(text), need = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (len + 8));
    if (!ids) return PDM_ENOMEM;
    int st = pdm_tokenizer_encode(r->model->tokenizer, text, len, PDM_TOKENIZE_ADD_BOS, ids,
                                  len + 8, &need);
    if (st) {
        free(ids);
        return st;
    }
    *out = ids;
    *n_out = need;
    return PDM_OK;
}

/* The log-probability entries (tokens x (1 + alternatives)) whose GenerateResult surely fits
 * a frame: each entry packs to at most 24 bytes plus its token's text, and each token's text
 * appears once more in the result's text, so entries x (2 x longest token + 24) stays within
 * the frame less 64 KiB for the rest. Capped at RT_MAX_LOGPROB_ENTRIES; computed once. */
static uint32_t rt_logprob_entries_max(pdm_router_t *r)
{
    if (r->lp_max_entries) return r->lp_max_entries;
    char piece[256];
    int longest = 1;
    for (uint32_t t = 0; t < r->model->hp.n_vocab; t++) {
        int w = pdm_tokenizer_token_bytes(r->model->tokenizer, (int32_t)t, 1, piece,
                                          sizeof(piece));
        if (w > longest) longest = w;
    }
    uint64_t fit = ((uint64_t)PDM_WIRE_MAX_FRAME - 65536) / (2u * (uint64_t)longest + 24);
    r->lp_max_entries = (uint32_t)PDM_MIN(fit, (uint64_t)RT_MAX_LOGPROB_ENTRIES);
    return r->lp_max_entries;
}

static int rt_has_decode(const pdm_router_t *r)
{
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (rt_node_usable(r, i) && r->nodes[i].role == PDMESH__ROLE__ROLE_DECODE) return 1;
    return 0;
}

int pdm_router_ready(const pdm_router_t *r) { return rt_has_decode(r); }

/* Whether some usable decode node runs n samples over one prompt (their rows as a beam
 * search's: Capacity.max_beams). */
static int rt_nsamp_any_node(const pdm_router_t *r, uint32_t n)
{
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (rt_node_usable(r, i) && r->nodes[i].role == PDMESH__ROLE__ROLE_DECODE &&
            r->nodes[i].max_beams >= n)
            return 1;
    return 0;
}

/* OpenAI's n: q (choice 0, admitted) and n - 1 more choices, choice i seeded with
 * pdm_sampler_seed_for_choice(seed, i), each with its sink; with `shared` a leader carries
 * their one attempt (internal.h). All enqueued, ids[i] = choice i's id; PDM_ENOMEM and
 * nothing enqueued (q freed) when out of memory. */
static int rt_submit_choices(pdm_router_t *r, rt_req_t *q, uint32_t n, int shared,
                             const pdm_router_sink_t *sinks, uint64_t *ids)
{
    rt_req_t *ch[RT_MAX_CHOICES] = {q}, *lead = NULL;
    int ok = 1;
    for (uint32_t i = 1; i < n; i++) ok &= (ch[i] = rt_req_clone(q)) != NULL;
    if (ok && shared) ok = (lead = rt_req_clone(q)) != NULL;
    if (!ok) {
        for (uint32_t i = 0; i < n; i++) rt_req_free(ch[i]);
        rt_req_free(lead);
        return pdm_error_set(PDM_ENOMEM, "out of memory");
    }
    if (lead) {
        lead->id = ++r->next_id;
        memset(&lead->sink, 0, sizeof(lead->sink));
        lead->n_samples = n;
        rt_req_enqueue(r, lead); /* before its choices: a scheduling pass meets it first */
    }
    for (uint32_t i = 0; i < n; i++) {
        rt_req_t *c = ch[i];
        if (i > 0) {
            c->id = ++r->next_id;
            c->sp.seed = pdm_sampler_seed_for_choice(q->sp.seed, (int)i);
        }
        c->sink = sinks[i];
        if (lead) {
            lead->choice[i] = c;
            c->leader = lead;
            c->choice_index = i;
            c->state = RQ_SHARED;
        }
        rt_req_enqueue(r, c);
        ids[i] = c->id;
    }
    return PDM_OK;
}

int pdm_router_submit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, const char *client,
                      const pdm_router_sink_t *sinks, uint64_t *ids, int *code)
{
    const int INV = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
    const pdm_router_sink_t *sink = sinks;
    const uint32_t n_choices = req->n ? req->n : 1;
    if (n_choices > RT_MAX_CHOICES)
        return rt_refuse(code, INV, PDM_EINVAL, "n %u: at most %d choices", req->n,
                         RT_MAX_CHOICES);
    if (n_choices > 1 && (req->beams > 1 || req->n_resume_tokens || req->prompt_only))
        return rt_refuse(code, INV, PDM_EINVAL, "n %u cannot be combined with beams, "
                         "resume_tokens or prompt_only", n_choices);
    if (req->resume_choice && (n_choices > 1 || req->beams > 1 || req->prompt_only))
        return rt_refuse(code, INV, PDM_EINVAL, "resume_choice (one choice of n going on "
                         "alone) cannot be combined with n > 1, beams or prompt_only");
    int kinds = (req->prompt && req->prompt[0]) + (req->n_prompt_tokens > 0) + (req->n_messages > 0);
    if (kinds != 1)
        return rt_refuse(code, INV, PDM_EINVAL, "give exactly one of prompt, prompt_tokens or messages");
    if (req->model && req->model[0] && strcmp(req->model, r->model_name))
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_NOT_FOUND, PDM_ENOTFOUND,
                         "model \"%.64s\" is not served (this router serves \"%s\")", req->model,
                         r->model_name);
    if (req->prompt_only && !req->prompt_logprobs)
        return rt_refuse(code, INV, PDM_EINVAL, "prompt_only needs prompt_logprobs");
    if (req->prompt_logprobs && req->beams > 1)
        return rt_refuse(code, INV, PDM_EINVAL, "prompt_logprobs are not reported with beam "
                         "search");
    /* scoring only: one token's room is reserved as for any request, none is generated */
    uint32_t max_new = req->prompt_only ? 1
                       : req->max_tokens ? req->max_tokens : r->cfg.default_max_tokens;
    if (r->cfg.max_tokens && max_new > r->cfg.max_tokens)
        return rt_refuse(code, INV, PDM_EINVAL, "max_tokens %u over the limit of %u", max_new,
                         r->cfg.max_tokens);
    if (req->n_stop > RT_MAX_STOPS)
        return rt_refuse(code, INV, PDM_EINVAL, "at most %d stop strings", RT_MAX_STOPS);
    for (size_t i = 0; i < req->n_stop; i++)
        if (!req->stop[i] || strlen(req->stop[i]) > 256)
            return rt_refuse(code, INV, PDM_EINVAL, "a stop string is longer than 256 bytes");
    if (req->deadline_ms > 3600u * 1000u)
        return rt_refuse(code, INV, PDM_EINVAL, "deadline_ms over one hour");
    pdm_sampler_params_t sp;
    if (pdm_sampler_params_from_msg(req->sampling, &sp))
        return rt_refuse(code, INV, PDM_EINVAL, "sampling: %s", pdm_error_last());
    if (sp.json_schema) { /* a schema we cannot compile is the client's error, here */
        pdm_grammar_t *gr = NULL;
        if (req->beams > 1)
            return rt_refuse(code, INV, PDM_EINVAL, "response_format (json_schema) is not "
                             "supported with beam search");
        if (pdm_grammar_compile(sp.json_schema, strlen(sp.json_schema), &gr))
            return rt_refuse(code, INV, PDM_EINVAL, "%s", pdm_error_last());
        pdm_grammar_destroy(gr);
    }
    for (int32_t i = 0; i < sp.n_bias; i++)
        if ((uint32_t)sp.bias_ids[i] >= r->model->hp.n_vocab)
            return rt_refuse(code, INV, PDM_EINVAL, "sampling: logit_bias names token %d, "
                             "outside the vocabulary of %u", sp.bias_ids[i], r->model->hp.n_vocab);
    /* Log-probabilities are kept for every token until the result, which must fit a frame. */
    const uint32_t lp_stride = sp.logprobs >= 0 ? 1u + (uint32_t)sp.logprobs : 0;
    if (lp_stride && (uint64_t)max_new * lp_stride > rt_logprob_entries_max(r))
        return rt_refuse(code, INV, PDM_EINVAL, "logprobs: max_tokens (%u) x (1 + top_logprobs "
                         "%d) is over %u entries; ask for fewer tokens or alternatives", max_new,
                         sp.logprobs, rt_logprob_entries_max(r));
    if (lp_stride && req->beams > 1)
        return rt_refuse(code, INV, PDM_EINVAL, "logprobs are not reported with beam search");
    int open_ = 0;
    for (rt_req_t *q = r->head; q; q = q->next) open_ += !strcmp(q->client, client ? client : "");
    if (r->cfg.per_client_max && open_ >= r->cfg.per_client_max)
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_OVERLOADED, PDM_EOVERFLOW,
                         "this client already has %d open requests (the limit)", open_);
    if (r->n_req + (int)n_choices + (n_choices > 1) > r->cfg.queue_max) { /* (+ n's leader) */
        pdm_metric_inc(r->m.requests, "overloaded", 1);
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_OVERLOADED, PDM_EOVERFLOW,
                         "overloaded: %d requests are open (the admission limit)", r->n_req);
    }
    if (!rt_has_decode(r))
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, PDM_ESTATE,
                         "no decode node is available");
    if (req->n_resume_tokens) { /* checked here; rt_req_resume then only needs memory */
        if (req->n_resume_tokens > max_new || req->beams > 1 || req->prompt_only)
            return rt_refuse(code, INV, PDM_EINVAL, "resume: %zu delivered tokens do not fit "
                             "max_tokens %u (or beams / prompt_only were asked)",
                             req->n_resume_tokens, max_new);
        for (size_t i = 0; i < req->n_resume_tokens; i++)
            if (req->resume_tokens[i] < 0 ||
                (uint32_t)req->resume_tokens[i] >= r->model->hp.n_vocab)
                return rt_refuse(code, INV, PDM_EINVAL, "resume token %d is outside the "
                                 "vocabulary", req->resume_tokens[i]);
    }
    int32_t *tok = NULL;
    size_t n = 0;
    if (req->n_prompt_tokens) {
        if (req->n_prompt_tokens > r->cfg.max_prompt_tokens)
            return rt_refuse(code, INV, PDM_EINVAL, "%zu prompt tokens over the limit of %u",
                             req->n_prompt_tokens, r->cfg.max_prompt_tokens);
        for (size_t i = 0; i < req->n_prompt_tokens; i++)
            if (req->prompt_tokens[i] < 0 || (uint32_t)req->prompt_tokens[i] >= r->model->hp.n_vocab)
                return rt_refuse(code, INV, PDM_EINVAL, "prompt token %d is outside the vocabulary",
                                 req->prompt_tokens[i]);
        tok = malloc(sizeof(int32_t) * req->n_prompt_tokens);
        if (!tok) return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
        memcpy(tok, req->prompt_tokens, sizeof(int32_t) * req->n_prompt_tokens);
        n = req->n_prompt_tokens;
    } else {
        if (req->prompt && strlen(req->prompt) > (size_t)r->cfg.max_prompt_tokens * 64)
            return rt_refuse(code, INV, PDM_EINVAL, "prompt text too long");
        int st = req->prompt && req->prompt[0] ? rt_tokenize(r, req->prompt, &tok, &n)
                             : rt_render_chat(r, (const Pdmesh__ChatMessage *const *)req->messages,
                                              req->n_messages, req->tools_json, &tok, &n);
        if (st) return rt_refuse(code, INV, PDM_EINVAL, "prompt: %s", pdm_error_last());
    }
    if (n == 0 || n > r->cfg.max_prompt_tokens || n + max_new > r->model->hp.n_ctx_train) {
        free(tok);
        return rt_refuse(code, INV, PDM_EINVAL, "%zu prompt tokens + %u new tokens do not fit "
                         "(prompt limit %u, context %u)", n, max_new, r->cfg.max_prompt_tokens,
                         r->model->hp.n_ctx_train);
    }
    /* The prompt's entries travel in the same result. */
    const uint32_t plp_stride =
        req->prompt_logprobs ? 1u + (uint32_t)(sp.logprobs > 0 ? sp.logprobs : 0) : 0;
    if (plp_stride && (uint64_t)n * plp_stride + (uint64_t)max_new * lp_stride >
                          rt_logprob_entries_max(r)) {
        free(tok);
        return rt_refuse(code, INV, PDM_EINVAL, "prompt logprobs: %zu prompt tokens x (1 + %d "
                         "alternatives) with the completion's are over %u entries", n,
                         sp.logprobs > 0 ? sp.logprobs : 0, rt_logprob_entries_max(r));
    }
    if (plp_stride && n < 2) {
        free(tok);
        return rt_refuse(code, INV, PDM_EINVAL, "prompt logprobs need a prompt of at least 2 "
                         "tokens");
    }
    char *schema = NULL;
    if (rt_tool_schema(r, req, &schema)) {
        free(tok);
        return rt_refuse(code, INV, PDM_EINVAL, "%s", pdm_error_last());
    }
    if (schema && req->beams > 1) {
        free(tok);
        free(schema);
        return rt_refuse(code, INV, PDM_EINVAL, "tool_choice is not supported with beam search");
    }
    if (!schema && sp.json_schema && !(schema = strdup(sp.json_schema))) {
        free(tok);
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
    }
    rt_req_t *q = calloc(1, sizeof(*q));
    if (q) q->gen = malloc(sizeof(int32_t) * max_new);
    if (q && plp_stride) {
        q->plp_stride = plp_stride;
        q->plp_ids = malloc(sizeof(int32_t) * n * plp_stride);
        q->plp_vals = malloc(sizeof(float) * n * plp_stride);
        q->plp_n = malloc(n);
        if (!q->plp_ids || !q->plp_vals || !q->plp_n) {
            rt_req_free(q); /* neither tok nor schema is q's yet */
            free(tok);
            free(schema);
            return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
        }
        q->want_plp = 1;
        q->prompt_only = req->prompt_only;
    }
    if (q && lp_stride) {
        q->lp_stride = lp_stride;
        q->lp_ids = malloc(sizeof(int32_t) * max_new * lp_stride);
        q->lp_vals = malloc(sizeof(float) * max_new * lp_stride);
        q->lp_n = malloc(max_new);
    }
    if (!q || !q->gen || (lp_stride && (!q->lp_ids || !q->lp_vals || !q->lp_n))) {
        rt_req_free(q);
        free(tok);
        free(schema);
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
    }
    int bst = rt_beams_admit(r, req, q, code);
    if (bst) {
        rt_req_free(q);
        free(tok);
        free(schema);
        return bst;
    }
    q->id = ++r->next_id;
    q->client_id = req->request_id;
    q->sink = *sink;
    snprintf(q->client, sizeof(q->client), "%s", client ? client : "");
    q->prompt = tok;
    q->n_prompt = (uint32_t)n;
    q->max_new = max_new;
    q->sp = sp;
    if (sp.n_bias) {
        memcpy(q->bias_ids, sp.bias_ids, sizeof(int32_t) * (size_t)sp.n_bias);
        memcpy(q->bias_values, sp.bias_values, sizeof(float) * (size_t)sp.n_bias);
    }
    q->sp.bias_ids = q->bias_ids;
    q->sp.bias_values = q->bias_values;
    q->sp.json_schema = q->json_schema = schema; /* the request owns it from here */
    for (size_t i = 0; i < req->n_stop; i++)
        if (req->stop[i][0]) q->stops[q->n_stops++] = strdup(req->stop[i]);
    q->ignore_eos = req->ignore_eos;
    q->tools = req->n_messages && req->tools_json && req->tools_json[0] &&
               !(req->tool_choice && !strcmp(req->tool_choice, "none"));
    q->t_arrival = pdm_now();
    q->deadline = q->t_arrival + (req->deadline_ms ? req->deadline_ms : r->cfg.default_deadline_ms) / 1e3;
    q->dnode = q->group = -1;
    pdm_detok_init(&q->detok, 0);
    if (req->n_resume_tokens && rt_req_resume(r, q, req->resume_tokens, req->n_resume_tokens,
                                              req->resume_text_bytes)) {
        int st = rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "%s",
                           pdm_error_last());
        rt_req_free(q); /* with its prompt (tok) and schema */
        return st;
    }
    if (req->n_resume_tokens) pdm_metric_inc(r->m.requests, "resumed", 1);
    /* A choice of n that a client fails over (GenerateRequest.resume_choice) runs as this
     * router's own choices run once their shared attempt failed (rt_leader_end), so that its
     * tokens are the ones the shared run would have given. Choices with prompt log-
     * probabilities never share an attempt (below): theirs is a plain request's resume. */
    q->resumed_choice = req->resume_choice && !q->want_plp;
    if (req->resume_choice && req->n_resume_tokens)
        pdm_metric_inc(r->m.requests, "resumed_choice", 1);
    if (n_choices > 1) {
        /* One prompt for every choice where a decode node can share it (prompt log-
         * probabilities are computed per attempt: those choices go alone, as before) */
        const int shared = !q->want_plp && rt_nsamp_any_node(r, n_choices);
        if (rt_submit_choices(r, q, n_choices, shared, sinks, ids))
            return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
        return PDM_OK;
    }
    rt_req_enqueue(r, q);
    *ids = q->id;
    return PDM_OK;
}

int pdm_router_cancel(pdm_router_t *r, uint64_t id)
{
    rt_req_t *q = rt_req_find(r, id);
    if (!q) return pdm_error_set(PDM_ENOTFOUND, "request %llu is not open", (unsigned long long)id);
    rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_CANCELLED, "cancelled");
    return PDM_OK;
}

uv_loop_t *pdm_router_loop(pdm_router_t *r) { return r->loop; }
const char *pdm_router_model_name(const pdm_router_t *r) { return r->model_name; }
const pdm_router_limits_t *pdm_router_limits(const pdm_router_t *r) { return &r->limits; }
struct pdm_metrics *pdm_router_metrics(pdm_router_t *r)
{
    rt_node_metrics(r);
    return r->m.reg;
}

int pdm_router_tokenize(pdm_router_t *r, const char *text, size_t len, int add_special,
                        int32_t **out, size_t *n_out)
{
    const int flags = PDM_TOKENIZE_SPECIAL | (add_special ? PDM_TOKENIZE_ADD_BOS : 0);
    size_t cap = len + 8, need = 0;
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    if (!ids) return pdm_error_set(PDM_ENOMEM, "out of memory");
    int st = pdm_tokenizer_encode(r->model->tokenizer, text, len, flags, ids, cap, &need);
    if (st) {
        free(ids);
        return pdm_error_set(PDM_EINVAL, "cannot tokenize the text");
    }
    *out = ids;
    *n_out = need;
    return PDM_OK;
}

int pdm_router_token_text(pdm_router_t *r, int32_t id, char *buf, size_t cap)
{
    if (id < 0 || (uint32_t)id >= r->model->hp.n_vocab) return PDM_ERANGE;
    return pdm_tokenizer_token_bytes(r->model->tokenizer, id, 1, buf, cap);
}

int32_t pdm_router_special_token(pdm_router_t *r, int which)
{
    return which == 0 ? pdm_tokenizer_bos(r->model->tokenizer)
                      : pdm_tokenizer_eos(r->model->tokenizer);
}
