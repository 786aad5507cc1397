/*
 * test_nodeproto.c - the node daemons' side of the control plane, tested as the router sees
 * it: the test binds a node socket (ROUTER), starts a real pdmesh-decode / pdmesh-prefill
 * against it, accepts its registration and then sends it malformed, oversized, unknown,
 * misrouted and stale-epoch frames. Each must come back as an Error with the right code (or a
 * typed refusal in the task's own result), and the daemon must keep serving: a well-formed
 * task afterwards succeeds. SIGTERM must end it with a Deregister and exit status 0.
 */
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/nodelink.h"
#include "common/pdm.h"
#include "common/wire.h"
#include "model/model.h"
#include "prefill_node/plan.h"
#include "router/features.h"
#include "sdk/pdmesh_client.h"
#include "tests.h"

extern char **environ;

#define SECRET "0123456789abcdef0123456789abcdef"
#define EPOCH 7
#define H_ANY (-2) /* h_recv: any message but registrations and heartbeats */

static char model_path[600];

static void make_model(void)
{
    snprintf(model_path, sizeof(model_path), "%s/nodeproto-model.gguf", pdm_test_tmpdir());
    if (access(model_path, R_OK) == 0) return;
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_layers = 2;
    p.d_model = 64;
    p.n_heads = 4;
    p.n_kv_heads = 2;
    p.n_ff = 96;
    p.n_ctx = 256;
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    p.seed = 5;
    if (pdm_testmodel_write(model_path, &p)) abort();
}

typedef struct {
    void *ctx, *sock;
    char dir[64], ep[128];
    pid_t pid;
    uint8_t ident[256];
    size_t ident_len;
    ProtobufCBinaryData ucx; /* the node's UCX address (copied) */
    int registrations;       /* Register messages acknowledged */
} harness_t;

static const char *bin(const char *env, const char *def)
{
    const char *v = getenv(env);
    return v && *v ? v : def;
}

/* Receives one frame from the node before `seconds`; NULL on timeout. Registrations are
 * acknowledged (epoch EPOCH) and heartbeats answered on the way unless want_type asks for
 * them. */
static pdm_wire_msg_t *h_recv(harness_t *h, int want_type, double seconds)
{
    double deadline = pdm_now() + seconds;
    while (pdm_now() < deadline) {
        zmq_pollitem_t it = {h->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 50) <= 0) continue;
        uint8_t ident[256];
        int il = zmq_recv(h->sock, ident, sizeof(ident), 0);
        zmq_msg_t f;
        zmq_msg_init(&f);
        ck_assert_int_ge(zmq_msg_recv(&f, h->sock, 0), 0);
        pdm_wire_msg_t *m;
        ck_assert_msg(pdm_wire_unpack(zmq_msg_data(&f), zmq_msg_size(&f), PDM_WIRE_MAX_FRAME, 0,
                                      &m) == 0, "the node sent a bad frame: %s", pdm_error_last());
        zmq_msg_close(&f);
        int type = pdm_wire_type(m);
        if (type == want_type || (want_type == H_ANY && type != PDMESH__MSG_TYPE__MSG_REGISTER &&
                                  type != PDMESH__MSG_TYPE__MSG_HEARTBEAT))
            return m;
        if (type == PDMESH__MSG_TYPE__MSG_REGISTER) {
            const Pdmesh__Register *r = (const Pdmesh__Register *)pdm_wire_message(m);
            ck_assert(pdm_auth_verify(SECRET, strlen(SECRET), r->node_id, r->nonce,
                                      r->timestamp_ms, r->proof.data, r->proof.len));
            memcpy(h->ident, ident, (size_t)il);
            h->ident_len = (size_t)il;
            h->registrations++;
            free(h->ucx.data);
            h->ucx.data = malloc(r->ucx_address.len);
            memcpy(h->ucx.data, r->ucx_address.data, r->ucx_address.len);
            h->ucx.len = r->ucx_address.len;
            Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
            ack.epoch = EPOCH;
            ack.heartbeat_ms = 200;
            pdm_wire_send(h->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_REGISTER_ACK, &ack.base);
        } else if (type == PDMESH__MSG_TYPE__MSG_HEARTBEAT) {
            Pdmesh__HeartbeatAck ack = PDMESH__HEARTBEAT_ACK__INIT;
            ack.epoch = EPOCH;
            pdm_wire_send(h->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK, &ack.base);
        } else {
            ck_abort_msg("unexpected %s from the node (waiting for %s)", pdm_wire_type_name(type),
                         pdm_wire_type_name(want_type));
        }
        pdm_wire_msg_free(m);
    }
    return NULL;
}

