/*
 * The admin API client (sdk/pdmesh_admin.h): one request, one reply, on a short-lived DEALER
 * socket. A socket monitor tells "nobody listens there" (EUNREACHABLE) from "connected but
 * nobody answers" (ETIMEOUT).
 */
#include "sdk/pdmesh_admin.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/pdm.h"
#include "common/wire.h"
#include "sdk/client_internal.h"

struct pdm_admin_reply {
    pdm_wire_msg_t *msg;
};

const Pdmesh__AdminReply *pdm_admin_reply_get(const pdm_admin_reply_t *r)
{
    return r ? (const Pdmesh__AdminReply *)pdm_wire_message(r->msg) : NULL;
}

int pdm_admin_reply_status(const pdm_admin_reply_t *r)
{
    const Pdmesh__AdminReply *a = pdm_admin_reply_get(r);
    if (!a) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "no reply");
    if (a->ok) return PDM_CLIENT_OK;
    int code = a->error && a->error->code > 0 && a->error->code <= 14 ? -(int)a->error->code
                                                                       : PDM_CLIENT_EINTERNAL;
    return pdm_client__fail(code, "%s", a->error && a->error->message && *a->error->message
                                            ? a->error->message : pdm_client_strerror(code));
}

void pdm_admin_reply_free(pdm_admin_reply_t *r)
{
    if (!r) return;
    pdm_wire_msg_free(r->msg);
    free(r);
}

/* Drains monitor events; sets *connected on ZMQ_EVENT_CONNECTED, and *refused (with why)
 * when the router refused the security handshake (CURVE key not allowed, or a mismatch). */
static void pdm__admin_monitor(void *mon, const char *endpoint, int *connected, int *refused,
                               char *why, size_t why_size)
{
    uint16_t event;
    uint32_t value;
    while (pdm_client__monitor_event(mon, &event, &value)) {
        if (event == ZMQ_EVENT_CONNECTED) *connected = 1;
        if (pdm_client__handshake_refusal(event, value, endpoint, why, why_size)) *refused = 1;
    }
}

