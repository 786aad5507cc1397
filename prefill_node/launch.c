/*
 * launch.c - the local harness: starts a prefill group of pdmesh-prefill processes (and
 * optionally a pdmesh-decode node) on this machine and drives them with the router's own
 * node protocol (proto/pdmesh.proto over ZeroMQ; the daemons cannot tell it from a router).
 *
 * The harness binds a ROUTER socket on an ipc:// endpoint in a private directory, starts the
 * daemons with --router pointing at it and a random cluster secret in their environment,
 * verifies their registrations (HMAC proof), answers heartbeats, wires the group
 * (GroupWire -> GroupReady) and then sends the same PrefillTask / DecodeTask / DecodeStart /
 * CancelTask messages as router/ does. What a task does is planned by prefill_node/plan.c,
 * the planner the router uses.
 *
 * Every wait has a deadline; a daemon that exits fails the operation that waits on it at
 * once (its death is seen by waitpid within 50 ms); stopping sends SIGTERM (the daemons
 * deregister and exit 0), waits a grace period, then SIGKILLs.
 */
#include "prefill_node/prefill.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/nodelink.h"
#include "common/pdm.h"
#include "common/wire.h"

extern char **environ;

#define PDM__GROUP "local"
#define PDM__IDENT_MAX 256

typedef struct {
    pid_t pid;
    int exited;                  /* reaped; status in `status` */
    int status;
    char node_id[32];
    uint8_t ident[PDM__IDENT_MAX]; /* ZeroMQ routing identity once registered */
    size_t ident_len;
    uint64_t epoch;              /* 0 until registered */
    uint8_t *ucx;                /* UCX worker address from the registration */
    size_t ucx_len;
    uint64_t features;           /* Register.features (PDM_FEAT_*) */
} pdm__proc_t;

/* A message a waiter did not ask for (another daemon's), kept for the next one that does. */
typedef struct pdm__held {
    struct pdm__held *next;
    int from;
    pdm_wire_msg_t *msg;
} pdm__held_t;

#define PDM__HELD_MAX 65536

struct pdm_launch {
    pdm_launch_params_t p;
    pdm__held_t *held, **held_tail;          /* FIFO of messages kept for later */
    int n_held;
    pdm__proc_t proc[PDM_KVT_MAX_RANKS + 1]; /* ranks, then the decode node if any */
    int n;                                 /* ranks */
    int n_procs;                           /* processes started */
    int has_decode;
    void *zctx, *sock;                     /* the node socket (ROUTER) */
    char dir[64];                          /* private: the socket and KV dumps */
    char endpoint[128];
    char secret[65];                       /* hex; the daemons get it as $PDMESH_SECRET */
    uint64_t next_epoch;
    uint64_t next_request;
    uint32_t next_task;
    char transports[128];
    pdm_prefill_conv_t conv;               /* mirror of the group's conversation (conv.c) */
    pdm_prefill_pool_t pool;               /* ... and of its pool of conversations (pool.h;
                                            * zeroed: empty, budget 0, no ops) */
};

void pdm_launch_params_default(pdm_launch_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->bin = "build/bin/pdmesh-prefill";
    p->model = pdm_model_default_path();
    p->ranks = 2;
    p->threads = 1;
    p->ctx_tokens = 8192;
    p->kv_dtype = "f16";
    p->timeout = 120;
    p->wrap = getenv("PDMESH_RANK_WRAP");
}

int pdm_launch_pid(const pdm_launch_t *l, int rank)
{
    return rank >= 0 && rank < l->n ? (int)l->proc[rank].pid : -1;
}

int pdm_launch_decode_pid(const pdm_launch_t *l)
{
    return l->has_decode ? (int)l->proc[l->n].pid : -1;
}

const char *pdm_launch_transports(const pdm_launch_t *l)
{
    return l->transports;
}

/* "rank N" or "the decode node" for messages. */
static const char *pdm__who(const pdm_launch_t *l, int i, char *buf, size_t size)
{
    if (i >= l->n) snprintf(buf, size, "the decode node");
    else snprintf(buf, size, "rank %d", i);
    return buf;
}

/* ---- processes ---- */

/* The daemons' environment: ours, without any secret or CURVE setting of the user's, with
 * this harness's secret. NULL-terminated, malloc'd (free with pdm__env_free). */
static char **pdm__env(const pdm_launch_t *l)
{
    size_t n = 0;
    while (environ[n]) n++;
    char **env = calloc(n + 2, sizeof(char *));
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "PDMESH_SECRET", 13) && strncmp(environ[i], "PDMESH_CURVE_", 13))
            env[k++] = environ[i];
    size_t len = strlen("PDMESH_SECRET=") + strlen(l->secret) + 1;
    if (!(env[k] = malloc(len))) {
        free(env);
        return NULL;
    }
    snprintf(env[k], len, "PDMESH_SECRET=%s", l->secret);
    env[k + 1] = NULL;
    return env;
}

static void pdm__env_free(char **env)
{
    if (!env) return;
    size_t k = 0;
    while (env[k + 1]) k++;
    free(env[k]); /* the one string of ours, last */
    free(env);
}

static int pdm__spawn_argv(pdm_launch_t *l, char *const *argv, pdm__proc_t *pr)
{
    char **env = pdm__env(l);
    if (!env) return pdm_error_set(PDM_ENOMEM, "out of memory");
    int err = posix_spawnp(&pr->pid, argv[0], NULL, NULL, argv, env);
    pdm__env_free(env);
    if (err) return pdm_error_set(-err, "cannot start %s: %s", argv[0], strerror(err));
    return PDM_OK;
}

/* The node options every daemon gets: the harness's socket, a node id, exit with us, and
 * where the KV plane listens. */
static int pdm__node_args(pdm_launch_t *l, pdm__proc_t *pr, char **argv, int a)
{
    argv[a++] = "--router";
    argv[a++] = l->endpoint;
    argv[a++] = "--node-id";
    argv[a++] = pr->node_id;
    argv[a++] = "--exit-with-parent";
    /* A local mesh keeps its KV plane on loopback, unless the caller chose the devices (the
     * environment, or a wrapper such as the namespace benchmarks' "env UCX_NET_DEVICES=..."). */
    if (!getenv("UCX_NET_DEVICES") && !(l->p.wrap && *l->p.wrap)) {
        argv[a++] = "--kv-interface";
        argv[a++] = "lo";
    }
    return a;
}

