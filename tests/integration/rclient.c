/*
 * pdm-rclient - a small test client of the router's ZeroMQ protocol (tests/integration).
 *
 *   pdm-rclient gen   --ep EP (--prompt TEXT | --tokens 1,2,3) [--chat] [-n N] [--temp T]
 *                     [--stream] [--count K] [--deadline-ms MS] [--timeout S] [--cancel-after N]
 *                     [--seed S]
 *                     [--stop STRING] [--beams B] [--n-best N] [--ignore-eos]
 *                     [--top-logprobs N]   (each token's bytes and its N best candidates)
 *   pdm-rclient raw   --ep EP --kind garbage|oversized|unknown|multipart|badproto|ping
 *   pdm-rclient admin --ep EP --op OP [--name N] [--key K] [--value V] [--id R] [--no-token]
 *   pdm-rclient register --ep NODE_EP --node-id ID      (secret from the environment)
 *   pdm-rclient fakenode --ep NODE_EP --node-id ID [--timeout S]   a decode node that answers
 *                     at once (router overhead)
 *   pdm-rclient bench --ep EP [--count N] [-n N]   sequential requests: p50/p99 round trip
 *
 * Every reply is printed as one JSON line; the exit status is 0 when the command ran (the
 * JSON says whether the router accepted), 1 on a timeout or a broken reply.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "common/pdm.h"
#include "common/wire.h"

static const char *stop_arg;
static const char *ep, *prompt, *tokens_arg, *kind, *op, *name, *key, *value, *node_id;
static int chat, n_predict = 32, stream_, count = 1, no_token, cancel_after = -1;
static int beams_, n_best_, ignore_eos_, top_lp_;
static double temp, timeout_s = 120;
static uint64_t seed; /* --seed: 0 = the router's default */
static unsigned deadline_ms;
static unsigned long long req_id_arg;

static void *dealer(void *ctx)
{
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_connect(s, ep)) {
        fprintf(stderr, "pdm-rclient: connect %s: %s\n", ep, zmq_strerror(zmq_errno()));
        exit(1);
    }
    return s;
}

/* Receives one message frame within ms; NULL on timeout. */
static pdm_wire_msg_t *recv_msg(void *s, int ms)
{
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, ms) <= 0) return NULL;
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, s, 0) < 0) return NULL;
    pdm_wire_msg_t *w = NULL;
    if (pdm_wire_unpack(zmq_msg_data(&m), zmq_msg_size(&m), 64u << 20, 0, &w))
        fprintf(stderr, "pdm-rclient: bad reply: %s\n", pdm_error_last());
    zmq_msg_close(&m);
    return w;
}

static void print_json(cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    printf("%s\n", s);
    fflush(stdout);
    free(s);
    cJSON_Delete(o);
}

static cJSON *error_json(const Pdmesh__Error *e)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "ok", 0);
    cJSON_AddNumberToObject(o, "code", e->code);
    cJSON_AddStringToObject(o, "error", e->message ? e->message : "");
    cJSON_AddNumberToObject(o, "id", (double)e->request_id);
    return o;
}

typedef struct {
    int done;
    int32_t *stream_toks;
    size_t n_stream;
    int stream_ok;
    char *stream_text;
} gen_state_t;

