/*
 * nodelink.c - a node daemon's control-plane link: one thread owning the DEALER to the node
 * socket, an inproc PAIR to the daemon's thread. See common/nodelink.h.
 *
 * The PAIR carries, link -> daemon, pointers to unpacked messages (pdm_wire_msg_t *; a NULL
 * pointer means "stop"), and daemon -> link, packed frames to forward (an empty frame only
 * wakes the thread to look at its flags).
 */
#include "common/nodelink.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/health.h"
#include "common/pdm.h"

/* One router of the node's list: its own socket, registration, epoch and lease. */
typedef struct {
    char endpoint[256];
    void *dealer;                /* to the router's node socket (link thread only) */
    _Atomic uint64_t epoch;
    _Atomic uint64_t router_id;  /* RegisterAck.router_id */
    atomic_uint orphans;         /* generations of this router's work orphaned */
    atomic_int registered;
    /* link thread only */
    int hb_ms;
    int register_unanswered;     /* a Register went out and no RegisterAck came yet */
    uint64_t generation;         /* Register.generation: +1 whenever a registration is dropped */
    int lease_ms;                /* the router's lease (RegisterAck); 0: 3 heartbeats */
    double last_ack;             /* last RegisterAck / HeartbeatAck */
    double next_register, next_heartbeat;
} pdm__link_router_t;

/* What the link hands the daemon over the pair: a message and the router it came from (a
 * NULL message means "stop"). */
typedef struct {
    pdm_wire_msg_t *m;
    int origin;
} pdm__link_item_t;

struct pdm_link {
    pdm_link_params_t p;
    uint8_t *secret;
    size_t secret_len;
    int sig_fd;                  /* SIGTERM / SIGINT */
    void *zctx;
    pdm__link_router_t routers[PDM_LINK_MAX_ROUTERS];
    int n_routers;
    int origin;                  /* daemon side: the router of the last message received */
    void *pair_link;             /* link thread's end of the inproc pair */
    void *pair_main;             /* daemon thread's end */
    char pair_ep[64];
    uint8_t *addr;               /* UCX worker address */
    size_t addr_len;
    pthread_t thread;
    int started;
    int closing;                 /* daemon side: "stop" was received */
    atomic_int stop, reregister, exit_status, draining;
    _Atomic double main_seen;    /* pdm_now() of the daemon's last pdm_link_recv */
    pthread_mutex_t load_mu;
    Pdmesh__Load load;
    /* the RegisterAck's prefix key parameters (under load_mu; pdm_link_prefix_keys) */
    uint64_t prefix_epoch;
    uint8_t prefix_salt[16];
    char prefix_model[128];
    int prefix_block_tokens;
    /* link thread only */
    int quitting;                /* signalled or refused: no more registrations */
    double next_health;
    double drain_until;          /* draining: when the grace runs out */
    int health_warned;
};

void pdm_link_params_default(pdm_link_params_t *p)
{
    memset(p, 0, sizeof(*p));
    pdmesh__capacity__init(&p->capacity);
    p->heartbeat_ms = 1000;
}

static uint64_t pdm__unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- link thread ---- */

static void pdm__link_send(pdm_link_t *l, pdm__link_router_t *rt, int type,
                           const ProtobufCMessage *m)
{
    if (pdm_wire_send(rt->dealer, NULL, 0, type, m))
        pdm_log_warn("node %s: cannot send %s to %s: %s", l->p.node_id, pdm_wire_type_name(type),
                     rt->endpoint, pdm_error_last());
}

static void pdm__link_error(pdm_link_t *l, pdm__link_router_t *rt, int code, uint64_t task_id,
                            uint32_t attempt, const char *text)
{
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.code = (Pdmesh__ErrorCode)code;
    e.message = (char *)text;
    e.task_id = task_id;
    e.attempt = attempt;
    pdm__link_send(l, rt, PDMESH__MSG_TYPE__MSG_ERROR, &e.base);
}

static int pdm__link_any_registered(const pdm_link_t *l)
{
    for (int i = 0; i < l->n_routers; i++)
        if (atomic_load(&((pdm_link_t *)l)->routers[i].registered)) return 1;
    return 0;
}