int pdm_admin_call(const char *endpoint, const Pdmesh__AdminRequest *req, int timeout_ms,
                   pdm_admin_reply_t **out)
{
    if (!endpoint || !*endpoint || !req || !out || timeout_ms <= 0)
        return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "pdm_admin_call: bad arguments");
    uint8_t *frame;
    size_t len;
    if (pdm_wire_pack(PDMESH__MSG_TYPE__MSG_ADMIN_REQUEST, &req->base, &frame, &len))
        return pdm_client__fail(PDM_CLIENT_ENOMEM, "cannot pack the admin request");
    int rc = PDM_CLIENT_ESYSTEM, zero = 0, connected = 0, refused = 0;
    char why[256] = "";
    int64_t maxsz = 64 << 20;
    void *mon = NULL, *sock = NULL, *ctx = zmq_ctx_new();
    if (!ctx) {
        pdm_client__fail(rc, "zmq_ctx_new: %s", zmq_strerror(errno));
        goto err_frame;
    }
    sock = zmq_socket(ctx, ZMQ_DEALER);
    mon = zmq_socket(ctx, ZMQ_PAIR);
    if (!sock || !mon) {
        pdm_client__fail(rc, "zmq_socket: %s", zmq_strerror(errno));
        goto err_sock;
    }
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &maxsz, sizeof(maxsz));
    const char *csrv = NULL, *ckey = NULL; /* CURVE from the environment (pdmesh_admin.h) */
    pdm_curve_env(&csrv, &ckey);
    if (pdm_curve_client_setup(sock, csrv, ckey)) {
        rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "%s", pdm_error_last());
        goto err_sock;
    }
    char mon_ep[64];
    snprintf(mon_ep, sizeof(mon_ep), "inproc://pdmesh-admin-monitor-%p", (void *)sock);
    if (zmq_socket_monitor(sock, mon_ep, PDM_CLIENT__MONITOR_EVENTS) < 0 ||
        zmq_connect(mon, mon_ep) < 0) {
        pdm_client__fail(rc, "socket monitor: %s", zmq_strerror(errno));
        goto err_sock;
    }
    if (zmq_connect(sock, endpoint) < 0) {
        rc = pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "cannot connect to '%s': %s",
                              endpoint, zmq_strerror(errno));
        goto err_mon;
    }
    /* queued until the connection is up (ZMQ_IMMEDIATE off) */
    if (zmq_send(sock, frame, len, ZMQ_DONTWAIT) < 0) {
        pdm_client__fail(rc, "send to %s: %s", endpoint, zmq_strerror(errno));
        goto err_mon;
    }
    double deadline = pdm_now() + timeout_ms / 1000.0;
    for (;;) {
        double left = deadline - pdm_now();
        if (left <= 0) {
            rc = connected
                     ? pdm_client__fail(PDM_CLIENT_ETIMEOUT, "router admin socket %s accepted "
                                        "the connection but did not answer within %d ms",
                                        endpoint, timeout_ms)
                     : pdm_client__fail(PDM_CLIENT_EUNREACHABLE, "router admin socket %s "
                                        "unreachable (no connection within %d ms)", endpoint,
                                        timeout_ms);
            goto err_mon;
        }
        zmq_pollitem_t items[2] = {{sock, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        long ms = (long)(left * 1000) + 1;
        if (zmq_poll(items, 2, ms) < 0 && errno != EINTR) {
            pdm_client__fail(rc, "zmq_poll: %s", zmq_strerror(errno));
            goto err_mon;
        }
        pdm__admin_monitor(mon, endpoint, &connected, &refused, why, sizeof(why));
        if (refused) {
            rc = pdm_client__fail(PDM_CLIENT_EUNAUTHORIZED, "%s", why);
            goto err_mon;
        }
        if (!(items[0].revents & ZMQ_POLLIN)) continue;
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            continue;
        }
        int more = zmq_msg_more(&m);
        pdm_wire_msg_t *w = NULL;
        int urc = more ? PDM_EFORMAT
                       : pdm_wire_unpack(zmq_msg_data(&m), zmq_msg_size(&m), (size_t)maxsz, 0, &w);
        size_t got = zmq_msg_size(&m);
        zmq_msg_close(&m);
        while (more) {
            zmq_msg_init(&m);
            more = zmq_msg_recv(&m, sock, 0) >= 0 && zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (urc) {
            rc = pdm_client__fail(PDM_CLIENT_EPROTOCOL, "malformed reply of %zu bytes from %s: %s",
                                  got, endpoint, pdm_error_last());
            goto err_mon;
        }
        int type = pdm_wire_type(w);
        if (type == PDMESH__MSG_TYPE__MSG_ADMIN_REPLY) {
            pdm_admin_reply_t *r = malloc(sizeof(*r));
            if (!r) {
                pdm_wire_msg_free(w);
                rc = pdm_client__fail(PDM_CLIENT_ENOMEM, "out of memory");
                goto err_mon;
            }
            r->msg = w;
            *out = r;
            rc = PDM_CLIENT_OK;
        } else if (type == PDMESH__MSG_TYPE__MSG_ERROR) {
            const Pdmesh__Error *e = (const Pdmesh__Error *)pdm_wire_message(w);
            int code = e->code > 0 && e->code <= 14 ? -(int)e->code : PDM_CLIENT_EINTERNAL;
            rc = pdm_client__fail(code, "router: %s", e->message && *e->message
                                                          ? e->message : pdm_client_strerror(code));
            pdm_wire_msg_free(w);
        } else {
            rc = pdm_client__fail(PDM_CLIENT_EPROTOCOL, "unexpected %s reply from %s",
                                  pdm_wire_type_name(type), endpoint);
            pdm_wire_msg_free(w);
        }
        break;
    }

err_mon:
    zmq_socket_monitor(sock, NULL, 0);
err_sock:
    if (mon) zmq_close(mon);
    if (sock) zmq_close(sock);
    zmq_ctx_term(ctx);
err_frame:
    free(frame);
    return rc;
}

int pdm_admin_load_token(const char *path, char **out)
{
    if (!out) return pdm_client__fail(PDM_CLIENT_EINVALID_ARGUMENT, "pdm_admin_load_token: no out");
    int st = pdm_auth_load_admin_token(path, "--token-file FILE", out);
    if (st)
        return pdm_client__fail(st == PDM_ENOMEM ? PDM_CLIENT_ENOMEM
                                                 : PDM_CLIENT_EINVALID_ARGUMENT,
                                "%s", pdm_error_last());
    return PDM_CLIENT_OK;
}
