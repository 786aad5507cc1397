/*
 * curve.c - the router's CURVE authentication (docs/router.md, "CURVE"): a ZAP handler
 * (ZeroMQ RFC 27) on inproc://zeromq.zap.01 that accepts mechanism CURVE with a client public
 * key from the allowlist (--curve-allow) and refuses everything else.
 *
 * The handler runs in its own small thread rather than on the libuv loop: libzmq's I/O thread
 * waits for the ZAP reply during every handshake, so the answer must not queue behind a long
 * tokenization or a scheduling pass on the loop, and a REP socket's edge-triggered ZMQ_FD would
 * need the same drain-until-EAGAIN care as the ROUTER sockets for no gain. The thread owns
 * only its REP socket and the read-only allowlist; it polls with a 100 ms timeout so that
 * rt_curve_stop can join it before the context is terminated.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/curve.h"
#include "router/internal.h"
#include "router/curve.h"

#define RT_CURVE_ALLOW_MAX 4096
#define RT_ZAP_EP "inproc://zeromq.zap.01"

typedef struct rt_curve rt_curve_t;

struct rt_curve {
    void *rep;
    pthread_t thread;
    int started;
    atomic_int stop;
    size_t n_allow;
    uint8_t (*allow)[32];
    double last_log;
    unsigned long suppressed, accepted, rejected;
};

static int rt_curve_load_allow(rt_curve_t *c, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return pdm_error_set(PDM_EIO, "CURVE allowlist %s: %s", path, strerror(errno));
    c->allow = calloc(RT_CURVE_ALLOW_MAX, 32);
    if (!c->allow) {
        fclose(f);
        return pdm_error_set(PDM_ENOMEM, "CURVE allowlist: out of memory");
    }
    char line[512];
    int lineno = 0, st = PDM_OK;
    while (!st && fgets(line, sizeof(line), f)) {
        lineno++;
        char *key;
        int k = pdm_curve_parse_line(line, &key);
        if (k == 0) continue;
        if (k < 0)
            st = pdm_error_set(PDM_EFORMAT, "CURVE allowlist %s:%d: not a 40-character Z85 key",
                               path, lineno);
        else if (c->n_allow == RT_CURVE_ALLOW_MAX)
            st = pdm_error_set(PDM_EOVERFLOW, "CURVE allowlist %s: more than %d keys", path,
                               RT_CURVE_ALLOW_MAX);
        else
            zmq_z85_decode(c->allow[c->n_allow++], key);
    }
    fclose(f);
    if (!st && !c->n_allow) pdm_log_warn("router: CURVE allowlist %s is empty: no client can connect", path);
    return st;
}

static int rt_curve_allowed(const rt_curve_t *c, const uint8_t *key, size_t len)
{
    if (len != 32) return 0;
    for (size_t i = 0; i < c->n_allow; i++)
        if (!memcmp(c->allow[i], key, 32)) return 1;
    return 0;
}

static void rt_zap_reply(void *rep, const zmq_msg_t *reqid, const char *code, const char *text)
{
    zmq_send(rep, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(rep, reqid ? zmq_msg_data((zmq_msg_t *)reqid) : "",
             reqid ? zmq_msg_size((zmq_msg_t *)reqid) : 0, ZMQ_SNDMORE);
    zmq_send(rep, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(rep, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(rep, "", 0, ZMQ_SNDMORE); /* user id */
    zmq_send(rep, "", 0, 0);           /* metadata */
}