static int pdm__spawn_rank(pdm_launch_t *l, int rank)
{
    const pdm_launch_params_t *p = &l->p;
    pdm__proc_t *pr = &l->proc[rank];
    snprintf(pr->node_id, sizeof(pr->node_id), "prefill-%s/%d", PDM__GROUP, rank);
    char threads[16], cpu[16], ctx[16], timeout[32], rank_s[16], size_s[16];
    snprintf(threads, sizeof(threads), "%d", p->threads);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(cpu, sizeof(cpu), "%ld", (long)rank % (ncpu > 0 ? ncpu : 1));
    snprintf(ctx, sizeof(ctx), "%d", p->ctx_tokens);
    snprintf(timeout, sizeof(timeout), "%g", p->timeout);
    snprintf(rank_s, sizeof(rank_s), "%d", rank);
    snprintf(size_s, sizeof(size_s), "%d", p->ranks);
    /* An optional wrapper in front (network namespaces in benchmarks): words split at
     * spaces, "%d" replaced by the rank. */
    char wrap_buf[512], *argv[72];
    int a = 0;
    if (p->wrap && *p->wrap) {
        size_t o = 0;
        for (const char *c = p->wrap; *c && o + 12 < sizeof(wrap_buf); c++) {
            if (c[0] == '%' && c[1] == 'd') {
                o += (size_t)snprintf(wrap_buf + o, sizeof(wrap_buf) - o, "%d", rank);
                c++;
            } else {
                wrap_buf[o++] = *c;
            }
        }
        wrap_buf[o] = 0;
        char *save = NULL;
        for (char *w = strtok_r(wrap_buf, " ", &save); w && a < 40; w = strtok_r(NULL, " ", &save))
            argv[a++] = w;
    }
    argv[a++] = (char *)p->bin;
    a = pdm__node_args(l, pr, argv, a);
    char *rest[] = {"--group", PDM__GROUP, "--rank", rank_s, "--group-size", size_s,
                    "--dump-dir", l->dir, "--model", (char *)p->model, "--threads", threads,
                    "--ctx", ctx, "--kv-dtype", (char *)p->kv_dtype, "--timeout", timeout};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(rest); i++) argv[a++] = rest[i];
    if (p->pin) {
        argv[a++] = "--cpu";
        argv[a++] = cpu;
    }
    argv[a] = NULL;
    return pdm__spawn_argv(l, argv, pr);
}

static int pdm__spawn_decode(pdm_launch_t *l)
{
    const pdm_launch_params_t *p = &l->p;
    pdm__proc_t *pr = &l->proc[l->n];
    snprintf(pr->node_id, sizeof(pr->node_id), "decode-%s", PDM__GROUP);
    char threads[16], batch[16], budget[32];
    snprintf(threads, sizeof(threads), "%d", p->decode_threads > 0 ? p->decode_threads : 1);
    snprintf(batch, sizeof(batch), "%d", p->decode_batch > 0 ? p->decode_batch : 16);
    snprintf(budget, sizeof(budget), "%ld", p->decode_kv_budget > 0 ? p->decode_kv_budget : 1L << 18);
    char *argv[32] = {(char *)p->decode_bin};
    int a = pdm__node_args(l, pr, argv, 1);
    char *rest[] = {"--model", (char *)p->model, "--threads", threads, "--batch", batch,
                    "--kv-budget", budget, "--kv-dtype",
                    (char *)(p->decode_kv_dtype ? p->decode_kv_dtype : p->kv_dtype)};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(rest); i++) argv[a++] = rest[i];
    if (p->decode_kv_fast_budget) {
        argv[a++] = "--kv-fast-budget";
        argv[a++] = (char *)p->decode_kv_fast_budget;
    }
    if (p->decode_kv_slow_tier) {
        argv[a++] = "--kv-slow-tier";
        argv[a++] = (char *)p->decode_kv_slow_tier;
    }
    if (p->decode_kv_window) {
        argv[a++] = "--kv-window";
        argv[a++] = (char *)p->decode_kv_window;
    }
    argv[a] = NULL;
    return pdm__spawn_argv(l, argv, pr);
}

/* Reaps the daemons that exited. */
static void pdm__reap(pdm_launch_t *l)
{
    for (int i = 0; i < l->n_procs; i++) {
        pdm__proc_t *pr = &l->proc[i];
        if (pr->exited) continue;
        if (waitpid(pr->pid, &pr->status, WNOHANG) == pr->pid) pr->exited = 1;
    }
}

/* PDM_EPEER naming the first watched daemon that exited (ranks: 0..n-1; decode: n). */
static int pdm__check_alive(pdm_launch_t *l, int ranks, int decode)
{
    pdm__reap(l);
    for (int i = 0; i < l->n_procs; i++) {
        if (!l->proc[i].exited || (i < l->n ? !ranks : !decode)) continue;
        char who[32];
        return pdm_error_set(PDM_EPEER, "%s exited", pdm__who(l, i, who, sizeof(who)));
    }
    return PDM_OK;
}

/* ---- the node socket ---- */

static int pdm__send(pdm_launch_t *l, int i, int type, const ProtobufCMessage *m)
{
    pdm__proc_t *pr = &l->proc[i];
    char who[32];
    if (!pr->epoch)
        return pdm_error_set(PDM_ESTATE, "%s is not registered", pdm__who(l, i, who, sizeof(who)));
    int st = pdm_wire_send(l->sock, pr->ident, pr->ident_len, type, m);
    if (st) return pdm_error_set(st, "%s: %s", pdm__who(l, i, who, sizeof(who)), pdm_error_last());
    return PDM_OK;
}

static void pdm__on_register(pdm_launch_t *l, const uint8_t *ident, size_t ident_len,
                           const Pdmesh__Register *r)
{
    int i = -1;
    for (int k = 0; k < l->n_procs && i < 0; k++)
        if (r->node_id && !strcmp(r->node_id, l->proc[k].node_id)) i = k;
    if (i < 0 || !pdm_auth_verify(l->secret, strlen(l->secret), r->node_id, r->nonce,
                                  r->timestamp_ms, r->proof.data, r->proof.len)) {
        pdm_wire_send_error(l->sock, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNAUTHORIZED, 0,
                            "register: not a node of this harness");
        return;
    }
    pdm__proc_t *pr = &l->proc[i];
    uint8_t *ucx = malloc(r->ucx_address.len ? r->ucx_address.len : 1);
    if (!ucx) return;
    memcpy(ucx, r->ucx_address.data, r->ucx_address.len);
    free(pr->ucx);
    pr->ucx = ucx;
    pr->ucx_len = r->ucx_address.len;
    pr->features = r->features;
    memcpy(pr->ident, ident, ident_len);
    pr->ident_len = ident_len;
    pr->epoch = ++l->next_epoch;
    Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
    ack.epoch = pr->epoch;
    ack.heartbeat_ms = 1000;
    ack.lease_ms = 0; /* the harness keeps no leases: it watches its children */
    pdm_wire_send(l->sock, ident, ident_len, PDMESH__MSG_TYPE__MSG_REGISTER_ACK, &ack.base);
}

/* The daemon a frame came from (-1: none registered with this identity). */
static int pdm__sender(const pdm_launch_t *l, const uint8_t *ident, size_t ident_len)
{
    for (int i = 0; i < l->n_procs; i++)
        if (l->proc[i].epoch && l->proc[i].ident_len == ident_len &&
            !memcmp(l->proc[i].ident, ident, ident_len))
            return i;
    return -1;
}

/* 1 if the caller asked for messages of daemon i (ranks: 0..n-1; decode: n). */
static int pdm__wanted(const pdm_launch_t *l, int i, int ranks, int decode)
{
    return i < l->n ? ranks : decode;
}

