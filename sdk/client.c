/*
 * libpdmesh: the C client of the router's client API. The threading model is explained in
 * sdk/pdmesh_client.h: one DEALER socket and one I/O thread per client; callers exchange
 * packed frames and replies with it under one mutex, wake it through an eventfd, and wait on
 * a per-call condition variable (CLOCK_MONOTONIC) with their own timeout.
 */
#include "sdk/pdmesh_client.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/pdm.h"
#include "common/wire.h"
#include "sdk/client_internal.h"

#define PDMC_DEFAULT_ENDPOINT "tcp://127.0.0.1:7700"
#define PDMC_BUCKETS 256
#define PDMC_MAX_STOPS 16
#define PDMC_MAX_BEAMS 64
#define PDMC_MAX_LOGIT_BIAS 300 /* OpenAI's bound, the router's (model.h) */
#define PDMC_MAX_TOP_LOGPROBS 20
#define PDMC_MAX_CMDS 8192
#define PDMC_CANCEL_RING 64

/* ---- status strings and the thread's last message ---- */

static _Thread_local char pdmc__last[512];

const char *pdm_client_strerror(int status)
{
    switch (status) {
#define PDMC__MSG(name, code, msg)                                                              \
    case code: return msg;
        PDM_CLIENT_STATUS_MAP(PDMC__MSG)
#undef PDMC__MSG
    }
    return "unknown status";
}

const char *pdm_client_status_name(int status)
{
    switch (status) {
#define PDMC__NAME(name, code, msg)                                                             \
    case code: return #name;
        PDM_CLIENT_STATUS_MAP(PDMC__NAME)
#undef PDMC__NAME
    }
    return "EUNKNOWN";
}

const char *pdm_client_last_error(void)
{
    return pdmc__last[0] ? pdmc__last : "no error";
}

/* Records the message for the calling thread and returns status. */
int pdm_client__fail(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pdmc__last, sizeof(pdmc__last), fmt, ap);
    va_end(ap);
    return status;
}

int pdm_client__monitor_event(void *mon, uint16_t *event, uint32_t *value)
{
    zmq_msg_t ev;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&ev);
        return 0;
    }
    *event = 0;
    *value = 0;
    if (zmq_msg_size(&ev) >= 6) {
        memcpy(event, zmq_msg_data(&ev), 2);
        memcpy(value, (const char *)zmq_msg_data(&ev) + 2, 4);
    }
    zmq_msg_close(&ev);
    zmq_msg_init(&ev);
    zmq_msg_recv(&ev, mon, 0); /* the endpoint frame always follows */
    zmq_msg_close(&ev);
    return 1;
}

int pdm_client__handshake_refusal(uint16_t event, uint32_t value, const char *endpoint,
                                  char *msg, size_t size)
{
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        snprintf(msg, size, "the router at %s refused this client's CURVE key (ZAP status %u: "
                 "the key is not in its allowlist)", endpoint, value);
        return PDM_CLIENT_EUNAUTHORIZED;
    }
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
        value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        snprintf(msg, size, "security mismatch with the router at %s: one side uses CURVE, the "
                 "other does not (set the router's public key and a client key, or neither)",
                 endpoint);
        return PDM_CLIENT_EUNAUTHORIZED;
    }
    return 0;
}

static double pdmc__now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static struct timespec pdmc__abstime(double t)
{
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    if (ts.tv_nsec < 0) ts.tv_nsec = 0;
    return ts;
}

/* ---- data structures ---- */

/* One received TokenChunk, copied out of the protobuf message. */
#define PDMC_MAX_CHOICES 8 /* request.n */

typedef struct pdmc_chunk {
    struct pdmc_chunk *next;
    uint32_t choice;
    uint32_t index;
    size_t bytes;    /* counted in the call's buffered bytes */
    pdm_client_logprob_t *logprobs; /* (n_tokens) or NULL: one allocation (pdmc__logprobs_copy) */
    size_t n_tokens, text_len;
    int32_t *tokens; /* points into the same allocation, after text */
    char text[];     /* text_len + 1 bytes, then the tokens */
} pdmc_chunk_t;

/* Copies the TokenLogprob list src[n] into ONE allocation (the entries, their alternatives
 * and every text, NUL-terminated); *out is NULL for n = 0. Returns the bytes, or 0 when out
 * of memory (nothing allocated). A missing log-probability becomes NAN. */
static size_t pdmc__logprobs_copy(Pdmesh__TokenLogprob *const *src, size_t n,
                                  pdm_client_logprob_t **out)
{
    size_t entries = n, text = 0;
    for (size_t i = 0; i < n; i++) {
        text += src[i]->text.len + 1;
        for (size_t k = 0; k < src[i]->n_top; k++) text += src[i]->top[k]->text.len + 1;
        entries += src[i]->n_top;
    }
    *out = NULL;
    if (!n) return 1;
    const size_t bytes = entries * sizeof(pdm_client_logprob_t) + text;
    pdm_client_logprob_t *e = malloc(bytes), *top = e + n;
    if (!e) return 0;
    char *t = (char *)(e + entries);
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k <= src[i]->n_top; k++) {
            const Pdmesh__TokenLogprob *m = k == 0 ? src[i] : src[i]->top[k - 1];
            pdm_client_logprob_t *o = k == 0 ? &e[i] : &top[k - 1];
            o->token = m->token;
            o->logprob = m->missing ? NAN : m->logprob;
            o->text = t;
            o->text_len = m->text.len;
            if (m->text.len) memcpy(t, m->text.data, m->text.len);
            t[m->text.len] = 0;
            t += m->text.len + 1;
            o->top = NULL;
            o->n_top = 0;
        }
        e[i].top = src[i]->n_top ? top : NULL;
        e[i].n_top = src[i]->n_top;
        top += src[i]->n_top;
    }
    *out = e;
    return bytes;
}

/* A frame waiting for the I/O thread. */
typedef struct pdmc_cmd {
    struct pdmc_cmd *next;
    uint64_t id;     /* request the frame belongs to (0: none) */
    size_t len;
    uint8_t *frame;
} pdmc_cmd_t;

typedef struct pdmc_call {
    struct pdmc_call *next; /* hash bucket chain */
    uint64_t id, router_id;
    int stream;
    int sent;               /* handed to ZeroMQ (lost if the connection drops) */
    int done, status;
    char error[256];
    pdm_wire_msg_t *final;  /* the GenerateResult (choice 0's), when done with OK */
    pdm_wire_msg_t *finals[PDMC_MAX_CHOICES]; /* request.n: each choice's GenerateResult */
    uint32_t n_choices, n_finals; /* results expected (request.n, at least 1) and come */
    pdmc_chunk_t *head, *tail;
    size_t buffered;
    double t_start, t_first;
    pthread_cond_t cond;
} pdmc_call_t;

#define PDMC_MAX_ROUTERS 8

/* A "resume" for pdmc__run (docs/sdk.md "Failover"): the completion tokens already delivered
 * by another router and the bytes of text the caller received with them; choice_alone: the
 * request is one choice of a request with n > 1 going on alone
 * (GenerateRequest.resume_choice), with or without tokens. */
typedef struct {
    const int32_t *tokens;
    size_t n_tokens;
    size_t text_bytes;
    int choice_alone;
} pdmc_resume_t;

/* OpenAI's n over several routers (pdmc__run_choices): what each choice delivered to the
 * caller across attempts, and the results of the choices that ended whole. */
typedef struct {
    int32_t *tokens;             /* (n_tokens) delivered to the caller's callback */
    size_t n_tokens;
    char *text;                  /* (text_len) their text as delivered, NUL-terminated or NULL */
    size_t text_len;
    int dropped;                 /* the last attempt lost chunks of it (queued, undelivered) */
    pdm_wire_msg_t *final;       /* its GenerateResult, once it ended with every chunk
                                    delivered; then it is not run again */
} pdmc_delivered_t;

typedef struct {
    uint32_t n_choices;
    pdmc_delivered_t choice[PDMC_MAX_CHOICES];
} pdmc_choices_t;

struct pdm_client {
    char *endpoint;
    /* Several routers (an endpoint list): this client talks to the first, alt[] are clients
     * of the others; a call goes to one of them and moves to another when its router is lost
     * (pdmc__run_failover). */
    struct pdm_client *alt[PDMC_MAX_ROUTERS - 1];
    int n_alt;
    unsigned next_router;   /* round robin over the routers for new calls (under mu) */
    pdm_client_options_t opt;
    void *zctx;
    void *sock;             /* I/O thread only (after create) */
    void *mon;              /* I/O thread only */
    int efd;
    pthread_t io;
    int io_started;

    pthread_mutex_t mu;     /* everything below */
    pthread_cond_t state_cond;  /* connection state changes, pongs */
    int closing;
    int connected;
    double unreachable_since;   /* when the connection was last lost (or create time) */
    int refused;                /* the last security handshake failed (CURVE/ZAP) */
    int handshaken;             /* the current connection completed its handshake */
    char refused_why[256];
    pdmc_cmd_t *cmd_head, *cmd_tail;
    size_t n_cmds;
    pdmc_call_t *buckets[PDMC_BUCKETS];
    int n_open;
    uint64_t next_id;
    uint64_t cancelled[PDMC_CANCEL_RING];
    unsigned n_cancelled;
    uint64_t pongs[8];
    unsigned n_pongs;
};

static pdmc_call_t **pdmc__slot(pdm_client_t *c, uint64_t id)
{
    pdmc_call_t **p = &c->buckets[(id * 0x9e3779b97f4a7c15ull) >> 56];
    while (*p && (*p)->id != id) p = &(*p)->next;
    return p;
}