static int cmd_gen(void *ctx)
{
    if (count > 4096) {
        fprintf(stderr, "pdm-rclient: gen: --count at most 4096\n");
        return 2;
    }
    void *s = dealer(ctx);
    int32_t *toks = NULL;
    size_t n_toks = 0;
    if (tokens_arg) {
        toks = malloc(sizeof(int32_t) * (strlen(tokens_arg) + 1));
        for (char *p = (char *)tokens_arg; *p;) {
            toks[n_toks++] = (int32_t)strtol(p, &p, 10);
            if (*p == ',') p++;
            else if (*p) break;
        }
    }
    Pdmesh__ChatMessage cm = PDMESH__CHAT_MESSAGE__INIT, *cmp = &cm;
    cm.role = "user";
    cm.content = (char *)prompt;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    sp.temperature = (float)temp;
    sp.seed = seed;
    sp.logprobs = top_lp_ > 0;
    sp.top_logprobs = (uint32_t)top_lp_;
    for (int i = 0; i < count; i++) {
        Pdmesh__GenerateRequest g = PDMESH__GENERATE_REQUEST__INIT;
        g.request_id = (uint64_t)i + 1;
        if (toks) {
            g.prompt_tokens = toks;
            g.n_prompt_tokens = n_toks;
        } else if (chat) {
            g.messages = &cmp;
            g.n_messages = 1;
        } else {
            g.prompt = (char *)prompt;
        }
        g.sampling = &sp;
        g.max_tokens = (uint32_t)n_predict;
        g.stream = stream_;
        g.deadline_ms = deadline_ms;
        g.beams = (uint32_t)beams_;
        g.n_best = (uint32_t)n_best_;
        g.ignore_eos = ignore_eos_;
        char *stops[1] = {(char *)stop_arg};
        if (stop_arg) {
            g.stop = stops;
            g.n_stop = 1;
        }
        if (pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST, &g.base)) {
            fprintf(stderr, "pdm-rclient: %s\n", pdm_error_last());
            return 1;
        }
    }
    gen_state_t *st = calloc((size_t)count + 1, sizeof(*st));
    for (int i = 0; i <= count; i++) {
        st[i].stream_toks = malloc(sizeof(int32_t) * (size_t)(n_predict + 1));
        st[i].stream_ok = 1;
        st[i].stream_text = calloc(1, 1 << 16);
    }
    int open_ = count;
    double end = pdm_now() + timeout_s;
    while (open_ > 0 && pdm_now() < end) {
        pdm_wire_msg_t *w = recv_msg(s, 200);
        if (!w) continue;
        int type = pdm_wire_type(w);
        ProtobufCMessage *m = pdm_wire_message(w);
        if (type == PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK) {
            Pdmesh__TokenChunk *c = (Pdmesh__TokenChunk *)m;
            if (c->request_id >= 1 && c->request_id <= (uint64_t)count) {
                gen_state_t *g = &st[c->request_id];
                if (c->index != g->n_stream) g->stream_ok = 0;
                for (size_t k = 0; k < c->n_tokens && g->n_stream < (size_t)n_predict; k++)
                    g->stream_toks[g->n_stream++] = c->tokens[k];
                if (c->text && strlen(g->stream_text) + strlen(c->text) < (1 << 16))
                    strcat(g->stream_text, c->text);
                if (cancel_after >= 0 && g->n_stream >= (size_t)cancel_after) {
                    Pdmesh__CancelRequest cr = PDMESH__CANCEL_REQUEST__INIT;
                    cr.request_id = c->request_id;
                    pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_CANCEL_REQUEST, &cr.base);
                    cancel_after = -1;
                }
            }
        } else if (type == PDMESH__MSG_TYPE__MSG_GENERATE_RESULT) {
            Pdmesh__GenerateResult *r = (Pdmesh__GenerateResult *)m;
            cJSON *o = cJSON_CreateObject();
            cJSON_AddBoolToObject(o, "ok", 1);
            cJSON_AddNumberToObject(o, "id", (double)r->request_id);
            cJSON_AddItemToObject(o, "tokens", cJSON_CreateIntArray(r->tokens, (int)r->n_tokens));
            cJSON_AddStringToObject(o, "text", r->text ? r->text : "");
            cJSON_AddNumberToObject(o, "finish", r->finish);
            if (r->n_logprobs) { /* [{token, bytes: [..], top: [[token, logprob], ..]}] */
                cJSON *la = cJSON_AddArrayToObject(o, "logprobs");
                for (size_t t = 0; t < r->n_logprobs; t++) {
                    const Pdmesh__TokenLogprob *lp = r->logprobs[t];
                    cJSON *e = cJSON_CreateObject(), *by = cJSON_AddArrayToObject(e, "bytes");
                    cJSON_AddNumberToObject(e, "token", lp->token);
                    for (size_t b = 0; b < lp->text.len; b++)
                        cJSON_AddItemToArray(by, cJSON_CreateNumber(lp->text.data[b]));
                    cJSON *top = cJSON_AddArrayToObject(e, "top");
                    for (size_t k = 0; k < lp->n_top; k++) {
                        cJSON *pair = cJSON_CreateArray();
                        cJSON_AddItemToArray(pair, cJSON_CreateNumber(lp->top[k]->token));
                        cJSON_AddItemToArray(pair, cJSON_CreateNumber(lp->top[k]->logprob));
                        cJSON_AddItemToArray(top, pair);
                    }
                    cJSON_AddItemToArray(la, e);
                }
            }
            cJSON *ba = cJSON_AddArrayToObject(o, "beams");
            for (size_t b = 0; b < r->n_beams; b++) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddItemToObject(e, "tokens", cJSON_CreateIntArray(r->beams[b]->tokens,
                                                                       (int)r->beams[b]->n_tokens));
                cJSON_AddStringToObject(e, "text", r->beams[b]->text ? r->beams[b]->text : "");
                cJSON_AddNumberToObject(e, "score", r->beams[b]->score);
                cJSON_AddNumberToObject(e, "logprob", r->beams[b]->logprob);
                cJSON_AddNumberToObject(e, "finish", r->beams[b]->finish);
                cJSON_AddItemToArray(ba, e);
            }
            if (r->usage) {
                cJSON *u = cJSON_AddObjectToObject(o, "usage");
                cJSON_AddNumberToObject(u, "prompt_tokens", r->usage->prompt_tokens);
                cJSON_AddNumberToObject(u, "completion_tokens", r->usage->completion_tokens);
                cJSON_AddNumberToObject(u, "ttft_ms", r->usage->ttft_ms);
                cJSON_AddNumberToObject(u, "total_ms", r->usage->total_ms);
                cJSON_AddStringToObject(u, "prefill_method", r->usage->prefill_method ? r->usage->prefill_method : "");
                cJSON_AddStringToObject(u, "prefill_group", r->usage->prefill_group ? r->usage->prefill_group : "");
                cJSON_AddStringToObject(u, "decode_node", r->usage->decode_node ? r->usage->decode_node : "");
                cJSON_AddNumberToObject(u, "attempts", r->usage->attempts);
                cJSON_AddNumberToObject(u, "cached_tokens", r->usage->cached_tokens);
                cJSON *pr = cJSON_AddArrayToObject(u, "prefill_ranges");
                for (size_t k = 0; k < r->usage->n_prefill_ranges; k++) {
                    const Pdmesh__TokenRange *x = r->usage->prefill_ranges[k];
                    int v[4] = {(int)x->start, (int)x->len, (int)x->rank, (int)x->chunk};
                    cJSON_AddItemToArray(pr, cJSON_CreateIntArray(v, 4));
                }
                cJSON_AddNumberToObject(u, "kv_bytes", (double)r->usage->kv_bytes);
            }
            if (stream_ && r->request_id >= 1 && r->request_id <= (uint64_t)count) {
                gen_state_t *g = &st[r->request_id];
                int same = g->stream_ok && g->n_stream == r->n_tokens &&
                           !memcmp(g->stream_toks, r->tokens, sizeof(int32_t) * r->n_tokens) &&
                           !strcmp(g->stream_text, r->text ? r->text : "");
                cJSON_AddBoolToObject(o, "stream_matches", same);
            }
            print_json(o);
            open_--;
        } else if (type == PDMESH__MSG_TYPE__MSG_ERROR) {
            print_json(error_json((Pdmesh__Error *)m));
            open_--;
        }
        pdm_wire_msg_free(w);
    }
    for (int i = 0; i <= count; i++) {
        free(st[i].stream_toks);
        free(st[i].stream_text);
    }
    free(st);
    free(toks);
    zmq_close(s);
    if (open_ > 0) {
        fprintf(stderr, "pdm-rclient: %d requests unanswered after %.0f s\n", open_, timeout_s);
        return 1;
    }
    return 0;
}