/* Starts a daemon (argv after the node options) and accepts its registration. */
static void h_start(harness_t *h, const char *const *extra)
{
    memset(h, 0, sizeof(*h));
    snprintf(h->dir, sizeof(h->dir), "/tmp/pdm-np-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(h->dir));
    snprintf(h->ep, sizeof(h->ep), "ipc://%s/node", h->dir);
    h->ctx = zmq_ctx_new();
    h->sock = zmq_socket(h->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(h->sock, ZMQ_LINGER, &zero, sizeof(zero));
    ck_assert_int_eq(zmq_bind(h->sock, h->ep), 0);
    const char *argv[40];
    int a = 0;
    for (const char *const *e = extra; *e; e++) argv[a++] = *e;
    argv[a++] = "--router";
    argv[a++] = h->ep;
    argv[a++] = "--model";
    argv[a++] = model_path;
    argv[a++] = "--exit-with-parent";
    argv[a] = NULL;
    setenv("PDMESH_SECRET", SECRET, 1);
    ck_assert_int_eq(posix_spawnp(&h->pid, argv[0], NULL, NULL, (char *const *)argv, environ), 0);
    unsetenv("PDMESH_SECRET");
    pdm_wire_msg_t *none = h_recv(h, -1, 2.0); /* registration, acked inside */
    ck_assert_ptr_null(none);
    ck_assert_msg(h->ident_len > 0, "the node did not register");
}

static void h_send_raw(harness_t *h, const void *frame, size_t len)
{
    ck_assert_int_ge(zmq_send(h->sock, h->ident, h->ident_len, ZMQ_SNDMORE), 0);
    ck_assert_int_ge(zmq_send(h->sock, frame, len, 0), 0);
}

static void h_send(harness_t *h, int type, const ProtobufCMessage *m)
{
    ck_assert_int_eq(pdm_wire_send(h->sock, h->ident, h->ident_len, type, m), 0);
}

/* The next message of `type`, within 20 s (fails the test otherwise). */
static pdm_wire_msg_t *h_expect(harness_t *h, int type)
{
    pdm_wire_msg_t *m = h_recv(h, type, 20.0);
    ck_assert_msg(m != NULL, "no %s from the node", pdm_wire_type_name(type));
    return m;
}

static void h_expect_error(harness_t *h, int code, uint64_t task_id, const char *what)
{
    pdm_wire_msg_t *m = h_expect(h, PDMESH__MSG_TYPE__MSG_ERROR);
    const Pdmesh__Error *e = (const Pdmesh__Error *)pdm_wire_message(m);
    ck_assert_msg((int)e->code == code, "%s: error code %d (%s), want %d", what, e->code,
                  e->message, code);
    ck_assert_msg(e->task_id == task_id, "%s: task %llu, want %llu", what,
                  (unsigned long long)e->task_id, (unsigned long long)task_id);
    ck_assert(e->message && e->message[0]);
    pdm_wire_msg_free(m);
}

/* The frames every daemon refuses in its link, whatever its role. */
static void h_send_bad_frames(harness_t *h, int foreign_type)
{
    h_send_raw(h, "hello", 5);
    h_expect_error(h, PDMESH__ERROR_CODE__ERR_BAD_MESSAGE, 0, "not a pdmesh frame");
    uint8_t hdr[12] = {'P', 'D', 1, 0, 0x03, 0xe7, 0, 0, 1, 2, 3, 4}; /* type 999 */
    h_send_raw(h, hdr, sizeof(hdr));
    h_expect_error(h, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, 0, "unknown type");
    uint8_t garbage[12] = {'P', 'D', 1, 0, 0, (uint8_t)foreign_type, 0, 0, 0xff, 0xff, 0xff, 0xff};
    garbage[5] = PDMESH__MSG_TYPE__MSG_DECODE_TASK;
    h_send_raw(h, garbage, sizeof(garbage));
    h_expect_error(h, PDMESH__ERROR_CODE__ERR_BAD_MESSAGE, 0, "malformed protobuf");
    size_t big = PDM_WIRE_MAX_FRAME + 100;
    uint8_t *huge = calloc(1, big);
    memcpy(huge, hdr, 8);
    huge[5] = PDMESH__MSG_TYPE__MSG_DECODE_TASK;
    h_send_raw(h, huge, big);
    free(huge);
    h_expect_error(h, PDMESH__ERROR_CODE__ERR_TOO_LARGE, 0, "oversized frame");
    Pdmesh__Ping ping = PDMESH__PING__INIT; /* a real message, but not a node's */
    h_send(h, PDMESH__MSG_TYPE__MSG_PING, &ping.base);
    h_expect_error(h, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, 0, "client message");
}

/* SIGTERM: Deregister with the current epoch, exit status 0. */
static void h_stop(harness_t *h)
{
    kill(h->pid, SIGTERM);
    pdm_wire_msg_t *m = h_expect(h, PDMESH__MSG_TYPE__MSG_DEREGISTER);
    ck_assert_int_eq(((const Pdmesh__Deregister *)pdm_wire_message(m))->epoch, EPOCH);
    pdm_wire_msg_free(m);
    int status = 0;
    double until = pdm_now() + 20;
    while (waitpid(h->pid, &status, WNOHANG) == 0 && pdm_now() < until) usleep(10000);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the node did not exit cleanly "
                  "(status %d)", status);
    zmq_close(h->sock);
    zmq_ctx_term(h->ctx);
    char path[128];
    snprintf(path, sizeof(path), "%s/node", h->dir);
    unlink(path);
    rmdir(h->dir);
    free(h->ucx.data);
}

START_TEST(test_decode_node_protocol)
{
    harness_t h;
    const char *argv[] = {bin("PDMESH_DECODE_BIN", "build/bin/pdmesh-decode"), "--node-id",
                          "decode-np", "--kv-budget", "4096", NULL};
    h_start(&h, argv);
    h_send_bad_frames(&h, PDMESH__MSG_TYPE__MSG_DECODE_TASK);

    /* a prefill rank's message */
    Pdmesh__PrefillTask pt = PDMESH__PREFILL_TASK__INIT;
    pt.task_id = 3;
    pt.epoch = EPOCH;
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &pt.base);
    h_expect_error(&h, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, 3, "PrefillTask to a decode node");

    /* a previous incarnation's task */
    int32_t prompt[6] = {5, 9, 17, 33, 2, 70};
    Pdmesh__DecodeTask t = PDMESH__DECODE_TASK__INIT;
    t.task_id = 11;
    t.epoch = EPOCH - 1;
    t.local_prefill = 1;
    t.prompt_tokens = prompt;
    t.n_prompt_tokens = 6;
    t.n_prompt = 6;
    t.max_new = 4;
    h_send(&h, PDMESH__MSG_TYPE__MSG_DECODE_TASK, &t.base);
    h_expect_error(&h, PDMESH__ERROR_CODE__ERR_STALE_EPOCH, 11, "stale epoch");

    /* a plan that names a rank it does not list: a typed refusal in DecodeReserved */
    Pdmesh__TokenRange range = PDMESH__TOKEN_RANGE__INIT, *rp = &range;
    range.len = 6;
    range.rank = 3;
    Pdmesh__DecodeTask bad = PDMESH__DECODE_TASK__INIT;
    bad.task_id = 12;
    bad.epoch = EPOCH;
    bad.n_prompt = 6;
    bad.max_new = 4;
    bad.prefill_addresses = &h.ucx; /* itself: any reachable worker will do */
    bad.n_prefill_addresses = 1;
    bad.ranges = &rp;
    bad.n_ranges = 1;
    h_send(&h, PDMESH__MSG_TYPE__MSG_DECODE_TASK, &bad.base);
    pdm_wire_msg_t *m = h_expect(&h, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED);
    const Pdmesh__DecodeReserved *dr = (const Pdmesh__DecodeReserved *)pdm_wire_message(m);
    ck_assert(dr->task_id == 12 && !dr->ok && dr->error &&
              dr->error->code == PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT);
    pdm_wire_msg_free(m);

    /* a start for a task it does not hold */
    Pdmesh__DecodeStart s = PDMESH__DECODE_START__INIT;
    s.task_id = 99;
    s.first_token = 1;
    h_send(&h, PDMESH__MSG_TYPE__MSG_DECODE_START, &s.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_DECODE_RESULT);
    const Pdmesh__DecodeResult *res = (const Pdmesh__DecodeResult *)pdm_wire_message(m);
    ck_assert(res->task_id == 99 && !res->ok && res->error);
    pdm_wire_msg_free(m);

    /* and it still serves: a local prefill, 4 tokens */
    t.epoch = EPOCH;
    h_send(&h, PDMESH__MSG_TYPE__MSG_DECODE_TASK, &t.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED);
    dr = (const Pdmesh__DecodeReserved *)pdm_wire_message(m);
    ck_assert_msg(dr->task_id == 11 && dr->ok, "%s", dr->error ? dr->error->message : "");
    pdm_wire_msg_free(m);
    s.task_id = 11;
    s.first_token = -1;
    s.ignore_eos = 1;
    h_send(&h, PDMESH__MSG_TYPE__MSG_DECODE_START, &s.base);
    int streamed = 0;
    const Pdmesh__DecodeResult *res2 = NULL;
    while (!res2) {
        m = h_recv(&h, H_ANY, 20);
        ck_assert_msg(m != NULL, "the generation stopped after %d tokens", streamed);
        if (pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_DECODE_TOKENS) {
            const Pdmesh__DecodeTokens *dt = (const Pdmesh__DecodeTokens *)pdm_wire_message(m);
            ck_assert(dt->task_id == 11 && dt->index == (uint32_t)streamed);
            streamed += (int)dt->n_tokens;
            pdm_wire_msg_free(m);
            continue;
        }
        ck_assert_int_eq(pdm_wire_type(m), PDMESH__MSG_TYPE__MSG_DECODE_RESULT);
        res2 = (const Pdmesh__DecodeResult *)pdm_wire_message(m);
    }
    ck_assert_msg(res2->task_id == 11 && res2->ok && res2->n_tokens == 4 && streamed == 4 &&
                  res2->finish == PDMESH__FINISH_REASON__FINISH_LENGTH,
                  "ok %d, %zu tokens (%d streamed), finish %d", res2->ok, res2->n_tokens, streamed,
                  res2->finish);
    pdm_wire_msg_free(m);

    /* nothing stays held */
    Pdmesh__StatsRequest q = PDMESH__STATS_REQUEST__INIT;
    q.epoch = EPOCH;
    h_send(&h, PDMESH__MSG_TYPE__MSG_STATS_REQUEST, &q.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_NODE_STATS);
    const Pdmesh__NodeStats *ns = (const Pdmesh__NodeStats *)pdm_wire_message(m);
    ck_assert(ns->held == 0 && ns->kv_slots == 0);
    pdm_wire_msg_free(m);
    h_stop(&h);
}
END_TEST