static void pdm__link_register(pdm_link_t *l, pdm__link_router_t *rt)
{
    /* An unanswered Register may still wait in the socket's queue behind a dead or cut
     * connection: a fresh connection drops it (linger 0), so that a router coming back gets
     * one registration, not one per retry (each would look like a restart of this node and
     * fail what the router just gave it). */
    if (rt->register_unanswered) {
        zmq_disconnect(rt->dealer, rt->endpoint);
        zmq_connect(rt->dealer, rt->endpoint);
    }
    rt->register_unanswered = 1;
    Pdmesh__Register r = PDMESH__REGISTER__INIT;
    Pdmesh__Capacity cap = l->p.capacity;
    uint8_t proof[32];
    uint64_t nonce;
    pdm_random_bytes(&nonce, sizeof(nonce));
    r.node_id = (char *)l->p.node_id;
    r.role = (Pdmesh__Role)l->p.role;
    r.group = (char *)(l->p.group ? l->p.group : "");
    r.rank = l->p.rank;
    r.group_size = l->p.group_size;
    r.ucx_address.data = l->addr;
    r.ucx_address.len = l->addr_len;
    r.capacity = &cap;
    r.model_id = (char *)(l->p.model_id ? l->p.model_id : "");
    r.nonce = nonce;
    r.timestamp_ms = pdm__unix_ms();
    pdm_auth_proof(l->secret, l->secret_len, l->p.node_id, nonce, r.timestamp_ms, proof);
    r.proof.data = proof;
    r.proof.len = sizeof(proof);
    r.pid = (uint32_t)getpid();
    r.generation = rt->generation;
    r.features = l->p.features;
    pdm__link_send(l, rt, PDMESH__MSG_TYPE__MSG_REGISTER, &r.base);
    rt->next_register = pdm_now() + 0.5; /* a restarted router is found within half a second */
}

static void pdm__link_heartbeat(pdm_link_t *l, pdm__link_router_t *rt)
{
    Pdmesh__Heartbeat h = PDMESH__HEARTBEAT__INIT;
    Pdmesh__Load load;
    pthread_mutex_lock(&l->load_mu);
    load = l->load;
    pthread_mutex_unlock(&l->load_mu);
    h.node_id = (char *)l->p.node_id;
    h.epoch = atomic_load(&rt->epoch);
    h.load = &load;
    h.draining = atomic_load(&l->draining) != 0;
    pdm__link_send(l, rt, PDMESH__MSG_TYPE__MSG_HEARTBEAT, &h.base);
    rt->next_heartbeat = pdm_now() + rt->hb_ms / 1000.0;
}

static void pdm__link_deregister(pdm_link_t *l)
{
    for (int i = 0; i < l->n_routers; i++) {
        pdm__link_router_t *rt = &l->routers[i];
        if (!atomic_load(&rt->registered) || !rt->dealer) continue;
        Pdmesh__Deregister d = PDMESH__DEREGISTER__INIT;
        d.node_id = (char *)l->p.node_id;
        d.epoch = atomic_load(&rt->epoch);
        pdm__link_send(l, rt, PDMESH__MSG_TYPE__MSG_DEREGISTER, &d.base);
        atomic_store(&rt->registered, 0);
    }
}

/* Rewrites the health file (common/health.h). A failure is logged once; the daemon keeps
 * serving. Registered: with at least one router. */
static void pdm__link_health(pdm_link_t *l)
{
    double now = pdm_now();
    l->next_health = now + 1.0;
    double age = now - atomic_load(&l->main_seen);
    pdm_health_t h = {.pid = (long)getpid(),
                      .written_ms = pdm__unix_ms(),
                      .main_age_ms = (uint64_t)(age > 0 ? age * 1000 : 0),
                      .registered = pdm__link_any_registered(l),
                      .epoch = atomic_load(&l->routers[0].epoch)};
    snprintf(h.node_id, sizeof(h.node_id), "%s", l->p.node_id);
    if (pdm_health_write(l->p.health_file, &h) && !l->health_warned) {
        l->health_warned = 1;
        pdm_log_warn("node %s: %s", l->p.node_id, pdm_error_last());
    }
}

/* Tells the daemon to stop (a NULL message). */
static void pdm__link_tell_stop(pdm_link_t *l)
{
    pdm__link_item_t it = {NULL, 0};
    zmq_send(l->pair_link, &it, sizeof(it), ZMQ_DONTWAIT);
}

/* Wakes the daemon (an empty message: pdm_link_recv returns with no message). */
static void pdm__link_tell_wake(pdm_link_t *l)
{
    zmq_send(l->pair_link, "", 0, ZMQ_DONTWAIT);
}

/* 1 if `type` is a message the daemon of this role takes. */
static int pdm__link_accepts(const pdm_link_t *l, int type)
{
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_STATS_REQUEST:
    case PDMESH__MSG_TYPE__MSG_CANCEL_TASK: return 1;
    case PDMESH__MSG_TYPE__MSG_GROUP_WIRE:
    case PDMESH__MSG_TYPE__MSG_PREFILL_TASK:
    case PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG: return l->p.role == PDMESH__ROLE__ROLE_PREFILL;
    case PDMESH__MSG_TYPE__MSG_DECODE_TASK:
    case PDMESH__MSG_TYPE__MSG_DECODE_START: return l->p.role == PDMESH__ROLE__ROLE_DECODE;
    default: return 0;
    }
}

