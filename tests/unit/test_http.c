/*
 * test_http.c - the OpenAI JSON translation of the HTTP front end (router/http_openai.c):
 * field mapping, refusals with their status and code, a mutation fuzz of request bodies (run
 * under ASan by `make asan`), and the response bodies parsed back.
 * The server itself is tested with real sockets by tests/http/test_fake.py and, end to end,
 * by tests/integration/.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "model/model.h"
#include "router/http_internal.h"
#include "tests.h"

static const pdm_router_limits_t limits = {
    .max_body_bytes = 1 << 20, .max_prompt_tokens = 100, .max_tokens = 512, .max_beams = 4};

static Pdmesh__GenerateRequest *parse_ok(const char *body, int chat, pdm_http_opts_t *opts)
{
    Pdmesh__GenerateRequest *req = NULL;
    pdm_http_err_t err;
    int st = pdm_http__parse_request(body, strlen(body), chat, &limits, "m", &req, opts, &err);
    ck_assert_msg(st == PDM_OK, "%s: %d %s %s", body, err.status, err.code, err.message);
    return req;
}

static void parse_fails(const char *body, int chat, int status, const char *code)
{
    Pdmesh__GenerateRequest *req = NULL;
    pdm_http_opts_t opts;
    pdm_http_err_t err;
    int st = pdm_http__parse_request(body, strlen(body), chat, &limits, "m", &req, &opts, &err);
    ck_assert_msg(st != PDM_OK, "accepted: %s", body);
    ck_assert_ptr_null(req);
    ck_assert_msg(err.status == status && !strcmp(err.code, code), "%s: got %d %s (%s)", body,
                  err.status, err.code, err.message);
    ck_assert(err.message[0]);
}

START_TEST(test_http_parse_fields)
{
    pdm_http_opts_t o;
    Pdmesh__GenerateRequest *r = parse_ok(
        "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":7,\"temperature\":0,\"top_p\":0.9,"
        "\"top_k\":5,\"seed\":42,\"stop\":[\"a\",\"bc\"],\"stream\":true,"
        "\"stream_options\":{\"include_usage\":true},\"n\":1}",
        0, &o);
    ck_assert_str_eq(r->prompt, "hi");
    ck_assert_str_eq(r->model, "m");
    ck_assert_uint_eq(r->max_tokens, 7);
    ck_assert(r->sampling->temperature == 0.0f);
    ck_assert(fabsf(r->sampling->top_p - 0.9f) < 1e-6f);
    ck_assert_int_eq(r->sampling->top_k, 5);
    ck_assert_uint_eq(r->sampling->seed, 42);
    ck_assert_uint_eq(r->n_stop, 2);
    ck_assert_str_eq(r->stop[1], "bc");
    ck_assert(r->stream && o.stream && o.include_usage && !o.chat);
    pdm_http__request_free(r);

    r = parse_ok("{\"prompt\":[1,2,3]}", 0, &o);
    ck_assert_uint_eq(r->n_prompt_tokens, 3);
    ck_assert_int_eq(r->prompt_tokens[2], 3);
    ck_assert_uint_eq(r->max_tokens, PDM_HTTP_COMPLETIONS_DEFAULT_TOKENS);
    ck_assert(r->sampling->temperature == 1.0f);
    pdm_http__request_free(r);

    r = parse_ok("{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},"
                 "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                 "{\"type\":\"text\",\"text\":\"b\"}]}],\"max_completion_tokens\":9}",
                 1, &o);
    ck_assert_uint_eq(r->n_messages, 2);
    ck_assert_str_eq(r->messages[0]->role, "system");
    ck_assert_str_eq(r->messages[1]->content, "ab");
    ck_assert_uint_eq(r->max_tokens, 9);
    ck_assert(o.chat);
    pdm_http__request_free(r);
}
END_TEST

/* echo, max_tokens 0 with echo (scoring only), lists of prompts (one request each). */
START_TEST(test_http_parse_echo_and_lists)
{
    pdm_http_opts_t o;
    Pdmesh__GenerateRequest *r =
        parse_ok("{\"prompt\":\"hi there\",\"echo\":true,\"max_tokens\":0,\"logprobs\":3}", 0,
                 &o);
    ck_assert(o.echo && r->prompt_logprobs && r->prompt_only);
    ck_assert_int_eq(o.logprobs, 3);
    pdm_http__request_free(r);
    r = parse_ok("{\"prompt\":\"hi\",\"echo\":true,\"max_tokens\":4}", 0, &o);
    ck_assert(o.echo && r->prompt_logprobs && !r->prompt_only && r->max_tokens == 4);
    pdm_http__request_free(r);
    r = parse_ok("{\"prompt\":\"hi\",\"echo\":false}", 0, &o);
    ck_assert(!o.echo && !r->prompt_logprobs);
    pdm_http__request_free(r);

    static const char body[] = "{\"prompt\":[\"a\",[5,6],\"c\"],\"max_tokens\":2,\"seed\":9}";
    Pdmesh__GenerateRequest **reqs = NULL;
    size_t n = 0;
    pdm_http_err_t err;
    ck_assert_int_eq(pdm_http__parse_batch(body, strlen(body), 0, &limits, "m", &reqs, &n, &o,
                                           &err), PDM_OK);
    ck_assert_uint_eq(n, 3);
    ck_assert_int_eq(o.n_prompts, 3);
    ck_assert_str_eq(reqs[0]->prompt, "a");
    ck_assert_uint_eq(reqs[1]->n_prompt_tokens, 2);
    ck_assert_int_eq(reqs[1]->prompt_tokens[1], 6);
    ck_assert_str_eq(reqs[2]->prompt, "c");
    for (size_t i = 0; i < n; i++)
        ck_assert(reqs[i]->max_tokens == 2 && reqs[i]->sampling->seed == 9);
    pdm_http__batch_free(reqs, n);

    /* n: one request per prompt with n set (the router makes the choices: choice = prompt * n
     * + sample, sample k seeded with pdm_sampler_seed_for_choice(seed, k)); chat too */
    static const char body_n[] = "{\"prompt\":[\"a\",\"b\"],\"n\":3,\"seed\":9}";
    ck_assert_int_eq(pdm_http__parse_batch(body_n, strlen(body_n), 0, &limits, "m", &reqs, &n,
                                           &o, &err), PDM_OK);
    ck_assert_uint_eq(n, 2);
    ck_assert_int_eq(o.n_prompts, 2);
    ck_assert_int_eq(o.n_samples, 3);
    for (size_t i = 0; i < n; i++) {
        ck_assert_str_eq(reqs[i]->prompt, i == 0 ? "a" : "b");
        ck_assert_uint_eq(reqs[i]->n, 3);
        ck_assert_uint_eq(reqs[i]->sampling->seed, 9);
    }
    pdm_http__batch_free(reqs, n);
    static const char chat_n[] =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"n\":2,\"stream\":true}";
    ck_assert_int_eq(pdm_http__parse_batch(chat_n, strlen(chat_n), 1, &limits, "m", &reqs, &n,
                                           &o, &err), PDM_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert(o.stream && o.chat && o.n_samples == 2 && reqs[0]->n == 2);
    pdm_http__batch_free(reqs, n);
    static const char one_n[] = "{\"prompt\":\"a\",\"n\":1}";
    ck_assert_int_eq(pdm_http__parse_batch(one_n, strlen(one_n), 0, &limits, "m", &reqs, &n,
                                           &o, &err), PDM_OK);
    ck_assert(n == 1 && reqs[0]->n == 0 && o.n_samples == 1);
    pdm_http__batch_free(reqs, n);
    parse_fails("{\"prompt\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\"],\"n\":8}", 0,
                400, "invalid_value"); /* 72 choices */
    parse_fails("{\"prompt\":\"a\",\"n\":2,\"best_of\":3}", 0, 400, "unsupported_value");

    parse_fails("{\"prompt\":\"a\",\"max_tokens\":0}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"echo\":1}", 0, 400, "invalid_type");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"echo\":true}", 1,
                400, "unsupported_value");
    parse_fails("{\"prompt\":[\"a\",7]}", 0, 400, "invalid_type");
    parse_fails("{\"prompt\":[\"a\",\"\"]}", 0, 400, "invalid_value");
}
END_TEST

