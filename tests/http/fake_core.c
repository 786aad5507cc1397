/*
 * fake_core.c - pdm-http-fake: the real HTTP front end (router/http.c) on a scripted router
 * core, to test the HTTP layer alone: error mapping, failures in the middle of a stream,
 * cancellation on disconnect, limits, pipelining. The end-to-end tests with the real router
 * and real nodes are tests/integration/.
 *
 * The scripted core implements router/router.h. The prompt (or the last chat message) selects
 * the behaviour:
 *   "REFUSE <code>"   pdm_router_submit refuses with that Pdmesh__ErrorCode
 *   "EARLY <code>"    accepted, then ends with that error before any token
 *   "MID <code>"      three tokens, then that error
 *   "SLOW"            one token every 100 ms, up to max_tokens (for cancellation)
 *   "PARAMS"          the completion is a JSON object of the request's parsed fields
 *   "INSTANT"         one token and the result on the loop's next turn (overhead measurements)
 *   "FLOOD"           64 KiB of text per token every 2 ms, up to max_tokens (slow readers)
 *   anything else     the prompt's words, cycled, one per token every 2 ms, up to max_tokens;
 *                     with logprobs, token i (text t_i) has logprob -(i + 1) / 8 and its
 *                     alternatives are t_i itself, then "alt1", "alt2", ... at that minus
 *                     1, 2, ... (fake_logprob), in the chunks and in the result
 * Events are printed on stdout, one per line: "port N", "submit ID", "cancel ID", "end ID".
 *
 *   pdm-http-fake [--port N] [--max-conns N] [--max-conns-per-peer N] [--idle S]
 *                 [--head-timeout S] [--body-timeout S] [--max-body BYTES] [--not-ready]
 * SIGTERM/SIGINT stop the server (pdm_http_stop) and the program exits when the loop is empty.
 */
#include <cjson/cJSON.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "router/http.h"
#include "router/metrics.h"

struct pdm_router {
    uv_loop_t *loop;
    pdm_router_limits_t limits;
    int ready;
    uint64_t next_id;
    struct freq *reqs;
    pdm_metrics_t *metrics;
};

typedef struct freq {
    struct freq *next;
    pdm_router_t *r;
    uint64_t id;
    pdm_router_sink_t sink;
    uv_timer_t timer;
    int mode;              /* 0 words, 1 early, 2 mid, 3 slow, 4 params, 5 flood, 6 instant */
    int code;
    uint32_t max_tokens, sent;
    char **words;
    size_t n_words;
    char *params;          /* mode 4: the completion text */
    char *text;            /* completion so far */
    size_t text_len;
    uint32_t prompt_tokens;
    int logprobs;          /* -1: none; else alternatives per token */
} freq_t;

/* The scripted log-probabilities of token i, whose text is piece: into *m, its alternatives
 * into tops[] (their texts in alt[][8]). */
static void fake_logprob(const freq_t *q, uint32_t i, const char *piece, Pdmesh__TokenLogprob *m,
                         Pdmesh__TokenLogprob *tops, Pdmesh__TokenLogprob **top_ptrs,
                         char (*alt)[8])
{
    pdmesh__token_logprob__init(m);
    m->token = (int32_t)i;
    m->logprob = -(float)(i + 1) / 8;
    m->text.data = (uint8_t *)piece;
    m->text.len = strlen(piece);
    for (int k = 0; k < q->logprobs; k++) {
        pdmesh__token_logprob__init(&tops[k]);
        tops[k].token = k == 0 ? (int32_t)i : 1000 + k;
        tops[k].logprob = m->logprob - (float)k;
        if (k) snprintf(alt[k], 8, "alt%d", k % 100);
        tops[k].text.data = (uint8_t *)(k ? alt[k] : piece);
        tops[k].text.len = strlen(k ? alt[k] : piece);
        top_ptrs[k] = &tops[k];
    }
    m->top = top_ptrs;
    m->n_top = (size_t)q->logprobs;
}