static int cmd_raw(void *ctx)
{
    void *s = dealer(ctx);
    uint8_t hdr[PDM_WIRE_HDR] = {'P', 'D', 1, 0, 0, 1, 0, 0};
    if (!strcmp(kind, "garbage")) {
        zmq_send(s, "hello, router", 13, 0);
    } else if (!strcmp(kind, "oversized")) {
        size_t n = PDM_WIRE_MAX_FRAME + 100;
        uint8_t *b = calloc(1, n);
        memcpy(b, hdr, sizeof(hdr));
        zmq_send(s, b, n, 0);
        free(b);
    } else if (!strcmp(kind, "unknown")) {
        hdr[5] = 99;
        zmq_send(s, hdr, sizeof(hdr), 0);
    } else if (!strcmp(kind, "multipart")) {
        zmq_send(s, hdr, sizeof(hdr), ZMQ_SNDMORE);
        zmq_send(s, hdr, sizeof(hdr), 0);
    } else if (!strcmp(kind, "badproto")) {
        uint8_t b[PDM_WIRE_HDR + 6];
        memcpy(b, hdr, sizeof(hdr));
        memcpy(b + PDM_WIRE_HDR, "\xff\xff\xff\xff\xff\xff", 6);
        zmq_send(s, b, sizeof(b), 0);
    } else if (!strcmp(kind, "ping")) {
        Pdmesh__Ping p = PDMESH__PING__INIT;
        p.nonce = 42;
        pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_PING, &p.base);
    } else {
        fprintf(stderr, "pdm-rclient: unknown --kind\n");
        return 2;
    }
    pdm_wire_msg_t *w = recv_msg(s, (int)(timeout_s * 1000));
    zmq_close(s);
    if (!w) {
        fprintf(stderr, "pdm-rclient: no reply\n");
        return 1;
    }
    if (pdm_wire_type(w) == PDMESH__MSG_TYPE__MSG_ERROR) {
        print_json(error_json((Pdmesh__Error *)pdm_wire_message(w)));
    } else {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddBoolToObject(o, "ok", 1);
        cJSON_AddStringToObject(o, "type", pdm_wire_type_name(pdm_wire_type(w)));
        print_json(o);
    }
    pdm_wire_msg_free(w);
    return 0;
}