/* An echoed choice: the prompt's text then the completion's, the prompt's entries then the
 * completion's, text_offset running over both, the first prompt token's logprob null. */
START_TEST(test_http_echo_choice)
{
    Pdmesh__TokenLogprob e[4], *p[2], *g[2];
    const char *texts[4] = {"Hi", " there", "!", " ok"};
    for (int i = 0; i < 4; i++) {
        pdmesh__token_logprob__init(&e[i]);
        e[i].token = i;
        e[i].logprob = -1.0f - (float)i;
        e[i].text.data = (uint8_t *)texts[i];
        e[i].text.len = strlen(texts[i]);
    }
    e[0].missing = 1;
    p[0] = &e[0], p[1] = &e[1], g[0] = &e[2], g[1] = &e[3];
    Pdmesh__GenerateResult res = PDMESH__GENERATE_RESULT__INIT;
    res.text = "! ok";
    res.finish = PDMESH__FINISH_REASON__FINISH_LENGTH;
    res.prompt_logprobs = p;
    res.n_prompt_logprobs = 2;
    res.logprobs = g;
    res.n_logprobs = 2;
    char *echo = pdm_http__echo_text(NULL, p, 2);
    ck_assert_str_eq(echo, "Hi there");
    cJSON *c = pdm_http__choice_json(0, 3, &res, 1, echo);
    free(echo);
    ck_assert_int_eq(cJSON_GetObjectItem(c, "index")->valueint, 3);
    ck_assert_str_eq(cJSON_GetObjectItem(c, "text")->valuestring, "Hi there! ok");
    cJSON *lp = cJSON_GetObjectItem(c, "logprobs");
    cJSON *tl = cJSON_GetObjectItem(lp, "token_logprobs");
    cJSON *off = cJSON_GetObjectItem(lp, "text_offset");
    ck_assert_int_eq(cJSON_GetArraySize(tl), 4);
    ck_assert(cJSON_IsNull(cJSON_GetArrayItem(tl, 0)));
    ck_assert(cJSON_GetArrayItem(tl, 3)->valuedouble == -4.0);
    const int want[4] = {0, 2, 8, 9};
    for (int i = 0; i < 4; i++) ck_assert_int_eq(cJSON_GetArrayItem(off, i)->valueint, want[i]);
    cJSON_Delete(c);
    /* usage summed over choices */
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    u.prompt_tokens = 5;
    u.completion_tokens = 2;
    cJSON *us = pdm_http__usage_json(&u);
    pdm_http__usage_add(us, 3, 4);
    ck_assert_int_eq(cJSON_GetObjectItem(us, "prompt_tokens")->valueint, 8);
    ck_assert_int_eq(cJSON_GetObjectItem(us, "completion_tokens")->valueint, 6);
    ck_assert_int_eq(cJSON_GetObjectItem(us, "total_tokens")->valueint, 14);
    cJSON_Delete(us);
}
END_TEST