static void pdmc__free_chunks(pdmc_call_t *call)
{
    pdmc_chunk_t *ch = call->head;
    while (ch) {
        pdmc_chunk_t *n = ch->next;
        free(ch->logprobs);
        free(ch);
        ch = n;
    }
    call->head = call->tail = NULL;
    call->buffered = 0;
}

/* Ends a call (mutex held). The first end wins. */
static void pdmc__end(pdmc_call_t *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void pdmc__end(pdmc_call_t *call, int status, const char *fmt, ...)
{
    if (call->done) return;
    call->done = 1;
    call->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(call->error, sizeof(call->error), fmt, ap);
    va_end(ap);
    pthread_cond_signal(&call->cond);
}

/* Puts a frame on the command queue and wakes the I/O thread (mutex held). Takes ownership
 * of frame. */
static int pdmc__enqueue(pdm_client_t *c, uint64_t id, uint8_t *frame, size_t len)
{
    if (c->n_cmds >= PDMC_MAX_CMDS) {
        free(frame);
        return PDM_CLIENT_EBUSY;
    }
    pdmc_cmd_t *cmd = malloc(sizeof(*cmd));
    if (!cmd) {
        free(frame);
        return PDM_CLIENT_ENOMEM;
    }
    cmd->next = NULL;
    cmd->id = id;
    cmd->frame = frame;
    cmd->len = len;
    if (c->cmd_tail) c->cmd_tail->next = cmd;
    else c->cmd_head = cmd;
    c->cmd_tail = cmd;
    c->n_cmds++;
    uint64_t one = 1;
    ssize_t w = write(c->efd, &one, sizeof(one));
    (void)w; /* EAGAIN means the counter is already non-zero: the thread will wake */
    return PDM_CLIENT_OK;
}

static int pdmc__pack(int type, const ProtobufCMessage *msg, uint8_t **frame, size_t *len)
{
    if (pdm_wire_pack(type, msg, frame, len))
        return pdm_client__fail(PDM_CLIENT_ENOMEM, "cannot pack %s", pdm_wire_type_name(type));
    return PDM_CLIENT_OK;
}

/* Sends a CancelRequest for id (mutex held). Best effort: the call has ended locally. */
static void pdmc__send_cancel(pdm_client_t *c, uint64_t id)
{
    Pdmesh__CancelRequest m = PDMESH__CANCEL_REQUEST__INIT;
    m.request_id = id;
    uint8_t *frame;
    size_t len;
    if (pdmc__pack(PDMESH__MSG_TYPE__MSG_CANCEL_REQUEST, &m.base, &frame, &len) == 0)
        pdmc__enqueue(c, 0, frame, len);
}

/* ---- the I/O thread ---- */

static void pdmc__on_frame(pdm_client_t *c, const void *data, size_t len)
{
    pdm_wire_msg_t *m = NULL;
    if (pdm_wire_unpack(data, len, c->opt.max_frame, 0, &m)) {
        /* Nothing to attribute it to: a broken router. Calls will time out; say why in logs. */
        pdm_log_warn("libpdmesh: dropped a malformed reply of %zu bytes from %s", len,
                c->endpoint);
        return;
    }
    int type = pdm_wire_type(m);
    ProtobufCMessage *msg = pdm_wire_message(m);
    pthread_mutex_lock(&c->mu);
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_ACCEPTED: {
        Pdmesh__Accepted *a = (Pdmesh__Accepted *)msg;
        pdmc_call_t *call = *pdmc__slot(c, a->request_id);
        if (call) call->router_id = a->router_request_id;
        break;
    }
    case PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK: {
        Pdmesh__TokenChunk *t = (Pdmesh__TokenChunk *)msg;
        pdmc_call_t *call = *pdmc__slot(c, t->request_id);
        if (!call || call->done) break;
        if (call->t_first == 0 && t->n_tokens) call->t_first = pdmc__now();
        if (!call->stream) break;
        size_t tl = t->text ? strlen(t->text) : 0;
        size_t bytes = sizeof(pdmc_chunk_t) + tl + 1 + t->n_tokens * sizeof(int32_t) + 4;
        pdm_client_logprob_t *lps = NULL;
        size_t lp_bytes = t->n_logprobs == t->n_tokens
                              ? pdmc__logprobs_copy(t->logprobs, t->n_logprobs, &lps) : 1;
        if (!lp_bytes) {
            pdmc__end(call, PDM_CLIENT_ENOMEM, "out of memory copying log-probabilities");
            break;
        }
        bytes += lp_bytes;
        if (call->buffered + bytes > c->opt.max_buffered) {
            free(lps);
            pdmc__end(call, PDM_CLIENT_EBUSY,
                      "the stream callback is too slow: over %zu bytes of tokens queued",
                      c->opt.max_buffered);
            pdmc__free_chunks(call);
            break;
        }
        pdmc_chunk_t *ch = malloc(bytes - lp_bytes);
        if (!ch) {
            free(lps);
            pdmc__end(call, PDM_CLIENT_ENOMEM, "out of memory queueing %zu bytes", bytes);
            break;
        }
        ch->next = NULL;
        ch->choice = t->choice;
        ch->bytes = bytes;
        ch->logprobs = lps;
        ch->index = t->index;
        ch->n_tokens = t->n_tokens;
        ch->text_len = tl;
        if (tl) memcpy(ch->text, t->text, tl);
        ch->text[tl] = 0;
        /* tokens after the text, 4-byte aligned */
        uintptr_t p = ((uintptr_t)(ch->text + tl + 1) + 3) & ~(uintptr_t)3;
        ch->tokens = (int32_t *)p;
        if (t->n_tokens) memcpy(ch->tokens, t->tokens, t->n_tokens * sizeof(int32_t));
        if (call->tail) call->tail->next = ch;
        else call->head = ch;
        call->tail = ch;
        call->buffered += bytes;
        pthread_cond_signal(&call->cond);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_GENERATE_RESULT: {
        Pdmesh__GenerateResult *r = (Pdmesh__GenerateResult *)msg;
        pdmc_call_t *call = *pdmc__slot(c, r->request_id);
        if (!call || call->done) break;
        /* request.n: one result per choice; the call ends with the last */
        const uint32_t k = call->n_choices > 1 ? r->choice : 0;
        if (k >= call->n_choices || k >= PDMC_MAX_CHOICES || call->finals[k]) break;
        call->finals[k] = m;
        m = NULL; /* kept by the call */
        if (++call->n_finals < call->n_choices) break;
        call->final = call->finals[0];
        pdmc__end(call, PDM_CLIENT_OK, "%s", "");
        break;
    }
    case PDMESH__MSG_TYPE__MSG_ERROR: {
        Pdmesh__Error *e = (Pdmesh__Error *)msg;
        pdmc_call_t *call = e->request_id ? *pdmc__slot(c, e->request_id) : NULL;
        int code = e->code > 0 && e->code <= 14 ? -(int)e->code : PDM_CLIENT_EINTERNAL;
        if (call)
            pdmc__end(call, code, "router: %s", e->message && *e->message
                                                    ? e->message : pdm_client_strerror(code));
        else
            pdm_log_warn("libpdmesh: router error not tied to a request: %s",
                    e->message ? e->message : "");
        break;
    }
    case PDMESH__MSG_TYPE__MSG_PONG: {
        Pdmesh__Ping *p = (Pdmesh__Ping *)msg;
        c->pongs[c->n_pongs++ % 8] = p->nonce;
        pthread_cond_broadcast(&c->state_cond);
        break;
    }
    default: break; /* not for clients: ignore */
    }
    pthread_mutex_unlock(&c->mu);
    pdm_wire_msg_free(m);
}

/* Connection state from the socket monitor: a lost connection loses every request already
 * handed to ZeroMQ (the router sees a new peer on reconnect), so those calls end now. */
static void pdmc__on_monitor(pdm_client_t *c)
{
    uint16_t event;
    uint32_t value;
    while (pdm_client__monitor_event(c->mon, &event, &value)) {
        pthread_mutex_lock(&c->mu);
        if (pdm_client__handshake_refusal(event, value, c->endpoint, c->refused_why,
                                          sizeof(c->refused_why))) {
            /* Refused: every open call ends now (ZeroMQ would retry the handshake forever),
             * and new calls fail at once until a handshake succeeds. */
            c->refused = 1;
            for (int b = 0; b < PDMC_BUCKETS; b++)
                for (pdmc_call_t *call = c->buckets[b]; call; call = call->next)
                    pdmc__end(call, PDM_CLIENT_EUNAUTHORIZED, "%s", c->refused_why);
        } else if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->refused = 0;
            c->handshaken = 1;
        } else if (event == ZMQ_EVENT_CONNECTED) {
            c->connected = 1;
        } else if (event == ZMQ_EVENT_DISCONNECTED) {
            /* Only an established connection (handshake done) can have carried requests;
             * before that they wait in ZeroMQ's queue for the next attempt (a handshake the
             * router refuses may show up as a bare disconnect first). */
            c->connected = 0;
            c->unreachable_since = pdmc__now();
            for (int b = 0; b < PDMC_BUCKETS && c->handshaken; b++)
                for (pdmc_call_t *call = c->buckets[b]; call; call = call->next)
                    if (call->sent)
                        pdmc__end(call, PDM_CLIENT_EUNREACHABLE,
                                  "connection to the router at %s lost", c->endpoint);
            c->handshaken = 0;
        }
        pthread_cond_broadcast(&c->state_cond);
        pthread_mutex_unlock(&c->mu);
    }
}

