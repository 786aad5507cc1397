/*
 * agent.c - router mode of the node daemons: a thread bridging the router's control plane
 * (ZeroMQ DEALER, protobuf frames of common/wire.h) to the daemon's JSON command loop through
 * two pipes. See common/agent.h.
 */
#include "common/agent.h"
#include "common/curve.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/pdm.h"
#include "common/wire.h"

#define AG_MAX_TASKS 1024
#define AG_OUT_CAP (64u << 20)   /* commands waiting for the loop (bytes) */
#define AG_LINE_CAP (16u << 20)  /* one event line */

typedef struct {
    int used;
    uint64_t wire, task_id;
    uint32_t attempt, skip;
    uint64_t kv_tokens;
    /* decode: beam search of the DecodeTask, repeated in the loop's start command */
    uint32_t beams, n_best;
    float length_penalty;
    char early_stopping[16];
} ag_task_t;

typedef struct {
    pdm_agent_params_t p;
    uint8_t *secret;
    size_t secret_len;
    int cmd_fd, ev_fd;           /* our ends of the pipes */
    int sig_fd;                  /* SIGTERM / SIGINT (blocked in every thread) */
    void *zctx, *sock;
    uint8_t *addr;               /* UCX address from the loop's hello */
    size_t addr_len;
    uint32_t pid;
    uint64_t epoch;
    int registered;
    double next_register, next_heartbeat;
    int hb_ms;
    char *out;                   /* pending command bytes */
    size_t out_len, out_cap;
    char *line;                  /* partial event line */
    size_t line_len;
    ag_task_t tasks[AG_MAX_TASKS];
} agent_t;

static agent_t *g_agent;

