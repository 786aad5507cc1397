/*
 * http_openai.c - OpenAI request and response JSON <-> pdmesh client messages (no I/O).
 *
 * Accepted request fields (everything else is ignored, as OpenAI-compatible servers do, except
 * the few listed as refused whose silent omission would change the answer):
 *   model, prompt (string, [string], [int...], [[int...]]) | messages ([{role, content}]),
 *   max_tokens / max_completion_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
 *   seed, presence_penalty, frequency_penalty, logit_bias, logprobs (completions: an integer
 *   0..20; chat: a boolean) and top_logprobs (chat, 0..20), stop (string or list), stream,
 *   stream_options.include_usage, n (1..8: GenerateRequest.n, the choices of a prompt share
 *   its prefill and KV), best_of (beams),
 *   ignore_eos, user, response_format (text, json_object, json_schema: grammar-constrained
 *   sampling, model/grammar.h), tools and tool_choice (chat; rendered by the router with the
 *   template, model/chat.h), messages of role tool and assistant messages with tool_calls.
 * With tools, tool calls in the output become choices[].message.tool_calls (streamed: OpenAI's
 * tool_calls deltas, pdm_http__tool_stream_feed).
 * Log-probabilities come back in OpenAI's shapes (https://platform.openai.com/docs/api-reference
 * /completions/object: choices[].logprobs = {tokens, token_logprobs, top_logprobs,
 * text_offset}; /chat/object: choices[].logprobs.content = [{token, logprob, bytes,
 * top_logprobs: [{token, logprob, bytes}]}]), streamed chunks carrying their tokens' entries.
 */
#include "router/http_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "common/wire.h"
#include "model/model.h"

/* OpenAI's n: at most the samples a decode node can share one prompt among (PDM_NSAMP_MAX in
 * decode_node/nsamp.h, which the router does not include). */
#define PDM_HTTP_MAX_N 8

static int fail(pdm_http_err_t *err, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(pdm_http_err_t *err, int status, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    err->status = status;
    err->code = code;
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return PDM_EINVAL;
}

void pdm_http__request_free(Pdmesh__GenerateRequest *req)
{
    if (!req) return;
    if (req->prompt != protobuf_c_empty_string) free(req->prompt);
    if (req->model != protobuf_c_empty_string) free(req->model);
    free(req->prompt_tokens);
    for (size_t i = 0; i < req->n_messages; i++) {
        Pdmesh__ChatMessage *m = req->messages[i];
        if (!m) continue;
        if (m->role != protobuf_c_empty_string) free(m->role);
        if (m->content != protobuf_c_empty_string) free(m->content);
        if (m->tool_calls_json != protobuf_c_empty_string) free(m->tool_calls_json);
        if (m->tool_call_id != protobuf_c_empty_string) free(m->tool_call_id);
        free(m);
    }
    free(req->messages);
    if (req->tools_json != protobuf_c_empty_string) free(req->tools_json);
    if (req->tool_choice != protobuf_c_empty_string) free(req->tool_choice);
    for (size_t i = 0; i < req->n_stop; i++) free(req->stop[i]);
    free(req->stop);
    if (req->sampling) {
        free(req->sampling->logit_bias_ids);
        free(req->sampling->logit_bias_values);
        if (req->sampling->json_schema != protobuf_c_empty_string) free(req->sampling->json_schema);
    }
    free(req->sampling);
    free(req);
}

/* A number field: absent -> *present = 0. Type errors are 400s naming the field. */
static int get_number(const cJSON *obj, const char *name, double lo, double hi, double *out,
                      int *present, pdm_http_err_t *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    *present = 0;
    if (!v || cJSON_IsNull(v)) return PDM_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return fail(err, 400, "invalid_type", "'%s' must be a number", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return fail(err, 400, "invalid_value", "'%s' must be between %g and %g (got %g)", name,
                    lo, hi, v->valuedouble);
    *out = v->valuedouble;
    *present = 1;
    return PDM_OK;
}

static int get_integer(const cJSON *obj, const char *name, double lo, double hi, double *out,
                       int *present, pdm_http_err_t *err)
{
    int st = get_number(obj, name, -INFINITY, INFINITY, out, present, err);
    if (st || !*present) return st;
    if (*out != floor(*out)) return fail(err, 400, "invalid_type", "'%s' must be an integer", name);
    if (*out < lo || *out > hi)
        return fail(err, 400, "invalid_value", "'%s' must be between %.0f and %.0f (got %.0f)",
                    name, lo, hi, *out);
    return PDM_OK;
}

static int get_bool(const cJSON *obj, const char *name, int *out, pdm_http_err_t *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!v || cJSON_IsNull(v)) return PDM_OK;
    if (!cJSON_IsBool(v)) return fail(err, 400, "invalid_type", "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v);
    return PDM_OK;
}

static char *dup_or_empty(const char *s)
{
    return s && *s ? strdup(s) : (char *)protobuf_c_empty_string;
}

/* An array of token ids into req->prompt_tokens. */
static int take_token_array(const cJSON *arr, Pdmesh__GenerateRequest *req, uint32_t max_prompt,
                            pdm_http_err_t *err)
{
    int n = cJSON_GetArraySize(arr);
    if (n <= 0) return fail(err, 400, "invalid_value", "'prompt' is empty");
    if (max_prompt && (uint32_t)n > max_prompt)
        return fail(err, 400, "context_length_exceeded",
                    "the prompt has %d tokens; this server accepts at most %u", n, max_prompt);
    req->prompt_tokens = malloc((size_t)n * sizeof(int32_t));
    if (!req->prompt_tokens) return fail(err, 500, "internal_error", "out of memory");
    size_t i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, arr) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) ||
            t->valuedouble < 0 || t->valuedouble > INT32_MAX)
            return fail(err, 400, "invalid_type",
                        "'prompt' token ids must be non-negative integers");
        req->prompt_tokens[i++] = (int32_t)t->valuedouble;
    }
    req->n_prompt_tokens = i;
    return PDM_OK;
}

/* How many prompts the body's "prompt" holds: 1 for a string or a list of token ids, else the
 * length of the list (of strings or lists of token ids). 0 with err set when it is none of
 * those. */
static int prompt_count(const cJSON *root, pdm_http_err_t *err)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (!p || cJSON_IsNull(p)) return fail(err, 400, "missing_field", "'prompt' is required"), 0;
    if (cJSON_IsString(p)) return 1;
    if (!cJSON_IsArray(p))
        return fail(err, 400, "invalid_type", "'prompt' must be a string, a list of token ids, "
                    "or a list of those"), 0;
    int n = cJSON_GetArraySize(p);
    if (n == 0) return fail(err, 400, "invalid_value", "'prompt' is empty"), 0;
    if (cJSON_IsNumber(cJSON_GetArrayItem(p, 0))) return 1;
    if (n > PDM_HTTP_MAX_PROMPTS)
        return fail(err, 400, "invalid_value", "'prompt' holds %d prompts (at most %d)", n,
                    PDM_HTTP_MAX_PROMPTS), 0;
    return n;
}

/* Prompt `index` of the body (prompt_count says how many) into req. */
static int take_prompt(const cJSON *root, int index, Pdmesh__GenerateRequest *req,
                       uint32_t max_prompt, pdm_http_err_t *err)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (!p || cJSON_IsNull(p)) return fail(err, 400, "missing_field", "'prompt' is required");
    if (cJSON_IsString(p)) {
        if (!p->valuestring[0]) return fail(err, 400, "invalid_value", "'prompt' is empty");
        req->prompt = strdup(p->valuestring);
        return req->prompt ? PDM_OK : fail(err, 500, "internal_error", "out of memory");
    }
    const cJSON *first = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsNumber(first)) return take_token_array(p, req, max_prompt, err);
    const cJSON *one = cJSON_GetArrayItem(p, index);
    if (cJSON_IsString(one)) {
        if (!one->valuestring[0])
            return fail(err, 400, "invalid_value", "'prompt[%d]' is empty", index);
        req->prompt = strdup(one->valuestring);
        return req->prompt ? PDM_OK : fail(err, 500, "internal_error", "out of memory");
    }
    if (cJSON_IsArray(one)) return take_token_array(one, req, max_prompt, err);
    return fail(err, 400, "invalid_type",
                "'prompt' must be a string, a list of token ids, or a list of those");
}

/* A message's content: a string, or a list of parts of which only {"type":"text"} is
 * understood (their texts are concatenated). Returns a malloc'ed string or NULL (err set). */
