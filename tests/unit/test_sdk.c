/*
 * test_sdk.c - libpdmesh (sdk/) against real ZeroMQ sockets: argument validation, status
 * strings, timeouts against a bound socket nobody serves, an unreachable endpoint, and the
 * client's multiplexing, streaming, cancel and error paths against a scripted peer (a ROUTER
 * socket in a thread speaking the pdmesh frame format with fixed answers). The router itself
 * is exercised by tests/integration/sdk.sh; this suite pins the client's own behaviour,
 * including replies a well-behaved router never sends (garbage, unknown ids).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/pdm.h"
#include "common/wire.h"
#include "model/model.h"
#include "sdk/pdmesh_admin.h"
#include "sdk/pdmesh_client.h"
#include "tests.h"

/* ---- the scripted peer ---- */

typedef struct {
    void *ctx, *sock;
    char endpoint[128];
    pthread_t thread;
    atomic_int stop;
    atomic_int cancels;     /* CancelRequests received */
    atomic_int requests;    /* GenerateRequests received */
    int silent;             /* bind, never answer */
    const char *admin_token; /* answer AdminRequests, checking this token */
} peer_t;

static void peer_send(peer_t *p, zmq_msg_t *ident, int type, const ProtobufCMessage *m)
{
    ck_assert_int_eq(pdm_wire_send(p->sock, zmq_msg_data(ident), zmq_msg_size(ident), type, m),
                     PDM_OK);
}

static void peer_chunk(peer_t *p, zmq_msg_t *ident, uint64_t id, uint32_t index, int32_t tok,
                       const char *text)
{
    Pdmesh__TokenChunk t = PDMESH__TOKEN_CHUNK__INIT;
    t.request_id = id;
    t.index = index;
    t.tokens = &tok;
    t.n_tokens = 1;
    t.text = (char *)text;
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK, &t.base);
}

/* OpenAI's n = 2 over two scripted routers (test_failover_choices): the completions of
 * choice 0 and choice 1 of the prompt "nfail" (one token per character), the request's seed,
 * and how much the first router sends before it dies. */
#define NFAIL_SEED 7u
static const char *const nfail_text[2] = {"abcd", "xyz"};

static void peer_nchunk(peer_t *p, zmq_msg_t *ident, uint64_t id, uint32_t choice,
                        uint32_t index, char c)
{
    int32_t tok = (unsigned char)c;
    char text[2] = {c, 0};
    Pdmesh__TokenChunk t = PDMESH__TOKEN_CHUNK__INIT;
    t.request_id = id;
    t.choice = choice;
    t.index = index;
    t.tokens = &tok;
    t.n_tokens = 1;
    t.text = text;
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK, &t.base);
}

static void peer_nresult(peer_t *p, zmq_msg_t *ident, uint64_t id, uint32_t choice,
                         const char *text)
{
    int32_t toks[8];
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i++) toks[i] = (unsigned char)text[i];
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    u.prompt_tokens = 5;
    u.completion_tokens = (uint32_t)n;
    Pdmesh__GenerateResult r = PDMESH__GENERATE_RESULT__INIT;
    r.request_id = id;
    r.choice = choice;
    r.finish = PDMESH__FINISH_REASON__FINISH_EOS;
    r.tokens = toks;
    r.n_tokens = n;
    r.text = (char *)text;
    r.usage = &u;
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_GENERATE_RESULT, &r.base);
}

/* "nfail" / "nfail keep" with n = 2 (the first router): choice 0's first two tokens and
 * choice 1's first one ("nfail keep": choice 1 whole and its result), then nothing (the test
 * kills this peer). One choice going on alone (resume_choice, the next router): the rest of
 * that choice's text after its resume tokens, told apart by its seed; a wrong seed, resume or
 * flag is refused (ERR_INVALID_ARGUMENT). */