void pdm_agent_params_default(pdm_agent_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->heartbeat_ms = 1000;
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- commands to the loop ---- */

static void ag_queue_cmd(agent_t *a, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return;
    size_t n = strlen(s);
    if (a->out_len + n + 1 > AG_OUT_CAP) {
        pdm_log_error("agent: command queue to the node loop is full; dropping a command");
        free(s);
        return;
    }
    if (a->out_len + n + 1 > a->out_cap) {
        size_t cap = PDM_MAX(a->out_cap * 2, a->out_len + n + 1 + 4096);
        char *b = realloc(a->out, cap);
        if (!b) {
            free(s);
            return;
        }
        a->out = b;
        a->out_cap = cap;
    }
    memcpy(a->out + a->out_len, s, n);
    a->out[a->out_len + n] = '\n';
    a->out_len += n + 1;
    free(s);
}

static void ag_flush_cmds(agent_t *a)
{
    while (a->out_len) {
        ssize_t w = write(a->cmd_fd, a->out, a->out_len);
        if (w <= 0) return; /* EAGAIN: the loop is busy; retried when the pipe drains */
        memmove(a->out, a->out + w, a->out_len - (size_t)w);
        a->out_len -= (size_t)w;
    }
}

/* ---- messages to the router ---- */

static void ag_send(agent_t *a, int type, const ProtobufCMessage *m)
{
    if (pdm_wire_send(a->sock, NULL, 0, type, m))
        pdm_log_warn("agent %s: cannot send %s: %s", a->p.node_id, pdm_wire_type_name(type),
                     pdm_error_last());
}

static void ag_register(agent_t *a)
{
    Pdmesh__Register r = PDMESH__REGISTER__INIT;
    Pdmesh__Capacity cap = PDMESH__CAPACITY__INIT;
    uint8_t proof[32];
    uint64_t nonce;
    pdm_random_bytes(&nonce, sizeof(nonce));
    r.node_id = (char *)a->p.node_id;
    r.role = a->p.role == PDM_AGENT_PREFILL ? PDMESH__ROLE__ROLE_PREFILL : PDMESH__ROLE__ROLE_DECODE;
    r.group = (char *)(a->p.group ? a->p.group : "");
    r.rank = a->p.rank;
    r.group_size = a->p.group_size;
    r.ucx_address.data = a->addr;
    r.ucx_address.len = a->addr_len;
    cap.kv_tokens = a->p.kv_tokens;
    cap.max_sequences = a->p.max_sequences;
    cap.max_batch = a->p.max_batch;
    cap.threads = a->p.threads;
    cap.max_prompt = a->p.max_prompt;
    cap.max_beams = a->p.max_beams;
    r.capacity = &cap;
    r.model_id = (char *)(a->p.model_id ? a->p.model_id : "");
    r.nonce = nonce;
    r.timestamp_ms = unix_ms();
    pdm_auth_proof(a->secret, a->secret_len, a->p.node_id, nonce, r.timestamp_ms, proof);
    r.proof.data = proof;
    r.proof.len = sizeof(proof);
    r.pid = a->pid;
    ag_send(a, PDMESH__MSG_TYPE__MSG_REGISTER, &r.base);
    a->next_register = pdm_now() + 1.0;
}

static void ag_heartbeat(agent_t *a)
{
    Pdmesh__Heartbeat h = PDMESH__HEARTBEAT__INIT;
    Pdmesh__Load load = PDMESH__LOAD__INIT;
    uint64_t used = 0;
    uint32_t n = 0;
    for (int i = 0; i < AG_MAX_TASKS; i++)
        if (a->tasks[i].used) {
            n++;
            used += a->tasks[i].kv_tokens;
        }
    load.running = n;
    load.held = n;
    load.kv_tokens_used = used;
    load.kv_tokens_free = a->p.kv_tokens > used ? a->p.kv_tokens - used : 0;
    h.node_id = (char *)a->p.node_id;
    h.epoch = a->epoch;
    h.load = &load;
    ag_send(a, PDMESH__MSG_TYPE__MSG_HEARTBEAT, &h.base);
    a->next_heartbeat = pdm_now() + a->hb_ms / 1000.0;
}

static ag_task_t *ag_task(agent_t *a, uint64_t wire)
{
    for (int i = 0; i < AG_MAX_TASKS; i++)
        if (a->tasks[i].used && a->tasks[i].wire == wire) return &a->tasks[i];
    return NULL;
}

static ag_task_t *ag_task_new(agent_t *a, uint64_t task_id, uint32_t attempt)
{
    uint64_t wire = PDM_AGENT_WIRE_ID(task_id, attempt);
    ag_task_t *t = ag_task(a, wire);
    for (int i = 0; i < AG_MAX_TASKS && !t; i++)
        if (!a->tasks[i].used) t = &a->tasks[i];
    if (!t) return NULL;
    memset(t, 0, sizeof(*t));
    t->used = 1;
    t->wire = wire;
    t->task_id = task_id;
    t->attempt = attempt;
    return t;
}

static cJSON *ag_hex(const void *b, size_t n)
{
    char *h = pdm_hex_encode(b, n);
    cJSON *s = cJSON_CreateString(h ? h : "");
    free(h);
    return s;
}

static cJSON *ag_ints(const int32_t *v, size_t n)
{
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; i < n && arr; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(v[i]));
    return arr;
}

static void ag_decode_reserved_fail(agent_t *a, uint64_t task_id, uint32_t attempt, int code,
                                    const char *msg)
{
    Pdmesh__DecodeReserved r = PDMESH__DECODE_RESERVED__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.code = code;
    e.message = (char *)msg;
    e.task_id = task_id;
    e.attempt = attempt;
    r.task_id = task_id;
    r.attempt = attempt;
    r.epoch = a->epoch;
    r.error = &e;
    ag_send(a, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED, &r.base);
}

/* Beam search (DecodeTask.beams > 1): kept with the task until its DecodeStart. */
static void ag_task_beams(ag_task_t *rec, const Pdmesh__DecodeTask *t)
{
    if (t->beams < 2) return;
    rec->beams = t->beams;
    rec->n_best = t->n_best ? t->n_best : 1;
    rec->length_penalty = t->length_penalty;
    snprintf(rec->early_stopping, sizeof(rec->early_stopping), "%s",
             t->early_stopping && t->early_stopping[0] ? t->early_stopping : "heuristic");
    /* the beam segments of decode_node/beam.h: what the node really holds */
    uint64_t steps = (t->max_new + 15u) / 16u * 16u;
    rec->kv_tokens = (uint64_t)(t->local_prefill ? t->n_prompt_tokens : t->n_prompt) +
                     (uint64_t)t->beams * steps;
}