static char *message_content(const cJSON *c, int index, pdm_http_err_t *err)
{
    if (!c || cJSON_IsNull(c)) return strdup("");
    if (cJSON_IsString(c)) return strdup(c->valuestring);
    if (!cJSON_IsArray(c)) {
        fail(err, 400, "invalid_type", "'messages[%d].content' must be a string or a list", index);
        return NULL;
    }
    size_t len = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 ||
            !cJSON_IsString(text)) {
            fail(err, 400, "unsupported_value",
                 "'messages[%d].content': only parts of type \"text\" are supported", index);
            return NULL;
        }
        len += strlen(text->valuestring);
    }
    char *out = malloc(len + 1);
    if (!out) {
        fail(err, 500, "internal_error", "out of memory");
        return NULL;
    }
    size_t at = 0;
    cJSON_ArrayForEach(part, c) {
        const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
        size_t l = strlen(t);
        memcpy(out + at, t, l);
        at += l;
    }
    out[at] = 0;
    return out;
}

/* A function name as OpenAI accepts it: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'. */
static int valid_function_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64) return 0;
    for (const char *p = s; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '_' || *p == '-'))
            return 0;
    return 1;
}

/* An assistant message's tool_calls ([{"id", "type": "function", "function": {"name",
 * "arguments": JSON text}}]) kept as JSON text for the template; a tool message's
 * tool_call_id. */
static int take_tool_fields(const cJSON *m, const char *role, int i, Pdmesh__ChatMessage *cm,
                            pdm_http_err_t *err)
{
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    if (calls && !cJSON_IsNull(calls) && !(cJSON_IsArray(calls) && !calls->child)) {
        if (strcmp(role, "assistant"))
            return fail(err, 400, "invalid_value", "'messages[%d].tool_calls' belongs to an "
                        "assistant message", i);
        if (!cJSON_IsArray(calls))
            return fail(err, 400, "invalid_type", "'messages[%d].tool_calls' must be a list", i);
        int k = 0;
        const cJSON *c;
        cJSON_ArrayForEach(c, calls) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
            const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
            if (!cJSON_IsObject(fn) || !cJSON_IsString(name) ||
                !valid_function_name(name->valuestring))
                return fail(err, 400, "invalid_value", "'messages[%d].tool_calls[%d].function."
                            "name' must be a function name", i, k);
            if (args && !cJSON_IsString(args) && !cJSON_IsObject(args))
                return fail(err, 400, "invalid_type", "'messages[%d].tool_calls[%d].function."
                            "arguments' must be a JSON string", i, k);
            k++;
        }
        if (!(cm->tool_calls_json = cJSON_PrintUnformatted(calls))) {
            cm->tool_calls_json = (char *)protobuf_c_empty_string;
            return fail(err, 500, "internal_error", "out of memory");
        }
    }
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "tool_call_id");
    if (!strcmp(role, "tool") && id && !cJSON_IsNull(id)) {
        if (!cJSON_IsString(id))
            return fail(err, 400, "invalid_type", "'messages[%d].tool_call_id' must be a string",
                        i);
        cm->tool_call_id = dup_or_empty(id->valuestring);
        if (!cm->tool_call_id) {
            cm->tool_call_id = (char *)protobuf_c_empty_string;
            return fail(err, 500, "internal_error", "out of memory");
        }
    }
    return PDM_OK;
}

/* tools ([{"type": "function", "function": {"name", "description", "parameters"}}], at most
 * PDM_HTTP_MAX_TOOLS) and tool_choice ("none" | "auto" | "required" | {"type": "function",
 * "function": {"name"}}; "auto" by default with tools), OpenAI's chat fields
 * (https://platform.openai.com/docs/api-reference/chat/create). The tools travel as JSON text
 * for the router to render with the template; "required" and a name are enforced there with
 * the grammar (router/api.c); opts->tools says that the output is parsed for calls. */
static int take_tools(const cJSON *root, int chat, Pdmesh__GenerateRequest *req,
                      pdm_http_opts_t *opts, pdm_http_err_t *err)
{
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    const cJSON *choice = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    int have_tools = tools && !cJSON_IsNull(tools) && !(cJSON_IsArray(tools) && !tools->child);
    int have_choice = choice && !cJSON_IsNull(choice);
    if (!have_tools && !have_choice) return PDM_OK;
    if (!chat)
        return fail(err, 400, "unsupported_value", "'%s' belongs to /v1/chat/completions",
                    have_tools ? "tools" : "tool_choice");
    if (!have_tools) {
        /* "none" without tools is harmless; anything else asks for a call we cannot make */
        if (cJSON_IsString(choice) && !strcmp(choice->valuestring, "none")) return PDM_OK;
        return fail(err, 400, "invalid_value", "'tool_choice' needs 'tools'");
    }
    if (!cJSON_IsArray(tools))
        return fail(err, 400, "invalid_type", "'tools' must be a list");
    if (cJSON_GetArraySize(tools) > PDM_HTTP_MAX_TOOLS)
        return fail(err, 400, "invalid_value", "'tools' has %d entries (at most %d)",
                    cJSON_GetArraySize(tools), PDM_HTTP_MAX_TOOLS);
    int k = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        if (!cJSON_IsObject(t) || !cJSON_IsString(type) || strcmp(type->valuestring, "function"))
            return fail(err, 400, "unsupported_value", "'tools[%d].type' must be \"function\"", k);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *desc = cJSON_GetObjectItemCaseSensitive(fn, "description");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        if (!cJSON_IsObject(fn) || !cJSON_IsString(name) || !valid_function_name(name->valuestring))
            return fail(err, 400, "invalid_value", "'tools[%d].function.name' must be 1 to 64 of "
                        "a-z, A-Z, 0-9, _ and -", k);
        if (desc && !cJSON_IsNull(desc) && !cJSON_IsString(desc))
            return fail(err, 400, "invalid_type", "'tools[%d].function.description' must be a "
                        "string", k);
        if (params && !cJSON_IsNull(params) && !cJSON_IsObject(params))
            return fail(err, 400, "invalid_type", "'tools[%d].function.parameters' must be a "
                        "JSON Schema object", k);
        for (const cJSON *u = tools->child; u != t; u = u->next)
            if (!strcmp(cJSON_GetObjectItemCaseSensitive(
                            cJSON_GetObjectItemCaseSensitive(u, "function"), "name")->valuestring,
                        name->valuestring))
                return fail(err, 400, "invalid_value", "'tools' names the function '%s' twice",
                            name->valuestring);
        k++;
    }
    const char *mode = "auto";
    if (have_choice && cJSON_IsString(choice)) {
        mode = choice->valuestring;
        if (strcmp(mode, "none") && strcmp(mode, "auto") && strcmp(mode, "required"))
            return fail(err, 400, "invalid_value", "'tool_choice' must be \"none\", \"auto\", "
                        "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    } else if (have_choice) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(choice, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(choice, "function"), "name");
        if (!cJSON_IsObject(choice) || !cJSON_IsString(type) ||
            strcmp(type->valuestring, "function") || !cJSON_IsString(name))
            return fail(err, 400, "invalid_value", "'tool_choice' must be \"none\", \"auto\", "
                        "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
        int found = 0;
        cJSON_ArrayForEach(t, tools) {
            const cJSON *n = cJSON_GetObjectItemCaseSensitive(
                cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
            found |= !strcmp(n->valuestring, name->valuestring);
        }
        if (!found)
            return fail(err, 400, "invalid_value", "'tool_choice' names the function '%.64s', "
                        "which is not in 'tools'", name->valuestring);
        mode = name->valuestring;
    }
    int forced = strcmp(mode, "none") && strcmp(mode, "auto");
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(root, "response_format");
    const cJSON *rft = cJSON_GetObjectItemCaseSensitive(rf, "type");
    if (forced && cJSON_IsString(rft) && strcmp(rft->valuestring, "text"))
        return fail(err, 400, "unsupported_value", "'tool_choice' \"%.64s\" cannot be combined "
                    "with 'response_format'", mode);
    req->tools_json = cJSON_PrintUnformatted(tools);
    req->tool_choice = strdup(mode);
    if (!req->tools_json || !req->tool_choice)
        return fail(err, 500, "internal_error", "out of memory");
    opts->tools = strcmp(mode, "none") != 0;
    return PDM_OK;
}

static int take_messages(const cJSON *root, Pdmesh__GenerateRequest *req, pdm_http_err_t *err)
{
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!msgs || cJSON_IsNull(msgs)) return fail(err, 400, "missing_field", "'messages' is required");
    if (!cJSON_IsArray(msgs)) return fail(err, 400, "invalid_type", "'messages' must be a list");
    int n = cJSON_GetArraySize(msgs);
    if (n == 0) return fail(err, 400, "invalid_value", "'messages' is empty");
    if (n > PDM_HTTP_MAX_MESSAGES)
        return fail(err, 400, "invalid_value", "'messages' has %d entries (at most %d)", n,
                    PDM_HTTP_MAX_MESSAGES);
    req->messages = calloc((size_t)n, sizeof(*req->messages));
    if (!req->messages) return fail(err, 500, "internal_error", "out of memory");
    int i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        if (!cJSON_IsObject(m))
            return fail(err, 400, "invalid_type", "'messages[%d]' must be an object", i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role))
            return fail(err, 400, "missing_field", "'messages[%d].role' must be a string", i);
        const char *r = role->valuestring;
        /* "developer" is OpenAI's newer name for the system role. */
        if (!strcmp(r, "developer")) r = "system";
        if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") &&
            strcmp(r, "tool"))
            return fail(err, 400, "invalid_value", "'messages[%d].role' must be system, user, "
                        "assistant or tool (got \"%.40s\")", i, role->valuestring);
        Pdmesh__ChatMessage *cm = malloc(sizeof(*cm));
        if (!cm) return fail(err, 500, "internal_error", "out of memory");
        pdmesh__chat_message__init(cm);
        req->messages[i] = cm;
        req->n_messages = (size_t)i + 1;
        if (take_tool_fields(m, r, i, cm, err)) return PDM_EINVAL;
        cm->role = strdup(r);
        cm->content = message_content(cJSON_GetObjectItemCaseSensitive(m, "content"), i, err);
        if (!cm->role || !cm->content) {
            if (!cm->role) cm->role = (char *)protobuf_c_empty_string;
            if (!cm->content) {
                cm->content = (char *)protobuf_c_empty_string;
                if (err->status) return PDM_EINVAL;
            }
            return fail(err, 500, "internal_error", "out of memory");
        }
        i++;
    }
    return PDM_OK;
}