/* The epoch a message is stamped with (0 when its type carries none, which is then not
 * checked), and the task it is about. */
static uint64_t pdm__msg_epoch(int type, const ProtobufCMessage *m, uint64_t *task_id,
                               uint32_t *attempt)
{
    *task_id = 0;
    *attempt = 0;
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_GROUP_WIRE: return ((const Pdmesh__GroupWire *)m)->epoch;
    case PDMESH__MSG_TYPE__MSG_STATS_REQUEST: return ((const Pdmesh__StatsRequest *)m)->epoch;
    case PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG: return ((const Pdmesh__GroupPingPong *)m)->epoch;
    case PDMESH__MSG_TYPE__MSG_PREFILL_TASK: {
        const Pdmesh__PrefillTask *t = (const Pdmesh__PrefillTask *)m;
        *task_id = t->task_id;
        *attempt = t->attempt;
        return t->epoch;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_TASK: {
        const Pdmesh__DecodeTask *t = (const Pdmesh__DecodeTask *)m;
        *task_id = t->task_id;
        *attempt = t->attempt;
        return t->epoch;
    }
    default: return 0;
    }
}

/* Router `rt` is gone for this node (lease, or it forgot the node): its tasks are orphans. */
static void pdm__link_orphan(pdm_link_t *l, pdm__link_router_t *rt)
{
    atomic_fetch_add(&rt->orphans, 1);
    pdm__link_tell_wake(l);
}

/* The link's own messages: acks and errors from router `rt`. */
static void pdm__link_on_control(pdm_link_t *l, pdm__link_router_t *rt, int type,
                                 const ProtobufCMessage *msg)
{
    if (type == PDMESH__MSG_TYPE__MSG_REGISTER_ACK) {
        const Pdmesh__RegisterAck *ack = (const Pdmesh__RegisterAck *)msg;
        pthread_mutex_lock(&l->load_mu); /* before the epoch: the daemon reads them after it */
        l->prefix_epoch = 0;
        if (ack->prefix_salt.len == sizeof(l->prefix_salt) && ack->prefix_block_tokens > 0 &&
            ack->prefix_block_tokens <= 4096 && ack->prefix_model &&
            strlen(ack->prefix_model) < sizeof(l->prefix_model)) {
            l->prefix_epoch = ack->epoch;
            memcpy(l->prefix_salt, ack->prefix_salt.data, sizeof(l->prefix_salt));
            snprintf(l->prefix_model, sizeof(l->prefix_model), "%s", ack->prefix_model);
            l->prefix_block_tokens = (int)ack->prefix_block_tokens;
        }
        pthread_mutex_unlock(&l->load_mu);
        /* A new epoch after an earlier one: the router forgot this node (it restarted, or
         * its lease of the node ran out), so whatever it gave the node before is nobody's. */
        atomic_store(&rt->router_id, ack->router_id);
        uint64_t old = atomic_exchange(&rt->epoch, ack->epoch);
        if (old != 0 && old != ack->epoch) pdm__link_orphan(l, rt);
        atomic_store(&rt->registered, 1);
        rt->register_unanswered = 0;
        l->next_health = 0; /* readiness changed: report it now */
        rt->last_ack = pdm_now();
        rt->lease_ms = ack->lease_ms >= 30 && ack->lease_ms <= 600000 ? (int)ack->lease_ms : 0;
        if (ack->heartbeat_ms >= 10 && ack->heartbeat_ms <= 60000)
            rt->hb_ms = (int)ack->heartbeat_ms;
        rt->next_heartbeat = pdm_now() + rt->hb_ms / 1000.0;
        pdm_log_info("node %s: registered with %s, epoch %llu", l->p.node_id, rt->endpoint,
                     (unsigned long long)ack->epoch);
    } else if (type == PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK) {
        if (((const Pdmesh__HeartbeatAck *)msg)->epoch != atomic_load(&rt->epoch))
            atomic_store(&rt->registered, 0), rt->next_register = 0, rt->generation++;
        else
            rt->last_ack = pdm_now();
    } else if (type == PDMESH__MSG_TYPE__MSG_ERROR) {
        const Pdmesh__Error *e = (const Pdmesh__Error *)msg;
        if (e->code == PDMESH__ERROR_CODE__ERR_UNAUTHORIZED) {
            fprintf(stderr, "node %s: the router %s refused the registration: %s\n",
                    l->p.node_id, rt->endpoint, e->message ? e->message : "");
            atomic_store(&l->exit_status, 3);
            l->quitting = 1;
            pdm__link_tell_stop(l);
            return;
        }
        if ((e->code == PDMESH__ERROR_CODE__ERR_STALE_EPOCH ||
             e->code == PDMESH__ERROR_CODE__ERR_NOT_FOUND) &&
            e->epoch && e->epoch != atomic_load(&rt->epoch)) {
            /* The refusal of a message sent before the current registration's ack came (a
             * heartbeat of the registration a restarted router never knew): it says nothing
             * of the current one. Registering again would look like a restart of this node
             * to the router, which would fail its tasks and re-wire its group. */
            pdm_log_info("node %s: router %s refused a message of epoch %llu (now %llu): "
                         "ignored", l->p.node_id, rt->endpoint, (unsigned long long)e->epoch,
                         (unsigned long long)atomic_load(&rt->epoch));
            return;
        }
        if (e->code == PDMESH__ERROR_CODE__ERR_STALE_EPOCH ||
            e->code == PDMESH__ERROR_CODE__ERR_NOT_FOUND) {
            if (atomic_load(&rt->registered)) rt->generation++;
            atomic_store(&rt->registered, 0), rt->next_register = 0;
        }
        pdm_log_warn("node %s: router %s error %d: %s", l->p.node_id, rt->endpoint, e->code,
                     e->message ? e->message : "");
    }
}