START_TEST(test_http_parse_refusals)
{
    parse_fails("{", 0, 400, "invalid_json");
    parse_fails("3", 0, 400, "invalid_json");
    parse_fails("{\"prompt\":\"a\",\"max_tokens\":513}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"max_tokens\":1e300}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"n\":0}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"n\":9}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"n\":-1e300}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"model\":\"x\"}", 0, 404, "model_not_found");
    parse_fails("{\"prompt\":\"a\",\"best_of\":5}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\",\"seed\":0.5}", 0, 400, "invalid_type");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}]}", 0, 400, "invalid_value");
    parse_fails("{\"prompt\":\"a\"}", 1, 400, "invalid_value");
    char big[1024] = "{\"prompt\":[";
    for (int i = 0; i < 101; i++) strcat(big, i ? ",1" : "1");
    strcat(big, "]}");
    parse_fails(big, 0, 400, "context_length_exceeded");
}
END_TEST

/* Random byte edits of valid bodies: every outcome is a clean accept or a clean refusal. */
START_TEST(test_http_parse_fuzz)
{
    static const char *seeds[] = {
        "{\"prompt\":\"hello\",\"max_tokens\":5,\"stop\":[\"x\"],\"temperature\":0.5}",
        ("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"t\"}]}],"
         "\"stream\":true,\"stream_options\":{\"include_usage\":true}}"),
        "{\"prompt\":[[1,2,3]],\"best_of\":2,\"seed\":-1,\"top_k\":-1}",
        ("{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
         "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":"
         "\"tool\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
         "\"f\",\"parameters\":{\"type\":\"object\"}}}],\"tool_choice\":{\"type\":\"function\","
         "\"function\":{\"name\":\"f\"}}}"),
    };
    uint64_t rng = 7;
    char buf[512];
    int accepted = 0, refused = 0;
    for (int it = 0; it < 20000; it++) {
        const char *s = seeds[it % 4];
        size_t len = strlen(s);
        memcpy(buf, s, len);
        int edits = 1 + (int)(pdm_splitmix64(&rng) % 4);
        for (int e = 0; e < edits; e++) {
            uint64_t x = pdm_splitmix64(&rng);
            size_t at = (size_t)(x % len);
            switch ((x >> 32) % 3) {
            case 0: buf[at] = (char)(x >> 40); break;                       /* replace */
            case 1: if (len > 1) { memmove(buf + at, buf + at + 1, len - at - 1); len--; } break;
            default: if (len < sizeof(buf) - 1) {                           /* insert */
                memmove(buf + at + 1, buf + at, len - at); buf[at] = "{}[]\",:01e-"[x % 11]; len++;
            }
            }
        }
        Pdmesh__GenerateRequest *req = NULL;
        pdm_http_opts_t o;
        pdm_http_err_t err;
        if (pdm_http__parse_request(buf, len, it % 4 == 1 || it % 4 == 3, &limits, "m", &req, &o,
                                    &err) == PDM_OK) {
            ck_assert_ptr_nonnull(req);
            ck_assert(req->sampling);
            pdm_http__request_free(req);
            accepted++;
        } else {
            ck_assert(err.status >= 400 && err.status < 600 && err.code && err.message[0]);
            refused++;
        }
    }
    ck_assert(accepted > 0 && refused > 0);
}
END_TEST