static int take_stop(const cJSON *root, Pdmesh__GenerateRequest *req, pdm_http_err_t *err)
{
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(root, "stop");
    if (!s || cJSON_IsNull(s)) return PDM_OK;
    int n = cJSON_IsString(s) ? 1 : cJSON_IsArray(s) ? cJSON_GetArraySize(s) : -1;
    if (n < 0) return fail(err, 400, "invalid_type", "'stop' must be a string or a list of strings");
    if (n > PDM_HTTP_MAX_STOP)
        return fail(err, 400, "invalid_value", "'stop' has %d strings (at most %d)", n,
                    PDM_HTTP_MAX_STOP);
    if (n == 0) return PDM_OK;
    req->stop = calloc((size_t)n, sizeof(char *));
    if (!req->stop) return fail(err, 500, "internal_error", "out of memory");
    const cJSON *one = cJSON_IsString(s) ? s : s->child;
    for (int i = 0; i < n; i++, one = one->next) {
        if (!cJSON_IsString(one))
            return fail(err, 400, "invalid_type", "'stop' must be a string or a list of strings");
        size_t l = strlen(one->valuestring);
        if (l == 0 || l > PDM_HTTP_MAX_STOP_LEN)
            return fail(err, 400, "invalid_value",
                        "each stop string must have 1 to %d bytes", PDM_HTTP_MAX_STOP_LEN);
        if (!(req->stop[i] = strdup(one->valuestring)))
            return fail(err, 500, "internal_error", "out of memory");
        req->n_stop = (size_t)i + 1;
    }
    return PDM_OK;
}

/* Fields whose non-default values we cannot honour: refusing beats a silently different
 * answer. */
static int refuse_unsupported(const cJSON *root, pdm_http_err_t *err)
{
    static const char *const must_be_absent[] = {"suffix", "functions"};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(must_be_absent); i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, must_be_absent[i]);
        if (v && !cJSON_IsNull(v) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0) &&
            !(cJSON_IsObject(v) && !v->child) && !(cJSON_IsString(v) && !v->valuestring[0]))
            return fail(err, 400, "unsupported_value", "'%s' is not supported", must_be_absent[i]);
    }
    return PDM_OK;
}

/* response_format (https://platform.openai.com/docs/guides/structured-outputs):
 * {"type": "text"} (nothing), {"type": "json_object"} (any JSON object: the schema
 * {"type":"object"}), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.
 * The schema travels as text in SamplingParams.json_schema; it is compiled here once so that a
 * schema the grammar compiler refuses is a 400 naming the keyword (model/grammar.h). */
static int take_response_format(const cJSON *root, Pdmesh__SamplingParams *sp,
                                pdm_http_err_t *err)
{
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(root, "response_format");
    if (!rf || cJSON_IsNull(rf)) return PDM_OK;
    if (!cJSON_IsObject(rf))
        return fail(err, 400, "invalid_type", "'response_format' must be an object");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rf, "type");
    if (!cJSON_IsString(type))
        return fail(err, 400, "invalid_value", "'response_format.type' must be \"text\", "
                    "\"json_object\" or \"json_schema\"");
    char *text = NULL;
    if (!strcmp(type->valuestring, "text")) {
        return PDM_OK;
    } else if (!strcmp(type->valuestring, "json_object")) {
        text = strdup("{\"type\":\"object\"}");
    } else if (!strcmp(type->valuestring, "json_schema")) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        const cJSON *schema = cJSON_IsObject(js) ? cJSON_GetObjectItemCaseSensitive(js, "schema")
                                                 : NULL;
        if (!schema || !(cJSON_IsObject(schema) || cJSON_IsBool(schema)))
            return fail(err, 400, "invalid_value", "'response_format.json_schema.schema' must "
                        "be a JSON Schema object");
        text = cJSON_PrintUnformatted(schema);
    } else {
        return fail(err, 400, "unsupported_value", "'response_format.type' \"%.40s\" is not "
                    "supported (text, json_object, json_schema)", type->valuestring);
    }
    if (!text) return fail(err, 500, "internal_error", "out of memory");
    pdm_grammar_t *g = NULL;
    int st = pdm_grammar_compile(text, strlen(text), &g);
    pdm_grammar_destroy(g);
    if (st) {
        free(text);
        return fail(err, 400, strstr(pdm_error_last(), "not supported") ? "unsupported_value"
                                                                        : "invalid_value",
                    "%s", pdm_error_last());
    }
    sp->json_schema = text;
    return PDM_OK;
}

/* logit_bias: {"<token id>": bias, ...}, at most PDM_SAMPLER_MAX_LOGIT_BIAS entries of
 * [-100, 100] (OpenAI's bounds); the ids are checked against the vocabulary by the router. */
static int take_logit_bias(const cJSON *root, Pdmesh__SamplingParams *sp, pdm_http_err_t *err)
{
    const cJSON *lb = cJSON_GetObjectItemCaseSensitive(root, "logit_bias");
    if (!lb || cJSON_IsNull(lb)) return PDM_OK;
    if (!cJSON_IsObject(lb))
        return fail(err, 400, "invalid_type",
                    "'logit_bias' must be an object mapping token ids to biases");
    int n = cJSON_GetArraySize(lb);
    if (n > PDM_SAMPLER_MAX_LOGIT_BIAS)
        return fail(err, 400, "invalid_value", "'logit_bias' has %d entries (at most %d)", n,
                    PDM_SAMPLER_MAX_LOGIT_BIAS);
    if (n == 0) return PDM_OK;
    sp->logit_bias_ids = malloc(sizeof(int32_t) * (size_t)n);
    sp->logit_bias_values = malloc(sizeof(float) * (size_t)n);
    if (!sp->logit_bias_ids || !sp->logit_bias_values)
        return fail(err, 500, "internal_error", "out of memory");
    const cJSON *e;
    size_t i = 0;
    cJSON_ArrayForEach(e, lb) {
        char *end = NULL;
        const char *key = e->string ? e->string : "";
        long long id = strtoll(key, &end, 10);
        if (!key[0] || *end || key[0] == '+' || key[0] == ' ' || id < 0 || id > INT32_MAX)
            return fail(err, 400, "invalid_value",
                        "'logit_bias' keys must be token ids (non-negative integers; got "
                        "\"%.32s\")", key);
        if (!cJSON_IsNumber(e) || !isfinite(e->valuedouble))
            return fail(err, 400, "invalid_type", "'logit_bias' values must be numbers");
        if (e->valuedouble < -PDM_SAMPLER_BIAS_MAX || e->valuedouble > PDM_SAMPLER_BIAS_MAX)
            return fail(err, 400, "invalid_value",
                        "'logit_bias' values must be between -100 and 100 (got %g for token "
                        "%lld)", e->valuedouble, id);
        sp->logit_bias_ids[i] = (int32_t)id;
        sp->logit_bias_values[i] = (float)e->valuedouble;
        sp->n_logit_bias_ids = sp->n_logit_bias_values = ++i;
    }
    return PDM_OK;
}