/* Word mode: the text of token i. */
static void word_piece(const freq_t *q, uint32_t i, char *piece, size_t cap)
{
    snprintf(piece, cap, "%s%s", i ? " " : "", q->n_words ? q->words[i % q->n_words] : "x");
}

static void freq_closed(uv_handle_t *h)
{
    freq_t *q = h->data;
    for (size_t i = 0; i < q->n_words; i++) free(q->words[i]);
    free(q->words);
    free(q->params);
    free(q->text);
    free(q);
}

static void freq_end(freq_t *q)
{
    pdm_router_t *r = q->r;
    for (freq_t **pp = &r->reqs; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    printf("end %llu\n", (unsigned long long)q->id);
    fflush(stdout);
    uv_timer_stop(&q->timer);
    uv_close((uv_handle_t *)&q->timer, freq_closed);
}

static void append(freq_t *q, const char *s)
{
    size_t l = strlen(s);
    char *t = realloc(q->text, q->text_len + l + 1);
    if (!t) return;
    memcpy(t + q->text_len, s, l + 1);
    q->text = t;
    q->text_len += l;
}

static void finish_ok(freq_t *q, int finish)
{
    Pdmesh__GenerateResult res = PDMESH__GENERATE_RESULT__INIT;
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    res.request_id = q->id;
    res.finish = finish;
    res.text = q->text ? q->text : "";
    u.prompt_tokens = q->prompt_tokens;
    u.completion_tokens = q->sent;
    u.prefill_method = "fake";
    u.attempts = 1;
    res.usage = &u;
    /* word mode with logprobs: every token's scripted entry */
    size_t n_lp = q->logprobs >= 0 && q->mode == 0 ? q->sent : 0;
    Pdmesh__TokenLogprob *m = calloc(n_lp + 1, sizeof(*m));
    Pdmesh__TokenLogprob **list = calloc(n_lp + 1, sizeof(*list));
    Pdmesh__TokenLogprob *tops = calloc((n_lp + 1) * 20, sizeof(*tops));
    Pdmesh__TokenLogprob **top_ptrs = calloc((n_lp + 1) * 20, sizeof(*top_ptrs));
    char (*pieces)[256] = calloc(n_lp + 1, 256), (*alt)[8] = calloc(20, 8);
    if (m && list && tops && top_ptrs && pieces && alt && q->logprobs >= 0) {
        for (size_t i = 0; i < n_lp; i++) {
            word_piece(q, (uint32_t)i, pieces[i], 256);
            fake_logprob(q, (uint32_t)i, pieces[i], &m[i], tops + i * 20, top_ptrs + i * 20, alt);
            list[i] = &m[i];
        }
        res.logprobs = list;
        res.n_logprobs = n_lp;
    }
    q->sink.on_result(q->sink.ctx, &res);
    free(m);
    free(list);
    free(tops);
    free(top_ptrs);
    free(pieces);
    free(alt);
    freq_end(q);
}

static void tick(uv_timer_t *t)
{
    freq_t *q = t->data;
    if (q->mode == 1) {
        q->sink.on_error(q->sink.ctx, q->code, "scripted failure before the first token");
        freq_end(q);
        return;
    }
    if (q->mode == 2 && q->sent == 3) {
        q->sink.on_error(q->sink.ctx, q->code, "scripted failure in the middle of the stream");
        freq_end(q);
        return;
    }
    if (q->mode == 6) {
        int32_t tok = 0;
        append(q, "x");
        q->sent = 1;
        q->sink.on_tokens(q->sink.ctx, 0, &tok, 1, "x", NULL);
        finish_ok(q, PDMESH__FINISH_REASON__FINISH_LENGTH);
        return;
    }
    if (q->mode == 4) {
        append(q, q->params);
        q->sent = 1;
        int32_t tok = 1;
        q->sink.on_tokens(q->sink.ctx, 0, &tok, 1, q->params, NULL);
        finish_ok(q, PDMESH__FINISH_REASON__FINISH_EOS);
        return;
    }
    if (q->sent >= q->max_tokens) {
        finish_ok(q, PDMESH__FINISH_REASON__FINISH_LENGTH);
        return;
    }
    if (q->mode == 5) {
        static char big[65537];
        memset(big, 'f', sizeof(big) - 1);
        int32_t tok = (int32_t)q->sent;
        q->sink.on_tokens(q->sink.ctx, q->sent, &tok, 1, big, NULL);
        q->sent++;
        return;
    }
    char piece[256];
    word_piece(q, q->sent, piece, sizeof(piece));
    append(q, piece);
    int32_t tok = (int32_t)q->sent;
    Pdmesh__TokenLogprob m, tops[20], *top_ptrs[20], *list[1] = {&m};
    char alt[20][8];
    if (q->logprobs >= 0 && q->mode == 0) fake_logprob(q, q->sent, piece, &m, tops, top_ptrs, alt);
    q->sink.on_tokens(q->sink.ctx, q->sent, &tok, 1, piece,
                      q->logprobs >= 0 && q->mode == 0 ? list : NULL);
    q->sent++;
}

static char *params_json(const Pdmesh__GenerateRequest *req)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "max_tokens", req->max_tokens);
    if (req->sampling) {
        cJSON_AddNumberToObject(o, "temperature", req->sampling->temperature);
        cJSON_AddNumberToObject(o, "top_p", req->sampling->top_p);
        cJSON_AddNumberToObject(o, "top_k", req->sampling->top_k);
        cJSON_AddNumberToObject(o, "min_p", req->sampling->min_p);
        cJSON_AddNumberToObject(o, "repeat_penalty", req->sampling->repeat_penalty);
        char seed[32];
        snprintf(seed, sizeof(seed), "%llu", (unsigned long long)req->sampling->seed);
        cJSON_AddStringToObject(o, "seed", seed);
        cJSON_AddNumberToObject(o, "presence_penalty", req->sampling->presence_penalty);
        cJSON_AddNumberToObject(o, "frequency_penalty", req->sampling->frequency_penalty);
        cJSON *lb = cJSON_AddObjectToObject(o, "logit_bias");
        for (size_t i = 0; i < req->sampling->n_logit_bias_ids; i++) {
            char key[16];
            snprintf(key, sizeof(key), "%d", req->sampling->logit_bias_ids[i]);
            cJSON_AddNumberToObject(lb, key, req->sampling->logit_bias_values[i]);
        }
        cJSON_AddBoolToObject(o, "logprobs", req->sampling->logprobs);
        cJSON_AddNumberToObject(o, "top_logprobs", req->sampling->top_logprobs);
        cJSON_AddStringToObject(o, "json_schema",
                                req->sampling->json_schema ? req->sampling->json_schema : "");
    }
    cJSON *stop = cJSON_AddArrayToObject(o, "stop");
    for (size_t i = 0; i < req->n_stop; i++) cJSON_AddItemToArray(stop, cJSON_CreateString(req->stop[i]));
    cJSON *toks = cJSON_AddArrayToObject(o, "prompt_tokens");
    for (size_t i = 0; i < req->n_prompt_tokens; i++)
        cJSON_AddItemToArray(toks, cJSON_CreateNumber(req->prompt_tokens[i]));
    cJSON_AddStringToObject(o, "prompt", req->prompt ? req->prompt : "");
    cJSON *msgs = cJSON_AddArrayToObject(o, "messages");
    for (size_t i = 0; i < req->n_messages; i++) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", req->messages[i]->role);
        cJSON_AddStringToObject(m, "content", req->messages[i]->content);
        cJSON_AddItemToArray(msgs, m);
    }
    cJSON_AddStringToObject(o, "model", req->model ? req->model : "");
    cJSON_AddBoolToObject(o, "stream", req->stream);
    cJSON_AddBoolToObject(o, "ignore_eos", req->ignore_eos);
    cJSON_AddNumberToObject(o, "beams", req->beams);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