START_TEST(test_http_responses)
{
    Pdmesh__GenerateResult res = PDMESH__GENERATE_RESULT__INIT;
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    u.prompt_tokens = 3;
    u.completion_tokens = 4;
    res.usage = &u;
    res.text = "quote \" and\nnewline";
    res.finish = PDMESH__FINISH_REASON__FINISH_EOS;
    for (int chat = 0; chat < 2; chat++) {
        char *s = pdm_http__result_json(chat, "id-1", 5, "m", &res, 0);
        cJSON *j = cJSON_Parse(s);
        ck_assert_ptr_nonnull(j);
        cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        cJSON *text = chat ? cJSON_GetObjectItem(cJSON_GetObjectItem(c0, "message"), "content")
                           : cJSON_GetObjectItem(c0, "text");
        ck_assert_str_eq(text->valuestring, res.text);
        ck_assert_str_eq(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "stop");
        ck_assert_int_eq(
            cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "total_tokens")->valueint, 7);
        cJSON_Delete(j);
        free(s);
        s = pdm_http__chunk_json(chat, "id-1", 5, "m", "t\"", NULL, 0, NULL, NULL);
        j = cJSON_Parse(s);
        ck_assert_ptr_nonnull(j);
        cJSON_Delete(j);
        free(s);
    }
    char *e = pdm_http__error_json(429, "overloaded", "too \"busy\"");
    cJSON *j = cJSON_Parse(e);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "type")->valuestring,
                     "rate_limit_error");
    cJSON_Delete(j);
    free(e);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_OVERLOADED), 429);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED), 504);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_UNAVAILABLE), 503);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_UNAUTHORIZED), 401);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_NOT_FOUND), 404);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT), 400);
    ck_assert_int_eq(pdm_http__status_for_code(PDMESH__ERROR_CODE__ERR_INTERNAL), 500);
}
END_TEST

/* Ill-formed UTF-8 becomes U+FFFD (one per maximal subpart), well-formed text is unchanged,
 * and an error body quoting it is valid JSON. */
START_TEST(test_http_utf8_sanitize)
{
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"plain", "plain"},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
        {"\xff\xfe", "\xef\xbf\xbd\xef\xbf\xbd"},
        {"a\xc3", "a\xef\xbf\xbd"},                         /* truncated at the end */
        {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},             /* overlong '/' */
        {"\xe0\x80\xaf", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* overlong, 3 bytes */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* a surrogate */
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* > U+10FFFF */
        {"\xe2\x82x", "\xef\xbf\xbdx"},                       /* maximal subpart: one U+FFFD */
        {"\xf0\x9f\x98", "\xef\xbf\xbd"},
        {"\x80z", "\xef\xbf\xbdz"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *o = pdm_http__utf8_sanitize(cases[i].in, strlen(cases[i].in));
        ck_assert_msg(o && !strcmp(o, cases[i].out), "case %zu", i);
        free(o);
        char *e = pdm_http__error_json(404, "model_not_found", cases[i].in);
        cJSON *j = cJSON_Parse(e);
        ck_assert_msg(j != NULL, "case %zu: %s", i, e);
        cJSON *err = cJSON_GetObjectItem(j, "error");
        const char *m = cJSON_GetObjectItem(err, "message")->valuestring;
        ck_assert_str_eq(m, cases[i].out);
        cJSON_Delete(j);
        free(e);
    }
    /* every byte value, alone and after a lead byte: always valid output */
    for (int a = 0; a < 256; a++)
        for (int b = 1; b < 256; b++) {
            char in[3] = {(char)(a ? a : 'x'), (char)b, 0};
            char *o = pdm_http__utf8_sanitize(in, 2);
            char *again = pdm_http__utf8_sanitize(o, strlen(o));
            ck_assert_str_eq(o, again); /* the output is well-formed: a fixed point */
            free(again);
            free(o);
        }
}
END_TEST