static int cmd_admin(void *ctx)
{
    static const struct { const char *n; int op; } ops[] = {
        {"nodes", 1}, {"node", 2}, {"drain", 3}, {"undrain", 4}, {"stats", 5}, {"policy-get", 6},
        {"policy-set", 7}, {"lut-show", 8}, {"lut-load", 9}, {"requests", 10}, {"cancel", 11}};
    int o = 0;
    for (size_t i = 0; i < PDM_ARRAY_SIZE(ops); i++)
        if (op && !strcmp(op, ops[i].n)) o = ops[i].op;
    if (!o) {
        fprintf(stderr, "pdm-rclient: unknown --op\n");
        return 2;
    }
    void *s = dealer(ctx);
    Pdmesh__AdminRequest a = PDMESH__ADMIN_REQUEST__INIT;
    a.op = o;
    a.token = no_token ? "" : getenv("PDMESH_ADMIN_TOKEN");
    a.name = (char *)name;
    a.key = (char *)key;
    a.value = (char *)value;
    a.request_id = req_id_arg;
    pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_ADMIN_REQUEST, &a.base);
    pdm_wire_msg_t *w = recv_msg(s, (int)(timeout_s * 1000));
    zmq_close(s);
    if (!w || pdm_wire_type(w) != PDMESH__MSG_TYPE__MSG_ADMIN_REPLY) {
        fprintf(stderr, "pdm-rclient: no admin reply\n");
        pdm_wire_msg_free(w);
        return 1;
    }
    Pdmesh__AdminReply *r = (Pdmesh__AdminReply *)pdm_wire_message(w);
    cJSON *j = r->ok || !r->error ? cJSON_CreateObject() : error_json(r->error);
    if (r->ok) cJSON_AddBoolToObject(j, "ok", 1);
    cJSON *nodes = cJSON_AddArrayToObject(j, "nodes");
    for (size_t i = 0; i < r->n_nodes; i++) {
        cJSON *n = cJSON_CreateObject();
        cJSON_AddStringToObject(n, "id", r->nodes[i]->node_id);
        cJSON_AddStringToObject(n, "state", r->nodes[i]->state);
        cJSON_AddNumberToObject(n, "role", r->nodes[i]->role);
        cJSON_AddNumberToObject(n, "epoch", (double)r->nodes[i]->epoch);
        cJSON_AddNumberToObject(n, "pid", r->nodes[i]->pid);
        if (r->nodes[i]->load) { /* what the node's last heartbeat reported */
            cJSON_AddNumberToObject(n, "held", r->nodes[i]->load->held);
            cJSON_AddNumberToObject(n, "kv_used", (double)r->nodes[i]->load->kv_tokens_used);
        }
        cJSON_AddItemToArray(nodes, n);
    }
    cJSON *vals = cJSON_AddObjectToObject(j, "values");
    for (size_t i = 0; i < r->n_values; i++)
        cJSON_AddStringToObject(vals, r->values[i]->key, r->values[i]->value);
    cJSON_AddNumberToObject(j, "requests", (double)r->n_requests);
    if (r->text && r->text[0]) cJSON_AddStringToObject(j, "text", r->text);
    print_json(j);
    pdm_wire_msg_free(w);
    return 0;
}