/* One frame from router `origin`: checked, then the link's own or passed to the daemon. */
static void pdm__link_on_frame(pdm_link_t *l, int origin, const void *frame, size_t len)
{
    pdm__link_router_t *rt = &l->routers[origin];
    pdm_wire_msg_t *m;
    int st = pdm_wire_unpack(frame, len, PDM_WIRE_MAX_FRAME, 0, &m);
    if (st) {
        int code = pdm_wire_refusal_code(st);
        char why[512];
        snprintf(why, sizeof(why), "%s", pdm_error_last());
        pdm_log_warn("node %s: refused a frame from %s: %s", l->p.node_id, rt->endpoint, why);
        pdm__link_error(l, rt, code, 0, 0, why);
        return;
    }
    int type = pdm_wire_type(m);
    const ProtobufCMessage *msg = pdm_wire_message(m);
    if (type == PDMESH__MSG_TYPE__MSG_REGISTER_ACK || type == PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK ||
        type == PDMESH__MSG_TYPE__MSG_ERROR) {
        pdm__link_on_control(l, rt, type, msg);
        pdm_wire_msg_free(m);
        return;
    }
    char why[256];
    uint64_t task_id;
    uint32_t attempt;
    uint64_t stamped = pdm__msg_epoch(type, msg, &task_id, &attempt);
    uint64_t epoch = atomic_load(&rt->epoch);
    pdm__link_item_t it = {m, origin};
    if (!pdm__link_accepts(l, type)) {
        snprintf(why, sizeof(why), "%s is not a message for a %s node", pdm_wire_type_name(type),
                 l->p.role == PDMESH__ROLE__ROLE_PREFILL ? "prefill" : "decode");
        pdm__link_error(l, rt, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, task_id, attempt, why);
    } else if (stamped && stamped != epoch) {
        snprintf(why, sizeof(why), "%s for epoch %llu; this node's epoch is %llu",
                 pdm_wire_type_name(type), (unsigned long long)stamped, (unsigned long long)epoch);
        pdm__link_error(l, rt, PDMESH__ERROR_CODE__ERR_STALE_EPOCH, task_id, attempt, why);
    } else if (zmq_send(l->pair_link, &it, sizeof(it), ZMQ_DONTWAIT) == (int)sizeof(it)) {
        return; /* the daemon owns it now */
    } else {
        pdm__link_error(l, rt, PDMESH__ERROR_CODE__ERR_OVERLOADED, task_id, attempt,
                        "the node's task queue is full");
    }
    pdm_wire_msg_free(m);
}

/* Frames the daemon sends: [1 byte router index][frame], forwarded to that router. */
static void pdm__link_forward(pdm_link_t *l)
{
    for (int k = 0; k < 1024; k++) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, l->pair_link, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            return;
        }
        size_t size = zmq_msg_size(&msg);
        const uint8_t *data = zmq_msg_data(&msg);
        if (size > 1 && data[0] < l->n_routers) {
            pdm__link_router_t *rt = &l->routers[data[0]];
            if (rt->dealer && zmq_send(rt->dealer, data + 1, size - 1, ZMQ_DONTWAIT) < 0)
                pdm_log_warn("node %s: a message to the router %s was dropped: %s",
                             l->p.node_id, rt->endpoint, zmq_strerror(errno));
        }
        zmq_msg_close(&msg);
    }
}