/* Completions: logprobs = N (0..20; OpenAI documents at most 5, vLLM allows 20) asks for the
 * chosen token's and the N best. Chat: logprobs = true, top_logprobs = N (0..20). */
static int take_logprobs(const cJSON *root, int chat, Pdmesh__SamplingParams *sp,
                         pdm_http_opts_t *opts, pdm_http_err_t *err)
{
    double v;
    int have, st;
    opts->logprobs = -1;
    if (!chat) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "top_logprobs");
        if (t && !cJSON_IsNull(t))
            return fail(err, 400, "unsupported_value",
                        "'top_logprobs' belongs to chat; completions take 'logprobs': N");
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(root, "logprobs");
        if (l && cJSON_IsBool(l)) /* a chat habit: false is off, true is the token alone */
            have = cJSON_IsTrue(l), v = 0;
        else if ((st = get_integer(root, "logprobs", 0, PDM_SAMPLER_MAX_TOP_LOGPROBS, &v, &have,
                                   err)))
            return st;
        if (!have) return PDM_OK;
        opts->logprobs = (int)v;
    } else {
        int want = 0;
        if ((st = get_bool(root, "logprobs", &want, err))) return st;
        if ((st = get_integer(root, "top_logprobs", 0, PDM_SAMPLER_MAX_TOP_LOGPROBS, &v, &have,
                              err)))
            return st;
        if (have && !want)
            return fail(err, 400, "invalid_value",
                        "'top_logprobs' needs 'logprobs' set to true");
        if (!want) return PDM_OK;
        opts->logprobs = have ? (int)v : 0;
    }
    sp->logprobs = 1;
    sp->top_logprobs = (uint32_t)opts->logprobs;
    return PDM_OK;
}

/* echo (completions): the prompt is prepended to the choice's text and, with logprobs, its
 * tokens' log-probabilities to the choice's (the request then asks for prompt_logprobs). */
static int take_echo(const cJSON *root, int chat, pdm_http_opts_t *opts, pdm_http_err_t *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "echo");
    if (!v || cJSON_IsNull(v)) return PDM_OK;
    if (!cJSON_IsBool(v)) return fail(err, 400, "invalid_type", "'echo' must be a boolean");
    if (cJSON_IsTrue(v) && chat)
        return fail(err, 400, "unsupported_value", "'echo' belongs to /v1/completions");
    opts->echo = cJSON_IsTrue(v);
    return PDM_OK;
}

/* One GenerateRequest of the body: prompt `index` (completions) and every other field. */
static int parse_one(const cJSON *root, int chat, int index, const pdm_router_limits_t *lim,
                     const char *model_name, Pdmesh__GenerateRequest **out,
                     pdm_http_opts_t *opts, pdm_http_err_t *err)
{
    Pdmesh__GenerateRequest *req = NULL;
    int st = PDM_OK;
    req = calloc(1, sizeof(*req));
    Pdmesh__SamplingParams *sp = calloc(1, sizeof(*sp));
    if (!req || !sp) {
        free(sp);
        st = fail(err, 500, "internal_error", "out of memory");
        goto done;
    }
    pdmesh__generate_request__init(req);
    pdmesh__sampling_params__init(sp);
    req->sampling = sp;
    /* No text prompt unless one is given (messages or token ids otherwise). */
    req->prompt = NULL;

    uint32_t max_prompt = lim ? lim->max_prompt_tokens : 0;
    uint32_t max_tokens_cap = lim && lim->max_tokens ? lim->max_tokens : PDM_HTTP_MAX_TOKENS_HARD;
    uint32_t max_beams = lim && lim->max_beams ? lim->max_beams : 16;

    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model && !cJSON_IsNull(model)) {
        if (!cJSON_IsString(model)) {
            st = fail(err, 400, "invalid_type", "'model' must be a string");
            goto done;
        }
        if (model->valuestring[0] && model_name && strcmp(model->valuestring, model_name)) {
            st = fail(err, 404, "model_not_found",
                      "the model '%.80s' does not exist (this server serves '%.80s')",
                      model->valuestring, model_name);
            goto done;
        }
        req->model = dup_or_empty(model->valuestring);
        if (!req->model) {
            req->model = (char *)protobuf_c_empty_string;
            st = fail(err, 500, "internal_error", "out of memory");
            goto done;
        }
    }
    if ((st = refuse_unsupported(root, err))) goto done;
    if (chat) {
        if (cJSON_GetObjectItemCaseSensitive(root, "prompt")) {
            st = fail(err, 400, "invalid_value",
                      "'prompt' belongs to /v1/completions; chat takes 'messages'");
            goto done;
        }
        if ((st = take_messages(root, req, err))) goto done;
    } else {
        if (cJSON_GetObjectItemCaseSensitive(root, "messages")) {
            st = fail(err, 400, "invalid_value",
                      "'messages' belongs to /v1/chat/completions; completions take 'prompt'");
            goto done;
        }
        if ((st = take_prompt(root, index, req, max_prompt, err))) goto done;
    }
    if ((st = take_echo(root, chat, opts, err))) goto done;
    if ((st = take_tools(root, chat, req, opts, err))) goto done;

    double v;
    int have;
    /* max_tokens: OpenAI's default is 16 for completions and "until done" for chat (the
     * router's default, 0 here). max_completion_tokens is the newer chat name. */
    req->max_tokens = chat ? 0 : PDM_HTTP_COMPLETIONS_DEFAULT_TOKENS;
    const char *mt_names[] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++) {
        if ((st = get_integer(root, mt_names[i], -1e18, 1e18, &v, &have, err))) goto done;
        if (!have) continue;
        /* echo with max_tokens 0: the prompt alone, scored (a text's log-likelihood) */
        if (v == 0 && opts->echo) {
            req->prompt_only = 1;
            req->max_tokens = 0;
            continue;
        }
        if (v < 1 || v > max_tokens_cap) {
            st = fail(err, 400, "invalid_value", "'%s' must be between %d and %u (got %.0f)",
                      mt_names[i], opts->echo ? 0 : 1, max_tokens_cap, v);
            goto done;
        }
        req->max_tokens = (uint32_t)v;
        req->prompt_only = 0;
    }
    /* echo needs the prompt's tokens (their texts, and with logprobs their log-probabilities),
     * which the prefill group reports with prompt_logprobs */
    req->prompt_logprobs = opts->echo;
    sp->temperature = 1.0f; /* OpenAI's default */
    if ((st = get_number(root, "temperature", 0, 2, &v, &have, err))) goto done;
    if (have) sp->temperature = (float)v;
    if ((st = get_number(root, "top_p", 0, 1, &v, &have, err))) goto done;
    if (have) {
        if (v == 0) {
            st = fail(err, 400, "invalid_value", "'top_p' must be greater than 0");
            goto done;
        }
        sp->top_p = (float)v;
    }
    if ((st = get_integer(root, "top_k", -1, 1e6, &v, &have, err))) goto done;
    if (have) sp->top_k = v < 0 ? 0 : (int32_t)v; /* -1 is vLLM's "off" */
    if ((st = get_number(root, "min_p", 0, 1, &v, &have, err))) goto done;
    if (have) sp->min_p = (float)v;
    if ((st = get_number(root, "repetition_penalty", 0.01, 10, &v, &have, err))) goto done;
    if (have) sp->repeat_penalty = (float)v;
    if ((st = get_number(root, "presence_penalty", -PDM_SAMPLER_PENALTY_MAX,
                         PDM_SAMPLER_PENALTY_MAX, &v, &have, err)))
        goto done;
    if (have) sp->presence_penalty = (float)v;
    if ((st = get_number(root, "frequency_penalty", -PDM_SAMPLER_PENALTY_MAX,
                         PDM_SAMPLER_PENALTY_MAX, &v, &have, err)))
        goto done;
    if (have) sp->frequency_penalty = (float)v;
    if ((st = take_logit_bias(root, sp, err))) goto done;
    if ((st = take_response_format(root, sp, err))) goto done;
    if ((st = take_logprobs(root, chat, sp, opts, err))) goto done;
    if ((st = get_integer(root, "seed", -9.2e18, 1.8e19, &v, &have, err))) goto done;
    if (have) {
        sp->seed = v < 0 ? (uint64_t)(int64_t)v : (uint64_t)v;
    } else if (pdm_random_bytes(&sp->seed, sizeof(sp->seed)) != PDM_OK) {
        st = fail(err, 500, "internal_error", "no random seed available");
        goto done;
    }
    if ((st = get_integer(root, "n", -1e18, 1e18, &v, &have, err))) goto done;
    /* n (1..8): checked here, fanned out by pdm_http__parse_batch */
    if ((st = get_integer(root, "n", -1e18, 1e18, &v, &have, err))) goto done;
    if (have && (v < 1 || v > PDM_HTTP_MAX_N)) {
        st = fail(err, 400, "invalid_value", "'n' must be between 1 and %d (got %.0f)",
                  PDM_HTTP_MAX_N, v);
        goto done;
    }
    const int n_choices = have ? (int)v : 1;
    int stream = 0, ignore_eos = 0;
    if ((st = get_bool(root, "stream", &stream, err))) goto done;
    if ((st = get_bool(root, "ignore_eos", &ignore_eos, err))) goto done;
    opts->stream = stream;
    req->stream = stream;
    req->ignore_eos = ignore_eos;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            st = fail(err, 400, "invalid_type", "'stream_options' must be an object");
            goto done;
        }
        if ((st = get_bool(so, "include_usage", &opts->include_usage, err))) goto done;
    }
    /* best_of > 1: beam search of that width, the best beam returned (not streamable). */
    if ((st = get_integer(root, "best_of", -1e18, 1e18, &v, &have, err))) goto done;
    if (have && v != 1) {
        if (v < 1 || v > max_beams) {
            st = fail(err, 400, "invalid_value", "'best_of' must be between 1 and %u", max_beams);
            goto done;
        }
        if (stream) {
            st = fail(err, 400, "invalid_value", "'best_of' > 1 cannot be streamed");
            goto done;
        }
        if (opts->logprobs >= 0 || opts->echo) {
            st = fail(err, 400, "unsupported_value", "'%s' is not supported with 'best_of' > 1 "
                      "(beam search)", opts->echo ? "echo" : "logprobs");
            goto done;
        }
        if (n_choices > 1) {
            st = fail(err, 400, "unsupported_value", "'n' > 1 is not supported with 'best_of' "
                      "> 1 (beam search returns the best beam only)");
            goto done;
        }
        req->beams = (uint32_t)v;
        req->n_best = 1;
        req->length_penalty = 1.0f;
    }
    if ((st = take_stop(root, req, err))) goto done;