START_TEST(test_prefill_rank_protocol)
{
    harness_t h;
    const char *argv[] = {bin("PDMESH_PREFILL_BIN", "build/bin/pdmesh-prefill"), "--node-id",
                          "prefill-np/0", "--group", "np", "--rank", "0", "--group-size", "1",
                          "--kv-dtype", "f32", "--timeout", "5", NULL};
    h_start(&h, argv);
    h_send_bad_frames(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK);

    int32_t prompt[7] = {4, 8, 15, 16, 23, 42, 99};
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    t.task_id = 21;
    t.epoch = EPOCH;
    t.method = "single";
    t.tokens = prompt;
    t.n_tokens = 7;
    t.top_logits = 5;
    t.want_logits = 1;
    /* before the group is wired: refused in the result */
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    pdm_wire_msg_t *m = h_expect(&h, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
    const Pdmesh__PrefillResult *r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert(r->task_id == 21 && !r->ok && r->error && strstr(r->error->message, "GroupWire"));
    pdm_wire_msg_free(m);

    /* a GroupWire that is no group: GroupReady says no */
    Pdmesh__GroupWire w = PDMESH__GROUP_WIRE__INIT;
    w.epoch = EPOCH;
    w.group = "np";
    w.rank = 2;
    w.size = 1;
    w.ucx_addresses = &h.ucx;
    w.n_ucx_addresses = 1;
    h_send(&h, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_GROUP_READY);
    ck_assert(!((const Pdmesh__GroupReady *)pdm_wire_message(m))->ok);
    pdm_wire_msg_free(m);
    /* it registers again: a group that failed to form is re-wired on a new epoch */
    const int before = h.registrations;
    for (int i = 0; i < 30 && h.registrations == before; i++) h_recv(&h, -1, 0.1);
    ck_assert_msg(h.registrations > before, "no new registration after a failed GroupWire");

    /* a stale GroupWire, then the right one */
    w.rank = 0;
    w.epoch = EPOCH + 5;
    h_send(&h, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base);
    h_expect_error(&h, PDMESH__ERROR_CODE__ERR_STALE_EPOCH, 0, "stale GroupWire");
    w.epoch = EPOCH;
    h_send(&h, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_GROUP_READY);
    ck_assert(((const Pdmesh__GroupReady *)pdm_wire_message(m))->ok);
    pdm_wire_msg_free(m);

    /* typed refusals in the result: unknown method, a dump without --dump-dir, chunks that
     * do not match the group */
    t.method = "nope";
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
    r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert(!r->ok && r->error->code == PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT);
    pdm_wire_msg_free(m);
    t.method = "single";
    t.kv_dump = "../../etc/x";
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
    r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert(!r->ok && strstr(r->error->message, "dump-dir"));
    pdm_wire_msg_free(m);
    t.kv_dump = "";
    uint32_t chunks[3] = {2, 2, 3};
    t.chunks = chunks;
    t.n_chunks = 3;
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
    r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert(!r->ok && strstr(r->error->message, "chunks"));
    pdm_wire_msg_free(m);
    t.n_chunks = 0;

    /* and it still serves, equal to the engine */
    h_send(&h, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    m = h_expect(&h, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
    r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert_msg(r->ok && r->owner && r->n_top_ids == 5 && r->n_logits > 0, "%s",
                  r->error ? r->error->message : "");
    pdm_model_t *model;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_load(model_path, &model), 0);
    ck_assert_int_eq(r->n_logits, model->hp.n_vocab);
    ck_assert_int_eq(pdm_model_ctx_create(model, 1, 64, &ctx), 0);
    ck_assert_int_eq(pdm_kv_cache_create(&model->hp, 16, PDM_DT_F32, &cache), 0);
    float *logits = malloc(sizeof(float) * model->hp.n_vocab);
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, prompt, 7, logits), 0);
    ck_assert_int_eq(r->first_token, pdm_test_argmax(logits, model->hp.n_vocab));
    ck_assert_int_eq(r->top_ids[0], r->first_token);
    for (uint32_t v = 0; v < model->hp.n_vocab; v++)
        ck_assert_msg(fabsf(r->logits[v] - logits[v]) <= 1e-3f * fmaxf(1, fabsf(logits[v])),
                      "logit %u: %g vs %g", v, r->logits[v], logits[v]);
    free(logits);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(model);
    pdm_wire_msg_free(m);
    h_stop(&h);
}
END_TEST