static void *pdm__link_main(void *arg)
{
    pdm_link_t *l = arg;
    const int nr = l->n_routers;
    while (!atomic_load(&l->stop)) {
        double now = pdm_now(), next = now + 1.0;
        int rereg = atomic_exchange(&l->reregister, 0);
        for (int i = 0; i < nr; i++) {
            pdm__link_router_t *rt = &l->routers[i];
            if (rereg && atomic_load(&rt->registered)) {
                atomic_store(&rt->registered, 0);
                rt->generation++;
                rt->next_register = now + 1.0;
            }
            /* The router's lease, seen from here: no ack for that long and the router is
             * gone (crashed, partitioned). Its tasks are orphans: the daemon frees them now
             * instead of finishing work nobody will read; registering again finds the next
             * instance. The other routers' work goes on. */
            const double lease = (rt->lease_ms ? rt->lease_ms : 3 * rt->hb_ms) / 1000.0;
            if (atomic_load(&rt->registered) && now - rt->last_ack > lease) {
                pdm_log_warn("node %s: no answer from the router %s for %.1f s: its tasks are "
                             "dropped", l->p.node_id, rt->endpoint, now - rt->last_ack);
                atomic_store(&rt->registered, 0);
                rt->generation++;
                rt->next_register = 0;
                l->next_health = 0;
                pdm__link_orphan(l, rt);
            }
            int reg = atomic_load(&rt->registered);
            if (!l->quitting && !reg && now >= rt->next_register) pdm__link_register(l, rt);
            if (reg && now >= rt->next_heartbeat) pdm__link_heartbeat(l, rt);
            double due = reg ? rt->next_heartbeat : rt->next_register;
            if (due < next) next = due;
        }
        if (l->p.health_file && now >= l->next_health) pdm__link_health(l);
        zmq_pollitem_t items[2 + PDM_LINK_MAX_ROUTERS];
        items[0] = (zmq_pollitem_t){l->pair_link, 0, ZMQ_POLLIN, 0};
        items[1] = (zmq_pollitem_t){NULL, l->sig_fd, ZMQ_POLLIN, 0};
        for (int i = 0; i < nr; i++)
            items[2 + i] = (zmq_pollitem_t){l->routers[i].dealer, 0, ZMQ_POLLIN, 0};
        long timeout = (long)((next - pdm_now()) * 1000) + 1;
        timeout = PDM_MAX(1, PDM_MIN(timeout, 1000));
        if (zmq_poll(items, 2 + nr, timeout) < 0) {
            if (errno == ETERM) break;
            continue;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            struct signalfd_siginfo si;
            if (read(l->sig_fd, &si, sizeof(si)) > 0 && !l->quitting) {
                if (l->p.drain_grace > 0 && pdm__link_any_registered(l) &&
                    !atomic_load(&l->draining)) {
                    /* Drain: tell the routers now (no new work), let the daemon finish. */
                    pdm_log_info("node %s: draining for up to %.0f s", l->p.node_id,
                                 l->p.drain_grace);
                    atomic_store(&l->draining, 1);
                    l->drain_until = pdm_now() + l->p.drain_grace;
                    for (int i = 0; i < nr; i++)
                        if (atomic_load(&l->routers[i].registered))
                            pdm__link_heartbeat(l, &l->routers[i]);
                    pdm__link_tell_wake(l);
                } else {
                    /* Clean shutdown: the routers learn at once (their requests move
                     * elsewhere without waiting for the lease); the daemon leaves its loop. */
                    l->quitting = 1;
                    pdm__link_deregister(l);
                    pdm__link_tell_stop(l);
                }
            }
        }
        if (atomic_load(&l->draining) && !l->quitting && pdm_now() > l->drain_until) {
            pdm_log_warn("node %s: drain grace over: stopping with work left", l->p.node_id);
            l->quitting = 1;
            pdm__link_deregister(l);
            pdm__link_tell_stop(l);
        }
        if (items[0].revents & ZMQ_POLLIN) pdm__link_forward(l);
        for (int i = 0; i < nr; i++)
            for (int k = 0; k < 1024; k++) {
                zmq_msg_t msg;
                zmq_msg_init(&msg);
                if (zmq_msg_recv(&msg, l->routers[i].dealer, ZMQ_DONTWAIT) < 0) {
                    zmq_msg_close(&msg);
                    break;
                }
                if (!l->quitting) pdm__link_on_frame(l, i, zmq_msg_data(&msg), zmq_msg_size(&msg));
                zmq_msg_close(&msg);
            }
    }
    pdm__link_forward(l); /* the daemon's last results */
    pdm__link_deregister(l);
    if (l->p.health_file) unlink(l->p.health_file); /* stopped: no longer healthy */
    int linger = 500;
    for (int i = 0; i < nr; i++) {
        zmq_setsockopt(l->routers[i].dealer, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_close(l->routers[i].dealer);
        l->routers[i].dealer = NULL;
    }
    return NULL; /* pdm_link_destroy closes the pair after draining it */
}

/* ---- daemon side ---- */

int pdm_link_create(const pdm_link_params_t *p, pdm_link_t **out)
{
    const char *list = p->endpoint_list[0] ? p->endpoint_list : p->endpoint;
    if (!list || !list[0] || !p->node_id || !p->node_id[0] || strlen(p->node_id) > 128)
        return pdm_error_set(PDM_EINVAL, "a node needs --router ENDPOINT[,ENDPOINT...] and "
                             "--node-id NAME (at most 128 characters)");
    pdm_link_t *l = calloc(1, sizeof(*l));
    if (!l) return pdm_error_set(PDM_ENOMEM, "node link: out of memory");
    l->p = *p;
    l->sig_fd = -1;
    /* Tests stand in for a node of an older version (one that registers without these
     * features) by setting PDMESH_TEST_FEATURES (a number, e.g. 0); read once, here. */
    const char *tf = getenv("PDMESH_TEST_FEATURES");
    if (tf && *tf) {
        char *end;
        errno = 0;
        const unsigned long long v = strtoull(tf, &end, 0);
        if (errno || *end) {
            free(l);
            return pdm_error_set(PDM_EINVAL, "PDMESH_TEST_FEATURES: \"%s\" is not a number", tf);
        }
        pdm_log_warn("node %s: registers with features 0x%llx (PDMESH_TEST_FEATURES), not "
                     "0x%llx", p->node_id, v, (unsigned long long)p->features);
        l->p.features = (uint64_t)v;
    }
    int st;
    for (const char *c = list; *c;) {
        size_t n = strcspn(c, ", ");
        if (n) {
            if (l->n_routers == PDM_LINK_MAX_ROUTERS || n >= sizeof(l->routers[0].endpoint)) {
                free(l);
                return pdm_error_set(PDM_EINVAL, "--router: at most %d endpoints of at most "
                                     "255 characters", PDM_LINK_MAX_ROUTERS);
            }
            pdm__link_router_t *rt = &l->routers[l->n_routers++];
            memcpy(rt->endpoint, c, n);
            rt->hb_ms = p->heartbeat_ms > 0 ? p->heartbeat_ms : 1000;
            rt->generation = 1;
        }
        c += n;
        c += strspn(c, ", ");
    }
    if (!l->n_routers) {
        free(l);
        return pdm_error_set(PDM_EINVAL, "--router: no endpoint in \"%s\"", list);
    }
    pthread_mutex_init(&l->load_mu, NULL);
    pdmesh__load__init(&l->load);
    st = pdm_auth_load_secret(p->secret_file, &l->secret, &l->secret_len);
    if (st) goto err; /* the message names the secret and its sources */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    if (pthread_sigmask(SIG_BLOCK, &sigs, NULL) ||
        (l->sig_fd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK)) < 0) {
        st = pdm_error_set(PDM_EIO, "signalfd: %s", strerror(errno));
        goto err;
    }
    if (p->exit_with_parent) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() == 1) kill(getpid(), SIGTERM); /* the parent is already gone */
    }
    l->zctx = zmq_ctx_new();
    l->pair_link = l->zctx ? zmq_socket(l->zctx, ZMQ_PAIR) : NULL;
    l->pair_main = l->zctx ? zmq_socket(l->zctx, ZMQ_PAIR) : NULL;
    for (int i = 0; i < l->n_routers && l->zctx; i++)
        if (!(l->routers[i].dealer = zmq_socket(l->zctx, ZMQ_DEALER))) break;
    if (!l->pair_link || !l->pair_main || !l->routers[l->n_routers - 1].dealer) {
        st = pdm_error_set(PDM_EIO, "zmq socket: %s", zmq_strerror(errno));
        goto err;
    }
    int zero = 0, hwm = 100000;
    int64_t maxmsg = PDM_WIRE_MAX_FRAME + 1024;
    for (int i = 0; i < l->n_routers; i++) {
        void *d = l->routers[i].dealer;
        zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof(zero));
        zmq_setsockopt(d, ZMQ_SNDHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(d, ZMQ_RCVHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(d, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    }
    for (int i = 0; i < 2; i++) {
        void *s = i ? l->pair_main : l->pair_link;
        zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
        zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    }
    snprintf(l->pair_ep, sizeof(l->pair_ep), "inproc://pdm-link-%p", (void *)l);
    if (zmq_bind(l->pair_link, l->pair_ep) || zmq_connect(l->pair_main, l->pair_ep)) {
        st = pdm_error_set(PDM_EIO, "inproc pair: %s", zmq_strerror(errno));
        goto err;
    }
    const char *csrv = p->curve_server_key_file, *ckey = p->curve_key_file;
    pdm_curve_env(&csrv, &ckey);
    for (int i = 0; i < l->n_routers; i++) {
        pdm__link_router_t *rt = &l->routers[i];
        if ((st = pdm_curve_client_setup(rt->dealer, csrv, ckey))) goto err; /* names the file */
        if (zmq_connect(rt->dealer, rt->endpoint)) {
            st = pdm_error_set(PDM_EINVAL, "cannot connect to %s: %s", rt->endpoint,
                               zmq_strerror(errno));
            goto err;
        }
    }
    *out = l;
    return PDM_OK;
err:
    pdm_link_destroy(l);
    return st;
}

int pdm_link_start(pdm_link_t *l, const void *ucx_address, size_t ucx_address_len)
{
    if (!(l->addr = malloc(ucx_address_len ? ucx_address_len : 1)))
        return pdm_error_set(PDM_ENOMEM, "node link: out of memory");
    memcpy(l->addr, ucx_address, ucx_address_len);
    l->addr_len = ucx_address_len;
    atomic_store(&l->main_seen, pdm_now());
    if (pthread_create(&l->thread, NULL, pdm__link_main, l))
        return pdm_error_set(PDM_EIO, "node link: cannot start the thread");
    l->started = 1;
    return PDM_OK;
}

int pdm_link_recv(pdm_link_t *l, int timeout_ms, pdm_wire_msg_t **out)
{
    *out = NULL;
    atomic_store(&l->main_seen, pdm_now());
    if (l->closing) return PDM_ECANCELED;
    zmq_pollitem_t pi = {l->pair_main, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&pi, 1, timeout_ms) <= 0) return PDM_OK;
    pdm__link_item_t it;
    /* an empty message is a wake-up (pdm__link_tell_wake): no message */
    if (zmq_recv(l->pair_main, &it, sizeof(it), ZMQ_DONTWAIT) != (int)sizeof(it)) return PDM_OK;
    if (!it.m) {
        l->closing = 1;
        return PDM_ECANCELED;
    }
    l->origin = it.origin;
    *out = it.m;
    return PDM_OK;
}