static void pdm__hold(pdm_launch_t *l, int from, pdm_wire_msg_t *m)
{
    pdm__held_t *h = malloc(sizeof(*h));
    if (!h || l->n_held >= PDM__HELD_MAX) {
        pdm_log_warn("harness: dropped a %s nobody waited for", pdm_wire_type_name(pdm_wire_type(m)));
        free(h);
        pdm_wire_msg_free(m);
        return;
    }
    *h = (pdm__held_t){.from = from, .msg = m};
    if (!l->held) l->held_tail = &l->held;
    *l->held_tail = h;
    l->held_tail = &h->next;
    l->n_held++;
}

/* The oldest kept message of a daemon the caller asked for (NULL: none). */
static pdm_wire_msg_t *pdm__take_held(pdm_launch_t *l, int ranks, int decode, int *from)
{
    for (pdm__held_t **pp = &l->held; *pp; pp = &(*pp)->next) {
        pdm__held_t *h = *pp;
        if (!pdm__wanted(l, h->from, ranks, decode)) continue;
        *pp = h->next;
        if (!*pp) l->held_tail = pp;
        l->n_held--;
        pdm_wire_msg_t *m = h->msg;
        *from = h->from;
        free(h);
        return m;
    }
    return NULL;
}

/* The next message of the daemons the caller waits on (ranks, decode), before `deadline`:
 * registrations and heartbeats are answered here, other daemons' messages kept for their
 * waiter. Returns 1 with *from and *out (free with pdm_wire_msg_free; NULL after a
 * registration, which the caller may be waiting for), 0 when the deadline passed, or an
 * error: a daemon waited on exited. */
static int pdm__recv(pdm_launch_t *l, double deadline, int ranks, int decode, int *from,
                   pdm_wire_msg_t **out)
{
    if ((*out = pdm__take_held(l, ranks, decode, from))) return 1;
    for (;;) {
        int st = pdm__check_alive(l, ranks, decode);
        if (st) return st;
        double left = deadline - pdm_now();
        if (left <= 0) return 0;
        zmq_pollitem_t it = {l->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, (long)PDM_MIN(left * 1000 + 1, 50)) <= 0) continue;
        uint8_t ident[PDM__IDENT_MAX];
        int il = zmq_recv(l->sock, ident, sizeof(ident), ZMQ_DONTWAIT);
        if (il < 0) continue;
        zmq_msg_t frame;
        zmq_msg_init(&frame);
        int more = 0;
        size_t ms = sizeof(more);
        zmq_getsockopt(l->sock, ZMQ_RCVMORE, &more, &ms);
        if (!more || zmq_msg_recv(&frame, l->sock, ZMQ_DONTWAIT) < 0 || il > PDM__IDENT_MAX) {
            zmq_msg_close(&frame);
            continue;
        }
        pdm_wire_msg_t *m;
        st = pdm_wire_unpack_or_reply(l->sock, ident, (size_t)il, zmq_msg_data(&frame),
                                      zmq_msg_size(&frame), PDM_WIRE_MAX_FRAME, &m);
        zmq_msg_close(&frame);
        if (st) {
            pdm_log_warn("harness: a node sent a frame it cannot take: %s", pdm_error_last());
            continue;
        }
        int type = pdm_wire_type(m);
        const ProtobufCMessage *msg = pdm_wire_message(m);
        int i = pdm__sender(l, ident, (size_t)il);
        if (type == PDMESH__MSG_TYPE__MSG_REGISTER) {
            pdm__on_register(l, ident, (size_t)il, (const Pdmesh__Register *)msg);
            pdm_wire_msg_free(m);
            *from = -1;
            *out = NULL; /* the caller may be waiting for it */
            return 1;
        } else if (i < 0) {
            pdm_wire_send_error(l->sock, ident, (size_t)il, PDMESH__ERROR_CODE__ERR_NOT_FOUND, 0,
                                "%s from a node that is not registered", pdm_wire_type_name(type));
        } else if (type == PDMESH__MSG_TYPE__MSG_HEARTBEAT) {
            Pdmesh__HeartbeatAck ack = PDMESH__HEARTBEAT_ACK__INIT;
            ack.epoch = l->proc[i].epoch;
            pdm_wire_send(l->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK,
                          &ack.base);
        } else if (type == PDMESH__MSG_TYPE__MSG_DEREGISTER) {
            l->proc[i].epoch = 0;
        } else if (!pdm__wanted(l, i, ranks, decode)) {
            pdm__hold(l, i, m);
            continue;
        } else {
            *from = i;
            *out = m;
            return 1;
        }
        pdm_wire_msg_free(m);
    }
}

/* An Error a daemon sent about task `task_id` (0: about no task, e.g. a refused frame). */
static int pdm__error_for(const pdm_wire_msg_t *m, uint64_t task_id, const Pdmesh__Error **e)
{
    if (pdm_wire_type(m) != PDMESH__MSG_TYPE__MSG_ERROR) return 0;
    *e = (const Pdmesh__Error *)pdm_wire_message(m);
    return (*e)->task_id == task_id || (*e)->task_id == 0;
}

static const char *pdm__err_text(const Pdmesh__Error *e)
{
    return e && e->message && e->message[0] ? e->message : "failed";
}

/* ---- start and stop ---- */

static void pdm__remove_dir(pdm_launch_t *l)
{
    if (!l->dir[0]) return;
    char path[128];
    snprintf(path, sizeof(path), "%s/node", l->dir);
    unlink(path);
    for (uint32_t t = 0; t < l->next_task; t++) { /* KV dumps not taken */
        snprintf(path, sizeof(path), "%s/kv-%u.bin", l->dir, t);
        unlink(path);
    }
    rmdir(l->dir);
}

int pdm_launch_finish(pdm_launch_t *l)
{
    if (!l) return PDM_OK;
    pdm__reap(l);
    for (int i = 0; i < l->n_procs; i++)
        if (!l->proc[i].exited) kill(l->proc[i].pid, SIGTERM);
    double until = pdm_now() + 5.0;
    int bad = 0;
    char msg[256] = "";
    for (int i = 0; i < l->n_procs; i++) {
        pdm__proc_t *pr = &l->proc[i];
        int killed = 0;
        while (!pr->exited) {
            if (waitpid(pr->pid, &pr->status, WNOHANG) == pr->pid) {
                pr->exited = 1;
            } else if (pdm_now() > until) {
                kill(pr->pid, SIGKILL);
                waitpid(pr->pid, &pr->status, 0);
                pr->exited = killed = 1;
            } else {
                usleep(2000);
            }
        }
        /* A clean stop is exit status 0; anything else (a crash, LeakSanitizer's exit code,
         * a process that had to be killed) is reported. */
        if (killed || !WIFEXITED(pr->status) || WEXITSTATUS(pr->status) != 0) {
            char who[32];
            if (!bad)
                snprintf(msg, sizeof(msg), "%s %s", pdm__who(l, i, who, sizeof(who)),
                         killed ? "did not stop" : WIFSIGNALED(pr->status) ? "was killed by a signal"
                                                                           : "exited with an error");
            bad++;
        }
        free(pr->ucx);
    }
    for (pdm__held_t *h = l->held, *next; h; h = next) {
        next = h->next;
        pdm_wire_msg_free(h->msg);
        free(h);
    }
    if (l->sock) zmq_close(l->sock);
    if (l->zctx) zmq_ctx_term(l->zctx);
    pdm__remove_dir(l);
    pdm_prefill_conv_free(&l->conv);
    pdm_prefill_pool_fini(&l->pool);
    free(l);
    if (bad) return pdm_error_set(PDM_EPEER, "%d process(es) did not end cleanly: %s", bad, msg);
    return PDM_OK;
}