/* Marks the call with this id as handed to ZeroMQ (mutex held). */
static void pdmc__mark_sent(pdm_client_t *c, uint64_t id)
{
    if (!id) return;
    pdmc_call_t *call = *pdmc__slot(c, id);
    if (call) call->sent = 1;
}

static void *pdmc__io_main(void *arg)
{
    pdm_client_t *c = arg;
    int blocked = 0; /* the socket refused a frame (high-water mark): retry soon */
    for (;;) {
        zmq_pollitem_t items[3] = {
            {c->sock, 0, ZMQ_POLLIN, 0},
            {c->mon, 0, ZMQ_POLLIN, 0},
            {NULL, c->efd, ZMQ_POLLIN, 0},
        };
        int n = zmq_poll(items, 3, blocked ? 10 : 500);
        if (n < 0 && errno != EINTR) {
            pdm_log_warn("libpdmesh: zmq_poll: %s", zmq_strerror(errno));
            usleep(10000);
        }
        if (items[2].revents & ZMQ_POLLIN) {
            uint64_t v;
            ssize_t r = read(c->efd, &v, sizeof(v));
            (void)r;
        }
        /* send what is queued */
        pthread_mutex_lock(&c->mu);
        if (c->closing) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        blocked = 0;
        while (c->cmd_head) {
            pdmc_cmd_t *cmd = c->cmd_head;
            if (zmq_send(c->sock, cmd->frame, cmd->len, ZMQ_DONTWAIT) < 0) {
                if (errno == EAGAIN) {
                    blocked = 1;
                    break;
                }
                pdmc_call_t *call = cmd->id ? *pdmc__slot(c, cmd->id) : NULL;
                if (call)
                    pdmc__end(call, PDM_CLIENT_ESYSTEM, "send to %s: %s", c->endpoint,
                              zmq_strerror(errno));
            } else {
                pdmc__mark_sent(c, cmd->id);
            }
            c->cmd_head = cmd->next;
            if (!c->cmd_head) c->cmd_tail = NULL;
            c->n_cmds--;
            free(cmd->frame);
            free(cmd);
        }
        pthread_mutex_unlock(&c->mu);
        pdmc__on_monitor(c);
        /* receive everything pending (ZMQ_FD semantics do not matter with zmq_poll, but
         * draining until EAGAIN keeps one poll per burst) */
        for (;;) {
            zmq_msg_t msg;
            zmq_msg_init(&msg);
            if (zmq_msg_recv(&msg, c->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&msg);
                break;
            }
            int more = zmq_msg_more(&msg);
            if (!more) pdmc__on_frame(c, zmq_msg_data(&msg), zmq_msg_size(&msg));
            zmq_msg_close(&msg);
            while (more) { /* a pdmesh message is one frame: drop extra parts */
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, c->sock, 0) < 0) more = 0;
                else more = zmq_msg_more(&msg);
                zmq_msg_close(&msg);
            }
        }
    }
    return NULL;
}

/* ---- create / destroy ---- */

/* A client of one router (pdm_client_create splits a list). */
static int pdmc__create_one(const char *endpoint, const pdm_client_options_t *opts,
                            pdm_client_t **out)
{
    pdm_client_options_t o = opts ? *opts : (pdm_client_options_t){0};
    if (o.timeout_ms < 0 || o.connect_timeout_ms < 0 || o.max_open_calls < 0)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "negative client option");
    if (!o.timeout_ms) o.timeout_ms = 60000;
    if (!o.connect_timeout_ms) o.connect_timeout_ms = 3000;
    if (!o.max_open_calls) o.max_open_calls = 1024;
    if (!o.max_frame) o.max_frame = 16u << 20;
    if (!o.max_buffered) o.max_buffered = 64u << 20;

    int status = PDM_CLIENT_ENOMEM;
    pdm_client_t *c = calloc(1, sizeof(*c));
    if (!c) return pdm_client__fail(PDM_CLIENT_ENOMEM, "out of memory");
    c->opt = o;
    c->efd = -1;
    c->next_id = 1;
    c->unreachable_since = pdmc__now();
    if (!(c->endpoint = strdup(endpoint))) goto err_free;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->state_cond, &ca);
    pthread_condattr_destroy(&ca);

    status = PDM_CLIENT_ESYSTEM;
    if ((c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        pdm_client__fail(status, "eventfd: %s", strerror(errno));
        goto err_sync;
    }
    if (!(c->zctx = zmq_ctx_new())) {
        pdm_client__fail(status, "zmq_ctx_new: %s", zmq_strerror(errno));
        goto err_efd;
    }
    if (!(c->sock = zmq_socket(c->zctx, ZMQ_DEALER))) {
        pdm_client__fail(status, "zmq_socket: %s", zmq_strerror(errno));
        goto err_ctx;
    }
    int zero = 0, hwm = 100000, ivl = 1000, hb_timeout = 5000, rivl = 100, rmax = 1000;
    int64_t maxsz = (int64_t)o.max_frame;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(c->sock, ZMQ_MAXMSGSIZE, &maxsz, sizeof(maxsz));
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof(hb_timeout));
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL, &rivl, sizeof(rivl));
    zmq_setsockopt(c->sock, ZMQ_RECONNECT_IVL_MAX, &rmax, sizeof(rmax));
    const char *csrv = o.curve_server_key_file, *ckey = o.curve_key_file;
    pdm_curve_env(&csrv, &ckey);
    if (pdm_curve_client_setup(c->sock, csrv, ckey)) {
        status = PDM_CLIENT_EINVALID_ARGUMENT;
        pdm_client__fail(status, "%s", pdm_error_last());
        goto err_sock;
    }
    c->opt.curve_server_key_file = c->opt.curve_key_file = NULL; /* borrowed: not kept */
    char mon_ep[64];
    snprintf(mon_ep, sizeof(mon_ep), "inproc://pdmesh-client-monitor-%p", (void *)c);
    if (zmq_socket_monitor(c->sock, mon_ep, PDM_CLIENT__MONITOR_EVENTS) < 0) {
        pdm_client__fail(status, "zmq_socket_monitor: %s", zmq_strerror(errno));
        goto err_sock;
    }
    if (!(c->mon = zmq_socket(c->zctx, ZMQ_PAIR))) {
        pdm_client__fail(status, "zmq_socket: %s", zmq_strerror(errno));
        goto err_sock;
    }
    zmq_setsockopt(c->mon, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_connect(c->mon, mon_ep) < 0) {
        pdm_client__fail(status, "monitor connect: %s", zmq_strerror(errno));
        goto err_mon;
    }
    if (zmq_connect(c->sock, endpoint) < 0) {
        status = PDM_CLIENT_EINVALID_ARGUMENT;
        pdm_client__fail(status, "cannot connect to '%s': %s", endpoint, zmq_strerror(errno));
        goto err_mon;
    }
    if (pthread_create(&c->io, NULL, pdmc__io_main, c)) {
        pdm_client__fail(status, "cannot start the I/O thread");
        goto err_mon;
    }
    c->io_started = 1;
    *out = c;
    return PDM_CLIENT_OK;

err_mon:
    zmq_close(c->mon);
err_sock:
    zmq_close(c->sock);
err_ctx:
    zmq_ctx_term(c->zctx);
err_efd:
    close(c->efd);
err_sync:
    pthread_cond_destroy(&c->state_cond);
    pthread_mutex_destroy(&c->mu);
err_free:
    free(c->endpoint);
    free(c);
    if (status == PDM_CLIENT_ENOMEM) pdm_client__fail(status, "out of memory");
    return status;
}

int pdm_client_create(const char *endpoint, const pdm_client_options_t *opts,
                      pdm_client_t **out)
{
    if (!out) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "pdm_client_create: out is NULL");
    if (!endpoint || !*endpoint) endpoint = getenv("PDMESH_ROUTER");
    if (!endpoint || !*endpoint) endpoint = PDMC_DEFAULT_ENDPOINT;
    char *list = strdup(endpoint), *save = NULL;
    if (!list) return pdm_client__fail(PDM_CLIENT_ENOMEM, "out of memory");
    pdm_client_t *c = NULL;
    int rc = PDM_CLIENT_OK;
    for (char *ep = strtok_r(list, ", ", &save); ep && !rc; ep = strtok_r(NULL, ", ", &save)) {
        if (c && c->n_alt == PDMC_MAX_ROUTERS - 1) {
            rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "at most %d router endpoints",
                                  PDMC_MAX_ROUTERS);
            break;
        }
        pdm_client_t *one = NULL;
        if ((rc = pdmc__create_one(ep, opts, &one))) break;
        if (!c) c = one;
        else c->alt[c->n_alt++] = one;
    }
    free(list);
    if (!rc && !c) rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "no router endpoint in '%s'",
                                         endpoint);
    if (rc) {
        pdm_client_destroy(c);
        return rc;
    }
    *out = c;
    return PDM_CLIENT_OK;
}

