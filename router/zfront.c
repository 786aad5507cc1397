/*
 * zfront.c - the ZeroMQ client front end: GenerateRequest / CancelRequest / Ping on the client
 * ROUTER socket, answered with Accepted, TokenChunk (stream), GenerateResult or Error.
 * A client whose identity is gone (ZMQ_ROUTER_MANDATORY send fails) has its requests
 * cancelled on the next tick.
 * OpenAI's n (GenerateRequest.n > 1): one entry per choice, all with the request's id; each
 * choice's TokenChunks and its GenerateResult carry `choice`, so the client gets n results.
 * The first choice to fail answers with the request's one Error; its siblings are then
 * cancelled quietly (as if their client were gone), and a CancelRequest cancels them all.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/zfront.h"

typedef struct rt_zc {
    struct rt_zc *next, *prev;
    pdm_router_t *r;
    uint8_t ident[RT_IDENT_MAX];
    size_t ident_len;
    uint64_t client_id, router_id;
    int stream, gone;
    uint32_t choice;         /* OpenAI's n: the choice this entry carries (0: the only one) */
} rt_zc_t;

typedef struct {
    rt_zc_t *head;
} rt_zfront_t;

int rt_zfront_init(pdm_router_t *r)
{
    r->zfront = calloc(1, sizeof(rt_zfront_t));
    return r->zfront ? PDM_OK : pdm_error_set(PDM_ENOMEM, "router: out of memory");
}

static void rt_zc_free(pdm_router_t *r, rt_zc_t *c)
{
    rt_zfront_t *z = r->zfront;
    if (c->prev) c->prev->next = c->next;
    else z->head = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c);
}

void rt_zfront_fini(pdm_router_t *r)
{
    rt_zfront_t *z = r->zfront;
    if (!z) return;
    while (z->head) rt_zc_free(r, z->head);
    free(z);
    r->zfront = NULL;
}

static void rt_zc_send(rt_zc_t *c, int type, const ProtobufCMessage *m)
{
    if (c->gone) return;
    int st = pdm_wire_send(c->r->client_sock, c->ident, c->ident_len, type, m);
    if (st == PDM_EPEER) c->gone = 1; /* cancelled by rt_zfront_sweep */
    else if (st) pdm_log_warn("router: client: %s", pdm_error_last());
}

static void rt_zc_on_tokens(void *ctx, uint32_t index, const int32_t *tokens, size_t n,
                            const char *text, Pdmesh__TokenLogprob *const *logprobs)
{
    rt_zc_t *c = ctx;
    if (!c->stream) return;
    Pdmesh__TokenChunk t = PDMESH__TOKEN_CHUNK__INIT;
    t.request_id = c->client_id;
    t.choice = c->choice;
    t.index = index;
    t.tokens = (int32_t *)tokens;
    t.n_tokens = n;
    t.text = (char *)(text ? text : "");
    if (logprobs) {
        t.logprobs = (Pdmesh__TokenLogprob **)logprobs;
        t.n_logprobs = n;
    }
    rt_zc_send(c, PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK, &t.base);
}

static void rt_zc_on_result(void *ctx, const Pdmesh__GenerateResult *res)
{
    rt_zc_t *c = ctx;
    Pdmesh__GenerateResult out = *res;
    out.choice = c->choice;
    rt_zc_send(c, PDMESH__MSG_TYPE__MSG_GENERATE_RESULT, &out.base);
    rt_zc_free(c->r, c);
}

static void rt_zc_on_error(void *ctx, int code, const char *message)
{
    rt_zc_t *c = ctx;
    if (!c->gone) {
        pdm_wire_send_error(c->r->client_sock, c->ident, c->ident_len, code, c->client_id, "%s",
                            message);
        /* the request's one Error went out: its other choices end unseen (the sweep) */
        rt_zfront_t *z = c->r->zfront;
        for (rt_zc_t *o = z->head; o; o = o->next)
            if (o != c && o->client_id == c->client_id && o->ident_len == c->ident_len &&
                !memcmp(o->ident, c->ident, c->ident_len))
                o->gone = 1;
    }
    rt_zc_free(c->r, c);
}

void rt_zfront_sweep(pdm_router_t *r)
{
    rt_zfront_t *z = r->zfront;
    for (int again = 1; again;) {
        again = 0;
        for (rt_zc_t *c = z ? z->head : NULL; c; c = c->next)
            if (c->gone) {
                pdm_router_cancel(r, c->router_id); /* frees c through on_error */
                again = 1;
                break;
            }
    }
}