done:
    if (st) {
        pdm_http__request_free(req);
        return st;
    }
    *out = req;
    return PDM_OK;
}

void pdm_http__batch_free(Pdmesh__GenerateRequest **reqs, size_t n)
{
    if (!reqs) return;
    for (size_t i = 0; i < n; i++) pdm_http__request_free(reqs[i]);
    free(reqs);
}

int pdm_http__parse_batch(const char *body, size_t len, int chat, const pdm_router_limits_t *lim,
                          const char *model_name, Pdmesh__GenerateRequest ***out, size_t *n_out,
                          pdm_http_opts_t *opts, pdm_http_err_t *err)
{
    memset(err, 0, sizeof(*err));
    memset(opts, 0, sizeof(*opts));
    opts->chat = chat;
    if (!body || len == 0) return fail(err, 400, "invalid_json", "the request body is empty");
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root) return fail(err, 400, "invalid_json", "the request body is not valid JSON");
    int st = PDM_OK, n = 1;
    Pdmesh__GenerateRequest **reqs = NULL;
    if (!cJSON_IsObject(root)) {
        st = fail(err, 400, "invalid_json", "the request body must be a JSON object");
        goto done;
    }
    if (!chat && cJSON_GetObjectItemCaseSensitive(root, "prompt") &&
        !(n = prompt_count(root, err))) {
        st = PDM_EINVAL;
        goto done;
    }
    /* OpenAI's n: one GenerateRequest per prompt with n set (the router makes its n choices,
     * sharing the prompt: router.h), choice index = prompt * n + sample (OpenAI's order for a
     * list of prompts), sample s drawing with pdm_sampler_seed_for_choice(the prompt's seed,
     * s). */
    const cJSON *jn = cJSON_GetObjectItemCaseSensitive(root, "n");
    const int n_samples = cJSON_IsNumber(jn) && jn->valuedouble >= 1 &&
                                  jn->valuedouble <= PDM_HTTP_MAX_N
                              ? (int)jn->valuedouble : 1; /* else parse_one refuses it */
    if (n * n_samples > PDM_HTTP_MAX_PROMPTS) {
        st = fail(err, 400, "invalid_value", "'n' x the prompts is %d choices (at most %d)",
                  n * n_samples, PDM_HTTP_MAX_PROMPTS);
        goto done;
    }
    const int n_prompts = n;
    if (!(reqs = calloc((size_t)n, sizeof(*reqs)))) {
        st = fail(err, 500, "internal_error", "out of memory");
        goto done;
    }
    /* Each prompt parsed from the same body: the same fields, its own prompt (and, without a
     * seed, its own random seed). */
    for (int i = 0; i < n_prompts && !st; i++) {
        memset(opts, 0, sizeof(*opts));
        opts->chat = chat;
        st = parse_one(root, chat, i, lim, model_name, &reqs[i], opts, err);
        if (!st && n_samples > 1) reqs[i]->n = (uint32_t)n_samples;
    }
    opts->n_prompts = n_prompts;
    opts->n_samples = n_samples;
done:
    cJSON_Delete(root);
    if (st) {
        pdm_http__batch_free(reqs, (size_t)n);
        return st;
    }
    *out = reqs;
    *n_out = (size_t)n;
    return PDM_OK;
}

int pdm_http__parse_request(const char *body, size_t len, int chat,
                            const pdm_router_limits_t *lim, const char *model_name,
                            Pdmesh__GenerateRequest **out, pdm_http_opts_t *opts,
                            pdm_http_err_t *err)
{
    Pdmesh__GenerateRequest **reqs = NULL;
    size_t n = 0;
    int st = pdm_http__parse_batch(body, len, chat, lim, model_name, &reqs, &n, opts, err);
    if (st) return st;
    *out = reqs[0];
    for (size_t i = 1; i < n; i++) pdm_http__request_free(reqs[i]);
    free(reqs);
    return PDM_OK;
}

int pdm_http__status_for_code(int code)
{
    switch (code) {
    case PDMESH__ERROR_CODE__ERR_BAD_MESSAGE:
    case PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE:
    case PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT: return 400;
    case PDMESH__ERROR_CODE__ERR_TOO_LARGE: return 413;
    case PDMESH__ERROR_CODE__ERR_UNAUTHORIZED: return 401;
    case PDMESH__ERROR_CODE__ERR_NOT_FOUND: return 404;
    case PDMESH__ERROR_CODE__ERR_OVERLOADED: return 429;
    case PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED: return 504;
    case PDMESH__ERROR_CODE__ERR_CANCELLED:
    case PDMESH__ERROR_CODE__ERR_UNAVAILABLE:
    case PDMESH__ERROR_CODE__ERR_NODE_FULL: return 503;
    default: return 500;
    }
}

const char *pdm_http__code_name(int code)
{
    switch (code) {
    case PDMESH__ERROR_CODE__ERR_BAD_MESSAGE: return "bad_message";
    case PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE: return "unknown_type";
    case PDMESH__ERROR_CODE__ERR_TOO_LARGE: return "too_large";
    case PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT: return "invalid_argument";
    case PDMESH__ERROR_CODE__ERR_UNAUTHORIZED: return "unauthorized";
    case PDMESH__ERROR_CODE__ERR_OVERLOADED: return "overloaded";
    case PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED: return "deadline_exceeded";
    case PDMESH__ERROR_CODE__ERR_CANCELLED: return "cancelled";
    case PDMESH__ERROR_CODE__ERR_UNAVAILABLE: return "unavailable";
    case PDMESH__ERROR_CODE__ERR_NOT_FOUND: return "not_found";
    case PDMESH__ERROR_CODE__ERR_STALE_EPOCH: return "stale_epoch";
    case PDMESH__ERROR_CODE__ERR_NODE_FULL: return "node_full";
    case PDMESH__ERROR_CODE__ERR_KV_TRANSFER: return "kv_transfer";
    default: return "internal_error";
    }
}

