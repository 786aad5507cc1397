/*
 * nodelink.h - a node daemon's link to the control plane (pdmesh-prefill, pdmesh-decode).
 *
 * A node daemon takes its tasks only as the protobuf messages of proto/pdmesh.proto over a
 * ZeroMQ DEALER connected to a node socket: the router's, or a local harness that speaks the
 * router's side of it (prefill_node/launch.c). The link owns that socket on a thread of its
 * own, so that a prefill or decode step that takes seconds never delays a heartbeat:
 *
 *   - it registers (HMAC proof of the cluster secret), heartbeats with the load the daemon
 *     last reported, registers again with a new epoch when the router answers
 *     ERR_STALE_EPOCH / ERR_NOT_FOUND or an ack carries another epoch;
 *   - it checks every frame before the daemon sees it: over the size cap -> Error
 *     ERR_TOO_LARGE; not a pdmesh frame or malformed protobuf -> ERR_BAD_MESSAGE; a type that
 *     is not a message for this role -> ERR_UNKNOWN_TYPE; an epoch other than the current
 *     one -> ERR_STALE_EPOCH (with the task id). The daemon keeps serving in every case;
 *   - it hands the daemon the unpacked messages (pdm_link_recv) and forwards what the daemon
 *     sends (pdm_link_send);
 *   - SIGTERM / SIGINT (blocked in every thread from pdm_link_create on, read with a
 *     signalfd): the link sends Deregister and pdm_link_recv returns PDM_ECANCELED, so the
 *     daemon leaves its loop and frees everything (sanitizer builds check leaks at exit).
 *     With a drain grace (--drain-grace S) the first SIGTERM drains instead: heartbeats say
 *     `draining`, the router sends no new work, pdm_link_draining turns 1 and the daemon
 *     leaves its loop once it holds nothing; when the grace runs out (or at a second SIGTERM)
 *     the link stops as above and the router moves what is left elsewhere (decode: migrated
 *     with the tokens already delivered; prefill: retried). This is what a Kubernetes pod's
 *     termination grace period is for;
 *   - ERR_UNAUTHORIZED on registration: pdm_link_recv returns PDM_ECANCELED and
 *     pdm_link_exit_status says 3;
 *   - the router's loss: no ack for the router's lease (RegisterAck.lease_ms; 0: three
 *     heartbeats), or a registration acknowledged with a new epoch (the router restarted or
 *     expired this node), orphans every task the node holds: pdm_link_orphans counts these
 *     events and the daemon drops the work of earlier generations, so a dead router's
 *     requests free their KV within a lease instead of running to max_tokens;
 *   - with a health file (--health-file), it rewrites that file every second: the daemon's
 *     liveness for `pdmesh health` (Kubernetes exec probes) and pdmesh up's supervisor. The
 *     file says when the daemon's own loop last asked for a message (a compute step that
 *     hangs shows as a stall) and whether the node is registered (readiness); a process that
 *     is frozen or gone stops rewriting it (common/health.h).
 *
 * Several routers (active-active, docs/router.md "High availability"): the endpoint is a list
 * (`--router EP1,EP2` or --router repeated). The link keeps one DEALER per router and
 * registers, heartbeats and watches the lease of each independently: each router has its own
 * epoch, its own orphan count (a dead router orphans only its own tasks) and its own
 * registration (a restarted router is registered with again by itself). Every message handed
 * to the daemon carries its origin (the router's index); pdm_link_send answers the origin of
 * the last message received (right for daemons that answer one message at a time), and
 * pdm_link_send_to a given one (a decode node streaming tokens of many tasks). Task ids of
 * different routers do not collide: each router starts its ids at a random 40-bit value.
 *
 * Threading: every function but the thread's own is called from the daemon's one thread.
 */
#ifndef PDM_NODELINK_H
#define PDM_NODELINK_H

#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

#define PDM_LINK_MAX_ROUTERS 8

typedef struct {
    const char *endpoint;    /* node socket, e.g. tcp://127.0.0.1:7701 or ipc:///tmp/x/node;
                              * several routers: "EP1,EP2" (see "Several routers" above) */
    char endpoint_list[2048]; /* pdm_link_params_add_router; used instead of endpoint when set */
    const char *node_id;     /* stable name, 1..128 bytes */
    const char *secret_file; /* NULL: $PDMESH_SECRET_FILE or $PDMESH_SECRET */
    const char *curve_server_key_file, *curve_key_file; /* CURVE (common/curve.h); NULL:
                                        * $PDMESH_CURVE_SERVER_KEY_FILE / $PDMESH_CURVE_KEY_FILE */
    int role;                /* Pdmesh__Role */
    const char *group;       /* prefill */
    uint32_t rank, group_size;
    const char *model_id;
    Pdmesh__Capacity capacity; /* copied into every Register */
    uint64_t features;       /* Register.features: PDM_FEAT_* this daemon has (common/pdm.h);
                              * $PDMESH_TEST_FEATURES overrides it (tests: an older node) */
    int heartbeat_ms;        /* until the router's RegisterAck says otherwise (1000) */
    int exit_with_parent;    /* SIGTERM to this process when its parent dies (local harness) */
    const char *health_file; /* rewritten every second (see above); NULL: none */
    double drain_grace;      /* seconds a SIGTERM drains before stopping (0: stop at once) */
} pdm_link_params_t;