void pdm_client_destroy(pdm_client_t *c)
{
    if (!c) return;
    for (int i = 0; i < c->n_alt; i++) pdm_client_destroy(c->alt[i]);
    c->n_alt = 0;
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    for (int b = 0; b < PDMC_BUCKETS; b++)
        for (pdmc_call_t *call = c->buckets[b]; call; call = call->next)
            pdmc__end(call, PDM_CLIENT_ECLOSED, "the client was closed");
    /* Wait (bounded) for callers to leave: they unregister their calls. */
    double until = pdmc__now() + 5.0;
    while (c->n_open > 0 && pdmc__now() < until) {
        struct timespec ts = pdmc__abstime(pdmc__now() + 0.05);
        pthread_cond_timedwait(&c->state_cond, &c->mu, &ts);
    }
    uint64_t one = 1;
    ssize_t w = write(c->efd, &one, sizeof(one));
    (void)w;
    pthread_mutex_unlock(&c->mu);
    if (c->io_started) pthread_join(c->io, NULL);
    zmq_socket_monitor(c->sock, NULL, 0);
    zmq_close(c->mon);
    zmq_close(c->sock);
    zmq_ctx_term(c->zctx);
    close(c->efd);
    for (pdmc_cmd_t *cmd = c->cmd_head; cmd;) {
        pdmc_cmd_t *n = cmd->next;
        free(cmd->frame);
        free(cmd);
        cmd = n;
    }
    pthread_cond_destroy(&c->state_cond);
    pthread_mutex_destroy(&c->mu);
    free(c->endpoint);
    free(c);
}

uint64_t pdm_client_new_id(pdm_client_t *c)
{
    if (!c) return 0;
    pthread_mutex_lock(&c->mu);
    uint64_t id = c->next_id++;
    pthread_mutex_unlock(&c->mu);
    return id;
}

/* When the caller should give up waiting for a connection (mutex held): +inf if connected. */
static double pdmc__unreachable_at(const pdm_client_t *c)
{
    return c->connected ? INFINITY : c->unreachable_since + c->opt.connect_timeout_ms / 1000.0;
}

int pdm_client_ping(pdm_client_t *c, int timeout_ms)
{
    if (!c) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "pdm_client_ping: client is NULL");
    if (timeout_ms <= 0) timeout_ms = c->opt.timeout_ms;
    uint64_t nonce;
    if (pdm_random_bytes(&nonce, sizeof(nonce))) nonce = (uint64_t)(uintptr_t)&nonce ^ 0x5a5a;
    Pdmesh__Ping p = PDMESH__PING__INIT;
    p.nonce = nonce;
    uint8_t *frame;
    size_t len;
    int rc = pdmc__pack(PDMESH__MSG_TYPE__MSG_PING, &p.base, &frame, &len);
    if (rc) return rc;
    double deadline = pdmc__now() + timeout_ms / 1000.0;
    pthread_mutex_lock(&c->mu);
    rc = pdmc__enqueue(c, 0, frame, len);
    while (rc == PDM_CLIENT_OK) {
        int got = 0;
        for (unsigned i = 0; i < 8; i++) got |= c->pongs[i] == nonce;
        if (got) break;
        double now = pdmc__now(), ua = pdmc__unreachable_at(c);
        if (c->closing) rc = pdm_client__fail(PDM_CLIENT_ECLOSED, "the client was closed");
        else if (c->refused) rc = pdm_client__fail(PDM_CLIENT_EUNAUTHORIZED, "%s", c->refused_why);
        else if (now >= ua && ua <= deadline)
            rc = pdm_client__fail(PDM_CLIENT_EUNREACHABLE, "router at %s unreachable (no connection "
                            "for %d ms)", c->endpoint, c->opt.connect_timeout_ms);
        else if (now >= deadline)
            rc = pdm_client__fail(c->connected ? PDM_CLIENT_ETIMEOUT : PDM_CLIENT_EUNREACHABLE,
                            "no answer to ping from %s within %d ms%s", c->endpoint, timeout_ms,
                            c->connected ? "" : " (not connected)");
        else {
            struct timespec ts = pdmc__abstime(PDM_MIN(deadline, ua));
            pthread_cond_timedwait(&c->state_cond, &c->mu, &ts);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- requests ---- */

void pdm_client_request_init(pdm_client_request_t *r)
{
    if (r) memset(r, 0, sizeof(*r));
}

static void pdmc__result_init(pdm_client_result_t *r)
{
    memset(r, 0, sizeof(*r));
}

/* Frees every GenerateResult a call kept. */
static void pdmc__free_finals(pdmc_call_t *call)
{
    for (int k = 0; k < PDMC_MAX_CHOICES; k++) pdm_wire_msg_free(call->finals[k]);
    memset(call->finals, 0, sizeof(call->finals));
    call->final = NULL;
}

void pdm_client_result_fini(pdm_client_result_t *r)
{
    if (!r) return;
    for (size_t i = 0; i < r->n_choices; i++) {
        free(r->choices[i].tokens);
        free(r->choices[i].text);
        free(r->choices[i].logprobs);
        free(r->choices[i].tool_calls_json);
        free(r->choices[i].tool_content);
    }
    free(r->choices);
    free(r->tool_calls_json);
    free(r->tokens);
    free(r->text);
    for (size_t i = 0; i < r->n_beams; i++) {
        free(r->beams[i].tokens);
        free(r->beams[i].text);
    }
    free(r->beams);
    free(r->logprobs);
    free(r->prompt_logprobs);
    memset(r, 0, sizeof(*r));
}

/* Checks a request locally; the router checks again against its own limits. */
static int pdmc__validate(const pdm_client_request_t *q)
{
    int kinds = (q->prompt != NULL) + (q->n_prompt_tokens > 0 || q->prompt_tokens != NULL) +
                (q->n_messages > 0 || q->messages != NULL);
    if (kinds != 1)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "a request needs exactly one of prompt, "
                          "prompt_tokens or messages (%d given)", kinds);
    if (q->prompt_tokens && q->n_prompt_tokens == 0)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "prompt_tokens is empty");
    if (!q->prompt_tokens && q->n_prompt_tokens)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n_prompt_tokens without prompt_tokens");
    for (size_t i = 0; i < q->n_prompt_tokens; i++)
        if (q->prompt_tokens[i] < 0)
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "prompt token %zu is negative (%d)",
                              i, q->prompt_tokens[i]);
    if (q->n_messages && !q->messages)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n_messages without messages");
    if (q->messages && !q->n_messages)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "messages is empty");
    for (size_t i = 0; i < q->n_messages; i++) {
        const char *role = q->messages[i].role;
        if (!role || (strcmp(role, "system") && strcmp(role, "user") &&
                      strcmp(role, "assistant") && strcmp(role, "tool")))
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "message %zu: role must be system, "
                              "user, assistant or tool", i);
        if (q->messages[i].tool_calls_json && strcmp(role, "assistant"))
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "message %zu: tool calls need "
                                    "the role assistant", i);
        if (!q->messages[i].content)
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "message %zu has no content", i);
    }
    if (!(q->temperature >= 0 && q->temperature <= 100))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "temperature must be in [0, 100]");
    if (q->top_k < 0) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "top_k must be >= 0");
    if (!(q->top_p >= 0 && q->top_p <= 1))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "top_p must be in [0, 1]");
    if (!(q->min_p >= 0 && q->min_p <= 1))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "min_p must be in [0, 1]");
    if (!(q->repeat_penalty >= 0 && q->repeat_penalty <= 100))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "repeat_penalty must be in [0, 100]");
    if (!(q->presence_penalty >= -2 && q->presence_penalty <= 2))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT,
                                "presence_penalty must be in [-2, 2]");
    if (!(q->frequency_penalty >= -2 && q->frequency_penalty <= 2))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT,
                                "frequency_penalty must be in [-2, 2]");
    if (q->n_logit_bias > PDMC_MAX_LOGIT_BIAS)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "at most %d logit_bias entries "
                                "(%zu given)", PDMC_MAX_LOGIT_BIAS, q->n_logit_bias);
    if (q->n_logit_bias && (!q->logit_bias_ids || !q->logit_bias_values))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT,
                                "n_logit_bias without logit_bias_ids and logit_bias_values");
    for (size_t i = 0; i < q->n_logit_bias; i++)
        if (q->logit_bias_ids[i] < 0 ||
            !(q->logit_bias_values[i] >= -100 && q->logit_bias_values[i] <= 100))
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "logit_bias %zu: token %d, "
                                    "bias %g (ids >= 0, biases in [-100, 100])", i,
                                    q->logit_bias_ids[i], q->logit_bias_values[i]);
    if (q->json_object && q->json_schema)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "json_schema and json_object "
                                "are exclusive");
    if (q->json_schema && !q->json_schema[0])
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "json_schema is empty");
    if (q->top_logprobs > PDMC_MAX_TOP_LOGPROBS)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "top_logprobs must be <= %d",
                                PDMC_MAX_TOP_LOGPROBS);
    if (q->prompt_only && !q->prompt_logprobs)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "prompt_only needs prompt_logprobs");
    if (!isfinite(q->length_penalty))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "length_penalty must be finite");
    if (q->n_stop > PDMC_MAX_STOPS)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "at most %d stop strings (%zu given)",
                          PDMC_MAX_STOPS, q->n_stop);
    if (q->n_stop && !q->stop)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n_stop without stop");
    for (size_t i = 0; i < q->n_stop; i++)
        if (!q->stop[i] || !*q->stop[i])
            return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "stop string %zu is empty", i);
    if (q->beams > PDMC_MAX_BEAMS)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "beams must be <= %d", PDMC_MAX_BEAMS);
    if (q->n_best > (q->beams > 1 ? q->beams : 1))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n_best (%u) exceeds beams (%u)",
                          q->n_best, q->beams);
    if (q->timeout_ms < 0)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "timeout_ms must be >= 0");
    if (q->n > PDMC_MAX_CHOICES)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n must be <= %d (%u given)",
                                PDMC_MAX_CHOICES, q->n);
    if (q->n > 1 && (q->beams > 1 || q->prompt_only))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "n > 1 cannot be combined with "
                                "beams or prompt_only");
    if ((q->tools_json || q->tool_choice) && !q->n_messages)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "tools need a chat (messages)");
    if (q->tool_choice && !q->tools_json && strcmp(q->tool_choice, "none"))
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "tool_choice needs tools_json");
    return PDM_CLIENT_OK;
}