static int cmd_register(void *ctx)
{
    uint8_t *secret;
    size_t slen;
    if (pdm_auth_load_secret(NULL, &secret, &slen)) {
        fprintf(stderr, "pdm-rclient: %s\n", pdm_error_last());
        return 2;
    }
    void *s = dealer(ctx);
    Pdmesh__Register r = PDMESH__REGISTER__INIT;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint8_t proof[32], addr[4] = {1, 2, 3, 4};
    r.node_id = (char *)node_id;
    r.role = PDMESH__ROLE__ROLE_DECODE;
    r.nonce = 7;
    r.timestamp_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    pdm_auth_proof(secret, slen, node_id, r.nonce, r.timestamp_ms, proof);
    r.proof.data = proof;
    r.proof.len = 32;
    r.ucx_address.data = addr;
    r.ucx_address.len = sizeof(addr);
    pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_REGISTER, &r.base);
    free(secret);
    pdm_wire_msg_t *w = recv_msg(s, (int)(timeout_s * 1000));
    zmq_close(s);
    if (!w) return 1;
    if (pdm_wire_type(w) == PDMESH__MSG_TYPE__MSG_ERROR) {
        print_json(error_json((Pdmesh__Error *)pdm_wire_message(w)));
    } else {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddBoolToObject(o, "ok", 1);
        cJSON_AddStringToObject(o, "type", pdm_wire_type_name(pdm_wire_type(w)));
        print_json(o);
    }
    pdm_wire_msg_free(w);
    return 0;
}

/* A decode node that answers at once (router overhead measurement): registers, heartbeats,
 * reserves everything, and returns max_new copies of token 28 for every task. Runs for
 * --timeout seconds. */