void pdm_link_params_default(pdm_link_params_t *p);

typedef struct pdm_link pdm_link_t;

/* Checks the parameters, loads the secret, blocks SIGTERM/SIGINT in the calling thread (and
 * so in every thread it starts later) and connects the socket. Nothing is sent until
 * pdm_link_start. Call it first in main(), before any library starts threads. */
int pdm_link_create(const pdm_link_params_t *p, pdm_link_t **out);

/* Starts the thread: registration with this UCX worker address (copied). */
int pdm_link_start(pdm_link_t *l, const void *ucx_address, size_t ucx_address_len);

/* The next message for the daemon, waiting at most timeout_ms (0: poll). *out is NULL on a
 * timeout; PDM_ECANCELED when the daemon must stop (signal, refused registration). Free the
 * message with pdm_wire_msg_free. */
int pdm_link_recv(pdm_link_t *l, int timeout_ms, pdm_wire_msg_t **out);

/* Appends a router to p->endpoint_list (a repeated --router). PDM_EINVAL when full. */
int pdm_link_params_add_router(pdm_link_params_t *p, const char *endpoint);

/* Sends a message to the router the last received message came from (through the link's
 * thread). PDM_EOVERFLOW when the queue is full (the message is dropped and logged). */
int pdm_link_send(pdm_link_t *l, int type, const ProtobufCMessage *msg);

/* The same, to router `origin` (an index from pdm_link_origin). */
int pdm_link_send_to(pdm_link_t *l, int origin, int type, const ProtobufCMessage *msg);

/* The router (index into the list) the last message pdm_link_recv returned came from. */
int pdm_link_origin(const pdm_link_t *l);

/* The routers of the list: how many, each one's endpoint, registered or not. */
int pdm_link_n_routers(const pdm_link_t *l);
const char *pdm_link_router_endpoint(const pdm_link_t *l, int origin);
int pdm_link_router_registered(const pdm_link_t *l, int origin);
/* The identity router `origin` gave in its current RegisterAck (random per router process;
 * 0 from a harness that sends none), and the registered router of the list with identity
 * `router_id` (-1: none now; e.g. it restarted since). Ranks of a group name a router by it:
 * each rank may list the routers in its own order. */
uint64_t pdm_link_router_id(const pdm_link_t *l, int origin);
int pdm_link_origin_of_router(const pdm_link_t *l, uint64_t router_id);

/* Sends an Error about a task. */
int pdm_link_send_error(pdm_link_t *l, int code, uint64_t task_id, uint32_t attempt,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* How many times the node's work was orphaned (see above), over all routers; the daemon
 * compares it with the value it saw last, then pdm_link_orphans_of to learn whose. */
unsigned pdm_link_orphans(const pdm_link_t *l);
unsigned pdm_link_orphans_of(const pdm_link_t *l, int origin);

/* 1 once a SIGTERM started draining (see above): leave the loop when nothing is held. */
int pdm_link_draining(const pdm_link_t *l);

/* The epoch of the registration with the last message's router (0 before the first ack). */
uint64_t pdm_link_epoch(const pdm_link_t *l);
uint64_t pdm_link_epoch_of(const pdm_link_t *l, int origin);

/* The router's prefix block key parameters (common/wire.h) from the current registration's
 * RegisterAck, with model (model_cap bytes, kp->model points at it): returns the epoch they
 * belong to, 0 when the router sent none (then *kp is untouched). A decode node names its
 * prefix pool's blocks with them in its KvEvents. */
uint64_t pdm_link_prefix_keys(pdm_link_t *l, pdm_prefix_key_params_t *kp, char *model,
                              size_t model_cap);

/* What the next heartbeats report. */
void pdm_link_set_load(pdm_link_t *l, const Pdmesh__Load *load);

/* Registers again with a new epoch (a group that failed to form: the router wires it anew). */
void pdm_link_reregister(pdm_link_t *l);

/* 0, or 3 after the router refused the registration. */
int pdm_link_exit_status(const pdm_link_t *l);

/* Deregisters (when registered), stops the thread, closes the socket, frees. NULL is fine. */
void pdm_link_destroy(pdm_link_t *l);

/* Identity of a task attempt on the daemons' side (decode reservations, KV stream tags):
 * task_id * 16 + (attempt mod 16), so two attempts of one request never share a reservation
 * or a stream tag. */
#define PDM_LINK_TASK_KEY(task, attempt) ((uint64_t)(task) * 16u + ((attempt) & 15u))

#endif