int pdm_link_send_to(pdm_link_t *l, int origin, int type, const ProtobufCMessage *msg)
{
    uint8_t *buf;
    size_t len;
    if (origin < 0 || origin >= l->n_routers)
        return pdm_error_set(PDM_EINVAL, "node %s: no router %d", l->p.node_id, origin);
    int st = pdm_wire_pack(type, msg, &buf, &len);
    if (st) return st;
    zmq_msg_t zm; /* [router index][frame] (pdm__link_forward) */
    if (zmq_msg_init_size(&zm, len + 1)) {
        free(buf);
        return pdm_error_set(PDM_ENOMEM, "node %s: out of memory", l->p.node_id);
    }
    ((uint8_t *)zmq_msg_data(&zm))[0] = (uint8_t)origin;
    memcpy((uint8_t *)zmq_msg_data(&zm) + 1, buf, len);
    if (zmq_msg_send(&zm, l->pair_main, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&zm);
        st = pdm_error_set(PDM_EOVERFLOW, "node %s: %s dropped: %s", l->p.node_id,
                           pdm_wire_type_name(type), zmq_strerror(errno));
    }
    free(buf);
    if (st) pdm_log_warn("%s", pdm_error_last());
    return st;
}

int pdm_link_send(pdm_link_t *l, int type, const ProtobufCMessage *msg)
{
    return pdm_link_send_to(l, l->origin, type, msg);
}