static void peer_nfail(peer_t *p, zmq_msg_t *ident, const Pdmesh__GenerateRequest *q)
{
    const uint64_t seed = q->sampling ? q->sampling->seed : 0;
    if (q->n == 2 && !q->resume_choice && !q->n_resume_tokens && seed == NFAIL_SEED) {
        peer_nchunk(p, ident, q->request_id, 0, 0, 'a');
        peer_nchunk(p, ident, q->request_id, 0, 1, 'b');
        const int keep = strstr(q->prompt, "keep") != NULL;
        for (uint32_t i = 0; i < (keep ? 3u : 1u); i++)
            peer_nchunk(p, ident, q->request_id, 1, i, nfail_text[1][i]);
        if (keep) peer_nresult(p, ident, q->request_id, 1, nfail_text[1]);
        return;
    }
    const int k = seed == NFAIL_SEED ? 0 : seed == pdm_seed_for_choice(NFAIL_SEED, 1) ? 1 : -1;
    const char *text = k >= 0 ? nfail_text[k] : "";
    int ok = k >= 0 && q->resume_choice && q->n <= 1 && q->n_resume_tokens <= strlen(text);
    for (size_t i = 0; ok && i < q->n_resume_tokens; i++)
        ok = q->resume_tokens[i] == (unsigned char)text[i];
    if (!ok) {
        ck_assert_int_eq(pdm_wire_send_error(p->sock, zmq_msg_data(ident), zmq_msg_size(ident),
                                             PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                                             q->request_id, "nfail: unexpected request (n %u, "
                                             "seed %llu, resume_choice %d, %zu resume tokens)",
                                             q->n, (unsigned long long)seed, q->resume_choice,
                                             q->n_resume_tokens), PDM_OK);
        return;
    }
    for (size_t i = q->n_resume_tokens; text[i]; i++)
        peer_nchunk(p, ident, q->request_id, 0, (uint32_t)i, text[i]);
    peer_nresult(p, ident, q->request_id, 0, text);
}

/* Answers by the prompt's first word:
 *   "echo ..."     Accepted, one chunk per character of the prompt after "echo " (token =
 *                  the byte, when streaming), then the result (text = that rest)
 *   "hang"         Accepted and one chunk, then nothing
 *   "overload"     Error ERR_OVERLOADED
 *   "garbage ..."  a malformed frame and a result for an unknown id, then like echo */
static void peer_generate(peer_t *p, zmq_msg_t *ident, const Pdmesh__GenerateRequest *q)
{
    const char *prompt = q->prompt ? q->prompt : "";
    Pdmesh__Accepted a = PDMESH__ACCEPTED__INIT;
    a.request_id = q->request_id;
    a.router_request_id = 1000 + q->request_id;
    if (!strncmp(prompt, "overload", 8)) {
        ck_assert_int_eq(pdm_wire_send_error(p->sock, zmq_msg_data(ident), zmq_msg_size(ident),
                                             PDMESH__ERROR_CODE__ERR_OVERLOADED, q->request_id,
                                             "admission queue full (%d)", 7), PDM_OK);
        return;
    }
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_ACCEPTED, &a.base);
    if (!strncmp(prompt, "nfail", 5)) {
        peer_nfail(p, ident, q);
        return;
    }
    if (!strcmp(prompt, "hang")) {
        peer_chunk(p, ident, q->request_id, 0, 42, "x");
        return;
    }
    const char *rest = strchr(prompt, ' ') ? strchr(prompt, ' ') + 1 : "";
    if (!strncmp(prompt, "garbage", 7)) {
        zmq_send(p->sock, zmq_msg_data(ident), zmq_msg_size(ident), ZMQ_SNDMORE);
        zmq_send(p->sock, "PD\x01\x00\x00\x04\x00\x00\xff\xff\xff", 11, 0);
        Pdmesh__GenerateResult other = PDMESH__GENERATE_RESULT__INIT;
        other.request_id = q->request_id + 999999;
        other.text = "not yours";
        peer_send(p, ident, PDMESH__MSG_TYPE__MSG_GENERATE_RESULT, &other.base);
    }
    size_t n = strlen(rest);
    int32_t *toks = malloc((n + 1) * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) {
        toks[i] = (unsigned char)rest[i];
        char s[2] = {rest[i], 0};
        if (q->stream) peer_chunk(p, ident, q->request_id, (uint32_t)i, toks[i], s);
    }
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    u.prompt_tokens = 5;
    u.completion_tokens = (uint32_t)n;
    u.prefill_method = "single";
    u.decode_node = "decode-0";
    Pdmesh__GenerateResult r = PDMESH__GENERATE_RESULT__INIT;
    r.request_id = q->request_id;
    r.finish = PDMESH__FINISH_REASON__FINISH_LENGTH;
    r.tokens = toks;
    r.n_tokens = n;
    r.text = (char *)rest;
    r.usage = &u;
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_GENERATE_RESULT, &r.base);
    free(toks);
}