/* ---- Two routers, one 2-rank group: rank 0 forwards every group task -------------------- */

/* One test router: a node socket and what each rank registered with it. */
typedef struct {
    void *sock;
    char ep[160];
    uint64_t id;             /* RegisterAck.router_id */
    uint8_t ident[2][256];   /* per rank */
    size_t ident_len[2];
    ProtobufCBinaryData ucx[2];
    uint64_t features[2];    /* Register.features per rank */
} grouter_t;

/* One message from either router before `seconds` (registrations acked, heartbeats answered);
 * *router and *rank say whose. NULL on timeout. */
static pdm_wire_msg_t *g_recv(grouter_t *rt, int *router, int *rank, double seconds)
{
    const double deadline = pdm_now() + seconds;
    while (pdm_now() < deadline) {
        zmq_pollitem_t it[2] = {{rt[0].sock, 0, ZMQ_POLLIN, 0}, {rt[1].sock, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, 50) <= 0) continue;
        const int w = it[0].revents & ZMQ_POLLIN ? 0 : 1;
        grouter_t *g = &rt[w];
        uint8_t ident[256];
        int il = zmq_recv(g->sock, ident, sizeof(ident), 0);
        ck_assert_int_gt(il, 0);
        zmq_msg_t f;
        zmq_msg_init(&f);
        ck_assert_int_ge(zmq_msg_recv(&f, g->sock, 0), 0);
        pdm_wire_msg_t *m;
        ck_assert_int_eq(pdm_wire_unpack(zmq_msg_data(&f), zmq_msg_size(&f), PDM_WIRE_MAX_FRAME,
                                         0, &m), 0);
        zmq_msg_close(&f);
        const int type = pdm_wire_type(m);
        int k = -1;
        for (int j = 0; j < 2; j++)
            if (g->ident_len[j] == (size_t)il && !memcmp(g->ident[j], ident, (size_t)il)) k = j;
        if (type == PDMESH__MSG_TYPE__MSG_REGISTER) {
            const Pdmesh__Register *r = (const Pdmesh__Register *)pdm_wire_message(m);
            k = r->node_id[strlen(r->node_id) - 1] - '0'; /* "fw/0", "fw/1" */
            ck_assert(k == 0 || k == 1);
            memcpy(g->ident[k], ident, (size_t)il);
            g->ident_len[k] = (size_t)il;
            free(g->ucx[k].data);
            g->ucx[k].data = malloc(r->ucx_address.len);
            memcpy(g->ucx[k].data, r->ucx_address.data, r->ucx_address.len);
            g->ucx[k].len = r->ucx_address.len;
            g->features[k] = r->features;
            Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
            ack.epoch = EPOCH;
            ack.heartbeat_ms = 200;
            ack.router_id = g->id;
            pdm_wire_send(g->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_REGISTER_ACK, &ack.base);
        } else if (type == PDMESH__MSG_TYPE__MSG_HEARTBEAT) {
            Pdmesh__HeartbeatAck ack = PDMESH__HEARTBEAT_ACK__INIT;
            ack.epoch = EPOCH;
            pdm_wire_send(g->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK, &ack.base);
        } else {
            *router = w;
            *rank = k;
            return m;
        }
        pdm_wire_msg_free(m);
    }
    return NULL;
}

static void g_send(grouter_t *g, int rank, int type, const ProtobufCMessage *msg)
{
    ck_assert_int_eq(pdm_wire_send(g->sock, g->ident[rank], g->ident_len[rank], type, msg), 0);
}

/* Collects `want` PrefillResults of task `task_id` within `seconds`: got[router][rank] counts
 * them; each must be ok. Nothing else may come. */
static void g_results(grouter_t *rt, uint64_t task_id, int want, double seconds, int got[2][2])
{
    memset(got, 0, sizeof(int) * 4);
    const double deadline = pdm_now() + seconds;
    for (int n = 0; n < want;) {
        int w, k;
        pdm_wire_msg_t *m = g_recv(rt, &w, &k, deadline - pdm_now());
        ck_assert_msg(m != NULL, "task %llu: %d of %d results within %.0f s",
                      (unsigned long long)task_id, n, want, seconds);
        ck_assert_int_eq(pdm_wire_type(m), PDMESH__MSG_TYPE__MSG_PREFILL_RESULT);
        const Pdmesh__PrefillResult *r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
        ck_assert_msg(r->task_id == task_id && r->ok, "task %llu: result of %llu, ok %d: %s",
                      (unsigned long long)task_id, (unsigned long long)r->task_id, r->ok,
                      r->error && r->error->message ? r->error->message : "");
        ck_assert_int_eq(r->rank, (uint32_t)k);
        got[w][k]++;
        n++;
        pdm_wire_msg_free(m);
    }
}

/* A 2-rank group "fw" of real pdmesh-prefill processes registered with two test routers
 * (rank 1 lists the routers the other way round). rank1_features: PDMESH_TEST_FEATURES of
 * rank 1 (a rank of an older version: "0"), or NULL. */
typedef struct {
    grouter_t rt[2];
    void *ctx;
    char dir[64];
    pid_t pid[2];
} fw_group_t;