int pdm_link_send_error(pdm_link_t *l, int code, uint64_t task_id, uint32_t attempt,
                        const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.code = (Pdmesh__ErrorCode)code;
    e.message = text;
    e.task_id = task_id;
    e.attempt = attempt;
    return pdm_link_send(l, PDMESH__MSG_TYPE__MSG_ERROR, &e.base);
}

unsigned pdm_link_orphans(const pdm_link_t *l)
{
    unsigned n = 0;
    for (int i = 0; i < l->n_routers; i++) n += atomic_load(&((pdm_link_t *)l)->routers[i].orphans);
    return n;
}

unsigned pdm_link_orphans_of(const pdm_link_t *l, int origin)
{
    if (origin < 0 || origin >= l->n_routers) return 0;
    return atomic_load(&((pdm_link_t *)l)->routers[origin].orphans);
}

int pdm_link_origin(const pdm_link_t *l)
{
    return l->origin;
}

int pdm_link_n_routers(const pdm_link_t *l)
{
    return l->n_routers;
}

const char *pdm_link_router_endpoint(const pdm_link_t *l, int origin)
{
    return origin >= 0 && origin < l->n_routers ? l->routers[origin].endpoint : "";
}

int pdm_link_router_registered(const pdm_link_t *l, int origin)
{
    if (origin < 0 || origin >= l->n_routers) return 0;
    return atomic_load(&((pdm_link_t *)l)->routers[origin].registered);
}