/* The start command's beam fields (decode_node/main.c). */
static void ag_start_beams(const ag_task_t *rec, const Pdmesh__DecodeStart *s, cJSON *o)
{
    if (!rec->beams) return;
    cJSON_AddNumberToObject(o, "beams", rec->beams);
    cJSON_AddNumberToObject(o, "n_best", rec->n_best);
    cJSON_AddNumberToObject(o, "length_penalty", rec->length_penalty);
    cJSON_AddStringToObject(o, "early_stopping", rec->early_stopping);
    cJSON_AddNumberToObject(o, "prompt_last", s->prompt_last);
}

/* The done event's "n_best" list as DecodeResult.beams (best first); frees with
 * ag_beams_free. */
static void ag_result_beams(const cJSON *ev, Pdmesh__DecodeResult *r)
{
    const cJSON *list = cJSON_GetObjectItem(ev, "n_best"), *h;
    int n = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 0;
    if (n <= 0 || n > 64) return;
    Pdmesh__Beam **bp = calloc((size_t)n, sizeof(*bp));
    if (!bp) return;
    size_t k = 0;
    cJSON_ArrayForEach(h, list)
    {
        Pdmesh__Beam *b = calloc(1, sizeof(*b));
        if (!b) break;
        pdmesh__beam__init(b);
        const cJSON *toks = cJSON_GetObjectItem(h, "tokens"), *x;
        int nt = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : 0;
        if (nt > 0 && (b->tokens = malloc(sizeof(int32_t) * (size_t)nt))) {
            cJSON_ArrayForEach(x, toks)
                b->tokens[b->n_tokens++] = (int32_t)(cJSON_IsNumber(x) ? x->valuedouble : -1);
        }
        const cJSON *text = cJSON_GetObjectItem(h, "text");
        b->text = strdup(cJSON_IsString(text) ? text->valuestring : "");
        const cJSON *v = cJSON_GetObjectItem(h, "score");
        b->score = cJSON_IsNumber(v) ? v->valuedouble : 0;
        v = cJSON_GetObjectItem(h, "logprob");
        b->logprob = cJSON_IsNumber(v) ? v->valuedouble : 0;
        b->finish = cJSON_IsTrue(cJSON_GetObjectItem(h, "eos")) ? PDMESH__FINISH_REASON__FINISH_EOS
                                                                 : PDMESH__FINISH_REASON__FINISH_LENGTH;
        bp[k++] = b;
    }
    r->beams = bp;
    r->n_beams = k;
}

static void ag_beams_free(Pdmesh__DecodeResult *r)
{
    for (size_t i = 0; i < r->n_beams; i++) {
        free(r->beams[i]->tokens);
        free(r->beams[i]->text);
        free(r->beams[i]);
    }
    free(r->beams);
}