void pdm_launch_stop(pdm_launch_t *l)
{
    pdm_launch_finish(l);
}

static int pdm__open_socket(pdm_launch_t *l)
{
    snprintf(l->dir, sizeof(l->dir), "/tmp/pdm-launch-XXXXXX");
    if (!mkdtemp(l->dir)) {
        l->dir[0] = 0;
        return pdm_error_set(-errno, "mkdtemp: %s", strerror(errno));
    }
    snprintf(l->endpoint, sizeof(l->endpoint), "ipc://%s/node", l->dir);
    uint8_t raw[32];
    if (pdm_random_bytes(raw, sizeof(raw))) return pdm_error_set(PDM_EIO, "no random bytes");
    char *hex = pdm_hex_encode(raw, sizeof(raw));
    if (!hex) return pdm_error_set(PDM_ENOMEM, "out of memory");
    snprintf(l->secret, sizeof(l->secret), "%s", hex);
    free(hex);
    l->zctx = zmq_ctx_new();
    l->sock = l->zctx ? zmq_socket(l->zctx, ZMQ_ROUTER) : NULL;
    if (!l->sock) return pdm_error_set(PDM_EIO, "zmq socket: %s", zmq_strerror(errno));
    int zero = 0, one = 1, hwm = 100000;
    int64_t maxmsg = PDM_WIRE_MAX_FRAME + 1024;
    zmq_setsockopt(l->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(l->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(l->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(l->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(l->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    if (zmq_bind(l->sock, l->endpoint))
        return pdm_error_set(PDM_EIO, "cannot bind %s: %s", l->endpoint, zmq_strerror(errno));
    return PDM_OK;
}

/* Waits until every daemon registered. */
static int pdm__wait_registered(pdm_launch_t *l, double deadline)
{
    for (;;) {
        int missing = -1;
        for (int i = 0; i < l->n_procs && missing < 0; i++)
            if (!l->proc[i].epoch) missing = i;
        if (missing < 0) return PDM_OK;
        int from;
        pdm_wire_msg_t *m;
        int st = pdm__recv(l, deadline, 1, 1, &from, &m);
        if (st < 0) return st;
        char who[32];
        if (st == 0)
            return pdm_error_set(PDM_ETIMEOUT, "%s did not register in time",
                                 pdm__who(l, missing, who, sizeof(who)));
        pdm_wire_msg_free(m); /* nothing else is expected yet (NULL: a registration) */
    }
}

/* GroupWire to every rank, then every rank's GroupReady. */
static int pdm__wire_group(pdm_launch_t *l, double deadline)
{
    ProtobufCBinaryData addrs[PDM_KVT_MAX_RANKS];
    for (int i = 0; i < l->n; i++) {
        addrs[i].data = l->proc[i].ucx;
        addrs[i].len = l->proc[i].ucx_len;
    }
    int st = PDM_OK;
    /* the router's rule (GroupWire.ordered): ordered only if every rank has the feature */
    int ordered = 1;
    for (int i = 0; i < l->n; i++) ordered &= (l->proc[i].features & PDM_FEAT_ORDERED_GROUP) != 0;
    for (int i = 0; i < l->n && !st; i++) {
        Pdmesh__GroupWire w = PDMESH__GROUP_WIRE__INIT;
        w.ordered = ordered;
        w.epoch = l->proc[i].epoch;
        w.group = PDM__GROUP;
        w.rank = (uint32_t)i;
        w.size = (uint32_t)l->n;
        w.ucx_addresses = addrs;
        w.n_ucx_addresses = (size_t)l->n;
        st = pdm__send(l, i, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base);
    }
    int ready[PDM_KVT_MAX_RANKS] = {0}, remaining = l->n;
    while (!st && remaining > 0) {
        int from;
        pdm_wire_msg_t *m;
        int got = pdm__recv(l, deadline, 1, 1, &from, &m);
        if (got < 0) return got;
        if (got == 0) return pdm_error_set(PDM_ETIMEOUT, "the group did not form in time");
        if (!m) continue;
        char who[32];
        const Pdmesh__Error *e;
        if (from < l->n && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_GROUP_READY && !ready[from]) {
            const Pdmesh__GroupReady *g = (const Pdmesh__GroupReady *)pdm_wire_message(m);
            if (!g->ok)
                st = pdm_error_set(PDM_EPEER, "%s: %s", pdm__who(l, from, who, sizeof(who)),
                                   pdm__err_text(g->error));
            if (from == 0 && g->transports)
                snprintf(l->transports, sizeof(l->transports), "%s", g->transports);
            ready[from] = 1;
            remaining--;
        } else if (pdm__error_for(m, 0, &e)) {
            st = pdm_error_set(PDM_EPEER, "%s: %s", pdm__who(l, from, who, sizeof(who)),
                               pdm__err_text(e));
        }
        pdm_wire_msg_free(m);
    }
    return st;
}

int pdm_launch_start(const pdm_launch_params_t *p, pdm_launch_t **out)
{
    if (p->ranks < 1 || p->ranks > PDM_KVT_MAX_RANKS)
        return pdm_error_set(PDM_EINVAL, "--ranks must be 1..%d", PDM_KVT_MAX_RANKS);
    pdm_launch_t *l = calloc(1, sizeof(*l));
    if (!l) return pdm_error_set(PDM_ENOMEM, "out of memory");
    l->p = *p;
    l->next_task = 1;
    int st = pdm__open_socket(l);
    for (int i = 0; i < p->ranks && !st; i++) {
        st = pdm__spawn_rank(l, i);
        if (!st) l->n_procs = ++l->n;
    }
    if (!st && p->decode_bin) {
        st = pdm__spawn_decode(l);
        if (!st) {
            l->n_procs++;
            l->has_decode = 1;
        }
    }
    double deadline = pdm_now() + p->timeout;
    if (!st) st = pdm__wait_registered(l, deadline);
    if (!st) st = pdm__wire_group(l, deadline);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        pdm_launch_stop(l);
        return pdm_error_set(st, "starting the prefill group: %s", msg);
    }
    *out = l;
    return PDM_OK;
}

/* ---- prefill tasks ---- */

/* Moves the ranks' KV dump to `to` (a copy when it is on another file system). */
static int pdm__take_dump(const char *from, const char *to)
{
    if (!rename(from, to)) return PDM_OK;
    if (errno != EXDEV) return pdm_error_set(PDM_EIO, "%s: %s", to, strerror(errno));
    FILE *in = fopen(from, "rb"), *o = in ? fopen(to, "wb") : NULL;
    int st = PDM_OK;
    char buf[1 << 16];
    size_t got;
    while (o && (got = fread(buf, 1, sizeof(buf), in)) > 0)
        if (fwrite(buf, 1, got, o) != got) st = PDM_EIO;
    if (!o || ferror(in) || (o && fclose(o))) st = PDM_EIO;
    if (in) fclose(in);
    unlink(from);
    return st ? pdm_error_set(st, "%s: cannot write the KV file", to) : PDM_OK;
}

static int pdm__write_logits(const char *path, const float *logits, size_t n)
{
    FILE *f = fopen(path, "wb");
    int st = !f || fwrite(logits, sizeof(float), n, f) != n;
    if (f && fclose(f)) st = 1;
    return st ? pdm_error_set(PDM_EIO, "%s: cannot write logits", path) : PDM_OK;
}

int pdm_launch_task(pdm_launch_t *l, const pdm_prefill_task_t *task, const char *kv_out,
                    const char *logits_out, pdm_launch_result_t *res)
{
    memset(res, 0, sizeof(*res));
    res->owner = -1;
    res->first_token = -1;
    const uint32_t task_id = task->id ? task->id : l->next_task;
    l->next_task = PDM_MAX(l->next_task, task_id + 1);
    char dump_name[32], dump_path[128];
    snprintf(dump_name, sizeof(dump_name), "kv-%u.bin", task_id);
    snprintf(dump_path, sizeof(dump_path), "%s/%s", l->dir, dump_name);
    unlink(dump_path); /* the ranks create it afresh */
    uint32_t chunks[PDM_KVT_MAX_RANKS];
    if (task->chunks)
        for (int i = 0; i < l->n; i++) chunks[i] = (uint32_t)task->chunks[i];
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    t.task_id = task_id;
    t.method = (char *)pdm_prefill_method_name(task->method);
    t.tokens = (int32_t *)task->tokens;
    t.n_tokens = (size_t)task->n_tokens;
    t.start = (uint32_t)task->start;
    if (task->prefix && task->start > 0) {
        t.prefix = (int32_t *)task->prefix;
        t.n_prefix = (size_t)task->start;
    }
    t.pool_source = task->pool_source;
    t.pool_tokens = task->pool_tokens > 0 ? (uint64_t)task->pool_tokens : 0;
    t.pool_reset = task->pool_reset;
    if (task->chunks) {
        t.chunks = chunks;
        t.n_chunks = (size_t)l->n;
    }
    if (task->stream) {
        if (!l->has_decode) return pdm_error_set(PDM_ESTATE, "the mesh has no decode node");
        t.decode_address.data = l->proc[l->n].ucx;
        t.decode_address.len = l->proc[l->n].ucx_len;
        t.decode_node = l->proc[l->n].node_id;
        t.stream_window = (uint32_t)task->stream->max_in_flight;
        if (task->stream->key) {
            t.kv_key.data = (uint8_t *)task->stream->key;
            t.kv_key.len = PDM_KVT_KEY_BYTES;
        }
    }
    t.top_logits = 16;
    t.want_logits = logits_out != NULL;
    if (task->prompt_logprobs) {
        t.prompt_logprobs = 1;
        t.prompt_top_logprobs = (uint32_t)task->prompt_top;
        if (!(res->prompt_logprobs = malloc(sizeof(float) * (size_t)task->n_tokens)))
            return pdm_error_set(PDM_ENOMEM, "out of memory");
        for (int32_t i = 0; i < task->n_tokens; i++) res->prompt_logprobs[i] = NAN;
    }
    t.kv_dump = kv_out ? dump_name : "";
    t.deadline_ms = (uint32_t)(l->p.timeout * 1000);
    double t0 = pdm_now(), deadline = t0 + l->p.timeout;
    /* to every rank: rank 0 forwards it to the others in the group's order, and their
     * copies tell them work is still to come (main.c) */
    int st = PDM_OK;
    for (int i = 0; i < l->n && !st; i++) {
        t.epoch = l->proc[i].epoch;
        st = pdm__send(l, i, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    }
    if (st) return st;

    /* Collect results as they come (any order), so the owner's arrival time is its own. */
    int done[PDM_KVT_MAX_RANKS] = {0}, remaining = l->n, first_err = PDM_OK;
    char err_msg[512] = "";
    while (remaining > 0 && !st) {
        int from;
        pdm_wire_msg_t *m;
        int got = pdm__recv(l, deadline, 1, 0, &from, &m);
        if (got < 0) {
            st = got;
            break;
        }
        if (got == 0) {
            st = pdm_error_set(PDM_ETIMEOUT, "prefill task: ranks did not finish in %.0f s",
                               l->p.timeout);
            break;
        }
        if (!m) continue;
        char who[32];
        const Pdmesh__Error *e;
        if (from < l->n && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_PREFILL_RESULT) {
            const Pdmesh__PrefillResult *r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
            if (r->task_id == task_id && !done[from]) { /* else a late answer to a task given up */
                done[from] = 1;
                remaining--;
                if (!r->ok && !first_err) {
                    first_err = PDM_EPEER;
                    snprintf(err_msg, sizeof(err_msg), "%s: %s", pdm__who(l, from, who, sizeof(who)),
                             pdm__err_text(r->error));
                } else if (r->ok) {
                    res->rank[from].n_local = (int)r->n_local;
                    res->rank[from].t_total = r->seconds;
                    res->rank[from].t_compute = r->t_compute;
                    res->rank[from].t_wait = r->t_wait;
                    res->rank[from].bytes_sent = (double)r->bytes_sent;
                    res->rank[from].bytes_received = (double)r->bytes_received;
                    for (size_t j = 0; res->prompt_logprobs && j < r->n_prompt_positions &&
                                       j < r->n_prompt_logprobs; j++) {
                        /* positions are absolute: index into this task's tokens */
                        int64_t at = (int64_t)r->prompt_positions[j] - task->start;
                        if (at >= 0 && at < task->n_tokens)
                            res->prompt_logprobs[at] = r->prompt_logprobs[j]->logprob;
                    }
                    if (kv_out && !r->kv_dumped && !first_err) {
                        first_err = PDM_EPEER;
                        snprintf(err_msg, sizeof(err_msg), "%s wrote no KV dump",
                                 pdm__who(l, from, who, sizeof(who)));
                    }
                }
                if (r->ok && r->owner) {
                    res->owner = from;
                    res->ttft = pdm_now() - t0;
                    res->first_token = r->first_token;
                    size_t k = PDM_MIN(PDM_MIN(r->n_top_ids, r->n_top_logits), 16u);
                    for (size_t j = 0; j < k; j++) {
                        res->top_ids[j] = r->top_ids[j];
                        res->top_logits[j] = r->top_logits[j];
                    }
                    res->n_top = (int)k;
                    if (logits_out && !first_err &&
                        (r->n_logits == 0 || pdm__write_logits(logits_out, r->logits, r->n_logits))) {
                        first_err = PDM_EIO;
                        snprintf(err_msg, sizeof(err_msg), "%s", r->n_logits ? pdm_error_last()
                                 : "the owner rank returned no logits");
                    }
                }
            }
        } else if (pdm__error_for(m, task_id, &e) && from < l->n && !done[from]) {
            /* the rank refused the message itself (stale epoch, bad frame): no result comes */
            done[from] = 1;
            remaining--;
            if (!first_err) {
                first_err = PDM_EPEER;
                snprintf(err_msg, sizeof(err_msg), "%s: %s", pdm__who(l, from, who, sizeof(who)),
                         pdm__err_text(e));
            }
        }
        pdm_wire_msg_free(m);
    }
    if (!st && !first_err && kv_out && pdm__take_dump(dump_path, kv_out)) {
        first_err = PDM_EIO;
        snprintf(err_msg, sizeof(err_msg), "%s", pdm_error_last());
    }
    if (!first_err && !st && res->owner < 0)
        st = pdm_error_set(PDM_EPEER, "prefill task: no rank reported the first token");
    if (!first_err && !st) { /* the mirror follows the ranks (pool.h, then conv.h) */
        if (task->pool_reset) {
            pdm_prefill_pool_clear(&l->pool);
            pdm_prefill_conv_reset(&l->conv);
        }
        int loaded;
        if (pdm_prefill_pool_begin(&l->pool, &l->conv, task->pool_source, task->start, &loaded))
            pdm_prefill_pool_clear(&l->pool);
        pdm_prefill_pool_set_budget(&l->pool, task->pool_tokens);
        pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
        int n_prefix, nr = pdm_prefill_conv_plan(&l->conv, task->method, l->n, task->start,
                                                 task->n_tokens, task->chunks, 0, plan,
                                                 &n_prefix);
        if (nr < 0 || pdm_prefill_conv_commit(&l->conv, task->method, l->n, task->start,
                                              task->tokens, task->n_tokens, plan, nr))
            pdm_prefill_conv_reset(&l->conv); /* out of step: a smaller view is always safe */
    }
    if (first_err || st) {
        pdm_prefill_conv_reset(&l->conv);
        pdm_prefill_pool_clear(&l->pool);
    }
    if (first_err) return pdm_error_set(first_err, "%s", err_msg);
    return st;
}

int pdm_launch_pingpong(pdm_launch_t *l, size_t bytes, int iters, double *seconds)
{
    if (l->n < 2) return pdm_error_set(PDM_EINVAL, "pingpong needs two ranks");
    Pdmesh__GroupPingPong p = PDMESH__GROUP_PING_PONG__INIT;
    p.bytes = bytes;
    p.iters = (uint32_t)iters;
    int st = PDM_OK;
    for (int i = 0; i < l->n && !st; i++) {
        p.epoch = l->proc[i].epoch;
        st = pdm__send(l, i, PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG, &p.base);
    }
    double deadline = pdm_now() + l->p.timeout;
    int remaining = l->n, done[PDM_KVT_MAX_RANKS] = {0};
    while (!st && remaining > 0) {
        int from;
        pdm_wire_msg_t *m;
        int got = pdm__recv(l, deadline, 1, 0, &from, &m);
        if (got <= 0) return got ? got : pdm_error_set(PDM_ETIMEOUT, "pingpong: no answer in time");
        if (!m) continue;
        if (from < l->n && !done[from] &&
            pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG_RESULT) {
            const Pdmesh__GroupPingPongResult *r =
                (const Pdmesh__GroupPingPongResult *)pdm_wire_message(m);
            char who[32];
            if (!r->ok)
                st = pdm_error_set(PDM_EPEER, "%s: %s", pdm__who(l, from, who, sizeof(who)),
                                   pdm__err_text(r->error));
            if (from == 0) *seconds = r->seconds;
            done[from] = 1;
            remaining--;
        }
        pdm_wire_msg_free(m);
    }
    return st;
}

/* ---- Disaggregated runs ------------------------------------------------------------------- */

void pdm_launch_response_free(pdm_launch_response_t *r)
{
    free(r->tokens);
    free(r->text);
    free(r->beam_json);
    free(r->offload_json);
    memset(r, 0, sizeof(*r));
}

typedef struct {
    pdm_launch_t *l;
    pdm_launch_response_t *out;
    int n;
    uint64_t first_id;
    int *state;     /* 0 not started, 1 generating, 2 finished */
    double *t0;     /* dispatch time of each request */
} pdm__gen_t;

/* The text of `j` (malloc'd; NULL when out of memory); frees `j`. */
static char *pdm__json_take(cJSON *j)
{
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    return s;
}

/* The beam search's report as the CLI prints it: {"n_best":[...],"beam":{...}}. */
static char *pdm__beam_json(const Pdmesh__DecodeResult *d)
{
    cJSON *j = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(j, "n_best");
    for (size_t h = 0; h < d->n_beams; h++) {
        const Pdmesh__Beam *b = d->beams[h];
        cJSON *e = cJSON_CreateObject();
        cJSON *toks = cJSON_AddArrayToObject(e, "tokens");
        for (size_t k = 0; k < b->n_tokens; k++)
            cJSON_AddItemToArray(toks, cJSON_CreateNumber(b->tokens[k]));
        cJSON_AddStringToObject(e, "text", b->text ? b->text : "");
        cJSON_AddNumberToObject(e, "score", b->score);
        cJSON_AddNumberToObject(e, "logprob", b->logprob);
        cJSON_AddBoolToObject(e, "eos", b->finish == PDMESH__FINISH_REASON__FINISH_EOS);
        cJSON_AddItemToArray(list, e);
    }
    const Pdmesh__BeamReport *r = d->beam_report;
    if (r) {
        cJSON *b = cJSON_AddObjectToObject(j, "beam");
        cJSON_AddNumberToObject(b, "width", r->width);
        cJSON_AddNumberToObject(b, "length_penalty", r->length_penalty);
        cJSON_AddStringToObject(b, "early_stopping", r->early_stopping ? r->early_stopping : "");
        cJSON_AddNumberToObject(b, "n_prompt", r->n_prompt);
        cJSON_AddNumberToObject(b, "n_response", r->n_response);
        cJSON_AddNumberToObject(b, "kv_prompt_bytes", (double)r->kv_prompt_bytes);
        cJSON_AddNumberToObject(b, "kv_response_bytes", (double)r->kv_response_bytes);
        cJSON_AddNumberToObject(b, "kv_bytes_eq2", (double)r->kv_bytes_eq2);
        cJSON_AddNumberToObject(b, "kv_bytes_eq3", (double)r->kv_bytes_eq3);
    }
    return pdm__json_take(j);
}

/* The decode node's head-wise offload report as the CLI prints it. */
static char *pdm__offload_json(const Pdmesh__OffloadStats *o)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "fast_budget", (double)o->fast_budget);
    cJSON_AddNumberToObject(j, "fast_bytes", (double)o->fast_bytes);
    cJSON_AddNumberToObject(j, "fast_peak", (double)o->fast_peak);
    cJSON_AddStringToObject(j, "slow_tier", o->slow_tier ? o->slow_tier : "ram");
    cJSON_AddNumberToObject(j, "slow_bytes", (double)o->slow_bytes);
    cJSON_AddNumberToObject(j, "slow_peak", (double)o->slow_peak);
    cJSON_AddNumberToObject(j, "resident_heads", o->resident_heads);
    cJSON_AddNumberToObject(j, "offloaded_heads", o->offloaded_heads);
    cJSON_AddNumberToObject(j, "group", o->group);
    cJSON_AddNumberToObject(j, "prefetches", (double)o->prefetches);
    cJSON_AddNumberToObject(j, "prefetch_bytes", (double)o->prefetch_bytes);
    cJSON_AddNumberToObject(j, "writeback_bytes", (double)o->writeback_bytes);
    cJSON_AddNumberToObject(j, "prefetch_waits", (double)o->prefetch_waits);
    cJSON_AddNumberToObject(j, "wait_seconds", o->wait_seconds);
    return pdm__json_take(j);
}

static const char *pdm__finish_name(Pdmesh__FinishReason f)
{
    switch (f) {
    case PDMESH__FINISH_REASON__FINISH_EOS: return "eos";
    case PDMESH__FINISH_REASON__FINISH_LENGTH: return "length";
    case PDMESH__FINISH_REASON__FINISH_STOP: return "stop";
    default: return "?";
    }
}

static void pdm__apply_result(pdm__gen_t *g, int i, const Pdmesh__DecodeResult *d)
{
    pdm_launch_response_t *r = &g->out[i];
    const int code = d->error ? (int)d->error->code : 0;
    /* a deadline or a cancel ends the generation with what it has (not an error here) */
    const int ended = !d->ok && (code == PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED ||
                                 code == PDMESH__ERROR_CODE__ERR_CANCELLED);
    g->state[i] = 2;
    if (!d->ok && !ended) {
        snprintf(r->error, sizeof(r->error), "decode node: %s", pdm__err_text(d->error));
        r->ok = 0;
        return;
    }
    r->tokens = malloc(sizeof(int32_t) * (d->n_tokens ? d->n_tokens : 1));
    r->n_tokens = 0;
    for (size_t k = 0; r->tokens && k < d->n_tokens; k++) r->tokens[r->n_tokens++] = d->tokens[k];
    r->text = strdup(d->text ? d->text : "");
    snprintf(r->finish, sizeof(r->finish), "%s",
             ended ? (code == PDMESH__ERROR_CODE__ERR_CANCELLED ? "cancelled" : "deadline")
                   : pdm__finish_name(d->finish));
    r->total = pdm_now() - g->t0[i];
    r->step_seconds = d->step_seconds;
    r->kv_seconds = d->kv_seconds;
    r->kv_bytes = (double)d->kv_bytes;
    r->kv_local_bytes = (double)d->kv_local_bytes;
    r->kv_global_bytes = (double)d->kv_global_bytes;
    if (d->n_beams || d->beam_report) r->beam_json = pdm__beam_json(d);
    free(r->offload_json);
    r->offload_json = d->offload ? pdm__offload_json(d->offload) : NULL;
    r->ok = 1;
}

/* Reads one message of the decode node and applies it. *reserved_id: the task a
 * DecodeReserved answered (0 if the message was something else). */
static int pdm__decode_event(pdm__gen_t *g, double deadline, uint64_t *reserved_id)
{
    pdm_launch_t *l = g->l;
    *reserved_id = 0;
    int from;
    pdm_wire_msg_t *m;
    int got = pdm__recv(l, deadline, 0, 1, &from, &m);
    if (got < 0) return got;
    if (got == 0) return pdm_error_set(PDM_ETIMEOUT, "the decode node did not answer in time");
    if (from != l->n) { /* a registration, or a late answer of a rank */ /* a late answer of a rank */
        pdm_wire_msg_free(m);
        return PDM_OK;
    }
    const ProtobufCMessage *msg = pdm_wire_message(m);
    uint64_t task_id = 0;
    switch (pdm_wire_type(m)) {
    case PDMESH__MSG_TYPE__MSG_DECODE_RESERVED: {
        const Pdmesh__DecodeReserved *d = (const Pdmesh__DecodeReserved *)msg;
        task_id = *reserved_id = d->task_id;
        int i = task_id >= g->first_id ? (int)(task_id - g->first_id) : -1;
        if (!d->ok && i >= 0 && i < g->n) {
            snprintf(g->out[i].error, sizeof(g->out[i].error), "decode node: %s",
                     pdm__err_text(d->error));
            g->out[i].ok = 0;
            g->state[i] = 2;
        }
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_RESULT: {
        const Pdmesh__DecodeResult *d = (const Pdmesh__DecodeResult *)msg;
        int i = d->task_id >= g->first_id ? (int)(d->task_id - g->first_id) : -1;
        if (i >= 0 && i < g->n && g->state[i] != 2) pdm__apply_result(g, i, d);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_ERROR: { /* the node refused a message about a task */
        const Pdmesh__Error *e = (const Pdmesh__Error *)msg;
        int i = e->task_id >= g->first_id ? (int)(e->task_id - g->first_id) : -1;
        if (i >= 0 && i < g->n && g->state[i] != 2) {
            snprintf(g->out[i].error, sizeof(g->out[i].error), "decode node: %s", pdm__err_text(e));
            g->state[i] = 2;
            *reserved_id = e->task_id;
        }
        break;
    }
    default: break; /* DecodeTokens: the result carries every token */
    }
    pdm_wire_msg_free(m);
    return PDM_OK;
}

static int pdm__send_reserve(pdm_launch_t *l, uint64_t id, const pdm_launch_request_t *q,
                           const pdm_prefill_range_t *ranges, int nr, const uint8_t *kv_key)
{
    Pdmesh__DecodeTask t = PDMESH__DECODE_TASK__INIT;
    Pdmesh__TokenRange rg[PDM_PREFILL_MAX_PLAN], *rp[PDM_PREFILL_MAX_PLAN];
    ProtobufCBinaryData addrs[PDM_KVT_MAX_RANKS];
    pdm_prefill_ranges_to_wire(ranges, nr, rg, rp);
    for (int i = 0; i < l->n; i++) {
        addrs[i].data = l->proc[i].ucx;
        addrs[i].len = l->proc[i].ucx_len;
    }
    t.task_id = id;
    t.epoch = l->proc[l->n].epoch;
    t.n_prompt = (uint32_t)q->n_tokens;
    t.max_new = (uint32_t)q->max_new;
    t.prefill_addresses = addrs;
    t.n_prefill_addresses = (size_t)l->n;
    t.ranges = rp;
    t.n_ranges = (size_t)nr;
    t.group = PDM__GROUP;
    t.kv_key.data = (uint8_t *)kv_key;
    t.kv_key.len = PDM_KVT_KEY_BYTES;
    if (q->beams > 1) {
        t.beams = (uint32_t)q->beams;
        t.length_penalty = q->length_penalty;
        t.n_best = (uint32_t)(q->n_best > 0 ? q->n_best : 1);
        t.early_stopping = (char *)(q->early_stopping ? q->early_stopping : "heuristic");
    }
    return pdm__send(l, l->n, PDMESH__MSG_TYPE__MSG_DECODE_TASK, &t.base);
}

static int pdm__send_start(pdm_launch_t *l, uint64_t id, const pdm_launch_request_t *q,
                         int32_t first_token)
{
    Pdmesh__DecodeStart s = PDMESH__DECODE_START__INIT;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    pdm_sampler_params_to_msg(&q->sp, &sp);
    s.task_id = id;
    s.first_token = first_token;
    s.sampling = &sp;
    s.stop = (char **)q->stops;
    s.n_stop = (size_t)q->n_stops;
    s.deadline_ms = q->timeout > 0 ? (uint32_t)(q->timeout * 1000) : 0;
    if (q->beams > 1) s.prompt_last = q->tokens[q->n_tokens - 1]; /* the search recomputes it */
    return pdm__send(l, l->n, PDMESH__MSG_TYPE__MSG_DECODE_START, &s.base);
}

int pdm_launch_generate(pdm_launch_t *l, const pdm_launch_request_t *reqs, int n,
                        pdm_launch_response_t *out)
{
    if (!l->has_decode) return pdm_error_set(PDM_ESTATE, "the mesh has no decode node");
    int state[n > 0 ? n : 1];
    double t0[n > 0 ? n : 1];
    memset(state, 0, sizeof(state));
    memset(out, 0, sizeof(*out) * (size_t)n);
    pdm__gen_t g = {.l = l, .out = out, .n = n, .first_id = l->next_request + 1, .state = state,
                  .t0 = t0};
    l->next_request += (uint64_t)n;
    double deadline = pdm_now();
    for (int i = 0; i < n; i++)
        deadline += reqs[i].timeout > 0 ? reqs[i].timeout : l->p.timeout;
    int mesh_st = PDM_OK;
    uint64_t ev_id;
    for (int i = 0; i < n && !mesh_st; i++) {
        const pdm_launch_request_t *q = &reqs[i];
        const uint64_t id = g.first_id + (uint64_t)i;
        /* Where it starts, who computes which tokens (the decode node posts its receives
         * accordingly): the router's planner (conv.c), on this group's mirror. The method
         * was resolved by the caller; the harness runs it or fails. */
        pdm_prefill_task_plan_params_t pp = {
            .followup = {.method = q->method, .ranks = l->n, .tokens = q->tokens,
                         .n_tokens = q->n_tokens,
                         .min_cached = q->min_cached > 0 ? q->min_cached : 1,
                         .reuse = q->reuse_prefix},
            .chunks = q->chunks};
        pdm_prefill_task_plan_t plan;
        if (pdm__check_alive(l, 1, 0)) { /* as the router, never dispatch to a broken group */
            snprintf(out[i].error, sizeof(out[i].error), "prefill: %s", pdm_error_last());
            state[i] = 2;
            continue;
        }
        if (pdm_prefill_conv_plan_task(&l->conv, &pp, &plan)) {
            snprintf(out[i].error, sizeof(out[i].error), "prefill: %s", pdm_error_last());
            state[i] = 2;
            continue;
        }
        const int32_t start = plan.start;
        const pdm_prefill_range_t *ranges = plan.ranges;
        const int nr = plan.n_ranges;
        out[i].cached = start;
        out[i].method = plan.method;
        memcpy(out[i].ranges, plan.ranges, sizeof(pdm_prefill_range_t) * (size_t)nr);
        out[i].n_ranges = nr;
        uint8_t kv_key[PDM_KVT_KEY_BYTES]; /* as the router: a fresh key per request */
        if (pdm_random_bytes(kv_key, sizeof(kv_key))) {
            mesh_st = pdm_error_set(PDM_EIO, "no random bytes");
            break;
        }
        mesh_st = pdm__send_reserve(l, id, q, ranges, nr, kv_key);
        /* Wait for this reservation's answer; other requests' events are applied meanwhile. */
        while (!mesh_st) {
            mesh_st = pdm__decode_event(&g, deadline, &ev_id);
            if (!mesh_st && ev_id == id) break;
        }
        if (mesh_st || state[i] == 2) continue; /* refused: out[i] says why */
        pdm_prefill_stream_t stream = {.max_in_flight = 64, .key = kv_key};
        pdm_prefill_task_t task = {.id = (uint32_t)id, .method = plan.method, .start = start,
                                   .prefix = q->tokens, .tokens = q->tokens + start,
                                   .n_tokens = q->n_tokens - start,
                                   .chunks = plan.has_chunks ? plan.chunks : NULL,
                                   .stream = &stream};
        pdm_launch_result_t res;
        t0[i] = pdm_now();
        int st = pdm_launch_task(l, &task, NULL, NULL, &res);
        if (st) {
            snprintf(out[i].error, sizeof(out[i].error), "prefill: %s", pdm_error_last());
            state[i] = 2;
            Pdmesh__CancelTask c = PDMESH__CANCEL_TASK__INIT; /* release the reservation */
            c.task_id = id;
            mesh_st = pdm__send(l, l->n, PDMESH__MSG_TYPE__MSG_CANCEL_TASK, &c.base);
            continue;
        }
        out[i].ttft = res.ttft;
        for (int r = 0; r < l->n; r++)
            out[i].prefill_wait = fmax(out[i].prefill_wait, res.rank[r].t_wait);
        mesh_st = pdm__send_start(l, id, q, res.first_token);
        state[i] = 1;
    }
    /* Collect until every request has ended. */
    for (;;) {
        int open_ = 0;
        for (int i = 0; i < n; i++) open_ += state[i] == 1;
        if (!open_ || mesh_st) break;
        mesh_st = pdm__decode_event(&g, deadline, &ev_id);
    }
    if (mesh_st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        for (int i = 0; i < n; i++)
            if (state[i] != 2) snprintf(out[i].error, sizeof(out[i].error), "%s", msg);
        return pdm_error_set(mesh_st, "%s", msg);
    }
    return PDM_OK;
}

int pdm_launch_decode_usage(pdm_launch_t *l, int *held, long *kv_slots)
{
    if (!l->has_decode) return pdm_error_set(PDM_ESTATE, "the mesh has no decode node");
    Pdmesh__StatsRequest q = PDMESH__STATS_REQUEST__INIT;
    q.epoch = l->proc[l->n].epoch;
    int st = pdm__send(l, l->n, PDMESH__MSG_TYPE__MSG_STATS_REQUEST, &q.base);
    double deadline = pdm_now() + l->p.timeout;
    /* Messages of finished requests may still be queued before the answer: skip them. */
    while (!st) {
        int from;
        pdm_wire_msg_t *m;
        int got = pdm__recv(l, deadline, 0, 1, &from, &m);
        if (got <= 0) return got ? got : pdm_error_set(PDM_ETIMEOUT, "decode node: no stats");
        if (!m) continue;
        if (from == l->n && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_NODE_STATS) {
            const Pdmesh__NodeStats *s = (const Pdmesh__NodeStats *)pdm_wire_message(m);
            *held = (int)s->held;
            *kv_slots = (long)s->kv_slots;
            pdm_wire_msg_free(m);
            return PDM_OK;
        }
        pdm_wire_msg_free(m);
    }
    return st;
}