static int submit_one(pdm_router_t *r, const Pdmesh__GenerateRequest *req, const char *client,
                      const pdm_router_sink_t *sink, uint64_t *id, int *code)
{
    const char *text = req->prompt && req->prompt[0] ? req->prompt : "";
    if (req->n_messages) text = req->messages[req->n_messages - 1]->content;
    int arg = 0;
    if (sscanf(text, "REFUSE %d", &arg) == 1) {
        *code = arg;
        return pdm_error_set(PDM_EINVAL, "scripted refusal with code %d", arg);
    }
    freq_t *q = calloc(1, sizeof(*q));
    if (!q) {
        *code = PDMESH__ERROR_CODE__ERR_INTERNAL;
        return pdm_error_set(PDM_ENOMEM, "out of memory");
    }
    q->r = r;
    q->id = ++r->next_id;
    q->sink = *sink;
    q->max_tokens = req->max_tokens ? req->max_tokens : 32;
    q->logprobs = req->sampling && req->sampling->logprobs ? (int)req->sampling->top_logprobs : -1;
    q->prompt_tokens = (uint32_t)(req->n_prompt_tokens ? req->n_prompt_tokens : strlen(text));
    uint64_t period = 2;
    if (sscanf(text, "EARLY %d", &arg) == 1) q->mode = 1, q->code = arg;
    else if (sscanf(text, "MID %d", &arg) == 1) q->mode = 2, q->code = arg;
    else if (!strcmp(text, "SLOW")) q->mode = 3, period = 100;
    else if (!strcmp(text, "PARAMS")) q->mode = 4, q->params = params_json(req);
    else if (!strcmp(text, "FLOOD")) q->mode = 5;
    else if (!strcmp(text, "INSTANT")) q->mode = 6, period = 0;
    if (q->mode == 0 || q->mode == 3 || q->mode == 2) {
        char *copy = strdup(text), *save = NULL;
        for (char *w = strtok_r(copy, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
            char **nw = realloc(q->words, (q->n_words + 1) * sizeof(char *));
            if (!nw) break;
            q->words = nw;
            q->words[q->n_words++] = strdup(w);
        }
        free(copy);
    }
    uv_timer_init(r->loop, &q->timer);
    q->timer.data = q;
    uv_timer_start(&q->timer, tick, period, period);
    q->next = r->reqs;
    r->reqs = q;
    *id = q->id;
    printf("submit %llu %s\n", (unsigned long long)q->id, client);
    fflush(stdout);
    return PDM_OK;
}

/* OpenAI's n: one scripted request per choice, each with its own sink (router.h). */
int pdm_router_submit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, const char *client,
                      const pdm_router_sink_t *sinks, uint64_t *ids, int *code)
{
    const uint32_t n = req->n > 1 ? req->n : 1;
    if (n > 8) {
        *code = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
        return pdm_error_set(PDM_EINVAL, "n %u: at most 8 choices", n);
    }
    for (uint32_t i = 0; i < n; i++) {
        /* a scripted refusal comes with the first choice (the same prompt for all) */
        int st = submit_one(r, req, client, &sinks[i], &ids[i], code);
        if (st) return st;
    }
    return PDM_OK;
}