int pdm_link_draining(const pdm_link_t *l)
{
    return atomic_load(&((pdm_link_t *)l)->draining);
}

uint64_t pdm_link_epoch(const pdm_link_t *l)
{
    return pdm_link_epoch_of(l, l->origin);
}

uint64_t pdm_link_epoch_of(const pdm_link_t *l, int origin)
{
    if (origin < 0 || origin >= l->n_routers) return 0;
    return atomic_load(&((pdm_link_t *)l)->routers[origin].epoch);
}

uint64_t pdm_link_router_id(const pdm_link_t *l, int origin)
{
    if (origin < 0 || origin >= l->n_routers) return 0;
    return atomic_load(&((pdm_link_t *)l)->routers[origin].router_id);
}

int pdm_link_origin_of_router(const pdm_link_t *l, uint64_t router_id)
{
    for (int o = 0; o < l->n_routers; o++)
        if (pdm_link_router_registered(l, o) && pdm_link_router_id(l, o) == router_id) return o;
    return -1;
}

int pdm_link_params_add_router(pdm_link_params_t *p, const char *endpoint)
{
    size_t have = strlen(p->endpoint_list), add = strlen(endpoint);
    if (have + add + 2 > sizeof(p->endpoint_list))
        return pdm_error_set(PDM_EINVAL, "--router: the list is too long");
    if (have) p->endpoint_list[have++] = ',';
    memcpy(p->endpoint_list + have, endpoint, add + 1);
    return PDM_OK;
}

uint64_t pdm_link_prefix_keys(pdm_link_t *l, pdm_prefix_key_params_t *kp, char *model,
                              size_t model_cap)
{
    pthread_mutex_lock(&l->load_mu);
    uint64_t e = l->prefix_epoch;
    if (e) {
        memcpy(kp->salt, l->prefix_salt, sizeof(kp->salt));
        snprintf(model, model_cap, "%s", l->prefix_model);
        kp->model = model;
        kp->block_tokens = l->prefix_block_tokens;
    }
    pthread_mutex_unlock(&l->load_mu);
    return e;
}

void pdm_link_set_load(pdm_link_t *l, const Pdmesh__Load *load)
{
    pthread_mutex_lock(&l->load_mu);
    l->load = *load;
    pthread_mutex_unlock(&l->load_mu);
}

static void pdm__link_wake(pdm_link_t *l)
{
    zmq_send(l->pair_main, "", 0, ZMQ_DONTWAIT);
}

void pdm_link_reregister(pdm_link_t *l)
{
    atomic_store(&l->reregister, 1);
    pdm__link_wake(l);
}

int pdm_link_exit_status(const pdm_link_t *l)
{
    return atomic_load(&((pdm_link_t *)l)->exit_status);
}

void pdm_link_destroy(pdm_link_t *l)
{
    if (!l) return;
    if (l->started) {
        atomic_store(&l->stop, 1);
        pdm__link_wake(l);
        pthread_join(l->thread, NULL);
    } else {
        for (int i = 0; i < l->n_routers; i++)
            if (l->routers[i].dealer) zmq_close(l->routers[i].dealer);
    }
    if (l->pair_main) {
        for (;;) { /* messages the daemon never took (wake-ups are empty) */
            pdm__link_item_t it;
            int got = zmq_recv(l->pair_main, &it, sizeof(it), ZMQ_DONTWAIT);
            if (got < 0) break;
            if (got == (int)sizeof(it) && it.m) pdm_wire_msg_free(it.m);
        }
        zmq_close(l->pair_main);
    }
    if (l->pair_link) zmq_close(l->pair_link);
    if (l->zctx) zmq_ctx_term(l->zctx);
    if (l->sig_fd >= 0) close(l->sig_fd);
    pthread_mutex_destroy(&l->load_mu);
    free(l->secret);
    free(l->addr);
    free(l);
}