/* Packs the GenerateRequest frame. */
static int pdmc__pack_request(const pdm_client_request_t *q, uint64_t id, int stream,
                              uint32_t deadline_ms, const pdmc_resume_t *resume,
                              uint8_t **frame, size_t *len)
{
    Pdmesh__GenerateRequest m = PDMESH__GENERATE_REQUEST__INIT;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    Pdmesh__ChatMessage *msgs = NULL, **msgp = NULL;
    m.request_id = id;
    m.prompt = (char *)q->prompt;
    m.prompt_tokens = (int32_t *)q->prompt_tokens;
    m.n_prompt_tokens = q->n_prompt_tokens;
    if (q->n_messages) {
        msgs = calloc(q->n_messages, sizeof(*msgs));
        msgp = calloc(q->n_messages, sizeof(*msgp));
        if (!msgs || !msgp) {
            free(msgs);
            free(msgp);
            return pdm_client__fail(PDM_CLIENT_ENOMEM, "out of memory");
        }
        for (size_t i = 0; i < q->n_messages; i++) {
            pdmesh__chat_message__init(&msgs[i]);
            msgs[i].role = (char *)q->messages[i].role;
            msgs[i].content = (char *)q->messages[i].content;
            if (q->messages[i].tool_calls_json)
                msgs[i].tool_calls_json = (char *)q->messages[i].tool_calls_json;
            if (q->messages[i].tool_call_id)
                msgs[i].tool_call_id = (char *)q->messages[i].tool_call_id;
            msgp[i] = &msgs[i];
        }
        m.messages = msgp;
        m.n_messages = q->n_messages;
    }
    sp.temperature = q->temperature;
    sp.top_k = q->top_k;
    sp.top_p = q->top_p;
    sp.min_p = q->min_p;
    sp.repeat_penalty = q->repeat_penalty;
    sp.seed = q->seed;
    sp.presence_penalty = q->presence_penalty;
    sp.frequency_penalty = q->frequency_penalty;
    sp.logit_bias_ids = (int32_t *)q->logit_bias_ids;
    sp.n_logit_bias_ids = q->n_logit_bias;
    sp.logit_bias_values = (float *)q->logit_bias_values;
    sp.n_logit_bias_values = q->n_logit_bias;
    sp.logprobs = q->logprobs != 0;
    sp.top_logprobs = q->logprobs ? q->top_logprobs : 0;
    if (q->json_object) sp.json_schema = (char *)"{\"type\":\"object\"}";
    else if (q->json_schema) sp.json_schema = (char *)q->json_schema;
    m.sampling = &sp;
    m.prompt_logprobs = q->prompt_logprobs != 0;
    m.prompt_only = q->prompt_only != 0;
    m.max_tokens = q->max_tokens;
    m.stop = (char **)q->stop;
    m.n_stop = q->n_stop;
    m.deadline_ms = deadline_ms;
    m.beams = q->beams;
    m.length_penalty = q->length_penalty;
    m.n_best = q->n_best;
    m.early_stopping = (char *)q->early_stopping;
    m.stream = stream;
    m.model = (char *)q->model;
    m.ignore_eos = q->ignore_eos != 0;
    m.n = q->n > 1 ? q->n : 0;
    if (q->tools_json) m.tools_json = (char *)q->tools_json;
    if (q->tool_choice) m.tool_choice = (char *)q->tool_choice;
    if (resume && resume->n_tokens) {
        m.resume_tokens = (int32_t *)resume->tokens;
        m.n_resume_tokens = resume->n_tokens;
        m.resume_text_bytes = (uint32_t)resume->text_bytes;
    }
    m.resume_choice = resume && resume->choice_alone;
    int rc = pdmc__pack(PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST, &m.base, frame, len);
    free(msgs);
    free(msgp);
    return rc;
}

static char *pdmc__strdup0(const char *s)
{
    return strdup(s ? s : "");
}

/* Copies s (NULL: "") into dst[cap], cut at cap - 1 bytes. */
static void pdmc__copy_str(char *dst, size_t cap, const char *s)
{
    size_t n = s ? strnlen(s, cap - 1) : 0;
    if (n) memcpy(dst, s, n);
    dst[n] = 0;
}

/* Fills result from the final GenerateResult. */
static int pdmc__fill_result(const Pdmesh__GenerateResult *g, pdm_client_result_t *r)
{
    r->finish = (pdm_client_finish_t)g->finish;
    if (g->n_tokens) {
        if (!(r->tokens = malloc(g->n_tokens * sizeof(int32_t)))) return PDM_CLIENT_ENOMEM;
        memcpy(r->tokens, g->tokens, g->n_tokens * sizeof(int32_t));
        r->n_tokens = g->n_tokens;
    }
    free(r->text);
    if (!(r->text = pdmc__strdup0(g->text))) return PDM_CLIENT_ENOMEM;
    if (g->usage) {
        const Pdmesh__Usage *u = g->usage;
        r->usage.prompt_tokens = u->prompt_tokens;
        r->usage.completion_tokens = u->completion_tokens;
        r->usage.attempts = u->attempts;
        r->usage.cached_tokens = u->cached_tokens;
        r->usage.ttft_ms = u->ttft_ms;
        r->usage.tpot_ms = u->tpot_ms;
        r->usage.total_ms = u->total_ms;
        r->usage.kv_bytes = u->kv_bytes;
        pdmc__copy_str(r->usage.prefill_method, sizeof(r->usage.prefill_method),
                       u->prefill_method);
        pdmc__copy_str(r->usage.prefill_group, sizeof(r->usage.prefill_group), u->prefill_group);
        pdmc__copy_str(r->usage.decode_node, sizeof(r->usage.decode_node), u->decode_node);
    }
    if (g->n_logprobs && g->n_logprobs == g->n_tokens) {
        free(r->logprobs);
        if (!pdmc__logprobs_copy(g->logprobs, g->n_logprobs, &r->logprobs))
            return PDM_CLIENT_ENOMEM;
        r->n_logprobs = g->n_logprobs;
    }
    if (g->tool_calls_json && g->tool_calls_json[0]) {
        free(r->tool_calls_json);
        if (!(r->tool_calls_json = strdup(g->tool_calls_json))) return PDM_CLIENT_ENOMEM;
    }
    if (g->n_prompt_logprobs) {
        free(r->prompt_logprobs);
        if (!pdmc__logprobs_copy(g->prompt_logprobs, g->n_prompt_logprobs, &r->prompt_logprobs))
            return PDM_CLIENT_ENOMEM;
        r->n_prompt_logprobs = g->n_prompt_logprobs;
    }
    if (g->n_beams) {
        if (!(r->beams = calloc(g->n_beams, sizeof(*r->beams)))) return PDM_CLIENT_ENOMEM;
        r->n_beams = g->n_beams;
        for (size_t i = 0; i < g->n_beams; i++) {
            const Pdmesh__Beam *b = g->beams[i];
            pdm_client_beam_t *o = &r->beams[i];
            o->score = b->score;
            o->logprob = b->logprob;
            o->finish = (pdm_client_finish_t)b->finish;
            if (!(o->text = pdmc__strdup0(b->text))) return PDM_CLIENT_ENOMEM;
            if (b->n_tokens) {
                if (!(o->tokens = malloc(b->n_tokens * sizeof(int32_t)))) return PDM_CLIENT_ENOMEM;
                memcpy(o->tokens, b->tokens, b->n_tokens * sizeof(int32_t));
                o->n_tokens = b->n_tokens;
            }
        }
    }
    return PDM_CLIENT_OK;
}

/* Fills *ch (zeroed; freed by the result's fini) as choice k from its GenerateResult g. */
static int pdmc__fill_choice(const Pdmesh__GenerateResult *g, uint32_t k,
                             pdm_client_choice_t *ch)
{
    pdm_client_result_t one;
    memset(&one, 0, sizeof(one));
    int rc = pdmc__fill_result(g, &one);
    ch->index = k;
    ch->finish = one.finish;
    ch->tokens = one.tokens;
    ch->n_tokens = one.n_tokens;
    ch->text = one.text;
    ch->logprobs = one.logprobs;
    ch->n_logprobs = one.n_logprobs;
    ch->tool_calls_json = one.tool_calls_json;
    ch->completion_tokens = one.usage.completion_tokens;
    one.tokens = NULL;
    one.text = NULL;
    one.logprobs = NULL;
    one.tool_calls_json = NULL;
    pdm_client_result_fini(&one);
    if (!rc && !ch->text) rc = PDM_CLIENT_ENOMEM;
    if (!rc && ch->tool_calls_json && !(ch->tool_content = pdmc__strdup0(g->tool_content)))
        rc = PDM_CLIENT_ENOMEM;
    return rc;
}

/* result->choices from each choice's GenerateResult (one for a request without n), and
 * usage.completion_tokens summed over them. */