static void ag_on_router(agent_t *a, pdm_wire_msg_t *m)
{
    int type = pdm_wire_type(m);
    ProtobufCMessage *msg = pdm_wire_message(m);
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_REGISTER_ACK: {
        Pdmesh__RegisterAck *ack = (Pdmesh__RegisterAck *)msg;
        a->epoch = ack->epoch;
        a->registered = 1;
        if (ack->heartbeat_ms >= 10 && ack->heartbeat_ms <= 60000) a->hb_ms = (int)ack->heartbeat_ms;
        a->next_heartbeat = pdm_now() + a->hb_ms / 1000.0;
        pdm_log_info("agent %s: registered, epoch %llu", a->p.node_id,
                     (unsigned long long)a->epoch);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK: {
        Pdmesh__HeartbeatAck *ack = (Pdmesh__HeartbeatAck *)msg;
        if (ack->epoch != a->epoch) a->registered = 0, a->next_register = 0;
        break;
    }
    case PDMESH__MSG_TYPE__MSG_ERROR: {
        Pdmesh__Error *e = (Pdmesh__Error *)msg;
        if (e->code == PDMESH__ERROR_CODE__ERR_UNAUTHORIZED) {
            fprintf(stderr, "agent %s: the router refused the registration: %s\n",
                    a->p.node_id, e->message ? e->message : "");
            _exit(3);
        }
        if (e->code == PDMESH__ERROR_CODE__ERR_STALE_EPOCH ||
            e->code == PDMESH__ERROR_CODE__ERR_NOT_FOUND) {
            a->registered = 0;
            a->next_register = 0;
        }
        pdm_log_warn("agent %s: router error %d: %s", a->p.node_id, e->code,
                     e->message ? e->message : "");
        break;
    }
    case PDMESH__MSG_TYPE__MSG_GROUP_WIRE: {
        Pdmesh__GroupWire *g = (Pdmesh__GroupWire *)msg;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "cmd", "group");
        cJSON_AddNumberToObject(o, "rank", g->rank);
        cJSON_AddNumberToObject(o, "size", g->size);
        cJSON *arr = cJSON_AddArrayToObject(o, "addrs");
        for (size_t i = 0; i < g->n_ucx_addresses; i++)
            cJSON_AddItemToArray(arr, ag_hex(g->ucx_addresses[i].data, g->ucx_addresses[i].len));
        ag_queue_cmd(a, o);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_PREFILL_TASK: {
        Pdmesh__PrefillTask *t = (Pdmesh__PrefillTask *)msg;
        uint64_t wire = PDM_AGENT_WIRE_ID(t->task_id, t->attempt);
        ag_task_t *rec = ag_task_new(a, t->task_id, t->attempt);
        (void)rec;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "cmd", "task");
        cJSON_AddNumberToObject(o, "id", (double)wire);
        cJSON_AddStringToObject(o, "method", t->method ? t->method : "single");
        cJSON_AddNumberToObject(o, "start", t->start);
        cJSON_AddNumberToObject(o, "top", 0);
        cJSON_AddItemToObject(o, "tokens", ag_ints(t->tokens, t->n_tokens));
        if (t->start > 0 && t->n_prefix == t->start)
            cJSON_AddItemToObject(o, "prefix", ag_ints(t->prefix, t->n_prefix));
        if (t->n_chunks) {
            cJSON *c = cJSON_AddArrayToObject(o, "chunks");
            for (size_t i = 0; i < t->n_chunks; i++)
                cJSON_AddItemToArray(c, cJSON_CreateNumber(t->chunks[i]));
        }
        if (t->decode_address.len) {
            cJSON *s = cJSON_AddObjectToObject(o, "stream");
            cJSON_AddNumberToObject(s, "request", (double)wire);
            cJSON_AddNumberToObject(s, "attempt", t->attempt & 15u);
            cJSON_AddItemToObject(s, "decode_addr",
                                  ag_hex(t->decode_address.data, t->decode_address.len));
        }
        ag_queue_cmd(a, o);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_TASK: {
        Pdmesh__DecodeTask *t = (Pdmesh__DecodeTask *)msg;
        uint64_t wire = PDM_AGENT_WIRE_ID(t->task_id, t->attempt);
        ag_task_t *rec = ag_task_new(a, t->task_id, t->attempt);
        if (!rec) {
            ag_decode_reserved_fail(a, t->task_id, t->attempt, PDMESH__ERROR_CODE__ERR_NODE_FULL,
                                    "agent: too many tasks");
            break;
        }
        rec->kv_tokens = (uint64_t)(t->local_prefill ? t->n_prompt_tokens : t->n_prompt) + t->max_new;
        ag_task_beams(rec, t);
        cJSON *o;
        if (t->local_prefill) {
            o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "cmd", "reserve_local");
            cJSON_AddItemToObject(o, "tokens", ag_ints(t->prompt_tokens, t->n_prompt_tokens));
        } else {
            cJSON *c = cJSON_CreateObject();
            cJSON_AddStringToObject(c, "cmd", "connect");
            cJSON *arr = cJSON_AddArrayToObject(c, "addrs");
            for (size_t i = 0; i < t->n_prefill_addresses; i++)
                cJSON_AddItemToArray(arr, ag_hex(t->prefill_addresses[i].data,
                                                 t->prefill_addresses[i].len));
            ag_queue_cmd(a, c);
            o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "cmd", "reserve");
            cJSON_AddNumberToObject(o, "n_prompt", t->n_prompt);
            cJSON *rg = cJSON_AddArrayToObject(o, "ranges");
            for (size_t i = 0; i < t->n_ranges; i++) {
                int v[4] = {(int)t->ranges[i]->start, (int)t->ranges[i]->len,
                            (int)t->ranges[i]->rank, (int)t->ranges[i]->chunk};
                cJSON_AddItemToArray(rg, cJSON_CreateIntArray(v, 4));
            }
        }
        cJSON_AddNumberToObject(o, "id", (double)wire);
        cJSON_AddNumberToObject(o, "attempt", t->attempt & 15u);
        cJSON_AddNumberToObject(o, "max_new", t->max_new);
        /* -1: no beam search, whatever the node's --beams default */
        cJSON_AddNumberToObject(o, "beams", rec->beams ? (double)rec->beams : -1);
        ag_queue_cmd(a, o);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_START: {
        Pdmesh__DecodeStart *s = (Pdmesh__DecodeStart *)msg;
        uint64_t wire = PDM_AGENT_WIRE_ID(s->task_id, s->attempt);
        ag_task_t *rec = ag_task(a, wire);
        if (rec) rec->skip = s->skip_tokens;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "cmd", "start");
        cJSON_AddNumberToObject(o, "id", (double)wire);
        cJSON_AddNumberToObject(o, "first_token", s->first_token);
        /* The router sends normalized parameters (0 = off already mapped). */
        Pdmesh__SamplingParams greedy = PDMESH__SAMPLING_PARAMS__INIT;
        const Pdmesh__SamplingParams *sp = s->sampling ? s->sampling : &greedy;
        cJSON_AddNumberToObject(o, "temp", sp->temperature);
        cJSON_AddNumberToObject(o, "top_k", sp->top_k);
        cJSON_AddNumberToObject(o, "top_p", sp->top_p > 0 ? sp->top_p : 1);
        cJSON_AddNumberToObject(o, "min_p", sp->min_p);
        cJSON_AddNumberToObject(o, "repeat_penalty", sp->repeat_penalty > 0 ? sp->repeat_penalty : 1);
        cJSON_AddNumberToObject(o, "seed", (double)sp->seed);
        if (s->deadline_ms) cJSON_AddNumberToObject(o, "timeout", s->deadline_ms / 1000.0);
        cJSON *st = cJSON_AddArrayToObject(o, "stop");
        for (size_t i = 0; i < s->n_stop; i++) cJSON_AddItemToArray(st, cJSON_CreateString(s->stop[i]));
        if (s->ignore_eos) cJSON_AddBoolToObject(o, "ignore_eos", 1);
        if (rec) ag_start_beams(rec, s, o);
        ag_queue_cmd(a, o);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_CANCEL_TASK: {
        Pdmesh__CancelTask *c = (Pdmesh__CancelTask *)msg;
        if (a->p.role != PDM_AGENT_DECODE) break; /* a running prefill task cannot be stopped */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "cmd", "cancel");
        cJSON_AddNumberToObject(o, "id", (double)PDM_AGENT_WIRE_ID(c->task_id, c->attempt));
        ag_queue_cmd(a, o);
        break;
    }
    default:
        break;
    }
}