static void fw_start(fw_group_t *f, const char *rank1_features)
{
    memset(f, 0, sizeof(*f));
    grouter_t *rt = f->rt;
    f->ctx = zmq_ctx_new();
    snprintf(f->dir, sizeof(f->dir), "/tmp/pdm-fw-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(f->dir));
    for (int w = 0; w < 2; w++) {
        snprintf(rt[w].ep, sizeof(rt[w].ep), "ipc://%s/router%d", f->dir, w);
        rt[w].id = 0x1111111111111111ull * (uint64_t)(w + 1);
        rt[w].sock = zmq_socket(f->ctx, ZMQ_ROUTER);
        int zero = 0;
        zmq_setsockopt(rt[w].sock, ZMQ_LINGER, &zero, sizeof(zero));
        ck_assert_int_eq(zmq_bind(rt[w].sock, rt[w].ep), 0);
    }
    setenv("PDMESH_SECRET", SECRET, 1);
    for (int k = 0; k < 2; k++) {
        char rank[4], id[16];
        snprintf(rank, sizeof(rank), "%d", k);
        snprintf(id, sizeof(id), "fw/%d", k);
        const char *argv[] = {bin("PDMESH_PREFILL_BIN", "build/bin/pdmesh-prefill"), "--node-id",
                              id, "--group", "fw", "--rank", rank, "--group-size", "2",
                              "--kv-dtype", "f32", "--timeout", "30", "--model", model_path,
                              /* rank 1 lists the routers the other way round */
                              "--router", rt[k].ep, "--router", rt[1 - k].ep,
                              "--exit-with-parent", NULL};
        if (k == 1 && rank1_features) setenv("PDMESH_TEST_FEATURES", rank1_features, 1);
        ck_assert_int_eq(posix_spawnp(&f->pid[k], argv[0], NULL, NULL, (char *const *)argv,
                                      environ), 0);
        unsetenv("PDMESH_TEST_FEATURES");
    }
    unsetenv("PDMESH_SECRET");
    /* both ranks register with both routers */
    for (double until = pdm_now() + 20; pdm_now() < until;) {
        int w, k;
        pdm_wire_msg_t *m = g_recv(rt, &w, &k, 0.1);
        ck_assert_msg(m == NULL, "unexpected %s", m ? pdm_wire_type_name(pdm_wire_type(m)) : "");
        if (rt[0].ident_len[0] && rt[0].ident_len[1] && rt[1].ident_len[0] && rt[1].ident_len[1])
            break;
    }
    ck_assert_msg(rt[0].ident_len[0] && rt[0].ident_len[1] && rt[1].ident_len[0] &&
                  rt[1].ident_len[1], "the ranks did not register with both routers");
}

/* Each router wires the group as the router would (GroupWire.ordered from the ranks'
 * registrations, router/features.h); the second router's wire is answered at once. Returns
 * the ordered flag sent. */
static int fw_wire(fw_group_t *f)
{
    grouter_t *rt = f->rt;
    ck_assert(rt[0].features[0] == rt[1].features[0] && rt[0].features[1] == rt[1].features[1]);
    const int ordered = rt_feat_group_ordered(rt[0].features, 2, NULL);
    for (int w = 0; w < 2; w++) {
        for (int k = 0; k < 2; k++) {
            Pdmesh__GroupWire gw = PDMESH__GROUP_WIRE__INIT;
            gw.epoch = EPOCH;
            gw.group = "fw";
            gw.rank = (uint32_t)k;
            gw.size = 2;
            gw.ucx_addresses = rt[0].ucx;
            gw.n_ucx_addresses = 2;
            gw.ordered = ordered;
            g_send(&rt[w], k, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &gw.base);
        }
        for (int n = 0; n < 2; n++) {
            int ww, k;
            pdm_wire_msg_t *m = g_recv(rt, &ww, &k, 20);
            ck_assert_msg(m && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_GROUP_READY,
                          "no GroupReady");
            ck_assert(ww == w && ((const Pdmesh__GroupReady *)pdm_wire_message(m))->ok);
            pdm_wire_msg_free(m);
        }
    }
    return ordered;
}

static void fw_stop(fw_group_t *f)
{
    for (int j = 0; j < 2; j++) {
        kill(f->pid[j], SIGKILL);
        waitpid(f->pid[j], NULL, 0);
    }
    for (int j = 0; j < 2; j++) {
        zmq_close(f->rt[j].sock);
        for (int r = 0; r < 2; r++) free(f->rt[j].ucx[r].data);
        char path[256];
        snprintf(path, sizeof(path), "%s/router%d", f->dir, j);
        unlink(path);
    }
    zmq_ctx_term(f->ctx);
    rmdir(f->dir);
}

/* The engine's logits of prompt[0..n) (n_vocab floats, malloc'd). */
static float *engine_logits(const int32_t *prompt, int n, uint32_t *n_vocab)
{
    pdm_model_t *model;
    pdm_model_ctx_t *mctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_load(model_path, &model), 0);
    ck_assert_int_eq(pdm_model_ctx_create(model, 1, 64, &mctx), 0);
    ck_assert_int_eq(pdm_kv_cache_create(&model->hp, 16, PDM_DT_F32, &cache), 0);
    float *logits = malloc(sizeof(float) * model->hp.n_vocab);
    ck_assert_int_eq(pdm_model_prefill(mctx, cache, prompt, n, logits), 0);
    *n_vocab = model->hp.n_vocab;
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(mctx);
    pdm_model_free(model);
    return logits;
}

/* A router hands a 2-rank group a task and dies before it reaches rank 1: the group must not
 * wait a group timeout for rank 1's copy (the CI failure of test_ha.py, 30 s pauses). Rank 0
 * forwards every group task; rank 1 answers the router the entry names though it lists the
 * routers in the other order; the copy a router also sends rank 1 only records the work to
 * come (one answer per rank). The logits equal the single-process engine. Both ranks are of
 * this version: both register PDM_FEAT_PREFILL and the group is wired ordered. */