static int pdmc__fill_choices(const pdmc_call_t *call, pdm_client_result_t *r)
{
    if (!(r->choices = calloc(call->n_choices, sizeof(*r->choices)))) return PDM_CLIENT_ENOMEM;
    r->n_choices = call->n_choices;
    uint32_t total = 0;
    for (uint32_t k = 0; k < call->n_choices; k++) {
        const Pdmesh__GenerateResult *g =
            (const Pdmesh__GenerateResult *)pdm_wire_message(call->finals[k]);
        int rc = pdmc__fill_choice(g, k, &r->choices[k]);
        if (rc) return rc;
        total += r->choices[k].completion_tokens;
    }
    r->usage.completion_tokens = total;
    return PDM_CLIENT_OK;
}

/* Appends streamed tokens/text to the result (kept when the call fails midway). */
static int pdmc__append(pdm_client_result_t *r, size_t *cap_tokens, size_t *text_len,
                        size_t *cap_text, const pdmc_chunk_t *ch)
{
    if (r->n_tokens + ch->n_tokens > *cap_tokens) {
        size_t nc = PDM_MAX(*cap_tokens * 2, r->n_tokens + ch->n_tokens + 64);
        int32_t *nt = realloc(r->tokens, nc * sizeof(int32_t));
        if (!nt) return PDM_CLIENT_ENOMEM;
        r->tokens = nt;
        *cap_tokens = nc;
    }
    if (ch->n_tokens) memcpy(r->tokens + r->n_tokens, ch->tokens, ch->n_tokens * sizeof(int32_t));
    r->n_tokens += ch->n_tokens;
    if (*text_len + ch->text_len + 1 > *cap_text) {
        size_t nc = PDM_MAX(*cap_text * 2, *text_len + ch->text_len + 256);
        char *nt = realloc(r->text, nc);
        if (!nt) return PDM_CLIENT_ENOMEM;
        r->text = nt;
        *cap_text = nc;
    }
    memcpy(r->text + *text_len, ch->text, ch->text_len);
    *text_len += ch->text_len;
    r->text[*text_len] = 0;
    return PDM_CLIENT_OK;
}

/* Appends n_add tokens and text_add[add_len] to a growing (tokens, text) pair; text stays
 * NUL-terminated. ENOMEM leaves both as they were. */
static int pdmc__keep(int32_t **tokens, size_t *n, const int32_t *add, size_t n_add,
                      char **text, size_t *text_len, const char *text_add, size_t add_len)
{
    if (n_add) {
        int32_t *t = realloc(*tokens, sizeof(int32_t) * (*n + n_add));
        if (!t) return PDM_CLIENT_ENOMEM;
        memcpy(t + *n, add, sizeof(int32_t) * n_add);
        *tokens = t;
        *n += n_add;
    }
    char *x = realloc(*text, *text_len + add_len + 1);
    if (!x) return PDM_CLIENT_ENOMEM;
    if (add_len) memcpy(x + *text_len, text_add, add_len);
    *text_len += add_len;
    x[*text_len] = 0;
    *text = x;
    return PDM_CLIENT_OK;
}

/* A failed call will not deliver its queued chunks: their choices lost tokens (mutex held). */
static void pdmc__note_dropped(const pdmc_call_t *call, pdmc_choices_t *track)
{
    if (!track) return;
    for (const pdmc_chunk_t *ch = call->head; ch; ch = ch->next)
        if (ch->choice < track->n_choices) track->choice[ch->choice].dropped = 1;
}

/* The body of both generate calls. With `track` (OpenAI's n over several routers), what each
 * choice delivers to the callback is appended to it, and when the call fails the
 * GenerateResults of the choices that ended with every chunk delivered move into it. */
static int pdmc__run(pdm_client_t *c, const pdm_client_request_t *q, int stream,
                     const pdmc_resume_t *resume, pdmc_choices_t *track,
                     pdm_client_chunk_cb cb, void *data, pdm_client_result_t *res)
{
    if (!res) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "result is NULL");
    pdmc__result_init(res);
    int rc;
    if (!c || !q) {
        rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "client or request is NULL");
        goto early;
    }
    if ((rc = pdmc__validate(q))) goto early;
    int timeout_ms = q->timeout_ms ? q->timeout_ms : c->opt.timeout_ms;
    uint32_t deadline_ms = q->deadline_ms ? q->deadline_ms : (uint32_t)timeout_ms;

    pthread_mutex_lock(&c->mu);
    uint64_t id = q->id ? q->id : c->next_id++;
    if (q->id && q->id >= c->next_id) c->next_id = q->id + 1;
    pthread_mutex_unlock(&c->mu);
    res->id = id;

    uint8_t *frame;
    size_t len;
    if ((rc = pdmc__pack_request(q, id, stream, deadline_ms, resume, &frame, &len))) goto early;
    if (len > c->opt.max_frame) {
        free(frame);
        rc = pdm_client__fail(PDM_CLIENT_ETOO_LARGE, "request of %zu bytes is over the %zu-byte frame "
                        "limit", len, c->opt.max_frame);
        goto early;
    }

    pdmc_call_t call;
    memset(&call, 0, sizeof(call));
    call.id = id;
    call.stream = stream;
    call.n_choices = q->n > 1 ? q->n : 1;
    call.t_start = pdmc__now();
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&call.cond, &ca);
    pthread_condattr_destroy(&ca);
    double deadline = call.t_start + timeout_ms / 1000.0;

    pthread_mutex_lock(&c->mu);
    pdmc_call_t **slot = pdmc__slot(c, id);
    int precancelled = 0;
    for (unsigned i = 0; i < PDMC_CANCEL_RING && i < c->n_cancelled; i++)
        precancelled |= c->cancelled[i] == id;
    if (c->closing) rc = pdm_client__fail(PDM_CLIENT_ECLOSED, "the client was closed");
    else if (*slot) rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "request id %llu is already "
                                    "open on this client", (unsigned long long)id);
    else if (c->n_open >= c->opt.max_open_calls)
        rc = pdm_client__fail(PDM_CLIENT_EBUSY, "%d calls already open on this client", c->n_open);
    else if (precancelled) rc = pdm_client__fail(PDM_CLIENT_ECANCELLED, "request %llu was cancelled "
                                           "before it started", (unsigned long long)id);
    if (rc) {
        pthread_mutex_unlock(&c->mu);
        free(frame);
        pthread_cond_destroy(&call.cond);
        goto early;
    }
    *slot = &call;
    c->n_open++;
    if ((rc = pdmc__enqueue(c, id, frame, len))) pdmc__end(&call, rc, "command queue full");

    size_t cap_tokens = 0, text_len = 0, cap_text = 0;
    for (uint32_t k = 0; track && k < PDMC_MAX_CHOICES; k++) track->choice[k].dropped = 0;
    for (;;) {
        /* A call that failed (timeout, cancel, lost connection) delivers nothing more. */
        if (call.done && call.status != PDM_CLIENT_OK) {
            pdmc__note_dropped(&call, track);
            pdmc__free_chunks(&call);
        }
        if (call.head) {
            pdmc_chunk_t *ch = call.head;
            call.head = ch->next;
            if (!call.head) call.tail = NULL;
            call.buffered -= PDM_MIN(call.buffered, ch->bytes);
            pthread_mutex_unlock(&c->mu);
            /* the result's stream text is choice 0's (the final results give every choice) */
            int stop = 0, arc = ch->choice ? PDM_CLIENT_OK
                                           : pdmc__append(res, &cap_tokens, &text_len,
                                                          &cap_text, ch);
            if (cb && !arc) {
                pdm_client_chunk_t pub = {id, ch->choice, ch->index, ch->tokens, ch->n_tokens,
                                          ch->text, ch->text_len, ch->logprobs,
                                          ch->logprobs ? ch->n_tokens : 0};
                stop = cb(&pub, data);
            }
            if (track && !arc && !stop && ch->choice < track->n_choices) {
                pdmc_delivered_t *tc = &track->choice[ch->choice];
                arc = pdmc__keep(&tc->tokens, &tc->n_tokens, ch->tokens, ch->n_tokens,
                                 &tc->text, &tc->text_len, ch->text, ch->text_len);
            }
            free(ch->logprobs);
            free(ch);
            pthread_mutex_lock(&c->mu);
            if (arc) pdmc__end(&call, PDM_CLIENT_ENOMEM, "out of memory collecting the stream");
            else if (stop) {
                /* The caller wants no more chunks: cancelled even if the router's final result
                 * is already here (the caller has not seen all of it). */
                if (call.done && call.status == PDM_CLIENT_OK) {
                    pdmc__free_finals(&call);
                    call.status = PDM_CLIENT_ECANCELLED;
                    snprintf(call.error, sizeof(call.error), "cancelled by the callback");
                }
                pdmc__end(&call, PDM_CLIENT_ECANCELLED, "cancelled by the callback");
                pdmc__free_chunks(&call);
            }
            continue;
        }
        if (call.done) break;
        double now = pdmc__now(), ua = pdmc__unreachable_at(c);
        if (c->refused) {
            pdmc__end(&call, PDM_CLIENT_EUNAUTHORIZED, "%s", c->refused_why);
            continue;
        }
        if (now >= deadline) {
            pdmc__end(&call, c->connected ? PDM_CLIENT_ETIMEOUT : PDM_CLIENT_EUNREACHABLE,
                      "no %s from the router at %s within %d ms%s",
                      call.t_first ? "end of the stream" : "answer", c->endpoint, timeout_ms,
                      c->connected ? "" : " (not connected)");
            continue;
        }
        if (now >= ua) {
            pdmc__end(&call, PDM_CLIENT_EUNREACHABLE, "router at %s unreachable (no connection "
                      "for %d ms)", c->endpoint, c->opt.connect_timeout_ms);
            continue;
        }
        struct timespec ts = pdmc__abstime(PDM_MIN(deadline, ua));
        pthread_cond_timedwait(&call.cond, &c->mu, &ts);
    }
    /* Tell the router to stop work it may still be doing for us. */
    if (call.status == PDM_CLIENT_ECANCELLED || call.status == PDM_CLIENT_ETIMEOUT ||
        call.status == PDM_CLIENT_EBUSY || call.status == PDM_CLIENT_ENOMEM)
        pdmc__send_cancel(c, id);
    *pdmc__slot(c, id) = call.next;
    c->n_open--;
    if (c->closing) pthread_cond_broadcast(&c->state_cond);
    pdmc__free_chunks(&call);
    pthread_mutex_unlock(&c->mu);

    rc = call.status;
    res->router_id = call.router_id;
    res->client_total_ms = (pdmc__now() - call.t_start) * 1e3;
    res->client_ttft_ms = call.t_first ? (call.t_first - call.t_start) * 1e3 : 0;
    if (rc == PDM_CLIENT_OK && call.final) {
        const Pdmesh__GenerateResult *g =
            (const Pdmesh__GenerateResult *)pdm_wire_message(call.final);
        /* The final message is authoritative: replace what the stream collected. */
        free(res->tokens);
        res->tokens = NULL;
        res->n_tokens = 0;
        if (pdmc__fill_result(g, res) || pdmc__fill_choices(&call, res)) {
            rc = PDM_CLIENT_ENOMEM;
            snprintf(call.error, sizeof(call.error), "out of memory copying the result");
        }
    }
    for (uint32_t k = 0; track && rc != PDM_CLIENT_OK && k < call.n_choices; k++)
        if (call.finals[k] && !track->choice[k].dropped && !track->choice[k].final) {
            track->choice[k].final = call.finals[k]; /* that choice is whole */
            call.finals[k] = NULL;
        }
    pdmc__free_finals(&call);
    pthread_cond_destroy(&call.cond);
    if (!res->text && !(res->text = strdup(""))) rc = PDM_CLIENT_ENOMEM;
    res->status = rc;
    if (rc) {
        snprintf(res->error, sizeof(res->error), "%s", call.error[0] ? call.error
                                                                      : pdm_client_strerror(rc));
        pdm_client__fail(rc, "%s", res->error);
    }
    return rc;