const char *pdm_http__type_for_status(int status)
{
    switch (status) {
    case 400:
    case 404:
    case 405:
    case 413:
    case 431: return "invalid_request_error";
    case 401: return "authentication_error";
    case 429: return "rate_limit_error";
    default: return "server_error";
    }
}

const char *pdm_http__reason(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
    }
}

/* Length of the well-formed UTF-8 sequence at s[0..len) (Unicode table 3-7: no overlong
 * forms, surrogates or code points over U+10FFFF), or minus the length of its longest
 * well-formed prefix (the "maximal subpart" one U+FFFD replaces), at least 1. */
static int utf8_sequence(const unsigned char *s, size_t len)
{
    unsigned char b = s[0];
    if (b < 0x80) return 1;
    int n;
    unsigned char lo = 0x80, hi = 0xBF; /* range of the second byte */
    if (b >= 0xC2 && b <= 0xDF) n = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
        n = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        n = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else
        return -1;
    for (int i = 1; i < n; i++) {
        unsigned char lo_i = i == 1 ? lo : 0x80, hi_i = i == 1 ? hi : 0xBF;
        if ((size_t)i >= len || s[i] < lo_i || s[i] > hi_i) return -i;
    }
    return n;
}

char *pdm_http__utf8_sanitize(const char *s, size_t len)
{
    char *out = malloc(len * 3 + 1); /* each invalid byte becomes at most 3 bytes */
    if (!out) return NULL;
    const unsigned char *in = (const unsigned char *)s;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        int n = utf8_sequence(in + i, len - i);
        if (n > 0) {
            memcpy(out + o, in + i, (size_t)n);
            o += (size_t)n;
            i += (size_t)n;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3); /* U+FFFD */
            o += 3;
            i += (size_t)-n;
        }
    }
    out[o] = 0;
    return out;
}

/* Every error body goes through here, and its message may quote the client (a model name, a
 * role, a path): it is made valid UTF-8 so that the body stays valid JSON. */
char *pdm_http__error_json(int status, const char *code, const char *message)
{
    char *clean = pdm_http__utf8_sanitize(message ? message : "", message ? strlen(message) : 0);
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    if (!e || !clean) {
        free(clean);
        cJSON_Delete(root);
        return NULL;
    }
    cJSON_AddStringToObject(e, "message", clean);
    free(clean);
    cJSON_AddStringToObject(e, "type", pdm_http__type_for_status(status));
    cJSON_AddNullToObject(e, "param");
    cJSON_AddStringToObject(e, "code", code ? code : "error");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

const char *pdm_http__finish_reason(int finish)
{
    switch (finish) {
    case PDMESH__FINISH_REASON__FINISH_EOS:
    case PDMESH__FINISH_REASON__FINISH_STOP: return "stop";
    case PDMESH__FINISH_REASON__FINISH_LENGTH: return "length";
    default: return NULL;
    }
}

cJSON *pdm_http__usage_json(const Pdmesh__Usage *u)
{
    cJSON *usage = cJSON_CreateObject();
    if (!usage) return NULL;
    uint32_t p = u ? u->prompt_tokens : 0, c = u ? u->completion_tokens : 0;
    cJSON_AddNumberToObject(usage, "prompt_tokens", p);
    cJSON_AddNumberToObject(usage, "completion_tokens", c);
    cJSON_AddNumberToObject(usage, "total_tokens", (double)p + c);
    if (!u) return usage;
    if (u->cached_tokens) {
        cJSON *d = cJSON_AddObjectToObject(usage, "prompt_tokens_details");
        if (d) cJSON_AddNumberToObject(d, "cached_tokens", u->cached_tokens);
    }
    /* pdmesh's own figures, under one extension key. */
    cJSON *x = cJSON_AddObjectToObject(usage, "pdmesh");
    if (!x) return usage;
    cJSON_AddNumberToObject(x, "ttft_ms", u->ttft_ms);
    cJSON_AddNumberToObject(x, "tpot_ms", u->tpot_ms);
    cJSON_AddNumberToObject(x, "total_ms", u->total_ms);
    cJSON_AddNumberToObject(x, "kv_bytes", (double)u->kv_bytes);
    cJSON_AddStringToObject(x, "prefill_method", u->prefill_method ? u->prefill_method : "");
    cJSON_AddStringToObject(x, "prefill_group", u->prefill_group ? u->prefill_group : "");
    /* how many ranks of the group took part: the distinct ranks of the plan (a solo prefill
     * has one, and which one is "prefill_rank") */
    uint64_t seen = 0;
    uint32_t ranks = 0;
    for (size_t k = 0; k < u->n_prefill_ranges; k++) {
        uint32_t rk = u->prefill_ranges[k]->rank;
        if (rk < 64 && !(seen >> rk & 1)) {
            seen |= 1ull << rk;
            ranks++;
        }
    }
    cJSON_AddNumberToObject(x, "prefill_ranks", ranks);
    if (ranks == 1 && u->prefill_method &&
        (!strcmp(u->prefill_method, "solo") || !strcmp(u->prefill_method, "batch")))
        cJSON_AddNumberToObject(x, "prefill_rank", u->prefill_ranges[0]->rank);
    cJSON_AddStringToObject(x, "decode_node", u->decode_node ? u->decode_node : "");
    cJSON_AddNumberToObject(x, "attempts", u->attempts);
    if (u->pool_prefix_tokens) /* delta transfer: taken from the decode node's pool */
        cJSON_AddNumberToObject(x, "pool_prefix_tokens", u->pool_prefix_tokens);
    return usage;
}

void pdm_http__usage_add(cJSON *usage, uint32_t prompt_tokens, uint32_t completion_tokens)
{
    static const char *const keys[] = {"prompt_tokens", "completion_tokens", "total_tokens"};
    const double add[] = {prompt_tokens, completion_tokens,
                          (double)prompt_tokens + completion_tokens};
    for (int i = 0; i < 3; i++) {
        cJSON *v = cJSON_GetObjectItemCaseSensitive(usage, keys[i]);
        if (cJSON_IsNumber(v)) cJSON_SetNumberValue(v, v->valuedouble + add[i]);
    }
}

static cJSON *response_head(const char *object, const char *id, long created, const char *model)
{
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    cJSON_AddStringToObject(root, "id", id);
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)created);
    cJSON_AddStringToObject(root, "model", model ? model : "");
    return root;
}