void rt_on_client_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                        const void *frame, size_t len)
{
    void *s = r->client_sock;
    rt_zfront_t *z = r->zfront;
    pdm_wire_msg_t *wm;
    if (pdm_wire_unpack_or_reply(s, ident, ident_len, frame, len, PDM_WIRE_MAX_FRAME, &wm)) return;
    int type = pdm_wire_type(wm);
    ProtobufCMessage *msg = pdm_wire_message(wm);
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST: {
        const Pdmesh__GenerateRequest *g = (Pdmesh__GenerateRequest *)msg;
        if (ident_len > RT_IDENT_MAX) {
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                                g->request_id, "routing id too long");
            break;
        }
        const uint32_t n_choices = g->n > 1 ? g->n : 1;
        if (n_choices > 8) {
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                                g->request_id, "n %u: at most 8 choices", g->n);
            break;
        }
        int dup = 0;
        for (rt_zc_t *c = z->head; c && !dup; c = c->next)
            dup = c->ident_len == ident_len && !memcmp(c->ident, ident, ident_len) &&
                  c->client_id == g->request_id;
        if (dup) {
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                                g->request_id, "request_id %llu is already open on this connection",
                                (unsigned long long)g->request_id);
            break;
        }
        rt_zc_t *cs[8] = {0};
        pdm_router_sink_t sinks[8];
        uint64_t ids[8];
        int oom = 0;
        for (uint32_t k = 0; k < n_choices; k++) {
            rt_zc_t *c = cs[k] = calloc(1, sizeof(*c));
            if (!c) {
                oom = 1;
                break;
            }
            c->r = r;
            memcpy(c->ident, ident, ident_len);
            c->ident_len = ident_len;
            c->client_id = g->request_id;
            c->stream = g->stream;
            c->choice = k;
            sinks[k] = (pdm_router_sink_t){c, rt_zc_on_tokens, rt_zc_on_result, rt_zc_on_error,
                                           NULL};
        }
        if (oom) {
            for (uint32_t k = 0; k < n_choices; k++) free(cs[k]);
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL,
                                g->request_id, "out of memory");
            break;
        }
        char client[96] = "zmq:";
        char *hex = pdm_hex_encode(ident, PDM_MIN(ident_len, 40));
        snprintf(client + 4, sizeof(client) - 4, "%s", hex ? hex : "?");
        free(hex);
        int code = 0;
        if (pdm_router_submit(r, g, client, sinks, ids, &code)) {
            pdm_wire_send_error(s, ident, ident_len, code, g->request_id, "%s", pdm_error_last());
            for (uint32_t k = 0; k < n_choices; k++) free(cs[k]);
            break;
        }
        for (uint32_t k = 0; k < n_choices; k++) {
            rt_zc_t *c = cs[k];
            c->router_id = ids[k];
            c->next = z->head;
            if (z->head) z->head->prev = c;
            z->head = c;
        }
        Pdmesh__Accepted a = PDMESH__ACCEPTED__INIT;
        a.request_id = g->request_id;
        a.router_request_id = ids[0];
        rt_zc_send(cs[0], PDMESH__MSG_TYPE__MSG_ACCEPTED, &a.base);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_CANCEL_REQUEST: {
        const Pdmesh__CancelRequest *cr = (Pdmesh__CancelRequest *)msg;
        /* every choice of it (each cancel frees its entry: the ids are taken first) */
        uint64_t ids[8];
        int k = 0;
        for (rt_zc_t *c = z->head; c && k < 8; c = c->next)
            if (c->ident_len == ident_len && !memcmp(c->ident, ident, ident_len) &&
                c->client_id == cr->request_id)
                ids[k++] = c->router_id;
        if (!k)
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND,
                                cr->request_id, "no open request %llu",
                                (unsigned long long)cr->request_id);
        for (int j = 0; j < k; j++) pdm_router_cancel(r, ids[j]);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_PING: {
        Pdmesh__Ping pong = PDMESH__PING__INIT;
        pong.nonce = ((Pdmesh__Ping *)msg)->nonce;
        rt_send(s, ident, ident_len, PDMESH__MSG_TYPE__MSG_PONG, &pong.base);
        break;
    }
    default:
        pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, 0,
                            "%s is not a client message", pdm_wire_type_name(type));
        break;
    }
    pdm_wire_msg_free(wm);
}