early:
    res->status = rc;
    pdmc__copy_str(res->error, sizeof(res->error), pdm_client_last_error());
    res->text = strdup("");
    return rc;
}

/* 1 if a call that ended with `rc` may go on at another router: its router is gone (the
 * connection was lost or never came) or has no node to serve it yet (a restarted router). */
static int pdmc__failover_status(int rc)
{
    return rc == PDM_CLIENT_EUNREACHABLE || rc == PDM_CLIENT_EUNAVAILABLE ||
           rc == PDM_CLIENT_ESTALE_EPOCH;
}

/* The routers' clients: [0] is c itself. */
static pdm_client_t *pdmc__router(pdm_client_t *c, int i)
{
    return i == 0 ? c : c->alt[i - 1];
}

/* Appends src's tokens and text to the resume state (tokens, text). */
static int pdmc__keep_delivered(const pdm_client_result_t *src, int32_t **tokens, size_t *n,
                                char **text, size_t *text_len)
{
    return pdmc__keep(tokens, n, src->tokens, src->n_tokens, text, text_len,
                      src->text ? src->text : "", src->text ? strlen(src->text) : 0);
}

/* The router a new call starts at: round robin, the next connected one. */
static int pdmc__first_router(pdm_client_t *c)
{
    const int n_routers = c->n_alt + 1;
    pthread_mutex_lock(&c->mu);
    unsigned first = c->next_router++;
    pthread_mutex_unlock(&c->mu);
    for (int k = 0; k < n_routers; k++) {
        int i = (int)((first + (unsigned)k) % (unsigned)n_routers);
        pdm_client_t *sub = pdmc__router(c, i);
        pthread_mutex_lock(&sub->mu);
        int up = sub->connected;
        pthread_mutex_unlock(&sub->mu);
        if (up) return i;
    }
    return (int)(first % (unsigned)n_routers);
}

/* One failover step after a failed attempt: the next router; a short pause once every router
 * failed once. */