static double jnum(const cJSON *o, const char *k, double def)
{
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : def;
}

static const char *jstr(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void ag_on_event(agent_t *a, const cJSON *ev)
{
    const char *name = jstr(ev, "event");
    if (!name) return;
    double idd = jnum(ev, "id", -1);
    uint64_t wire = idd >= 0 ? (uint64_t)idd : 0;
    int ok = cJSON_IsTrue(cJSON_GetObjectItem(ev, "ok"));
    const char *err = jstr(ev, "error");
    if (!strcmp(name, "hello")) {
        const char *hex = jstr(ev, "address");
        if (!hex || pdm_hex_decode(hex, &a->addr, &a->addr_len)) {
            fprintf(stderr, "agent: the node failed to start: %s\n", err ? err : "no address");
            _exit(1);
        }
        a->pid = (uint32_t)jnum(ev, "pid", 0);
        a->next_register = 0;
        return;
    }
    if (idd < 0) {
        if (err) pdm_log_warn("agent %s: node: %s: %s", a->p.node_id, name, err);
        if (!strcmp(name, "ready") && !ok && a->registered) {
            /* The group did not form (a peer was still busy or gone): registering again
             * gives this rank a new epoch, so the router breaks the group and wires it
             * anew once every rank is alive. */
            a->registered = 0;
            a->next_register = pdm_now() + 1.0;
        }
        return;
    }
    ag_task_t *t = ag_task(a, wire);
    uint64_t task_id = wire / 16;
    uint32_t attempt = (uint32_t)(wire % 16);
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.task_id = task_id;
    e.attempt = attempt;
    e.message = (char *)(err ? err : "");
    if (!strcmp(name, "result")) { /* prefill rank */
        Pdmesh__PrefillResult r = PDMESH__PREFILL_RESULT__INIT;
        r.task_id = task_id;
        r.attempt = attempt;
        r.epoch = a->epoch;
        r.rank = a->p.rank;
        r.ok = ok;
        r.first_token = cJSON_IsTrue(cJSON_GetObjectItem(ev, "owner"))
                            ? (int32_t)jnum(ev, "first_token", -1) : -1;
        r.seconds = jnum(ev, "t_total", 0);
        r.kv_bytes = (uint64_t)jnum(ev, "bytes_streamed", 0);
        if (!ok) {
            e.code = PDMESH__ERROR_CODE__ERR_INTERNAL;
            r.error = &e;
        }
        ag_send(a, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, &r.base);
        if (t) t->used = 0;
    } else if (!strcmp(name, "reserved")) {
        Pdmesh__DecodeReserved r = PDMESH__DECODE_RESERVED__INIT;
        r.task_id = task_id;
        r.attempt = attempt;
        r.epoch = a->epoch;
        r.ok = ok;
        if (!ok) {
            e.code = err && strstr(err, "full") ? PDMESH__ERROR_CODE__ERR_NODE_FULL
                                                : PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
            r.error = &e;
            if (t) t->used = 0;
        }
        ag_send(a, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED, &r.base);
    } else if (!strcmp(name, "token")) {
        uint32_t index = (uint32_t)jnum(ev, "index", 0);
        if (t && index < t->skip) return; /* migration: already delivered */
        Pdmesh__DecodeTokens d = PDMESH__DECODE_TOKENS__INIT;
        int32_t tok = (int32_t)jnum(ev, "token", -1);
        d.task_id = task_id;
        d.attempt = attempt;
        d.index = index;
        d.tokens = &tok;
        d.n_tokens = 1;
        ag_send(a, PDMESH__MSG_TYPE__MSG_DECODE_TOKENS, &d.base);
    } else if (!strcmp(name, "done") || !strcmp(name, "error")) {
        Pdmesh__DecodeResult r = PDMESH__DECODE_RESULT__INIT;
        r.task_id = task_id;
        r.attempt = attempt;
        r.epoch = a->epoch;
        int32_t *toks = NULL;
        if (!strcmp(name, "done")) {
            const char *f = jstr(ev, "finish");
            f = f ? f : "";
            r.ok = 1;
            if (!strcmp(f, "eos")) r.finish = PDMESH__FINISH_REASON__FINISH_EOS;
            else if (!strcmp(f, "length")) r.finish = PDMESH__FINISH_REASON__FINISH_LENGTH;
            else if (!strcmp(f, "stop")) r.finish = PDMESH__FINISH_REASON__FINISH_STOP;
            else {
                r.ok = 0;
                e.code = !strcmp(f, "deadline") ? PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED
                                                : PDMESH__ERROR_CODE__ERR_CANCELLED;
                e.message = (char *)f;
                r.error = &e;
            }
            const cJSON *arr = cJSON_GetObjectItem(ev, "tokens"), *x;
            int n = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : 0;
            if (n > 0 && (toks = malloc(sizeof(int32_t) * (size_t)n))) {
                int k = 0;
                cJSON_ArrayForEach(x, arr) toks[k++] = (int32_t)(cJSON_IsNumber(x) ? x->valuedouble : -1);
                r.tokens = toks;
                r.n_tokens = (size_t)k;
            }
            r.kv_seconds = jnum(ev, "kv_seconds", 0);
            r.step_seconds = jnum(ev, "step_seconds", 0);
            r.kv_bytes = (uint64_t)jnum(ev, "kv_bytes", 0);
            ag_result_beams(ev, &r);
        } else {
            e.code = err && (strstr(err, "KV") || strstr(err, "kv"))
                         ? PDMESH__ERROR_CODE__ERR_KV_TRANSFER : PDMESH__ERROR_CODE__ERR_INTERNAL;
            r.error = &e;
        }
        ag_send(a, PDMESH__MSG_TYPE__MSG_DECODE_RESULT, &r.base);
        ag_beams_free(&r);
        free(toks);
        if (t) t->used = 0;
    }
}

static void ag_read_events(agent_t *a)
{
    for (;;) {
        if (a->line_len == AG_LINE_CAP) a->line_len = 0; /* absurd line: drop it */
        ssize_t got = read(a->ev_fd, a->line + a->line_len, AG_LINE_CAP - a->line_len);
        if (got == 0) _exit(0); /* the loop closed its protocol stream: the node is exiting */
        if (got < 0) return;
        a->line_len += (size_t)got;
        char *nl;
        while ((nl = memchr(a->line, '\n', a->line_len))) {
            cJSON *ev = cJSON_ParseWithLength(a->line, (size_t)(nl - a->line));
            if (ev) ag_on_event(a, ev);
            cJSON_Delete(ev);
            size_t used = (size_t)(nl - a->line) + 1;
            memmove(a->line, nl + 1, a->line_len - used);
            a->line_len -= used;
        }
    }
}

static void *ag_main(void *arg)
{
    agent_t *a = arg;
    for (;;) {
        double now = pdm_now();
        if (a->addr && !a->registered && now >= a->next_register) ag_register(a);
        if (a->registered && now >= a->next_heartbeat) ag_heartbeat(a);
        ag_flush_cmds(a);
        zmq_pollitem_t items[4] = {{a->sock, 0, ZMQ_POLLIN, 0},
                                   {NULL, a->ev_fd, ZMQ_POLLIN, 0},
                                   {NULL, a->sig_fd, ZMQ_POLLIN, 0},
                                   {NULL, a->cmd_fd, ZMQ_POLLOUT, 0}};
        double next = a->registered ? a->next_heartbeat : a->next_register;
        long timeout = (long)((next - pdm_now()) * 1000) + 1;
        if (!a->addr) timeout = 100;
        timeout = PDM_MAX(1, PDM_MIN(timeout, 1000));
        int n = zmq_poll(items, a->out_len ? 4 : 3, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == ETERM) return NULL;
            continue;
        }
        if (items[2].revents & ZMQ_POLLIN) {
            /* Clean shutdown: tell the router at once (its requests move elsewhere without
             * waiting for the lease), give the message a moment to leave, exit. */
            if (a->registered) {
                Pdmesh__Deregister d = PDMESH__DEREGISTER__INIT;
                d.node_id = (char *)a->p.node_id;
                d.epoch = a->epoch;
                ag_send(a, PDMESH__MSG_TYPE__MSG_DEREGISTER, &d.base);
            }
            int linger = 500;
            zmq_setsockopt(a->sock, ZMQ_LINGER, &linger, sizeof(linger));
            zmq_close(a->sock);
            zmq_ctx_term(a->zctx);
            _exit(0);
        }
        if (items[1].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) ag_read_events(a);
        for (int k = 0; k < 1024; k++) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, a->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                break;
            }
            pdm_wire_msg_t *m;
            if (!pdm_wire_unpack(zmq_msg_data(&msg), zmq_msg_size(&msg), PDM_WIRE_MAX_FRAME, 0, &m)) {
                ag_on_router(a, m);
                pdm_wire_msg_free(m);
            } else {
                pdm_log_warn("agent %s: bad frame from the router: %s", a->p.node_id,
                             pdm_error_last());
            }
            zmq_msg_close(&msg);
        }
    }
    return NULL;
}