static void peer_admin(peer_t *p, zmq_msg_t *ident, const Pdmesh__AdminRequest *q)
{
    Pdmesh__AdminReply r = PDMESH__ADMIN_REPLY__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    Pdmesh__KeyValue kv = PDMESH__KEY_VALUE__INIT, *kvp = &kv;
    if (!q->token || strcmp(q->token, p->admin_token)) {
        e.code = PDMESH__ERROR_CODE__ERR_UNAUTHORIZED;
        e.message = "bad admin token";
        r.error = &e;
    } else {
        r.ok = 1;
        kv.key = "requests_total";
        kv.value = "3";
        r.values = &kvp;
        r.n_values = 1;
    }
    peer_send(p, ident, PDMESH__MSG_TYPE__MSG_ADMIN_REPLY, &r.base);
}

static void *peer_main(void *arg)
{
    peer_t *p = arg;
    while (!atomic_load(&p->stop)) {
        zmq_pollitem_t it = {p->sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 20) <= 0) continue;
        zmq_msg_t ident, body;
        zmq_msg_init(&ident);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&ident, p->sock, 0) < 0 || zmq_msg_recv(&body, p->sock, 0) < 0) {
            zmq_msg_close(&ident);
            zmq_msg_close(&body);
            continue;
        }
        pdm_wire_msg_t *m;
        if (!p->silent &&
            pdm_wire_unpack(zmq_msg_data(&body), zmq_msg_size(&body), 1 << 20, 0, &m) == 0) {
            ProtobufCMessage *msg = pdm_wire_message(m);
            switch (pdm_wire_type(m)) {
            case PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST:
                atomic_fetch_add(&p->requests, 1);
                peer_generate(p, &ident, (Pdmesh__GenerateRequest *)msg);
                break;
            case PDMESH__MSG_TYPE__MSG_CANCEL_REQUEST: atomic_fetch_add(&p->cancels, 1); break;
            case PDMESH__MSG_TYPE__MSG_PING:
                peer_send(p, &ident, PDMESH__MSG_TYPE__MSG_PONG, msg);
                break;
            case PDMESH__MSG_TYPE__MSG_ADMIN_REQUEST:
                peer_admin(p, &ident, (Pdmesh__AdminRequest *)msg);
                break;
            default: break;
            }
            pdm_wire_msg_free(m);
        }
        zmq_msg_close(&ident);
        zmq_msg_close(&body);
    }
    return NULL;
}