static void pdmc__next_router(const pdm_client_t *c, int *at, int tries)
{
    const int n_routers = c->n_alt + 1;
    *at = (*at + 1) % n_routers;
    if (tries % n_routers == 0) {
        struct timespec ts = {0, 200 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* Sets the attempt's timeout and router deadline from what is left of the call's. */
static void pdmc__attempt_times(const pdm_client_request_t *q, double deadline,
                                pdm_client_request_t *q2)
{
    double left_ms = (deadline - pdmc__now()) * 1e3;
    if (left_ms < 1) left_ms = 1;
    q2->timeout_ms = (int)left_ms;
    q2->deadline_ms = q->deadline_ms ? (uint32_t)PDM_MIN((double)q->deadline_ms, left_ms)
                                     : (uint32_t)left_ms;
}

/* The times of a call over several routers. */
typedef struct {
    double t_start, deadline;
    double ttft_ms;              /* call start -> the first token of any attempt, 0: none yet */
    int tries;                   /* attempts so far, every router and choice counted */
} pdmc_span_t;

static void pdmc__span_attempt(pdmc_span_t *sp, const pdm_client_result_t *res)
{
    if (!sp->ttft_ms && res->client_ttft_ms > 0)
        sp->ttft_ms = res->client_ttft_ms + (pdmc__now() * 1e3 - res->client_total_ms -
                                             sp->t_start * 1e3);
    sp->tries++;
}

/* One completion over the routers from *at (docs/sdk.md "Failover"): q2 (id set) is sent;
 * when its router is lost or has no node yet, it goes to the next router with the tokens
 * delivered so far (GenerateRequest.resume_tokens), until it ends or the span's deadline.
 * (tokens, text) are what was delivered before (malloc'd or NULL; taken over). choice_alone:
 * q2 is one choice of a request with n > 1 going on alone (resume_choice). On failure the
 * result keeps everything delivered. *at is left at the last router tried. */
static int pdmc__run_attempts(pdm_client_t *c, int *at, const pdm_client_request_t *q,
                              pdm_client_request_t *q2, int stream, int choice_alone,
                              int32_t *tokens, size_t n_tokens, char *text, size_t text_len,
                              pdm_client_chunk_cb cb, void *data, pdmc_span_t *sp,
                              pdm_client_result_t *res)
{
    int rc;
    for (;;) {
        pdmc_resume_t resume = {tokens, n_tokens, text_len, choice_alone};
        pdmc__attempt_times(q, sp->deadline, q2);
        rc = pdmc__run(pdmc__router(c, *at), q2, stream,
                       n_tokens || choice_alone ? &resume : NULL, NULL, cb, data, res);
        pdmc__span_attempt(sp, res);
        if (!pdmc__failover_status(rc) || pdmc__now() >= sp->deadline) break;
        /* what this router delivered stays delivered */
        if (pdmc__keep_delivered(res, &tokens, &n_tokens, &text, &text_len)) {
            pdm_client_result_fini(res);
            rc = PDM_CLIENT_ENOMEM;
            pdmc__result_init(res);
            snprintf(res->error, sizeof(res->error), "out of memory keeping the stream");
            break;
        }
        pdm_client_result_fini(res);
        pdmc__next_router(c, at, sp->tries);
    }
    if (n_tokens && rc != PDM_CLIENT_OK &&
        !pdmc__keep_delivered(res, &tokens, &n_tokens, &text, &text_len)) {
        /* the caller keeps everything delivered before the failure */
        free(res->tokens);
        free(res->text);
        res->tokens = tokens;
        res->n_tokens = n_tokens;
        res->text = text;
        tokens = NULL;
        text = NULL;
    }
    free(tokens);
    free(text);
    return rc;
}

/* A choice's chunks from its own request (n 1) carry choice 0: the caller sees its index. */
typedef struct {
    pdm_client_chunk_cb cb;
    void *data;
    uint32_t choice;
} pdmc_renumber_t;

static int pdmc__renumber_cb(const pdm_client_chunk_t *chunk, void *data)
{
    const pdmc_renumber_t *rn = data;
    pdm_client_chunk_t ch = *chunk;
    ch.choice = rn->choice;
    return rn->cb ? rn->cb(&ch, rn->data) : 0;
}

/* Choice k's outcome as a whole result (*one zeroed): from the GenerateResult it ended with,
 * or by running it alone at the next routers (n 1, its seed, its delivered tokens as the
 * resume, GenerateRequest.resume_choice). Takes its delivered tokens out of d. */
static int pdmc__choice_outcome(pdm_client_t *c, int *at, const pdm_client_request_t *q,
                                uint64_t id, int stream, uint32_t k, pdmc_delivered_t *d,
                                pdm_client_chunk_cb cb, void *data, pdmc_span_t *sp,
                                pdm_client_result_t *one)
{
    if (d->final) {
        const Pdmesh__GenerateResult *g =
            (const Pdmesh__GenerateResult *)pdm_wire_message(d->final);
        one->id = id;
        int rc = pdmc__fill_result(g, one);
        if (!rc && !(one->choices = calloc(1, sizeof(*one->choices)))) rc = PDM_CLIENT_ENOMEM;
        if (!rc) {
            one->n_choices = 1;
            rc = pdmc__fill_choice(g, k, &one->choices[0]);
        }
        if (rc) snprintf(one->error, sizeof(one->error), "out of memory copying the result");
        return one->status = rc;
    }
    pdm_client_request_t q1 = *q;
    q1.id = id;
    q1.n = 0;
    /* the seed choice k sampled with: the router derives it from the seed it samples with,
     * its default for a request that named none (choice 0 keeps the request's own) */
    if (k > 0) q1.seed = pdm_seed_for_choice(q->seed ? q->seed : PDM_SEED_DEFAULT, (int)k);
    pdmc_renumber_t rn = {cb, data, k};
    int rc = pdmc__run_attempts(c, at, q, &q1, stream, 1, d->tokens, d->n_tokens, d->text,
                                d->text_len, cb ? pdmc__renumber_cb : NULL, &rn, sp, one);
    d->tokens = NULL;
    d->n_tokens = 0;
    d->text = NULL;
    d->text_len = 0;
    if (!rc && one->n_choices == 1) one->choices[0].index = k;
    return rc;
}

/* The whole result of a request with n > 1 from each choice's (one[n], emptied): choice 0's
 * is the result's own, choices[] holds every choice, usage.completion_tokens sums them. */
static int pdmc__merge_choices(pdm_client_result_t *one, uint32_t n, pdm_client_result_t *res)
{
    pdm_client_choice_t *all = calloc(n, sizeof(*all));
    if (!all) return PDM_CLIENT_ENOMEM;
    *res = one[0];
    memset(&one[0], 0, sizeof(one[0]));
    uint32_t total = 0;
    for (uint32_t k = 0; k < n; k++) {
        pdm_client_result_t *src = k ? &one[k] : res;
        if (src->n_choices == 1) {
            all[k] = src->choices[0];
            free(src->choices);
            src->choices = NULL;
            src->n_choices = 0;
        }
        all[k].index = k;
        if (!all[k].text && !(all[k].text = strdup(""))) {
            res->choices = all; /* freed with the result */
            res->n_choices = k + 1;
            return PDM_CLIENT_ENOMEM;
        }
        total += all[k].completion_tokens;
        if (k) pdm_client_result_fini(&one[k]);
    }
    res->choices = all;
    res->n_choices = n;
    res->usage.completion_tokens = total;
    return PDM_CLIENT_OK;
}

/* OpenAI's n over several routers (docs/sdk.md "Failover"). The request goes whole to a
 * router; when that router is lost (or has no node yet) and nothing was delivered, it goes
 * whole to the next. Once any choice delivered tokens (or ended), every choice that has not
 * ended goes on at the next routers as its own request: n 1, the seed that choice samples
 * with, its delivered tokens as the resume, GenerateRequest.resume_choice so that the router
 * computes it as its own choices go on alone; the choices run one after the other, each with
 * the single-completion failover. The callback sees every choice's chunks contiguous; the
 * result is the one the undisturbed call gives (choices, usage summed). */
static int pdmc__run_choices(pdm_client_t *c, const pdm_client_request_t *q, int stream,
                             pdm_client_chunk_cb cb, void *data, pdm_client_result_t *res)
{
    const int timeout_ms = q->timeout_ms ? q->timeout_ms : c->opt.timeout_ms;
    pdmc_span_t sp = {pdmc__now(), 0, 0, 0};
    sp.deadline = sp.t_start + timeout_ms / 1000.0;
    pdm_client_request_t q2 = *q;
    if (!q2.id) q2.id = pdm_client_new_id(c);
    int at = pdmc__first_router(c);
    pdmc_choices_t track;
    memset(&track, 0, sizeof(track));
    track.n_choices = q->n <= PDMC_MAX_CHOICES ? q->n : PDMC_MAX_CHOICES;
    int rc, alone = 0;
    for (;;) {
        pdmc__attempt_times(q, sp.deadline, &q2);
        rc = pdmc__run(pdmc__router(c, at), &q2, stream, NULL, &track, cb, data, res);
        pdmc__span_attempt(&sp, res);
        if (!pdmc__failover_status(rc) || pdmc__now() >= sp.deadline) break;
        for (uint32_t k = 0; k < track.n_choices; k++)
            alone |= track.choice[k].n_tokens > 0 || track.choice[k].final != NULL;
        pdm_client_result_fini(res);
        pdmc__next_router(c, &at, sp.tries);
        if (alone) break; /* the choices go on one by one */
    }
    if (alone) {
        pdm_client_result_t one[PDMC_MAX_CHOICES];
        memset(one, 0, sizeof(one));
        uint32_t k = 0;
        rc = PDM_CLIENT_OK;
        for (; k < track.n_choices && !rc; k++)
            rc = pdmc__choice_outcome(c, &at, q, q2.id, stream, k, &track.choice[k], cb, data,
                                      &sp, &one[k]);
        if (!rc && (rc = pdmc__merge_choices(one, track.n_choices, res))) {
            snprintf(res->error, sizeof(res->error), "out of memory merging the choices");
        } else if (rc) {
            /* The failed choice's result says why; the call keeps choice 0's tokens (all of
             * them once it ended), and has no choices, as a failed call. */
            pdm_client_result_t *failed = &one[k - 1], gone;
            *res = k > 1 ? one[0] : *failed;
            memset(k > 1 ? &one[0] : failed, 0, sizeof(*res));
            if (k > 1) pdmc__copy_str(res->error, sizeof(res->error), failed->error);
            memset(&gone, 0, sizeof(gone));
            gone.choices = res->choices;
            gone.n_choices = res->n_choices;
            pdm_client_result_fini(&gone);
            res->choices = NULL;
            res->n_choices = 0;
        }
        for (uint32_t i = 0; i < track.n_choices; i++) pdm_client_result_fini(&one[i]);
        res->id = q2.id;
        res->status = rc;
        if (rc) pdm_client__fail(rc, "%s", res->error);
    }
    for (uint32_t k = 0; k < PDMC_MAX_CHOICES; k++) {
        free(track.choice[k].tokens);
        free(track.choice[k].text);
        pdm_wire_msg_free(track.choice[k].final);
    }
    res->client_total_ms = (pdmc__now() - sp.t_start) * 1e3;
    if (sp.ttft_ms > 0) res->client_ttft_ms = sp.ttft_ms;
    return rc;
}

/* A call over a list of routers (docs/sdk.md "Failover"). New calls go round robin to the
 * routers that are connected. When the call's router is lost (the connection dropped: a
 * crash, or no ZeroMQ heartbeat for 5 s) or it has no node yet, the call is sent to the next
 * router with the tokens already delivered (GenerateRequest.resume_tokens): the new router
 * prefills prompt + those tokens and streams on from there, so the caller's callback sees
 * one stream with no token lost or repeated. A request that delivered nothing is sent whole;
 * one with n > 1 goes on per choice (pdmc__run_choices). Everything stays within the call's
 * one timeout; the result is the whole completion. */
static int pdmc__run_failover(pdm_client_t *c, const pdm_client_request_t *q, int stream,
                              pdm_client_chunk_cb cb, void *data, pdm_client_result_t *res)
{
    if (!c || !c->n_alt || !q || !res) return pdmc__run(c, q, stream, NULL, NULL, cb, data, res);
    if (q->n > 1) {
        /* checked first: a request the router would refuse is refused here, not split */
        int rc = pdmc__validate(q);
        if (rc) return pdmc__run(c, q, stream, NULL, NULL, cb, data, res);
        return pdmc__run_choices(c, q, stream, cb, data, res);
    }
    const int timeout_ms = q->timeout_ms ? q->timeout_ms : c->opt.timeout_ms;
    pdmc_span_t sp = {pdmc__now(), 0, 0, 0};
    sp.deadline = sp.t_start + timeout_ms / 1000.0;
    pdm_client_request_t q2 = *q;
    if (!q2.id) q2.id = pdm_client_new_id(c);
    int at = pdmc__first_router(c);
    int rc = pdmc__run_attempts(c, &at, q, &q2, stream, 0, NULL, 0, NULL, 0, cb, data, &sp,
                                res);
    res->client_total_ms = (pdmc__now() - sp.t_start) * 1e3;
    if (sp.ttft_ms > 0) res->client_ttft_ms = sp.ttft_ms;
    return rc;
}

int pdm_client_generate(pdm_client_t *c, const pdm_client_request_t *req,
                        pdm_client_result_t *result)
{
    return pdmc__run_failover(c, req, 0, NULL, NULL, result);
}

int pdm_client_generate_stream(pdm_client_t *c, const pdm_client_request_t *req,
                               pdm_client_chunk_cb cb, void *data, pdm_client_result_t *result)
{
    return pdmc__run_failover(c, req, 1, cb, data, result);
}

int pdm_client_cancel(pdm_client_t *c, uint64_t id)
{
    if (!c || !id) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "client is NULL or id is 0");
    /* several routers: the call is open on one of them */
    for (int i = 0; i < c->n_alt; i++) {
        pthread_mutex_lock(&c->alt[i]->mu);
        pdmc_call_t *call = *pdmc__slot(c->alt[i], id);
        pthread_mutex_unlock(&c->alt[i]->mu);
        if (call) return pdm_client_cancel(c->alt[i], id);
    }
    pthread_mutex_lock(&c->mu);
    pdmc_call_t *call = *pdmc__slot(c, id);
    int rc = PDM_CLIENT_OK;
    if (call && !call->done) {
        pdmc__end(call, PDM_CLIENT_ECANCELLED, "cancelled");
    } else {
        c->cancelled[c->n_cancelled++ % PDMC_CANCEL_RING] = id;
        rc = pdm_client__fail(PDM_CLIENT_ENOT_FOUND, "no open call with id %llu (remembered: a call "
                        "starting with it is cancelled at once)", (unsigned long long)id);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}