static const char tools_body[] =
    "{\"messages\":[{\"role\":\"user\",\"content\":\"t?\"},{\"role\":\"assistant\",\"content\":"
    "null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
    "\"get_time\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"call_1\","
    "\"content\":\"12:00\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
    "\"get_time\",\"description\":\"now\",\"parameters\":{\"type\":\"object\"}}}]%s}";

static char *tools_request(const char *extra)
{
    static char buf[2048];
    snprintf(buf, sizeof(buf), tools_body, extra);
    return buf;
}

START_TEST(test_http_parse_tools)
{
    pdm_http_opts_t o;
    Pdmesh__GenerateRequest *r = parse_ok(tools_request(""), 1, &o);
    ck_assert_str_eq(r->tool_choice, "auto");
    ck_assert(o.tools);
    ck_assert_ptr_nonnull(strstr(r->tools_json, "\"get_time\""));
    ck_assert_uint_eq(r->n_messages, 3);
    ck_assert_str_eq(r->messages[1]->content, "");
    ck_assert_ptr_nonnull(strstr(r->messages[1]->tool_calls_json, "\"arguments\":\"{}\""));
    ck_assert_str_eq(r->messages[2]->role, "tool");
    ck_assert_str_eq(r->messages[2]->tool_call_id, "call_1");
    pdm_http__request_free(r);
    r = parse_ok(tools_request(",\"tool_choice\":\"none\""), 1, &o);
    ck_assert_str_eq(r->tool_choice, "none");
    ck_assert(!o.tools);
    pdm_http__request_free(r);
    r = parse_ok(tools_request(",\"tool_choice\":\"required\",\"stream\":true"), 1, &o);
    ck_assert_str_eq(r->tool_choice, "required");
    ck_assert(o.tools && o.stream);
    pdm_http__request_free(r);
    r = parse_ok(tools_request(",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
                               "\"get_time\"}}"), 1, &o);
    ck_assert_str_eq(r->tool_choice, "get_time");
    pdm_http__request_free(r);
    /* refusals name the field */
    parse_fails(tools_request(",\"tool_choice\":\"always\""), 1, 400, "invalid_value");
    parse_fails(tools_request(",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":"
                              "\"nope\"}}"), 1, 400, "invalid_value");
    parse_fails(tools_request(",\"tool_choice\":\"required\",\"response_format\":{\"type\":"
                              "\"json_object\"}"), 1, 400, "unsupported_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":"
                "\"required\"}", 1, 400, "invalid_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", 1, 400,
                "invalid_type");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                "\"retrieval\"}]}", 1, 400, "unsupported_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                "\"function\",\"function\":{\"name\":\"a b\"}}]}", 1, 400, "invalid_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                "\"function\",\"function\":{\"name\":\"f\",\"parameters\":3}}]}", 1, 400,
                "invalid_type");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                "\"function\",\"function\":{\"name\":\"f\"}},{\"type\":\"function\",\"function\":"
                "{\"name\":\"f\"}}]}", 1, 400, "invalid_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}],"
                "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                "\"prompt\":1}", 1, 400, "invalid_value");
    parse_fails("{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[{}]}]}", 1,
                400, "invalid_value");
    parse_fails("{\"prompt\":\"x\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
                "\"f\"}}]}", 0, 400, "unsupported_value");
    parse_fails("{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", 1, 400,
                "invalid_value");
}
END_TEST