static void peer_start(peer_t *p, int silent)
{
    memset(p, 0, sizeof(*p));
    p->silent = silent;
    p->admin_token = "secret-admin-token";
    p->ctx = zmq_ctx_new();
    p->sock = zmq_socket(p->ctx, ZMQ_ROUTER);
    int zero = 0, one = 1;
    zmq_setsockopt(p->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(p->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    ck_assert_int_eq(zmq_bind(p->sock, "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof(p->endpoint);
    zmq_getsockopt(p->sock, ZMQ_LAST_ENDPOINT, p->endpoint, &len);
    ck_assert_int_eq(pthread_create(&p->thread, NULL, peer_main, p), 0);
}

static void peer_stop(peer_t *p)
{
    atomic_store(&p->stop, 1);
    pthread_join(p->thread, NULL);
    zmq_close(p->sock);
    zmq_ctx_term(p->ctx);
}

/* A free TCP port on loopback that nobody listens on (bound, then closed). */
static void dead_endpoint(char *out, size_t cap)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    ck_assert_int_eq(zmq_bind(s, "tcp://127.0.0.1:*"), 0);
    size_t len = cap;
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, out, &len);
    zmq_close(s);
    zmq_ctx_term(ctx);
}

/* ---- tests ---- */

START_TEST(test_status_strings)
{
    ck_assert_str_eq(pdm_client_strerror(PDM_CLIENT_OK), "ok");
    ck_assert_str_eq(pdm_client_status_name(PDM_CLIENT_ETIMEOUT), "ETIMEOUT");
    ck_assert_str_eq(pdm_client_status_name(PDM_CLIENT_EUNREACHABLE), "EUNREACHABLE");
    /* router codes are the proto's ErrorCode negated */
    ck_assert_int_eq(PDM_CLIENT_EOVERLOADED, -PDMESH__ERROR_CODE__ERR_OVERLOADED);
    ck_assert_int_eq(PDM_CLIENT_EKV_TRANSFER, -PDMESH__ERROR_CODE__ERR_KV_TRANSFER);
    ck_assert_int_eq(PDM_CLIENT_ECANCELLED, -PDMESH__ERROR_CODE__ERR_CANCELLED);
    ck_assert_str_eq(pdm_client_strerror(12345), "unknown status");
}
END_TEST

/* The seeds of OpenAI's n choices: the SDK's failover of a choice (sdk/client.c) sends the
 * seed the router and the decode node derive (pdm_sampler_seed_for_choice). The same values
 * pin the Python SDK's copy (tests/integration/sdk_python.py seeds). */
START_TEST(test_seed_for_choice)
{
    static const struct {
        uint64_t seed;
        int i;
        uint64_t want;
    } known[] = {
        {PDM_SEED_DEFAULT, 0, 0x5eedull},
        {PDM_SEED_DEFAULT, 1, 0xbf61994367a404f7ull},
        {PDM_SEED_DEFAULT, 2, 0x8bf7ae6268510a62ull},
        {PDM_SEED_DEFAULT, 3, 0xea51ef4ce9ddb022ull},
        {7, 1, 0x6078bf180ff8632full},
        {7, 3, 0xdcfa1426c230ef5full},
        {42, 2, 0xfa797f03f3c87f80ull},
        {0xffffffffffffffffull, 0, 0xffffffffffffffffull},
        {0xffffffffffffffffull, 1, 0x6a5ca13be3a3489eull},
        {0xffffffffffffffffull, 3, 0x294a8675f849beddull},
    };
    for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++) {
        ck_assert_uint_eq(pdm_seed_for_choice(known[k].seed, known[k].i), known[k].want);
        ck_assert_uint_eq(pdm_sampler_seed_for_choice(known[k].seed, known[k].i),
                          known[k].want);
    }
    /* a request without a seed samples with the default (model.h sampling parameters) */
    pdm_sampler_params_t p;
    pdm_sampler_params_default(&p);
    ck_assert_uint_eq(p.seed, PDM_SEED_DEFAULT);
}
END_TEST

START_TEST(test_validation)
{
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(NULL, NULL, NULL), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_options_t bad = {.timeout_ms = -1};
    ck_assert_int_eq(pdm_client_create("tcp://127.0.0.1:1", &bad, &c),
                     PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_int_eq(pdm_client_create("nonsense://x", NULL, &c), PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(pdm_client_last_error(), "nonsense://x"));
    ck_assert_int_eq(pdm_client_create("tcp://127.0.0.1:1", NULL, &c), PDM_CLIENT_OK);

    pdm_client_request_t q;
    pdm_client_result_t r;
    int32_t toks[2] = {1, -5};
    const char *stops[17];
    for (int i = 0; i < 17; i++) stops[i] = "s";
    pdm_client_message_t bad_role = {.role = "robot", .content = "hi"};
    /* no prompt at all */
    pdm_client_request_init(&q);
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(r.error, "exactly one"));
    ck_assert_str_eq(r.text, "");
    pdm_client_result_fini(&r);
    /* two prompts */
    q.prompt = "a";
    q.prompt_tokens = toks;
    q.n_prompt_tokens = 1;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    /* negative token id */
    q.prompt = NULL;
    q.n_prompt_tokens = 2;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(r.error, "negative"));
    pdm_client_result_fini(&r);
    /* bad sampling */
    pdm_client_request_init(&q);
    q.prompt = "a";
    q.temperature = -1;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    q.temperature = 0.0f / 0.0f;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    q.temperature = 0;
    q.top_p = 1.5f;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    /* too many / empty stop strings */
    pdm_client_request_init(&q);
    q.prompt = "a";
    q.stop = stops;
    q.n_stop = 17;
    ck_assert_int_eq(pdm_client_generate_stream(c, &q, NULL, NULL, &r),
                     PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    stops[0] = "";
    q.n_stop = 1;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    /* beams */
    pdm_client_request_init(&q);
    q.prompt = "a";
    q.beams = 65;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    q.beams = 2;
    q.n_best = 3;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    /* chat roles */
    pdm_client_request_init(&q);
    q.messages = &bad_role;
    q.n_messages = 1;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(r.error, "role"));
    pdm_client_result_fini(&r);
    /* NULLs */
    ck_assert_int_eq(pdm_client_generate(c, NULL, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    ck_assert_int_eq(pdm_client_generate(NULL, &q, &r), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_result_fini(&r);
    ck_assert_int_eq(pdm_client_cancel(c, 0), PDM_CLIENT_EINVALID_ARGUMENT);
    pdm_client_destroy(c);
    pdm_client_destroy(NULL);
}
END_TEST

/* A router that does not answer: a bound socket nobody serves. The call must end with
 * ETIMEOUT within its timeout (plus scheduling slack), not hang and not claim unreachable. */
START_TEST(test_timeout_silent_router)
{
    peer_t p;
    peer_start(&p, 1);
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(p.endpoint, NULL, &c), PDM_CLIENT_OK);
    pdm_client_request_t q;
    pdm_client_request_init(&q);
    q.prompt = "echo hello";
    q.timeout_ms = 400;
    pdm_client_result_t r;
    double t0 = pdm_now();
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_ETIMEOUT);
    double dt = pdm_now() - t0;
    ck_assert_msg(dt >= 0.39 && dt < 2.0, "timeout after %.3f s (want 0.4)", dt);
    ck_assert_ptr_nonnull(strstr(r.error, "400 ms"));
    pdm_client_result_fini(&r);
    ck_assert_int_eq(pdm_client_ping(c, 300), PDM_CLIENT_ETIMEOUT);
    pdm_client_destroy(c);
    peer_stop(&p);
}
END_TEST

START_TEST(test_unreachable)
{
    char ep[128];
    dead_endpoint(ep, sizeof(ep));
    pdm_client_options_t o = {.connect_timeout_ms = 300};
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(ep, &o, &c), PDM_CLIENT_OK);
    pdm_client_request_t q;
    pdm_client_request_init(&q);
    q.prompt = "echo hello";
    q.timeout_ms = 10000;
    pdm_client_result_t r;
    double t0 = pdm_now();
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EUNREACHABLE);
    double dt = pdm_now() - t0;
    ck_assert_msg(dt < 2.0, "unreachable reported after %.3f s", dt);
    ck_assert_ptr_nonnull(strstr(r.error, "unreachable"));
    pdm_client_result_fini(&r);
    ck_assert_int_eq(pdm_client_ping(c, 5000), PDM_CLIENT_EUNREACHABLE);
    pdm_client_destroy(c);
}
END_TEST