/* Ends the request inside the call (the sink contract allows it), to exercise that path. */
int pdm_router_cancel(pdm_router_t *r, uint64_t id)
{
    for (freq_t *q = r->reqs; q; q = q->next)
        if (q->id == id) {
            printf("cancel %llu\n", (unsigned long long)id);
            fflush(stdout);
            q->sink.on_error(q->sink.ctx, PDMESH__ERROR_CODE__ERR_CANCELLED, "cancelled");
            freq_end(q);
            return PDM_OK;
        }
    return PDM_ENOTFOUND;
}

uv_loop_t *pdm_router_loop(pdm_router_t *r) { return r->loop; }
const char *pdm_router_model_name(const pdm_router_t *r) { return "fake-model"; }
int pdm_router_ready(const pdm_router_t *r) { return r->ready; }
const pdm_router_limits_t *pdm_router_limits(const pdm_router_t *r) { return &r->limits; }
struct pdm_metrics *pdm_router_metrics(pdm_router_t *r) { return r->metrics; }
int pdm_router_render_chat(pdm_router_t *r, const Pdmesh__ChatMessage *const *msgs, size_t n,
                           int32_t **out, size_t *n_out)
{
    return pdm_error_set(PDM_EUNSUPPORTED, "fake core: no chat template");
}