static char *finish_json(cJSON *root)
{
    char *s = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

/* A token's text as a JSON string: its bytes made valid UTF-8 (a token that holds part of a
 * character shows U+FFFD; chat's "bytes" keeps the exact bytes). */
static cJSON *token_string(const Pdmesh__TokenLogprob *t)
{
    char *clean = pdm_http__utf8_sanitize(t->text.data ? (const char *)t->text.data : "",
                                          t->text.len);
    cJSON *s = cJSON_CreateString(clean ? clean : "");
    free(clean);
    return s;
}

static cJSON *logprob_number(const Pdmesh__TokenLogprob *t)
{
    return t->missing ? cJSON_CreateNull() : cJSON_CreateNumber(t->logprob);
}

/* Chat: {"token", "logprob", "bytes"} of one token. */
static cJSON *chat_entry(const Pdmesh__TokenLogprob *t)
{
    cJSON *e = cJSON_CreateObject(), *bytes = cJSON_CreateArray();
    if (!e || !bytes) {
        cJSON_Delete(e);
        cJSON_Delete(bytes);
        return NULL;
    }
    cJSON_AddItemToObject(e, "token", token_string(t));
    cJSON_AddItemToObject(e, "logprob", logprob_number(t));
    for (size_t i = 0; i < t->text.len; i++)
        cJSON_AddItemToArray(bytes, cJSON_CreateNumber(t->text.data[i]));
    cJSON_AddItemToObject(e, "bytes", bytes);
    return e;
}

size_t pdm_http__logprobs_text_len(Pdmesh__TokenLogprob *const *lps, size_t n)
{
    size_t len = 0;
    for (size_t i = 0; i < n; i++) len += lps[i]->text.len;
    return len;
}

/* choices[].logprobs in OpenAI's shape: chat {"content": [entry + top_logprobs]}, completions
 * {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}. */
static cJSON *logprobs_json(int chat, const pdm_http_logprobs_t *lp)
{
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    if (chat) {
        cJSON *content = cJSON_AddArrayToObject(root, "content");
        for (size_t i = 0; content && i < lp->n; i++) {
            const Pdmesh__TokenLogprob *t = lp->lps[i];
            cJSON *e = chat_entry(t), *top = cJSON_CreateArray();
            for (size_t k = 0; top && k < t->n_top; k++)
                cJSON_AddItemToArray(top, chat_entry(t->top[k]));
            if (e && top) cJSON_AddItemToObject(e, "top_logprobs", top);
            else cJSON_Delete(top);
            if (e) cJSON_AddItemToArray(content, e);
        }
        return root;
    }
    cJSON *tokens = cJSON_AddArrayToObject(root, "tokens");
    cJSON *token_lps = cJSON_AddArrayToObject(root, "token_logprobs");
    cJSON *tops = cJSON_AddArrayToObject(root, "top_logprobs");
    cJSON *offsets = cJSON_AddArrayToObject(root, "text_offset");
    if (!tokens || !token_lps || !tops || !offsets) return root;
    size_t offset = lp->text_offset;
    for (size_t i = 0; i < lp->n; i++) {
        const Pdmesh__TokenLogprob *t = lp->lps[i];
        cJSON_AddItemToArray(tokens, token_string(t));
        cJSON_AddItemToArray(token_lps, logprob_number(t));
        cJSON *top = cJSON_CreateObject();
        for (size_t k = 0; top && k < t->n_top; k++) {
            cJSON *key = token_string(t->top[k]);
            /* two tokens with the same text (rare): the first, more likely, one stays */
            if (key && !cJSON_GetObjectItemCaseSensitive(top, key->valuestring))
                cJSON_AddItemToObject(top, key->valuestring, logprob_number(t->top[k]));
            cJSON_Delete(key);
        }
        cJSON_AddItemToArray(tops, top ? top : cJSON_CreateNull());
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)offset));
        offset += t->text.len;
    }
    return root;
}

char *pdm_http__echo_text(const char *prompt, Pdmesh__TokenLogprob *const *lps, size_t n)
{
    if (prompt) return strdup(prompt);
    size_t len = pdm_http__logprobs_text_len(lps, n), at = 0;
    char *raw = malloc(len + 1);
    if (!raw) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (lps[i]->text.len) memcpy(raw + at, lps[i]->text.data, lps[i]->text.len);
        at += lps[i]->text.len;
    }
    char *clean = pdm_http__utf8_sanitize(raw, len);
    free(raw);
    return clean;
}

/* Completions' logprobs of an echoed choice: the prompt's entries, then the completion's. */
static cJSON *echo_logprobs_json(Pdmesh__TokenLogprob *const *prompt, size_t n_prompt,
                                 Pdmesh__TokenLogprob *const *gen, size_t n_gen)
{
    Pdmesh__TokenLogprob **all = malloc(sizeof(*all) * (n_prompt + n_gen + 1));
    if (!all) return NULL;
    if (n_prompt) memcpy(all, prompt, sizeof(*all) * n_prompt);
    if (n_gen) memcpy(all + n_prompt, gen, sizeof(*all) * n_gen);
    pdm_http_logprobs_t lp = {all, n_prompt + n_gen, 0};
    cJSON *j = logprobs_json(0, &lp);
    free(all);
    return j;
}

cJSON *pdm_http__choice_json(int chat, uint32_t index, const Pdmesh__GenerateResult *res,
                             int logprobs, const char *echo)
{
    cJSON *c = cJSON_CreateObject();
    if (!c) return NULL;
    cJSON_AddNumberToObject(c, "index", index);
    const char *text = res->text ? res->text : "";
    /* Beam search: the best beam is the answer. */
    if (res->n_beams > 0 && res->beams[0] && res->beams[0]->text) text = res->beams[0]->text;
    if (chat) {
        cJSON *msg = cJSON_AddObjectToObject(c, "message");
        if (msg) {
            cJSON_AddStringToObject(msg, "role", "assistant");
            cJSON_AddStringToObject(msg, "content", text);
        }
    } else if (echo) {
        size_t el = strlen(echo), tl = strlen(text);
        char *both = malloc(el + tl + 1);
        if (both) {
            memcpy(both, echo, el);
            memcpy(both + el, text, tl + 1);
        }
        cJSON_AddStringToObject(c, "text", both ? both : "");
        free(both);
    } else {
        cJSON_AddStringToObject(c, "text", text);
    }
    cJSON *l = NULL;
    if (logprobs && echo) {
        l = echo_logprobs_json(res->prompt_logprobs, res->n_prompt_logprobs, res->logprobs,
                               res->n_logprobs);
    } else if (logprobs) {
        pdm_http_logprobs_t lp = {res->logprobs, res->n_logprobs, 0};
        l = logprobs_json(chat, &lp);
    }
    if (l) cJSON_AddItemToObject(c, "logprobs", l);
    else cJSON_AddNullToObject(c, "logprobs");
    const char *fr = pdm_http__finish_reason(res->finish);
    if (fr) cJSON_AddStringToObject(c, "finish_reason", fr);
    else cJSON_AddNullToObject(c, "finish_reason");
    return c;
}

char *pdm_http__response_json(int chat, const char *id, long created, const char *model,
                              cJSON *choices, cJSON *usage)
{
    cJSON *root = response_head(chat ? "chat.completion" : "text_completion", id, created, model);
    if (!root) {
        cJSON_Delete(choices);
        cJSON_Delete(usage);
        return NULL;
    }
    cJSON_AddItemToObject(root, "choices", choices ? choices : cJSON_CreateArray());
    if (usage) cJSON_AddItemToObject(root, "usage", usage);
    return finish_json(root);
}

char *pdm_http__result_json(int chat, const char *id, long created, const char *model,
                            const Pdmesh__GenerateResult *res, int logprobs)
{
    cJSON *choices = cJSON_CreateArray();
    cJSON *c = pdm_http__choice_json(chat, 0, res, logprobs, NULL);
    if (choices && c) cJSON_AddItemToArray(choices, c);
    else cJSON_Delete(c);
    return pdm_http__response_json(chat, id, created, model, choices,
                                   pdm_http__usage_json(res->usage));
}

char *pdm_http__chunk_json(int chat, const char *id, long created, const char *model,
                           const char *text, const char *finish, int role_delta,
                           const Pdmesh__Usage *usage, const pdm_http_logprobs_t *lp)
{
    return pdm_http__chunk_json_at(chat, id, created, model, 0, text, finish, role_delta,
                                   usage ? pdm_http__usage_json(usage) : NULL, lp);
}

char *pdm_http__chunk_json_at(int chat, const char *id, long created, const char *model,
                              uint32_t index, const char *text, const char *finish,
                              int role_delta, cJSON *usage, const pdm_http_logprobs_t *lp)
{
    cJSON *root =
        response_head(chat ? "chat.completion.chunk" : "text_completion", id, created, model);
    if (!root) return NULL;
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    if (!choices) return finish_json(root);
    if (usage) {
        cJSON_AddItemToObject(root, "usage", usage);
        return finish_json(root);
    }
    cJSON *c = cJSON_CreateObject();
    if (!c) return finish_json(root);
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", index);
    if (chat) {
        cJSON *delta = cJSON_AddObjectToObject(c, "delta");
        if (delta && role_delta) cJSON_AddStringToObject(delta, "role", "assistant");
        if (delta && text) cJSON_AddStringToObject(delta, "content", text);
    } else {
        cJSON_AddStringToObject(c, "text", text ? text : "");
    }
    cJSON *l = lp ? logprobs_json(chat, lp) : NULL;
    if (l) cJSON_AddItemToObject(c, "logprobs", l);
    else cJSON_AddNullToObject(c, "logprobs");
    if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
    else cJSON_AddNullToObject(c, "finish_reason");
    return finish_json(root);
}

/* ---- Tool calls in the output ------------------------------------------------------------ */