typedef struct {
    char text[4096];
    size_t len;
    uint32_t next_index;
    int calls, stop_after;
} collect_t;

static int collect_cb(const pdm_client_chunk_t *ch, void *data)
{
    collect_t *col = data;
    ck_assert_uint_eq(ch->index, col->next_index);
    col->next_index += (uint32_t)ch->n_tokens;
    memcpy(col->text + col->len, ch->text, ch->text_len);
    col->len += ch->text_len;
    col->text[col->len] = 0;
    return ++col->calls == col->stop_after;
}

START_TEST(test_generate_and_stream)
{
    peer_t p;
    peer_start(&p, 0);
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(p.endpoint, NULL, &c), PDM_CLIENT_OK);
    ck_assert_int_eq(pdm_client_ping(c, 5000), PDM_CLIENT_OK);
    pdm_client_request_t q;
    pdm_client_request_init(&q);
    q.prompt = "echo hello world";
    pdm_client_result_t r;
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_OK);
    ck_assert_str_eq(r.text, "hello world");
    ck_assert_uint_eq(r.n_tokens, 11);
    ck_assert_int_eq(r.tokens[0], 'h');
    ck_assert_int_eq(r.finish, PDM_CLIENT_FINISH_LENGTH);
    ck_assert_uint_eq(r.usage.prompt_tokens, 5);
    ck_assert_str_eq(r.usage.decode_node, "decode-0");
    ck_assert_uint_eq(r.router_id, 1000 + r.id);
    pdm_client_result_fini(&r);

    collect_t col = {0};
    ck_assert_int_eq(pdm_client_generate_stream(c, &q, collect_cb, &col, &r), PDM_CLIENT_OK);
    ck_assert_str_eq(col.text, "hello world");
    ck_assert_int_eq(col.calls, 11);
    ck_assert_str_eq(r.text, "hello world");
    ck_assert(r.client_ttft_ms > 0 && r.client_ttft_ms <= r.client_total_ms);
    pdm_client_result_fini(&r);

    /* a malformed frame and a result for somebody else's id are dropped */
    q.prompt = "garbage ok";
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_OK);
    ck_assert_str_eq(r.text, "ok");
    pdm_client_result_fini(&r);

    /* typed router error */
    q.prompt = "overload";
    ck_assert_int_eq(pdm_client_generate(c, &q, &r), PDM_CLIENT_EOVERLOADED);
    ck_assert_ptr_nonnull(strstr(r.error, "admission queue full (7)"));
    ck_assert_ptr_nonnull(strstr(pdm_client_last_error(), "admission queue full"));
    pdm_client_result_fini(&r);

    /* a callback that asks to stop cancels the call and tells the router */
    q.prompt = "echo abcdefgh";
    col = (collect_t){.stop_after = 2};
    ck_assert_int_eq(pdm_client_generate_stream(c, &q, collect_cb, &col, &r),
                     PDM_CLIENT_ECANCELLED);
    ck_assert_int_eq(col.calls, 2);
    ck_assert_str_eq(r.text, "ab"); /* what was streamed before the cancel is kept */
    pdm_client_result_fini(&r);
    for (int i = 0; i < 100 && atomic_load(&p.cancels) < 1; i++) usleep(10000);
    ck_assert_int_ge(atomic_load(&p.cancels), 1);
    pdm_client_destroy(c);
    peer_stop(&p);
}
END_TEST