/* The non-streamed choice: calls moved into message.tool_calls. */
START_TEST(test_http_choice_tools)
{
    Pdmesh__GenerateResult res;
    pdmesh__generate_result__init(&res);
    res.text = "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": "
               "\"UTC\"}}\n</tool_call>";
    res.finish = PDMESH__FINISH_REASON__FINISH_EOS;
    cJSON *c = pdm_http__choice_json(1, 0, &res, 0, NULL);
    ck_assert_int_eq(pdm_http__choice_tools(c), PDM_OK);
    cJSON *msg = cJSON_GetObjectItem(c, "message");
    ck_assert_str_eq(cJSON_GetObjectItem(msg, "content")->valuestring, "Checking.");
    cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(msg, "tool_calls"), 0);
    ck_assert_int_eq(strncmp(cJSON_GetObjectItem(call, "id")->valuestring, "call_", 5), 0);
    ck_assert_int_eq(strlen(cJSON_GetObjectItem(call, "id")->valuestring), 29);
    ck_assert_str_eq(cJSON_GetObjectItem(call, "type")->valuestring, "function");
    cJSON *fn = cJSON_GetObjectItem(call, "function");
    ck_assert_str_eq(cJSON_GetObjectItem(fn, "name")->valuestring, "get_time");
    ck_assert_str_eq(cJSON_GetObjectItem(fn, "arguments")->valuestring, "{\"tz\":\"UTC\"}");
    ck_assert_str_eq(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "tool_calls");
    cJSON_Delete(c);
    /* only a call: content null; no call: unchanged */
    res.text = "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>";
    c = pdm_http__choice_json(1, 0, &res, 0, NULL);
    pdm_http__choice_tools(c);
    ck_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")));
    cJSON_Delete(c);
    res.text = "no call here";
    c = pdm_http__choice_json(1, 0, &res, 0, NULL);
    pdm_http__choice_tools(c);
    ck_assert_str_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")
                         ->valuestring, "no call here");
    ck_assert_ptr_null(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "tool_calls"));
    ck_assert_str_eq(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    cJSON_Delete(c);
}
END_TEST

typedef struct {
    char content[512];
    char calls[512]; /* "name(args);" per call */
    int events;
} tool_sink_t;

static void tool_sink(void *ctx, const char *content, const char *name, const char *args)
{
    tool_sink_t *t = ctx;
    t->events++;
    if (content) strncat(t->content, content, sizeof(t->content) - strlen(t->content) - 1);
    else
        snprintf(t->calls + strlen(t->calls), sizeof(t->calls) - strlen(t->calls), "%s(%s);",
                 name, args);
}

/* Streaming: fed whole or byte by byte, the same content and calls come out, and no byte of a
 * marker ever reaches the content. */