START_TEST(test_prefill_group_forwarding)
{
    fw_group_t f;
    fw_start(&f, NULL);
    grouter_t *rt = f.rt;
    for (int k = 0; k < 2; k++)
        ck_assert_msg(rt[0].features[k] == PDM_FEAT_PREFILL, "rank %d registered features "
                      "0x%llx", k, (unsigned long long)rt[0].features[k]);
    ck_assert_int_eq(fw_wire(&f), 1);

    int32_t prompt[9] = {4, 8, 15, 16, 23, 42, 99, 7, 3};
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    t.epoch = EPOCH;
    t.method = "cp-kv";
    t.tokens = prompt;
    t.n_tokens = 9;
    t.top_logits = 5;
    t.want_logits = 1;
    t.deadline_ms = 20000;
    int got[2][2];

    /* router 1's task reaches rank 0 only (it "died" before rank 1): both ranks answer router
     * 1, well within the group timeout (30 s) */
    t.task_id = 41;
    double t0 = pdm_now();
    g_send(&rt[1], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    g_results(rt, 41, 2, 10, got);
    ck_assert_msg(got[1][0] == 1 && got[1][1] == 1, "results at the wrong router");
    ck_assert_msg(pdm_now() - t0 < 10, "the group waited %.1f s", pdm_now() - t0);

    /* router 0's task sent to both ranks, as a router does: one answer per rank */
    t.task_id = 42;
    g_send(&rt[0], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    g_send(&rt[0], 1, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    g_results(rt, 42, 2, 10, got);
    ck_assert(got[0][0] == 1 && got[0][1] == 1);

    /* both routers at once, in one order: every task answered at its own router, and the
     * owner's logits equal the engine's */
    t.task_id = 43;
    g_send(&rt[0], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    Pdmesh__PrefillTask t2 = t;
    t2.task_id = 44;
    g_send(&rt[1], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t2.base);
    uint32_t n_vocab;
    float *logits = engine_logits(prompt, 9, &n_vocab);
    int seen[2][2] = {{0}}, owners = 0;
    for (int n = 0; n < 4; n++) {
        int w, k;
        pdm_wire_msg_t *m = g_recv(rt, &w, &k, 10);
        ck_assert_msg(m && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_PREFILL_RESULT,
                      "%d of 4 results", n);
        const Pdmesh__PrefillResult *r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
        ck_assert_msg(r->ok && r->task_id == (w == 0 ? 43u : 44u), "task %llu at router %d",
                      (unsigned long long)r->task_id, w);
        seen[w][k]++;
        if (r->owner) {
            owners++;
            ck_assert_int_eq(r->n_logits, n_vocab);
            for (uint32_t v = 0; v < n_vocab; v++)
                ck_assert_msg(fabsf(r->logits[v] - logits[v]) <= 1e-3f * fmaxf(1, fabsf(logits[v])),
                              "logit %u: %g vs %g", v, r->logits[v], logits[v]);
        }
        pdm_wire_msg_free(m);
    }
    ck_assert(seen[0][0] == 1 && seen[0][1] == 1 && seen[1][0] == 1 && seen[1][1] == 1);
    ck_assert_int_eq(owners, 2);
    /* and nothing more (no second answer to the copy of task 42) */
    int w, k;
    pdm_wire_msg_t *extra = g_recv(rt, &w, &k, 1.0);
    ck_assert_msg(extra == NULL, "an extra %s", extra ? pdm_wire_type_name(pdm_wire_type(extra)) : "");

    /* PrefillTask.formation: the group's own is run; another (planned before the group
     * re-formed) is refused by rank 0 at once, and rank 1 never hears of it */
    const void *datas[2] = {rt[0].ucx[0].data, rt[0].ucx[1].data};
    const size_t lens[2] = {rt[0].ucx[0].len, rt[0].ucx[1].len};
    t.task_id = 45;
    t.formation = pdm_prefill_formation(datas, lens, 2);
    g_send(&rt[0], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    g_results(rt, 45, 2, 10, got);
    ck_assert(got[0][0] == 1 && got[0][1] == 1);
    t.task_id = 46;
    t.formation ^= 1;
    g_send(&rt[0], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    pdm_wire_msg_t *m = g_recv(rt, &w, &k, 5);
    ck_assert_msg(m && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, "no answer");
    const Pdmesh__PrefillResult *rr = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
    ck_assert_msg(rr->task_id == 46 && !rr->ok && w == 0 && k == 0 && rr->error &&
                  strstr(rr->error->message, "formation"), "task %llu ok %d from %d/%d",
                  (unsigned long long)rr->task_id, rr->ok, w, k);
    pdm_wire_msg_free(m);
    extra = g_recv(rt, &w, &k, 1.0);
    ck_assert_msg(extra == NULL, "rank %d answered a refused task", k);
    free(logits);
    fw_stop(&f);
}
END_TEST

/* A rolling upgrade: rank 1 is of an older version (PDMESH_TEST_FEATURES=0: it registers
 * without features), so the group is wired unordered (the router's rule, GroupWire.ordered
 * false) and runs as before forwarding: each rank runs the copies its routers send it, in
 * arrival order, and answers the router each came from; rank 0 forwards nothing. Every task
 * is answered by both ranks, the owner's logits equal the engine's. */
START_TEST(test_prefill_group_unordered)
{
    /* the engine's logits first: while the test does not poll, its routers answer no
     * heartbeat, and a node that gives a router up registers anew from another socket
     * identity (tasks sent to the old one are lost) */
    int32_t prompt[9] = {4, 8, 15, 16, 23, 42, 99, 7, 3};
    uint32_t n_vocab;
    float *logits = engine_logits(prompt, 9, &n_vocab);
    fw_group_t f;
    fw_start(&f, "0");
    grouter_t *rt = f.rt;
    ck_assert_msg(rt[0].features[0] == PDM_FEAT_PREFILL && rt[0].features[1] == 0,
                  "registered features 0x%llx and 0x%llx", (unsigned long long)rt[0].features[0],
                  (unsigned long long)rt[0].features[1]);
    uint32_t lacking = 9;
    ck_assert_int_eq(rt_feat_group_ordered(rt[0].features, 2, &lacking), 0);
    ck_assert_uint_eq(lacking, 1);
    ck_assert_int_eq(fw_wire(&f), 0);

    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    t.epoch = EPOCH;
    t.method = "cp-kv";
    t.tokens = prompt;
    t.n_tokens = 9;
    t.top_logits = 5;
    t.want_logits = 1;
    t.deadline_ms = 20000;
    /* tasks 51..53 from router 0, router 1, router 0, each sent to both ranks and answered
     * before the next is sent: an unordered group has no order across routers (a rank may
     * take a later task of one router before an earlier one of the other: the stall of
     * docs/deployment.md "Versions"), so one at a time */
    int seen[2][2] = {{0}}, owners = 0;
    for (uint64_t id = 51; id <= 53; id++) {
        t.task_id = id;
        const int from = id == 52;
        g_send(&rt[from], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
        g_send(&rt[from], 1, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
        for (int n = 0; n < 2; n++) {
            int w, k;
            pdm_wire_msg_t *m = g_recv(rt, &w, &k, 20);
            ck_assert_msg(m && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_PREFILL_RESULT,
                          "task %llu: %d of 2 results, then %s", (unsigned long long)id, n,
                          m ? pdm_wire_type_name(pdm_wire_type(m)) : "none");
            const Pdmesh__PrefillResult *r = (const Pdmesh__PrefillResult *)pdm_wire_message(m);
            ck_assert_msg(r->ok && r->task_id == id && r->rank == (uint32_t)k && w == from,
                          "task %llu: ok %d, rank %u at router %d: %s",
                          (unsigned long long)r->task_id, r->ok, r->rank, w,
                          r->error && r->error->message ? r->error->message : "");
            seen[w][k]++;
            if (r->owner) {
                owners++;
                ck_assert_int_eq(r->n_logits, n_vocab);
                for (uint32_t v = 0; v < n_vocab; v++)
                    ck_assert_msg(fabsf(r->logits[v] - logits[v]) <=
                                      1e-3f * fmaxf(1, fabsf(logits[v])),
                                  "logit %u: %g vs %g", v, r->logits[v], logits[v]);
            }
            pdm_wire_msg_free(m);
        }
    }
    ck_assert(seen[0][0] == 2 && seen[0][1] == 2 && seen[1][0] == 1 && seen[1][1] == 1);
    ck_assert_int_eq(owners, 3);

    /* Rank 1 runs its own copy, not one forwarded by rank 0: one task reaching rank 0 from
     * router 0 and rank 1 from router 1 is answered by each rank to its own router (an
     * ordered group answers both at router 0, the router of rank 0's copy). */
    t.task_id = 54;
    g_send(&rt[0], 0, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    g_send(&rt[1], 1, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base);
    int got[2][2];
    g_results(rt, 54, 2, 20, got);
    ck_assert_msg(got[0][0] == 1 && got[1][1] == 1, "rank 1 answered router %d (forwarded?)",
                  got[0][1] ? 0 : 1);
    int w, k;
    pdm_wire_msg_t *extra = g_recv(rt, &w, &k, 1.0);
    ck_assert_msg(extra == NULL, "an extra %s",
                  extra ? pdm_wire_type_name(pdm_wire_type(extra)) : "");
    free(logits);
    fw_stop(&f);
}
END_TEST

/* ---- A real router meets a formation refusal ------------------------------------------- */

/* One message from the second router's socket (registrations acked with long heartbeats, so
 * the test need not answer any), or NULL after `seconds`. *rank: whose (-1: unknown). */
static pdm_wire_msg_t *f_recv(grouter_t *g, int *rank, double seconds)
{
    const double deadline = pdm_now() + seconds;
    while (pdm_now() < deadline) {
        zmq_pollitem_t it = {g->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 50) <= 0) continue;
        uint8_t ident[256];
        int il = zmq_recv(g->sock, ident, sizeof(ident), 0);
        ck_assert_int_gt(il, 0);
        zmq_msg_t f;
        zmq_msg_init(&f);
        ck_assert_int_ge(zmq_msg_recv(&f, g->sock, 0), 0);
        pdm_wire_msg_t *m;
        ck_assert_int_eq(pdm_wire_unpack(zmq_msg_data(&f), zmq_msg_size(&f), PDM_WIRE_MAX_FRAME,
                                         0, &m), 0);
        zmq_msg_close(&f);
        int k = -1;
        for (int j = 0; j < 2; j++)
            if (g->ident_len[j] == (size_t)il && !memcmp(g->ident[j], ident, (size_t)il)) k = j;
        if (pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_REGISTER) {
            const Pdmesh__Register *r = (const Pdmesh__Register *)pdm_wire_message(m);
            k = r->node_id[strlen(r->node_id) - 1] - '0'; /* "sf/0", "sf/1" */
            ck_assert(k == 0 || k == 1);
            memcpy(g->ident[k], ident, (size_t)il);
            g->ident_len[k] = (size_t)il;
            free(g->ucx[k].data);
            g->ucx[k].data = malloc(r->ucx_address.len);
            memcpy(g->ucx[k].data, r->ucx_address.data, r->ucx_address.len);
            g->ucx[k].len = r->ucx_address.len;
            Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
            ack.epoch = EPOCH;
            ack.heartbeat_ms = 60000;
            ack.lease_ms = 600000;
            ack.router_id = g->id;
            pdm_wire_send(g->sock, ident, (size_t)il, PDMESH__MSG_TYPE__MSG_REGISTER_ACK,
                          &ack.base);
        } else if (pdm_wire_type(m) != PDMESH__MSG_TYPE__MSG_HEARTBEAT) {
            *rank = k;
            return m;
        }
        pdm_wire_msg_free(m);
    }
    return NULL;
}

/* One greedy request of 24 prompt tokens through the router at `ep`. */
static void sf_generate(const char *ep, pdm_client_result_t *res)
{
    int32_t prompt[24];
    for (int i = 0; i < 24; i++) prompt[i] = 1 + (i * 7) % 50;
    pdm_client_t *c;
    pdm_client_options_t o = {0};
    o.timeout_ms = 40000;
    ck_assert_int_eq(pdm_client_create(ep, &o, &c), 0);
    pdm_client_request_t req;
    pdm_client_request_init(&req);
    req.prompt_tokens = prompt;
    req.n_prompt_tokens = 24;
    req.max_tokens = 4;
    req.ignore_eos = 1;
    memset(res, 0, sizeof(*res));
    pdm_client_generate(c, &req, res);
    pdm_client_destroy(c);
}

/* Issue 19: a group task refused for another formation (the group re-formed under another
 * router's GroupWire) is not a failure of the group. A real router, decode node and 2-rank
 * group; a second router (this test) re-wires rank 0 alone, so the router's next task is
 * refused with ERR_STALE_FORMATION. The router must wire the group again and run the task
 * through the group at once: the request ends ok via the group in its second attempt. Had
 * the router taken the refusal for a failure, it would have suspected the group and the
 * second attempt would have been prefilled by the decode node (no group in its usage). */
START_TEST(test_router_stale_formation)
{
    char dir[64], client_ep[160], node_ep[160], admin_ep[160];
    snprintf(dir, sizeof(dir), "/tmp/pdm-sf-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(client_ep, sizeof(client_ep), "ipc://%s/client", dir);
    snprintf(node_ep, sizeof(node_ep), "ipc://%s/node", dir);
    snprintf(admin_ep, sizeof(admin_ep), "ipc://%s/admin", dir);
    grouter_t fake;
    memset(&fake, 0, sizeof(fake));
    void *ctx = zmq_ctx_new();
    snprintf(fake.ep, sizeof(fake.ep), "ipc://%s/fake", dir);
    fake.id = 0x5151515151515151ull;
    fake.sock = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(fake.sock, ZMQ_LINGER, &zero, sizeof(zero));
    ck_assert_int_eq(zmq_bind(fake.sock, fake.ep), 0);
    setenv("PDMESH_SECRET", SECRET, 1);
    pid_t pid[4];
    const char *router_argv[] = {bin("PDMESH_ROUTER_BIN", "build/bin/pdmesh-router"), "--model",
                                 model_path, "--client", client_ep, "--node", node_ep, "--admin",
                                 admin_ep, "--http-port", "-1", "--local-threshold", "4",
                                 "--max-attempts", "4", "--method", "kvr-e", NULL};
    /* the router has no --exit-with-parent: it dies with this test process (a failed check
     * ends it before the kills below) */
    const pid_t parent = getpid();
    pid[0] = fork();
    ck_assert_int_ge(pid[0], 0);
    if (pid[0] == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        execvp(router_argv[0], (char *const *)router_argv);
        _exit(127);
    }
    const char *decode_argv[] = {bin("PDMESH_DECODE_BIN", "build/bin/pdmesh-decode"), "--model",
                                 model_path, "--router", node_ep, "--node-id", "sf-d",
                                 "--exit-with-parent", NULL};
    ck_assert_int_eq(posix_spawnp(&pid[1], decode_argv[0], NULL, NULL,
                                  (char *const *)decode_argv, environ), 0);
    for (int k = 0; k < 2; k++) {
        char rank[4], id[16];
        snprintf(rank, sizeof(rank), "%d", k);
        snprintf(id, sizeof(id), "sf/%d", k);
        const char *argv[] = {bin("PDMESH_PREFILL_BIN", "build/bin/pdmesh-prefill"), "--node-id",
                              id, "--group", "sf", "--rank", rank, "--group-size", "2",
                              "--timeout", "10", "--model", model_path, "--router", node_ep,
                              "--router", fake.ep, "--exit-with-parent", NULL};
        ck_assert_int_eq(posix_spawnp(&pid[2 + k], argv[0], NULL, NULL, (char *const *)argv,
                                      environ), 0);
    }
    /* both ranks registered here too; then a first request goes through the group */
    int rank;
    for (double end = pdm_now() + 20; (!fake.ident_len[0] || !fake.ident_len[1]) &&
                                      pdm_now() < end;) {
        pdm_wire_msg_t *m = f_recv(&fake, &rank, 0.2);
        pdm_wire_msg_free(m);
    }
    ck_assert_msg(fake.ident_len[0] && fake.ident_len[1], "the ranks did not register");
    pdm_client_result_t res;
    for (double end = pdm_now() + 30;;) { /* until the router has wired the group */
        sf_generate(client_ep, &res);
        const int via_group = res.status == 0 && !strcmp(res.usage.prefill_group, "sf");
        pdm_client_result_fini(&res);
        if (via_group) break;
        ck_assert_msg(pdm_now() < end, "no request through the group: %s", res.error);
        usleep(200000);
    }

    /* the second router re-wires rank 0 as a group of its own */
    Pdmesh__GroupWire w = PDMESH__GROUP_WIRE__INIT;
    w.epoch = EPOCH;
    w.group = "sf";
    w.rank = 0;
    w.size = 1;
    w.ucx_addresses = &fake.ucx[0];
    w.n_ucx_addresses = 1;
    ck_assert_int_eq(pdm_wire_send(fake.sock, fake.ident[0], fake.ident_len[0],
                                   PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base), 0);
    pdm_wire_msg_t *m = f_recv(&fake, &rank, 20);
    ck_assert_msg(m && pdm_wire_type(m) == PDMESH__MSG_TYPE__MSG_GROUP_READY && rank == 0,
                  "no GroupReady from rank 0");
    const Pdmesh__GroupReady *ready = (const Pdmesh__GroupReady *)pdm_wire_message(m);
    ck_assert_msg(ready->ok, "rank 0 did not re-form alone");
    pdm_wire_msg_free(m);

    /* the router's next task is refused (stale formation), the group re-wired and the task
     * run by it in the next attempt */
    sf_generate(client_ep, &res);
    ck_assert_msg(res.status == 0, "request failed: %s", res.error);
    ck_assert_int_eq(res.n_tokens, 4);
    ck_assert_msg(!strcmp(res.usage.prefill_group, "sf") && res.usage.attempts == 2,
                  "attempt %u prefilled by '%s' (expected the group's second attempt)",
                  res.usage.attempts, res.usage.prefill_group);
    pdm_client_result_fini(&res);
    /* and the group stays in use (not suspected): the next request goes through it at once */
    sf_generate(client_ep, &res);
    ck_assert_msg(res.status == 0 && !strcmp(res.usage.prefill_group, "sf") &&
                  res.usage.attempts == 1, "next request: %s, attempt %u via '%s'", res.error,
                  res.usage.attempts, res.usage.prefill_group);
    pdm_client_result_fini(&res);

    for (int j = 0; j < 4; j++) {
        kill(pid[j], SIGKILL);
        waitpid(pid[j], NULL, 0);
    }
    zmq_close(fake.sock);
    for (int k = 0; k < 2; k++) free(fake.ucx[k].data);
    zmq_ctx_term(ctx);
    const char *files[] = {"client", "node", "admin", "fake"};
    for (int j = 0; j < 4; j++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/%s", dir, files[j]);
        unlink(path);
    }
    rmdir(dir);
}
END_TEST

static void setup(void)
{
    make_model();
    setenv("UCX_HANDLE_ERRORS", "none", 0);
}

Suite *suite_nodeproto(void)
{
    Suite *s = suite_create("nodeproto");
    TCase *tc = tcase_create("daemons");
    tcase_add_unchecked_fixture(tc, setup, NULL);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_decode_node_protocol);
    tcase_add_test(tc, test_prefill_rank_protocol);
    tcase_add_test(tc, test_prefill_group_forwarding);
    tcase_add_test(tc, test_prefill_group_unordered);
    tcase_add_test(tc, test_router_stale_formation);
    suite_add_tcase(s, tc);
    return s;
}