/* The chunks of an n = 2 stream per choice; once `kill_after` chunks came, the first router
 * (a peer) is stopped, after a pause that lets its queued frames reach the client. */
typedef struct {
    char text[2][16];
    uint32_t next[2];
    int gap, chunks, kill_after;
    peer_t *first;
} nfail_col_t;

static int nfail_cb(const pdm_client_chunk_t *ch, void *data)
{
    nfail_col_t *col = data;
    if (ch->choice > 1 || ch->index != col->next[ch->choice] || ch->n_tokens != 1) {
        col->gap = 1;
        return 0;
    }
    size_t len = strlen(col->text[ch->choice]);
    if (len + 1 < sizeof(col->text[0])) col->text[ch->choice][len] = ch->text[0];
    col->next[ch->choice]++;
    if (++col->chunks == col->kill_after) {
        usleep(200 * 1000);
        peer_stop(col->first); /* the connection drops: the call fails over */
    }
    return 0;
}

/* OpenAI's n = 2 when its router dies after both choices delivered tokens: each unfinished
 * choice goes on alone at the next router (n 1, its seed pdm_seed_for_choice(seed, i), its
 * delivered tokens, resume_choice), a choice whose result came is kept; every choice's
 * stream is contiguous and the result holds both, usage summed. */
START_TEST(test_failover_choices)
{
    for (int keep = 0; keep < 2; keep++) {
        peer_t first, next;
        peer_start(&first, 0);
        peer_start(&next, 0);
        char list[300];
        snprintf(list, sizeof(list), "%s,%s", first.endpoint, next.endpoint);
        pdm_client_t *c;
        ck_assert_int_eq(pdm_client_create(list, NULL, &c), PDM_CLIENT_OK);
        ck_assert_int_eq(pdm_client_ping(c, 5000), PDM_CLIENT_OK); /* the first is connected */
        pdm_client_request_t q;
        pdm_client_request_init(&q);
        q.prompt = keep ? "nfail keep" : "nfail";
        q.n = 2;
        q.temperature = 0.8f;
        q.seed = NFAIL_SEED;
        q.timeout_ms = 20000;
        nfail_col_t col = {.kill_after = keep ? 5 : 3, .first = &first};
        pdm_client_result_t r;
        int rc = pdm_client_generate_stream(c, &q, nfail_cb, &col, &r);
        ck_assert_msg(rc == PDM_CLIENT_OK, "keep %d: %s", keep, r.error);
        ck_assert_int_eq(col.gap, 0);
        ck_assert_str_eq(col.text[0], nfail_text[0]);
        ck_assert_str_eq(col.text[1], nfail_text[1]);
        ck_assert_uint_eq(r.n_choices, 2);
        for (uint32_t i = 0; i < 2; i++) {
            ck_assert_uint_eq(r.choices[i].index, i);
            ck_assert_str_eq(r.choices[i].text, nfail_text[i]);
            ck_assert_uint_eq(r.choices[i].n_tokens, strlen(nfail_text[i]));
            ck_assert_int_eq(r.choices[i].finish, PDM_CLIENT_FINISH_EOS);
        }
        ck_assert_str_eq(r.text, nfail_text[0]);
        ck_assert_uint_eq(r.usage.completion_tokens, 7);
        /* choice 0 went on alone, choice 1 too unless its result had come */
        ck_assert_int_eq(atomic_load(&next.requests), keep ? 1 : 2);
        pdm_client_result_fini(&r);
        pdm_client_destroy(c);
        peer_stop(&next);
    }
}
END_TEST

typedef struct {
    pdm_client_t *c;
    uint64_t id;
    int rc;
    double seconds;
} cancel_arg_t;