START_TEST(test_http_tool_stream)
{
    static const struct {
        const char *text, *content, *calls;
    } cases[] = {
        {"Hi <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n"
         "<tool_call>{\"name\":\"g\",\"arguments\":\"{}\"}</tool_call>\n",
         "Hi", "f({\"a\":1});g({});"},
        {"plain <tool text\n\n", "plain <tool text\n\n", ""},
        {"<tool_call>{\"name\": \"f\", \"argu", "<tool_call>{\"name\": \"f\", \"argu", ""},
        {"<tool_call>[1]</tool_call> after", "<tool_call>[1]</tool_call> after", ""},
        {"<tool_call>{\"name\":\"f\"}</tool_call>\nthen text", "then text", "f({});"},
        /* Llama 3.1: a bare call, with or without <|python_tag|>; JSON that is no call */
        {" {\"name\": \"f\", \"parameters\": {\"a\": 1}}", "", "f({\"a\":1});"},
        {"<|python_tag|>{\"name\": \"f\", \"parameters\": {}}", "", "f({});"},
        {"{\"answer\": 42}", "{\"answer\": 42}", ""},
        {"<|python_tag|> hello", "<|python_tag|> hello", ""},
    };
    for (size_t i = 0; i < PDM_ARRAY_SIZE(cases); i++) {
        for (int bytewise = 0; bytewise < 2; bytewise++) {
            tool_sink_t sink = {0};
            pdm_http_tool_stream_t ts = {0};
            const char *t = cases[i].text;
            if (bytewise) {
                for (size_t k = 0; t[k]; k++) {
                    char one[2] = {t[k], 0};
                    ck_assert_int_eq(pdm_http__tool_stream_feed(&ts, one, 0, tool_sink, &sink),
                                     PDM_OK);
                    ck_assert_ptr_null(strstr(sink.content, "<tool_call>{\"name\":\"g"));
                }
            } else {
                ck_assert_int_eq(pdm_http__tool_stream_feed(&ts, t, 0, tool_sink, &sink),
                                 PDM_OK);
            }
            ck_assert_int_eq(pdm_http__tool_stream_feed(&ts, NULL, 1, tool_sink, &sink), PDM_OK);
            ck_assert_msg(!strcmp(sink.content, cases[i].content), "case %zu/%d: content '%s'",
                          i, bytewise, sink.content);
            ck_assert_msg(!strcmp(sink.calls, cases[i].calls), "case %zu/%d: calls '%s'", i,
                          bytewise, sink.calls);
            pdm_http__tool_stream_fini(&ts);
        }
    }
    /* mutated call texts: never a crash, and the stream finds the calls the parser finds
     * (malformed and unclosed blocks are text in both) */
    static const char seed[] = "a <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, "
                               "\"y\"]}}\n</tool_call>\n<tool_call>{\"name\":\"g\"}</tool_call>";
    uint64_t rng = 11;
    for (int it = 0; it < 3000; it++) {
        char buf[256];
        size_t len = sizeof(seed) - 1;
        memcpy(buf, seed, len);
        for (int e = 0, edits = 1 + (int)(pdm_splitmix64(&rng) % 3); e < edits; e++) {
            uint64_t x = pdm_splitmix64(&rng);
            size_t at = (size_t)(x % len);
            if ((x >> 32) % 2 && len > 1) {
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
            } else {
                buf[at] = "{}[]\",:<>/ \n"[(x >> 40) % 12];
            }
        }
        buf[len] = 0;
        pdm_chat_tool_call_t *calls = NULL;
        int n = 0;
        char *content = NULL;
        ck_assert_int_eq(pdm_chat_tool_calls_parse(buf, &calls, &n, &content), PDM_OK);
        tool_sink_t sink = {0};
        pdm_http_tool_stream_t ts = {0};
        size_t step = 1 + (size_t)(pdm_splitmix64(&rng) % 7);
        for (size_t k = 0; k < len; k += step) {
            char piece[8] = {0};
            memcpy(piece, buf + k, k + step <= len ? step : len - k);
            ck_assert_int_eq(pdm_http__tool_stream_feed(&ts, piece, 0, tool_sink, &sink), PDM_OK);
        }
        ck_assert_int_eq(pdm_http__tool_stream_feed(&ts, NULL, 1, tool_sink, &sink), PDM_OK);
        ck_assert_msg(ts.calls == n, "'%s': %d calls parsed, %d streamed", buf, n, ts.calls);
        pdm_http__tool_stream_fini(&ts);
        pdm_chat_tool_calls_free(calls, n);
        free(content);
    }
    /* the chunk shapes */
    char *first = pdm_http__tool_chunk_json("id", 1, "m", 0, 2, "call_x", "f", "");
    char *frag = pdm_http__tool_chunk_json("id", 1, "m", 0, 2, NULL, NULL, "{\"a\":1}");
    ck_assert_str_eq(first, "{\"id\":\"id\",\"object\":\"chat.completion.chunk\",\"created\":1,"
                            "\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":"
                            "[{\"index\":2,\"id\":\"call_x\",\"type\":\"function\",\"function\":{"
                            "\"name\":\"f\",\"arguments\":\"\"}}]},\"logprobs\":null,"
                            "\"finish_reason\":null}]}");
    ck_assert_ptr_nonnull(strstr(frag, "{\"index\":2,\"function\":{\"arguments\":"
                                       "\"{\\\"a\\\":1}\"}}"));
    free(first);
    free(frag);
}
END_TEST

Suite *suite_http(void)
{
    Suite *s = suite_create("http");
    TCase *tc = tcase_create("openai");
    tcase_add_test(tc, test_http_parse_fields);
    tcase_add_test(tc, test_http_parse_refusals);
    tcase_add_test(tc, test_http_parse_echo_and_lists);
    tcase_add_test(tc, test_http_echo_choice);
    tcase_add_test(tc, test_http_parse_fuzz);
    tcase_add_test(tc, test_http_responses);
    tcase_add_test(tc, test_http_utf8_sanitize);
    tcase_add_test(tc, test_http_parse_tools);
    tcase_add_test(tc, test_http_choice_tools);
    tcase_add_test(tc, test_http_tool_stream);
    suite_add_tcase(s, tc);
    return s;
}