static int cmd_fakenode(void *ctx)
{
    uint8_t *secret;
    size_t slen;
    if (pdm_auth_load_secret(NULL, &secret, &slen)) {
        fprintf(stderr, "pdm-rclient: %s\n", pdm_error_last());
        return 2;
    }
    void *s = dealer(ctx);
    uint64_t epoch = 0;
    double end = pdm_now() + timeout_s, next_hb = 0;
    uint32_t max_new[4096] = {0};
    while (pdm_now() < end) {
        if (!epoch && pdm_now() >= next_hb) {
            Pdmesh__Register r = PDMESH__REGISTER__INIT;
            Pdmesh__Capacity cap = PDMESH__CAPACITY__INIT;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            uint8_t proof[32], addr[4] = {1, 2, 3, 4};
            r.node_id = (char *)node_id;
            r.role = PDMESH__ROLE__ROLE_DECODE;
            pdm_random_bytes(&r.nonce, sizeof(r.nonce));
            r.timestamp_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
            pdm_auth_proof(secret, slen, node_id, r.nonce, r.timestamp_ms, proof);
            r.proof.data = proof;
            r.proof.len = 32;
            r.ucx_address.data = addr;
            r.ucx_address.len = sizeof(addr);
            cap.kv_tokens = 1u << 30;
            cap.max_sequences = 4096;
            r.capacity = &cap;
            pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_REGISTER, &r.base);
            next_hb = pdm_now() + 1;
        } else if (epoch && pdm_now() >= next_hb) {
            Pdmesh__Heartbeat h = PDMESH__HEARTBEAT__INIT;
            h.node_id = (char *)node_id;
            h.epoch = epoch;
            pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_HEARTBEAT, &h.base);
            next_hb = pdm_now() + 0.5;
        }
        pdm_wire_msg_t *w = recv_msg(s, 50);
        if (!w) continue;
        ProtobufCMessage *m = pdm_wire_message(w);
        switch (pdm_wire_type(w)) {
        case PDMESH__MSG_TYPE__MSG_REGISTER_ACK:
            epoch = ((Pdmesh__RegisterAck *)m)->epoch;
            next_hb = pdm_now() + 0.5;
            printf("{\"registered\":true,\"epoch\":%llu}\n", (unsigned long long)epoch);
            fflush(stdout);
            break;
        case PDMESH__MSG_TYPE__MSG_DECODE_TASK: {
            Pdmesh__DecodeTask *t = (Pdmesh__DecodeTask *)m;
            max_new[t->task_id % 4096] = t->max_new;
            Pdmesh__DecodeReserved r = PDMESH__DECODE_RESERVED__INIT;
            r.task_id = t->task_id;
            r.attempt = t->attempt;
            r.epoch = epoch;
            r.ok = 1;
            pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED, &r.base);
            break;
        }
        case PDMESH__MSG_TYPE__MSG_DECODE_START: {
            Pdmesh__DecodeStart *d = (Pdmesh__DecodeStart *)m;
            uint32_t n = max_new[d->task_id % 4096];
            int32_t toks[4096];
            for (uint32_t i = 0; i < n && i < 4096; i++) toks[i] = 28;
            Pdmesh__DecodeTokens dt = PDMESH__DECODE_TOKENS__INIT;
            dt.task_id = d->task_id;
            dt.attempt = d->attempt;
            dt.tokens = toks;
            dt.n_tokens = PDM_MIN(n, 4096u);
            pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_DECODE_TOKENS, &dt.base);
            Pdmesh__DecodeResult res = PDMESH__DECODE_RESULT__INIT;
            res.task_id = d->task_id;
            res.attempt = d->attempt;
            res.epoch = epoch;
            res.ok = 1;
            res.finish = PDMESH__FINISH_REASON__FINISH_LENGTH;
            res.tokens = toks;
            res.n_tokens = dt.n_tokens;
            pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_DECODE_RESULT, &res.base);
            break;
        }
        default:
            break;
        }
        pdm_wire_msg_free(w);
    }
    free(secret);
    zmq_close(s);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sequential requests: client-side round trip per request, p50/p99 in ms (JSON). */