static void *hang_call(void *arg)
{
    cancel_arg_t *a = arg;
    pdm_client_request_t q;
    pdm_client_request_init(&q);
    q.prompt = "hang";
    q.id = a->id;
    q.timeout_ms = 20000;
    pdm_client_result_t r;
    double t0 = pdm_now();
    a->rc = pdm_client_generate_stream(a->c, &q, NULL, NULL, &r);
    a->seconds = pdm_now() - t0;
    pdm_client_result_fini(&r);
    return NULL;
}

START_TEST(test_cancel_from_other_thread)
{
    peer_t p;
    peer_start(&p, 0);
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(p.endpoint, NULL, &c), PDM_CLIENT_OK);
    cancel_arg_t a = {.c = c, .id = pdm_client_new_id(c)};
    pthread_t t;
    pthread_create(&t, NULL, hang_call, &a);
    for (int i = 0; i < 500 && atomic_load(&p.requests) < 1; i++) usleep(10000);
    usleep(50000);
    ck_assert_int_eq(pdm_client_cancel(c, a.id), PDM_CLIENT_OK);
    pthread_join(t, NULL);
    ck_assert_int_eq(a.rc, PDM_CLIENT_ECANCELLED);
    ck_assert_msg(a.seconds < 10, "cancel took %.3f s", a.seconds);
    for (int i = 0; i < 100 && atomic_load(&p.cancels) < 1; i++) usleep(10000);
    ck_assert_int_eq(atomic_load(&p.cancels), 1);
    /* cancelling before the call starts: no race, the call ends at once */
    cancel_arg_t b = {.c = c, .id = pdm_client_new_id(c)};
    ck_assert_int_eq(pdm_client_cancel(c, b.id), PDM_CLIENT_ENOT_FOUND);
    hang_call(&b);
    ck_assert_int_eq(b.rc, PDM_CLIENT_ECANCELLED);
    ck_assert(b.seconds < 1.0);
    pdm_client_destroy(c);
    peer_stop(&p);
}
END_TEST

/* 32 threads share one client: every call gets its own answer (multiplexing by id). */
typedef struct {
    pdm_client_t *c;
    int n, ok;
} many_arg_t;

static void *many_call(void *arg)
{
    many_arg_t *a = arg;
    char prompt[80], want[64];
    for (int k = 0; k < 5; k++) {
        snprintf(want, sizeof(want), "thread %d call %d", a->n, k);
        snprintf(prompt, sizeof(prompt), "echo %s", want);
        pdm_client_request_t q;
        pdm_client_request_init(&q);
        q.prompt = prompt;
        collect_t col = {0};
        pdm_client_result_t r;
        int rc = k % 2 ? pdm_client_generate(a->c, &q, &r)
                       : pdm_client_generate_stream(a->c, &q, collect_cb, &col, &r);
        if (rc == PDM_CLIENT_OK && !strcmp(r.text, want) && (k % 2 || !strcmp(col.text, want)))
            a->ok++;
        pdm_client_result_fini(&r);
    }
    return NULL;
}

START_TEST(test_concurrent_threads)
{
    peer_t p;
    peer_start(&p, 0);
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(p.endpoint, NULL, &c), PDM_CLIENT_OK);
    pthread_t th[32];
    many_arg_t args[32];
    for (int i = 0; i < 32; i++) {
        args[i] = (many_arg_t){.c = c, .n = i};
        pthread_create(&th[i], NULL, many_call, &args[i]);
    }
    int ok = 0;
    for (int i = 0; i < 32; i++) {
        pthread_join(th[i], NULL);
        ok += args[i].ok;
    }
    ck_assert_int_eq(ok, 32 * 5);
    pdm_client_destroy(c);
    peer_stop(&p);
}
END_TEST

/* Destroying the client ends calls still blocked in it with ECLOSED. */
static void *closed_call(void *arg)
{
    cancel_arg_t *a = arg;
    pdm_client_request_t q;
    pdm_client_request_init(&q);
    q.prompt = "hang";
    pdm_client_result_t r;
    a->rc = pdm_client_generate(a->c, &q, &r);
    pdm_client_result_fini(&r);
    return NULL;
}