/* A byte tokenizer: token i is the byte i. */
int pdm_router_tokenize(pdm_router_t *r, const char *text, size_t len, int add_special,
                        int32_t **out, size_t *n_out)
{
    int32_t *ids = malloc(sizeof(int32_t) * (len + 1));
    if (!ids) return pdm_error_set(PDM_ENOMEM, "out of memory");
    for (size_t i = 0; i < len; i++) ids[i] = (unsigned char)text[i];
    *out = ids;
    *n_out = len;
    return PDM_OK;
}

int pdm_router_token_text(pdm_router_t *r, int32_t id, char *buf, size_t cap)
{
    if (id < 0 || id > 255) return PDM_ERANGE;
    if (cap < 1) return PDM_EOVERFLOW;
    buf[0] = (char)id;
    return 1;
}

int32_t pdm_router_special_token(pdm_router_t *r, int which) { return -1; }

static pdm_http_t *g_http;
static uv_signal_t g_sigterm, g_sigint;

static void on_signal(uv_signal_t *s, int signum)
{
    pdm_http_stop(g_http);
    g_http = NULL;
    uv_close((uv_handle_t *)&g_sigterm, NULL);
    uv_close((uv_handle_t *)&g_sigint, NULL);
}

int main(int argc, char **argv)
{
    pdm_router_t r = {0};
    pdm_http_config_t cfg = {.host = "127.0.0.1", .port = 0};
    r.ready = 1;
    r.limits.max_tokens = 4096;
    r.limits.max_prompt_tokens = 8192;
    r.limits.max_beams = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--port") && i + 1 < argc) cfg.port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-conns") && i + 1 < argc) cfg.max_connections = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--idle") && i + 1 < argc) cfg.idle_timeout = atof(argv[++i]);
        else if (!strcmp(argv[i], "--max-conns-per-peer") && i + 1 < argc)
            cfg.max_connections_per_peer = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--head-timeout") && i + 1 < argc)
            cfg.head_timeout = atof(argv[++i]);
        else if (!strcmp(argv[i], "--body-timeout") && i + 1 < argc)
            cfg.body_timeout = atof(argv[++i]);
        else if (!strcmp(argv[i], "--max-body") && i + 1 < argc)
            r.limits.max_body_bytes = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--not-ready")) r.ready = 0;
        else {
            fprintf(stderr, "pdm-http-fake: unknown argument '%s'\n", argv[i]);
            return 2;
        }
    }
    uv_loop_t loop;
    uv_loop_init(&loop);
    r.loop = &loop;
    r.metrics = pdm_metrics_create();
    if (pdm_http_start(&r, &cfg, &g_http) != PDM_OK) {
        fprintf(stderr, "pdm-http-fake: %s\n", pdm_error_last());
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
        pdm_metrics_free(r.metrics);
        return 1;
    }
    printf("port %d\n", pdm_http_port(g_http));
    fflush(stdout);
    uv_signal_init(&loop, &g_sigterm);
    uv_signal_init(&loop, &g_sigint);
    uv_signal_start(&g_sigterm, on_signal, SIGTERM);
    uv_signal_start(&g_sigint, on_signal, SIGINT);
    uv_run(&loop, UV_RUN_DEFAULT);
    int rc = uv_loop_close(&loop);
    pdm_metrics_free(r.metrics);
    if (rc != 0) {
        fprintf(stderr, "pdm-http-fake: handles left open at exit\n");
        return 1;
    }
    printf("exit\n");
    return 0;
}