static int cmd_bench(void *ctx)
{
    void *s = dealer(ctx);
    double *lat = calloc((size_t)count, sizeof(double));
    int32_t toks[3] = {1, 2, 3};
    int okn = 0;
    for (int i = 0; i < count; i++) {
        Pdmesh__GenerateRequest g = PDMESH__GENERATE_REQUEST__INIT;
        g.request_id = (uint64_t)i + 1;
        g.prompt_tokens = toks;
        g.n_prompt_tokens = 3;
        g.max_tokens = (uint32_t)n_predict;
        double t0 = pdm_now();
        pdm_wire_send(s, NULL, 0, PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST, &g.base);
        for (;;) {
            pdm_wire_msg_t *w = recv_msg(s, (int)(timeout_s * 1000));
            if (!w) {
                fprintf(stderr, "pdm-rclient: bench: no answer\n");
                free(lat);
                return 1;
            }
            int type = pdm_wire_type(w);
            pdm_wire_msg_free(w);
            if (type == PDMESH__MSG_TYPE__MSG_GENERATE_RESULT) okn++;
            if (type == PDMESH__MSG_TYPE__MSG_GENERATE_RESULT || type == PDMESH__MSG_TYPE__MSG_ERROR) break;
        }
        lat[i] = (pdm_now() - t0) * 1e3;
    }
    qsort(lat, (size_t)count, sizeof(double), cmp_double);
    printf("{\"requests\":%d,\"ok\":%d,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"max_ms\":%.3f}\n", count, okn,
           lat[count / 2], lat[(int)(count * 0.99)], lat[count - 1]);
    free(lat);
    zmq_close(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: pdm-rclient gen|raw|admin|register [options]\n");
        return 2;
    }
    const char *cmd = argv[1];
    static const struct option opts[] = {
        {"ep", required_argument, 0, 'e'},     {"prompt", required_argument, 0, 'p'},
        {"tokens", required_argument, 0, 'T'}, {"chat", no_argument, 0, 'c'},
        {"n-predict", required_argument, 0, 'n'}, {"temp", required_argument, 0, 't'},
        {"stream", no_argument, 0, 's'},       {"count", required_argument, 0, 'k'},
        {"deadline-ms", required_argument, 0, 'd'}, {"timeout", required_argument, 0, 'o'},
        {"kind", required_argument, 0, 'K'},   {"op", required_argument, 0, 'O'},
        {"name", required_argument, 0, 'N'},   {"key", required_argument, 0, 'y'},
        {"value", required_argument, 0, 'v'},  {"id", required_argument, 0, 'i'},
        {"no-token", no_argument, 0, 'x'},     {"node-id", required_argument, 0, 'I'},
        {"cancel-after", required_argument, 0, 'C'}, {"stop", required_argument, 0, 'S'},
        {"beams", required_argument, 0, 'B'},  {"n-best", required_argument, 0, 'b'},
        {"ignore-eos", no_argument, 0, 'E'},  {"seed", required_argument, 0, 'D'},
        {"top-logprobs", required_argument, 0, 'L'},
        {0, 0, 0, 0}};
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
        switch (c) {
        case 'e': ep = optarg; break;
        case 'p': prompt = optarg; break;
        case 'T': tokens_arg = optarg; break;
        case 'c': chat = 1; break;
        case 'n': n_predict = atoi(optarg); break;
        case 't': temp = atof(optarg); break;
        case 'D': seed = strtoull(optarg, NULL, 10); break;
        case 's': stream_ = 1; break;
        case 'k': count = atoi(optarg); break;
        case 'd': deadline_ms = (unsigned)atoi(optarg); break;
        case 'o': timeout_s = atof(optarg); break;
        case 'K': kind = optarg; break;
        case 'O': op = optarg; break;
        case 'N': name = optarg; break;
        case 'y': key = optarg; break;
        case 'v': value = optarg; break;
        case 'i': req_id_arg = strtoull(optarg, NULL, 10); break;
        case 'x': no_token = 1; break;
        case 'I': node_id = optarg; break;
        case 'C': cancel_after = atoi(optarg); break;
        case 'S': stop_arg = optarg; break;
        case 'B': beams_ = atoi(optarg); break;
        case 'b': n_best_ = atoi(optarg); break;
        case 'E': ignore_eos_ = 1; break;
        case 'L': top_lp_ = atoi(optarg); break;
        default: return 2;
        }
    }
    if (!ep || count < 1 || count > 100000 || n_predict < 1) {
        fprintf(stderr, "pdm-rclient: --ep required; --count in [1, 100000]\n");
        return 2;
    }
    void *ctx = zmq_ctx_new();
    int st = 2;
    if (!strcmp(cmd, "gen") && (prompt || tokens_arg)) st = cmd_gen(ctx);
    else if (!strcmp(cmd, "raw") && kind) st = cmd_raw(ctx);
    else if (!strcmp(cmd, "admin")) st = cmd_admin(ctx);
    else if (!strcmp(cmd, "register") && node_id) st = cmd_register(ctx);
    else if (!strcmp(cmd, "fakenode") && node_id) st = cmd_fakenode(ctx);
    else if (!strcmp(cmd, "bench")) st = cmd_bench(ctx);
    else fprintf(stderr, "pdm-rclient: unknown command or missing arguments\n");
    zmq_ctx_term(ctx);
    return st;
}