START_TEST(test_destroy_with_open_calls)
{
    peer_t p;
    peer_start(&p, 0);
    pdm_client_t *c;
    ck_assert_int_eq(pdm_client_create(p.endpoint, NULL, &c), PDM_CLIENT_OK);
    cancel_arg_t a = {.c = c};
    pthread_t t;
    pthread_create(&t, NULL, closed_call, &a);
    for (int i = 0; i < 500 && atomic_load(&p.requests) < 1; i++) usleep(10000);
    pdm_client_destroy(c);
    pthread_join(t, NULL);
    ck_assert_int_eq(a.rc, PDM_CLIENT_ECLOSED);
    peer_stop(&p);
}
END_TEST

START_TEST(test_admin)
{
    peer_t p;
    peer_start(&p, 0);
    Pdmesh__AdminRequest q = PDMESH__ADMIN_REQUEST__INIT;
    q.op = PDMESH__ADMIN_OP__ADMIN_STATS;
    q.token = "secret-admin-token";
    pdm_admin_reply_t *r = NULL;
    ck_assert_int_eq(pdm_admin_call(p.endpoint, &q, 5000, &r), PDM_CLIENT_OK);
    ck_assert_int_eq(pdm_admin_reply_status(r), PDM_CLIENT_OK);
    ck_assert_uint_eq(pdm_admin_reply_get(r)->n_values, 1);
    ck_assert_str_eq(pdm_admin_reply_get(r)->values[0]->value, "3");
    pdm_admin_reply_free(r);
    q.token = "wrong";
    ck_assert_int_eq(pdm_admin_call(p.endpoint, &q, 5000, &r), PDM_CLIENT_OK);
    ck_assert_int_eq(pdm_admin_reply_status(r), PDM_CLIENT_EUNAUTHORIZED);
    ck_assert_str_eq(pdm_client_last_error(), "bad admin token");
    pdm_admin_reply_free(r);
    peer_stop(&p);

    peer_start(&p, 1); /* silent */
    double t0 = pdm_now();
    ck_assert_int_eq(pdm_admin_call(p.endpoint, &q, 300, &r), PDM_CLIENT_ETIMEOUT);
    ck_assert(pdm_now() - t0 < 2.0);
    peer_stop(&p);
    char ep[128];
    dead_endpoint(ep, sizeof(ep));
    ck_assert_int_eq(pdm_admin_call(ep, &q, 300, &r), PDM_CLIENT_EUNREACHABLE);

    /* token sources: file first, then the environment; never empty */
    char path[512];
    snprintf(path, sizeof(path), "%s/admin-token", pdm_test_tmpdir());
    FILE *f = fopen(path, "w");
    fputs("from-file\n", f);
    fclose(f);
    char *tok;
    unsetenv("PDMESH_ADMIN_TOKEN_FILE");
    setenv("PDMESH_ADMIN_TOKEN", "from-env", 1);
    ck_assert_int_eq(pdm_admin_load_token(path, &tok), PDM_CLIENT_OK);
    ck_assert_str_eq(tok, "from-file");
    free(tok);
    ck_assert_int_eq(pdm_admin_load_token(NULL, &tok), PDM_CLIENT_OK);
    ck_assert_str_eq(tok, "from-env");
    free(tok);
    setenv("PDMESH_ADMIN_TOKEN_FILE", path, 1);
    ck_assert_int_eq(pdm_admin_load_token(NULL, &tok), PDM_CLIENT_OK);
    ck_assert_str_eq(tok, "from-file");
    free(tok);
    unsetenv("PDMESH_ADMIN_TOKEN_FILE");
    unsetenv("PDMESH_ADMIN_TOKEN");
    ck_assert_int_eq(pdm_admin_load_token(NULL, &tok), PDM_CLIENT_EINVALID_ARGUMENT);
    ck_assert_int_eq(pdm_admin_load_token("/nonexistent/token", &tok),
                     PDM_CLIENT_EINVALID_ARGUMENT);
}
END_TEST

Suite *suite_sdk(void)
{
    Suite *s = suite_create("sdk");
    TCase *tc = tcase_create("client");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_status_strings);
    tcase_add_test(tc, test_seed_for_choice);
    tcase_add_test(tc, test_validation);
    tcase_add_test(tc, test_timeout_silent_router);
    tcase_add_test(tc, test_unreachable);
    tcase_add_test(tc, test_generate_and_stream);
    tcase_add_test(tc, test_failover_choices);
    tcase_add_test(tc, test_cancel_from_other_thread);
    tcase_add_test(tc, test_concurrent_threads);
    tcase_add_test(tc, test_destroy_with_open_calls);
    tcase_add_test(tc, test_admin);
    suite_add_tcase(s, tc);
    return s;
}