/* One request: version, request id, domain, address, identity, mechanism, credentials... */
static void rt_zap_handle(rt_curve_t *c)
{
    enum { NMAX = 8 };
    zmq_msg_t part[NMAX];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->rep, 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < NMAX) part[n++] = m;
        else zmq_msg_close(&m);
    }
    const char *why = NULL;
    char addr[64] = "?", mech[16] = "?";
    if (n >= 6) {
        snprintf(addr, sizeof(addr), "%.*s", (int)PDM_MIN(zmq_msg_size(&part[3]), 60),
                 (const char *)zmq_msg_data(&part[3]));
        snprintf(mech, sizeof(mech), "%.*s", (int)PDM_MIN(zmq_msg_size(&part[5]), 12),
                 (const char *)zmq_msg_data(&part[5]));
    }
    if (n < 6 || zmq_msg_size(&part[0]) != 3 || memcmp(zmq_msg_data(&part[0]), "1.0", 3))
        why = "malformed ZAP request";
    else if (strcmp(mech, "CURVE"))
        why = "mechanism is not CURVE";
    else if (n < 7 || !rt_curve_allowed(c, zmq_msg_data(&part[6]), zmq_msg_size(&part[6])))
        why = "client key not in the allowlist";
    rt_zap_reply(c->rep, n >= 2 ? &part[1] : NULL, why ? "400" : "200", why ? why : "OK");
    if (!why) {
        c->accepted++;
    } else {
        c->rejected++;
        double now = pdm_now();
        if (now - c->last_log >= 1.0) { /* rate limit: one line a second */
            char key[PDM_CURVE_KEY_LEN + 1] = "-";
            if (n >= 7 && zmq_msg_size(&part[6]) == 32) zmq_z85_encode(key, zmq_msg_data(&part[6]), 32);
            pdm_log_warn("router: CURVE: refused %s from %s (mechanism %s, key %s); %lu more "
                         "refusals since the last line",
                         why, addr, mech, key, c->suppressed);
            c->suppressed = 0;
            c->last_log = now;
        } else {
            c->suppressed++;
        }
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&part[i]);
}

static void *rt_zap_main(void *arg)
{
    rt_curve_t *c = arg;
    while (!atomic_load(&c->stop)) {
        zmq_pollitem_t it = {.socket = c->rep, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&it, 1, 100);
        if (rc < 0 && errno != EINTR) break;
        if (rc > 0 && (it.revents & ZMQ_POLLIN)) rt_zap_handle(c);
    }
    zmq_close(c->rep);
    c->rep = NULL;
    return NULL;
}

int rt_curve_start(pdm_router_t *r, char *secret)
{
    const rt_config_t *cfg = &r->cfg;
    if (!cfg->curve_secret_file && !cfg->curve_allow_file) return PDM_OK;
    if (!cfg->curve_secret_file || !cfg->curve_allow_file)
        return pdm_error_set(PDM_EINVAL, "CURVE needs both --curve-secret-file and --curve-allow");
    if (!zmq_has("curve"))
        return pdm_error_set(PDM_EUNSUPPORTED, "this libzmq was built without CURVE");
    char pub[PDM_CURVE_KEY_LEN + 1];
    int st = pdm_curve_load_secret(cfg->curve_secret_file, pub, secret);
    if (st) return st;
    rt_curve_t *c = calloc(1, sizeof(*c));
    if (!c) return pdm_error_set(PDM_ENOMEM, "router: out of memory");
    r->curve = c;
    if ((st = rt_curve_load_allow(c, cfg->curve_allow_file))) return st;
    /* The handler must be bound before any CURVE socket binds (PITFALLS.md: without a ZAP
     * handler libzmq accepts every client key). */
    int zero = 0;
    c->rep = zmq_socket(r->zctx, ZMQ_REP);
    if (!c->rep) return pdm_error_set(PDM_EIO, "ZAP socket: %s", zmq_strerror(errno));
    zmq_setsockopt(c->rep, ZMQ_LINGER, &zero, sizeof(zero));
    if (zmq_bind(c->rep, RT_ZAP_EP))
        return pdm_error_set(PDM_EIO, "cannot bind %s: %s", RT_ZAP_EP, zmq_strerror(errno));
    if (pthread_create(&c->thread, NULL, rt_zap_main, c))
        return pdm_error_set(PDM_EIO, "cannot start the ZAP thread");
    c->started = 1;
    pdm_log_info("router: CURVE on; server key %s; %zu client keys allowed", pub, c->n_allow);
    return PDM_OK;
}

void rt_curve_stop(pdm_router_t *r)
{
    rt_curve_t *c = r->curve;
    if (!c) return;
    if (c->started) {
        atomic_store(&c->stop, 1);
        pthread_join(c->thread, NULL);
    }
    if (c->rep) zmq_close(c->rep);
    free(c->allow);
    free(c);
    r->curve = NULL;
}