void pdm_http__tool_call_id(char out[PDM_HTTP_TOOL_CALL_ID_LEN])
{
    static const char digits[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    unsigned char rnd[24] = {0};
    pdm_random_bytes(rnd, sizeof(rnd));
    memcpy(out, "call_", 5);
    for (int i = 0; i < 24; i++) out[5 + i] = digits[rnd[i] % 62];
    out[29] = 0;
}

int pdm_http__choice_tools(cJSON *choice)
{
    cJSON *msg = cJSON_GetObjectItemCaseSensitive(choice, "message");
    cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
    if (!cJSON_IsString(content)) return PDM_OK;
    pdm_chat_tool_call_t *calls = NULL;
    int n = 0;
    char *rest = NULL;
    int st = pdm_chat_tool_calls_parse(content->valuestring, &calls, &n, &rest);
    if (st || n == 0) {
        pdm_chat_tool_calls_free(calls, n);
        free(rest);
        return st;
    }
    cJSON *list = cJSON_CreateArray();
    for (int i = 0; list && i < n; i++) {
        cJSON *c = cJSON_CreateObject();
        if (!c) break;
        cJSON_AddItemToArray(list, c);
        char id[PDM_HTTP_TOOL_CALL_ID_LEN];
        pdm_http__tool_call_id(id);
        cJSON_AddStringToObject(c, "id", id);
        cJSON_AddStringToObject(c, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(c, "function");
        if (!fn) break;
        cJSON_AddStringToObject(fn, "name", calls[i].name);
        cJSON_AddStringToObject(fn, "arguments", calls[i].arguments);
    }
    pdm_chat_tool_calls_free(calls, n);
    cJSON_ReplaceItemInObjectCaseSensitive(msg, "content",
                                           rest ? cJSON_CreateString(rest) : cJSON_CreateNull());
    free(rest);
    if (!list) return PDM_ENOMEM;
    cJSON_AddItemToObject(msg, "tool_calls", list);
    cJSON_ReplaceItemInObjectCaseSensitive(choice, "finish_reason",
                                           cJSON_CreateString("tool_calls"));
    return PDM_OK;
}

char *pdm_http__tool_chunk_json(const char *id, long created, const char *model, uint32_t index,
                                int call_index, const char *call_id, const char *name,
                                const char *arguments)
{
    cJSON *root = response_head("chat.completion.chunk", id, created, model);
    if (!root) return NULL;
    cJSON *choices = cJSON_AddArrayToObject(root, "choices");
    cJSON *c = cJSON_CreateObject();
    if (!choices || !c) {
        cJSON_Delete(c);
        return finish_json(root);
    }
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", index);
    cJSON *delta = cJSON_AddObjectToObject(c, "delta");
    cJSON *calls = delta ? cJSON_AddArrayToObject(delta, "tool_calls") : NULL;
    cJSON *call = cJSON_CreateObject();
    if (calls && call) {
        cJSON_AddItemToArray(calls, call);
        cJSON_AddNumberToObject(call, "index", call_index);
        if (call_id) {
            cJSON_AddStringToObject(call, "id", call_id);
            cJSON_AddStringToObject(call, "type", "function");
        }
        cJSON *fn = cJSON_AddObjectToObject(call, "function");
        if (fn && name) cJSON_AddStringToObject(fn, "name", name);
        if (fn) cJSON_AddStringToObject(fn, "arguments", arguments ? arguments : "");
    } else {
        cJSON_Delete(call);
    }
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddNullToObject(c, "finish_reason");
    return finish_json(root);
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Emits content (text outside calls) through the callback; whitespace is held back until
 * text follows it, so that the newlines around calls do not become content. */
static int tool_stream_content(pdm_http_tool_stream_t *ts, const char *text, size_t n,
                               pdm_http_tool_emit_cb emit, void *ctx)
{
    if (ts->calls && !ts->content_after) /* the newlines after a call are not content */
        while (n && is_space(*text)) text++, n--;
    if (!n) return PDM_OK;
    char *seg = malloc(n + 1);
    if (!seg) return PDM_ENOMEM;
    memcpy(seg, text, n);
    seg[n] = 0;
    emit(ctx, seg, NULL, NULL);
    free(seg);
    ts->content = 1;
    ts->content_after = ts->calls > 0;
    return PDM_OK;
}

int pdm_http__tool_stream_feed(pdm_http_tool_stream_t *ts, const char *text, int final,
                               pdm_http_tool_emit_cb emit, void *ctx)
{
    static const char open[] = PDM_CHAT_TOOL_CALL_OPEN, close[] = PDM_CHAT_TOOL_CALL_CLOSE;
    const size_t lo = sizeof(open) - 1, lc = sizeof(close) - 1;
    size_t add = text ? strlen(text) : 0;
    if (add) {
        char *b = realloc(ts->buf, ts->n + add + 1);
        if (!b) return PDM_ENOMEM;
        memcpy(b + ts->n, text, add + 1);
        ts->buf = b;
        ts->n += add;
    }
    if (!ts->buf) return PDM_OK;
    /* Llama 3.1's call is the whole answer, a bare JSON object (after <|python_tag|>): an
     * answer that starts like one is held to the end, then parsed */
    if (!ts->content && !ts->calls && !strstr(ts->buf, open)) {
        const char *a = ts->buf;
        while (is_space(*a)) a++;
        size_t lt = strlen(PDM_CHAT_PYTHON_TAG), la = strlen(a);
        if (*a == '{' || !strncmp(a, PDM_CHAT_PYTHON_TAG, la < lt ? la : lt)) {
            if (!final) return PDM_OK;
            pdm_chat_tool_call_t *calls = NULL;
            int n = 0;
            char *rest = NULL;
            if (pdm_chat_tool_calls_parse(ts->buf, &calls, &n, &rest)) return PDM_ENOMEM;
            free(rest);
            if (n == 1) {
                emit(ctx, NULL, calls[0].name, calls[0].arguments);
                ts->calls++;
                ts->n = 0;
                ts->buf[0] = 0;
            }
            pdm_chat_tool_calls_free(calls, n);
            if (n == 1) return PDM_OK;
        }
    }
    size_t at = 0; /* ts->buf[0..at) is consumed */
    int st = PDM_OK;
    while (!st && at < ts->n) {
        char *p = ts->buf + at;
        char *a = strstr(p, open);
        if (!a) {
            /* hold back a suffix that may begin the marker, and trailing whitespace */
            size_t n = ts->n - at, keep = 0;
            if (!final) {
                for (size_t k = n < lo - 1 ? n : lo - 1; k > 0; k--)
                    if (!memcmp(p + n - k, open, k)) {
                        keep = k;
                        break;
                    }
                while (keep < n && is_space(p[n - keep - 1])) keep++;
            } else if (ts->calls) {
                while (keep < n && is_space(p[n - keep - 1])) keep++;
                if (keep < n) keep = 0; /* text after the calls is content after all */
            }
            st = tool_stream_content(ts, p, n - keep, emit, ctx);
            at += n - keep;
            if (final) at = ts->n;
            break;
        }
        size_t before = (size_t)(a - p), trim = before;
        while (trim > 0 && is_space(p[trim - 1])) trim--;
        char *z = strstr(a + lo, close);
        if (!z) {
            if (final) { /* an unclosed call: text */
                st = tool_stream_content(ts, p, ts->n - at, emit, ctx);
                at = ts->n;
            } else {
                st = tool_stream_content(ts, p, trim, emit, ctx);
                at += before;
            }
            break;
        }
        struct {
            char *name, *arguments;
        } call = {0};
        int ok = pdm_chat_tool_call_parse_one(a + lo, (size_t)(z - a - lo), &call.name,
                                              &call.arguments);
        if (ok < 0) {
            st = PDM_ENOMEM;
            break;
        }
        size_t end = (size_t)(z + lc - p);
        if (!ok) { /* not a call: the block is text */
            st = tool_stream_content(ts, p, end, emit, ctx);
        } else {
            if (!(st = tool_stream_content(ts, p, trim, emit, ctx))) {
                emit(ctx, NULL, call.name, call.arguments);
                ts->calls++;
                ts->content_after = 0;
            }
        }
        free(call.name);
        free(call.arguments);
        at += end;
    }
    memmove(ts->buf, ts->buf + at, ts->n - at + 1);
    ts->n -= at;
    return st;
}

void pdm_http__tool_stream_fini(pdm_http_tool_stream_t *ts)
{
    free(ts->buf);
    memset(ts, 0, sizeof(*ts));
}