int pdm_agent_start(const pdm_agent_params_t *p)
{
    if (!p->endpoint || !p->node_id || !p->node_id[0] || strlen(p->node_id) > 128)
        return pdm_error_set(PDM_EINVAL, "router mode needs --router ENDPOINT and --node-id NAME "
                             "(at most 128 characters)");
    agent_t *a = calloc(1, sizeof(*a));
    if (!a || !(a->line = malloc(AG_LINE_CAP)))
        return pdm_error_set(PDM_ENOMEM, "agent: out of memory");
    a->p = *p;
    a->hb_ms = p->heartbeat_ms > 0 ? p->heartbeat_ms : 1000;
    int st = pdm_auth_load_secret(p->secret_file, &a->secret, &a->secret_len);
    if (st) return pdm_error_set(st, "agent: cluster secret: %s", pdm_error_last());
    /* SIGTERM/SIGINT go to the agent (signalfd), blocked in this and every later thread. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    if (pthread_sigmask(SIG_BLOCK, &sigs, NULL) || (a->sig_fd = signalfd(-1, &sigs, SFD_CLOEXEC)) < 0)
        return pdm_error_set(PDM_EIO, "agent: signalfd: %s", strerror(errno));
    int cmd[2], ev[2];
    if (pipe(cmd) || pipe(ev)) return pdm_error_set(PDM_EIO, "agent: pipe: %s", strerror(errno));
    /* The loop reads commands on fd 0 and writes events to fd 1 (pdm_ctl_open dups it). */
    if (dup2(cmd[0], 0) < 0 || dup2(ev[1], 1) < 0)
        return pdm_error_set(PDM_EIO, "agent: dup2: %s", strerror(errno));
    close(cmd[0]);
    close(ev[1]);
    a->cmd_fd = cmd[1];
    a->ev_fd = ev[0];
    fcntl(a->cmd_fd, F_SETFL, fcntl(a->cmd_fd, F_GETFL) | O_NONBLOCK);
    fcntl(a->ev_fd, F_SETFL, fcntl(a->ev_fd, F_GETFL) | O_NONBLOCK);
    fcntl(a->cmd_fd, F_SETFD, FD_CLOEXEC);
    fcntl(a->ev_fd, F_SETFD, FD_CLOEXEC);
    a->zctx = zmq_ctx_new();
    a->sock = a->zctx ? zmq_socket(a->zctx, ZMQ_DEALER) : NULL;
    if (!a->sock) return pdm_error_set(PDM_EIO, "agent: zmq socket: %s", zmq_strerror(errno));
    int zero = 0, hwm = 10000;
    int64_t maxmsg = PDM_WIRE_MAX_FRAME + 1024;
    zmq_setsockopt(a->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(a->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(a->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(a->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    const char *csrv = p->curve_server_key_file, *ckey = p->curve_key_file;
    pdm_curve_env(&csrv, &ckey);
    int cst = pdm_curve_client_setup(a->sock, csrv, ckey);
    if (cst) return cst; /* the message names the key file */
    if (zmq_connect(a->sock, p->endpoint))
        return pdm_error_set(PDM_EINVAL, "agent: cannot connect to %s: %s", p->endpoint,
                             zmq_strerror(errno));
    pthread_t th;
    if (pthread_create(&th, NULL, ag_main, a))
        return pdm_error_set(PDM_EIO, "agent: cannot start the thread");
    pthread_detach(th);
    g_agent = a;
    return PDM_OK;
}
