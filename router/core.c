/*
 * core.c - the router's life and loop: configuration, the ZeroMQ sockets on the libuv loop,
 * start-up and shutdown (ARCHITECTURE.md "Control plane"). The front ends enter through
 * api.c, where a request goes is schedule.c's choice, its life request.c's.
 *
 * Sockets: three ROUTER sockets (client, node, admin). Each socket's ZMQ_FD is watched with a
 * uv_poll; ZeroMQ signals that fd edge-triggered, so every callback - and a uv_check after
 * every loop iteration, because sending can consume the edge - drains the socket until
 * ZMQ_EVENTS has no POLLIN (PITFALLS.md, ZeroMQ).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/curve.h"
#include "router/internal.h"
#include "router/kvindex.h"
#include "router/admin.h"
#include "router/core.h"
#include "router/curve.h"
#include "router/registry.h"
#include "router/request.h"
#include "router/schedule.h"
#include "router/zfront.h"

void rt_config_default(rt_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->client_ep = "tcp://127.0.0.1:7700";
    c->node_ep = "tcp://127.0.0.1:7701";
    c->admin_ep = "tcp://127.0.0.1:7702";
    c->heartbeat_ms = 1000;
    c->lease_ms = 3000;
    c->queue_max = 256;
    c->per_client_max = 64;
    c->max_prompt_tokens = 4096;
    c->max_tokens = 1024;
    c->default_max_tokens = 128;
    c->max_beams = 8; /* the decode node's widest (PDM_BEAM_MAX_WIDTH) */
    c->default_deadline_ms = 120000;
    c->max_attempts = 4;
    c->local_threshold = 16;
    snprintf(c->method, sizeof(c->method), "auto");
    c->block_tokens = 64;
    c->prefix_reuse = 1;
    c->group_pool_tokens = 0;
    c->pool_local_max = 512;
    c->pool_delta = 1;
    c->max_skew_s = 30;
    c->group_inflight = 2;
    c->adaptive_group = 0; /* off: no consistent win below saturation on the reference machine
                            * (docs/perf/serve-adaptive.md) */
    c->prefill_batch_max = 1; /* off: no gain measured on the reference machine
                               * (docs/perf/serve-batch.md) */
    c->prefill_batch_tokens = 2048;
    c->prefill_chunk_tokens = 0;
    c->http_host = "127.0.0.1";
    c->http_port = 8080;
}

/* ---------------------------------------------------------------- sockets and loop */

static void rt_drain(pdm_router_t *r, int which)
{
    void *sock = which == 0 ? r->client_sock : which == 1 ? r->node_sock : r->admin_sock;
    for (int k = 0; k < 100000; k++) {
        int ev = 0;
        size_t sz = sizeof(ev);
        if (zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &sz) || !(ev & ZMQ_POLLIN)) break;
        zmq_msg_t part[2];
        int nparts = 0, more = 1;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (nparts < 2) part[nparts] = m;
            else zmq_msg_close(&m);
            nparts++;
        }
        if (nparts < 1) break;
        const uint8_t *ident = zmq_msg_data(&part[0]);
        size_t ident_len = zmq_msg_size(&part[0]);
        if (nparts != 2) {
            pdm_wire_send_error(sock, ident, ident_len, PDMESH__ERROR_CODE__ERR_BAD_MESSAGE, 0,
                                "expected exactly one message frame, got %d", nparts - 1);
        } else {
            const void *f = zmq_msg_data(&part[1]);
            size_t flen = zmq_msg_size(&part[1]);
            if (which == 0) rt_on_client_frame(r, ident, ident_len, f, flen);
            else if (which == 1) rt_on_node_frame(r, ident, ident_len, f, flen);
            else rt_on_admin_frame(r, ident, ident_len, f, flen);
        }
        for (int i = 0; i < PDM_MIN(nparts, 2); i++) zmq_msg_close(&part[i]);
    }
}

static void rt_drain_all(pdm_router_t *r)
{
    for (int i = 0; i < 3; i++) rt_drain(r, i);
    rt_schedule(r);
}

static void rt_on_poll(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    rt_drain_all(h->data);
}

static void rt_on_check(uv_check_t *h) { rt_drain_all(h->data); }

static void rt_on_tick(uv_timer_t *h)
{
    pdm_router_t *r = h->data;
    rt_registry_tick(r);
    rt_zfront_sweep(r);
    rt_req_expire(r);
    rt_drain_all(r);
}

static void *rt_socket(pdm_router_t *r, const char *ep, const char *curve_secret)
{
    void *s = zmq_socket(r->zctx, ZMQ_ROUTER);
    if (!s) return NULL;
    if (curve_secret[0] && pdm_curve_server_setup(s, curve_secret)) {
        zmq_close(s);
        return NULL;
    }
    int one = 1, zero = 0, hwm = 10000, ivl = 10000, ttl = 30000;
    int64_t maxmsg = 2 * (int64_t)PDM_WIRE_MAX_FRAME + 1024; /* frames up to twice the cap get a
                                                             * TOO_LARGE reply; beyond, the
                                                             * connection is dropped */
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &ttl, sizeof(ttl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TTL, &ttl, sizeof(ttl));
    if (zmq_bind(s, ep)) {
        pdm_error_set(PDM_EIO, "cannot bind %s: %s", ep, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* The admin token (common/wire.h); none configured: NULL, every admin call is refused. */
static int rt_load_token(const char *path, char **out)
{
    int st = pdm_auth_load_admin_token(path, "--admin-token-file FILE", out);
    if (st == PDM_ENOTFOUND) *out = NULL;
    return st == PDM_ENOTFOUND ? PDM_OK : st;
}

int rt_router_create(uv_loop_t *loop, const rt_config_t *cfg, pdm_router_t **out)
{
    pdm_router_t *r = calloc(1, sizeof(*r));
    if (!r) return pdm_error_set(PDM_ENOMEM, "router: out of memory");
    r->loop = loop;
    r->cfg = *cfg;
    if (r->cfg.max_attempts < 1) r->cfg.max_attempts = 1;
    if (r->cfg.max_attempts > 15) r->cfg.max_attempts = 15;
    r->limits.max_body_bytes = 1u << 20;
    r->limits.max_prompt_tokens = cfg->max_prompt_tokens;
    r->limits.max_tokens = cfg->max_tokens;
    r->limits.max_beams = cfg->max_beams;
    int st = pdm_auth_load_secret(cfg->secret_file, &r->secret, &r->secret_len);
    if (st) goto fail; /* the message names the secret and its sources */
    if ((st = rt_load_token(cfg->admin_token_file, &r->admin_token))) goto fail;
    pdm_prefix_salt_derive(r->secret, r->secret_len, r->prefix_salt); /* one per mesh */
    do { /* RegisterAck.router_id: random and never 0 (a one-router harness's) */
        if ((st = pdm_random_bytes(&r->router_id, sizeof(r->router_id)))) goto fail;
    } while (!r->router_id);
    r->pool_block_tokens = cfg->block_tokens > 0 ? cfg->block_tokens : 64;
    if (!(r->kvidx = rt_kvindex_create(0))) {
        st = pdm_error_set(PDM_ENOMEM, "router: no memory for the prefix block index");
        goto fail;
    }
    /* Several routers share the nodes (docs/router.md "High availability"): a node tells
     * their tasks apart by task id and their registrations by epoch, so each router (and
     * each restart of one) starts both at a random 40-bit value instead of 0. */
    if ((st = pdm_random_bytes(&r->next_id, sizeof(r->next_id)))) goto fail;
    if ((st = pdm_random_bytes(&r->next_epoch, sizeof(r->next_epoch)))) goto fail;
    r->next_id &= (1ull << 40) - 1;
    r->next_epoch &= (1ull << 40) - 1;
    if ((st = pdm_model_load(cfg->model_path, &r->model))) goto fail;
    if (!r->model->tokenizer) {
        st = pdm_error_set(PDM_EUNSUPPORTED, "%s has no tokenizer", cfg->model_path);
        goto fail;
    }
    /* before any thread uses the tokenizer (tokenizer.h) */
    if (cfg->chat_template &&
        (st = pdm_tokenizer_set_chat_template(r->model->tokenizer, cfg->chat_template)))
        goto fail;
    if (pdm_tokenizer_chat_format(r->model->tokenizer) == PDM_CHAT_UNKNOWN)
        pdm_log_warn("router: %s has no chat format pdmesh renders; chat requests will fail "
                     "until --chat-template NAME is given", cfg->model_path);
    const char *base = strrchr(cfg->model_path, '/');
    snprintf(r->model_name, sizeof(r->model_name), "%s", base ? base + 1 : cfg->model_path);
    char *dot = strstr(r->model_name, ".gguf");
    if (dot) *dot = 0;
    if (cfg->partition_table) {
        if ((st = pdm_partition_table_load(cfg->partition_table, &r->table))) goto fail;
        r->has_table = 1;
    }
    if (cfg->calibration) {
        if ((st = pdm_calibration_load(cfg->calibration, &r->calib))) goto fail;
        r->has_calib = 1;
    }
    r->m.reg = pdm_metrics_create();
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
    /* TTFT also has 1.5 and 2 s: the autoscaler's p90 (histogram_quantile) interpolates
     * between bounds, and the SLO of the serving benchmark lies between 1 and 2.5 s. */
    static const double ttft[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                  1,     1.5,  2,     2.5,  5,   10,   30};
    static const double tpot[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1};
    pdm_metrics_t *m = r->m.reg;
    r->m.requests = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_requests_total",
                                    "Requests ended, by outcome.", "outcome", NULL, 0);
    r->m.ttft = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_ttft_seconds",
                                "Arrival to first token.", NULL, ttft, PDM_ARRAY_SIZE(ttft));
    r->m.tpot = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_tpot_seconds",
                                "Mean time per output token after the first.", NULL, tpot,
                                PDM_ARRAY_SIZE(tpot));
    r->m.queue = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth",
                                 "Requests admitted and not ended.", NULL, NULL, 0);
    r->m.method = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_prefill_method_total",
                                  "Prefills by method (local: the decode node prefilled).",
                                  "method", NULL, 0);
    r->m.prefill_tokens = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_prefill_tokens_total",
                                          "Prompt tokens sent to be prefilled (group: by a "
                                          "prefill group's task, local: by a decode node, "
                                          "delivered tokens of a migration included).",
                                          "where", NULL, 0);
    r->m.kv_bytes = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_kv_bytes_total",
                                    "KV bytes streamed from prefill groups to decode nodes.",
                                    NULL, NULL, 0);
    r->m.kv_time = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_kv_transfer_seconds",
                                   "Decode node: start to KV verified.", NULL, lat,
                                   PDM_ARRAY_SIZE(lat));
    r->m.nodes = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_nodes", "Nodes by role and state.",
                                 "role_state", NULL, 0);
    r->m.migrations = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_migrations_total",
                                      "Requests moved to another decode node.", NULL, NULL, 0);
    r->m.retries = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_retries_total",
                                   "Prefill attempts run again.", NULL, NULL, 0);
    r->m.offload = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_offload_bytes",
                                   "Head-wise offload: bytes in the slow tier, per node.", "node",
                                   NULL, 0);
    r->m.prefix_hits = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_prefix_hits_total",
                                       "Prefills that reused a prefix cached on their group.",
                                       NULL, NULL, 0);
    r->m.prefix_tokens = pdm_metrics_add(m, PDM_METRIC_COUNTER,
                                         "pdmesh_prefix_cached_tokens_total",
                                         "Prompt tokens not prefilled again (cached on the group).",
                                         NULL, NULL, 0);
    r->m.waiting = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_requests_waiting",
                                   "Requests admitted and not dispatched, by what they wait for "
                                   "(prefill: a group with room; decode: a decode node with room).",
                                   "reason", NULL, 0);
    r->m.kv_free = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_decode_kv_free_tokens",
                                   "KV tokens not reserved, summed over usable decode nodes.", NULL,
                                   NULL, 0);
    r->m.kv_capacity = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_decode_kv_capacity_tokens",
                                       "KV budgets summed over usable decode nodes.", NULL, NULL,
                                       0);
    r->m.group_inflight = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_prefill_inflight",
                                          "Prefill tasks sent to a group and not finished.",
                                          "group", NULL, 0);
    r->m.group_inflight_limit = pdm_metrics_add(
        m, PDM_METRIC_GAUGE, "pdmesh_prefill_inflight_limit",
        "Prefill tasks a group may hold (--group-inflight).", NULL, NULL, 0);
    static const double batch_sizes[] = {1, 2, 3, 4, 5, 6, 7, 8};
    r->m.batch_requests = pdm_metrics_add(
        m, PDM_METRIC_HISTOGRAM, "pdmesh_prefill_batch_requests",
        "Requests per batched prefill task sent (--prefill-batch-max).", NULL, batch_sizes,
        PDM_ARRAY_SIZE(batch_sizes));
    r->m.batched = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefill_batched_total",
        "Requests whose prefill rank ran them in one engine batch with others "
        "(PrefillResult.batch_size > 1).", NULL, NULL, 0);
    r->m.solo_concurrent = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefill_solo_concurrent_total",
        "Solo prefill tasks sent while another rank of the group ran one (--adaptive-group).",
        "group", NULL, 0);
    r->m.pool_lookups = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefix_pool_lookups_total",
        "Requests whose prompt was looked up in the global index of decode-node prefix pools.",
        NULL, NULL, 0);
    r->m.pool_hits = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefix_pool_hits_total",
        "Lookups prefilled on the node the index chose that reused at least the expected prefix.",
        NULL, NULL, 0);
    r->m.pool_misses = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefix_pool_misses_total",
        "Lookups that reused no pooled prefix, by reason (no_match: no node holds a prefix; "
        "evicted: the index said the node held it, the node found less; routed_elsewhere_load: a "
        "node held it but load or free KV sent the request elsewhere; delta_over_local_max: the "
        "rest of the prompt was longer than pool_local_max; delta_unsupported: ... and the node "
        "or a rank of the group is of an older version without the delta transfer).",
        "reason", NULL, 0);
    r->m.pool_cached_tokens = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefix_pool_cached_tokens_total",
        "Prompt tokens served from decode-node prefix pools (DecodeResult.cached_tokens).", NULL,
        NULL, 0);
    r->m.pool_delta_requests = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_pool_delta_requests_total",
        "Group prefills whose decode node took the prompt's prefix from its own pool and "
        "received only the rest's KV (delta transfer, --pool-delta).", NULL, NULL, 0);
    r->m.pool_delta_tokens = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_pool_delta_tokens_total",
        "Prompt tokens whose KV was not streamed thanks to the delta transfer.", NULL, NULL, 0);
    r->m.pool_delta_refused = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_pool_delta_refused_total",
        "Delta transfers a decode node refused (its pool no longer held the prefix, or held it "
        "corrupt); each was retried with the whole prompt streamed.", NULL, NULL, 0);
    r->m.pool_hit_rate = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_prefix_pool_hit_rate",
                                         "Prefix pool hits / lookups so far.", NULL, NULL, 0);
    r->m.pool_tokens = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_prefix_pool_tokens",
                                       "KV token slots a decode node's prefix pool holds.", "node",
                                       NULL, 0);
    r->m.pool_bytes = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_prefix_pool_bytes",
                                      "Bytes of KV a decode node's prefix pool holds.", "node",
                                      NULL, 0);
    r->m.pool_blocks = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_prefix_pool_blocks",
                                       "Prefix blocks a decode node's pool holds (its report).",
                                       "node", NULL, 0);
    r->m.pool_corrupt = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefix_pool_corrupt_total",
        "Pooled prefixes whose checksum failed on reuse (recomputed, never used), per node.",
        "node", NULL, 0);
    r->m.kv_events = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_kv_events_total",
                                     "Prefix block events from decode nodes, by kind (stored, "
                                     "evicted, reset, stale, malformed).",
                                     "kind", NULL, 0);
    r->m.group_pool_tokens = pdm_metrics_add(
        m, PDM_METRIC_GAUGE, "pdmesh_group_pool_tokens",
        "Tokens of finished conversations a prefill group's pool holds (router's mirror).",
        "group", NULL, 0);
    r->m.group_pool_entries = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_group_pool_entries",
                                              "Conversations a prefill group's pool holds.",
                                              "group", NULL, 0);
    r->m.group_pool_evictions = pdm_metrics_add(
        m, PDM_METRIC_GAUGE, "pdmesh_group_pool_evictions",
        "Conversations a prefill group's pool evicted (LRU) since it was wired.", "group", NULL, 0);
    r->m.group_pool_corrupt = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_group_pool_corrupt_total",
        "Pooled conversations a prefill group's rank found corrupt (checksum) and did not use.",
        "group", NULL, 0);
    r->m.group_prefill_tokens = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_group_prefill_tokens_total",
        "Prompt tokens prefill groups computed (cached ones not counted).", NULL, NULL, 0);
    r->m.prefill_chunks = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefill_chunks_total",
        "Chunks of long prompts prefill groups computed ahead of the request's own task "
        "(--prefill-chunk-tokens).", NULL, NULL, 0);
    r->m.prefill_chunk_failures = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_prefill_chunk_failures_total",
        "Chunks that failed or were lost (the request then went whole).", NULL, NULL, 0);
    r->m.stale_formation = pdm_metrics_add(
        m, PDM_METRIC_COUNTER, "pdmesh_stale_formation_total",
        "Group tasks rank 0 refused as planned for another formation of the group (it re-formed "
        "under another router's wiring, or this router's re-wire was on its way); each was "
        "planned again, not counted as a failure.",
        "group", NULL, 0);
    r->m.kv_index_blocks = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_kv_index_blocks",
                                           "Block keys in the router's global prefix index.",
                                           NULL, NULL, 0);
    pdm_metric_inc(r->m.pool_lookups, NULL, 0);
    pdm_metric_inc(r->m.pool_hits, NULL, 0);
    pdm_metric_inc(r->m.pool_cached_tokens, NULL, 0);
    for (int k = 0; k < 5; k++) {
        static const char *reasons[] = {"no_match", "evicted", "routed_elsewhere_load",
                                        "delta_over_local_max", "delta_unsupported"};
        pdm_metric_inc(r->m.pool_misses, reasons[k], 0);
    }
    pdm_metric_set(r->m.queue, NULL, 0);
    pdm_metric_inc(r->m.requests, "ok", 0);
    pdm_metric_inc(r->m.migrations, NULL, 0);
    pdm_metric_inc(r->m.retries, NULL, 0);
    pdm_metric_inc(r->m.kv_bytes, NULL, 0);
    r->zctx = zmq_ctx_new();
    char curve_secret[PDM_CURVE_KEY_LEN + 1] = "";
    if (r->zctx && (st = rt_curve_start(r, curve_secret))) goto fail; /* ZAP before binds */
    if (!r->zctx || !(r->client_sock = rt_socket(r, cfg->client_ep, curve_secret)) ||
        !(r->node_sock = rt_socket(r, cfg->node_ep, curve_secret)) ||
        !(r->admin_sock = rt_socket(r, cfg->admin_ep, curve_secret))) {
        explicit_bzero(curve_secret, sizeof(curve_secret));
        st = PDM_EIO;
        goto fail;
    }
    explicit_bzero(curve_secret, sizeof(curve_secret));
    void *socks[3] = {r->client_sock, r->node_sock, r->admin_sock};
    for (int i = 0; i < 3; i++) {
        int fd;
        size_t sz = sizeof(fd);
        zmq_getsockopt(socks[i], ZMQ_FD, &fd, &sz);
        uv_poll_init(loop, &r->poll[i], fd);
        r->poll[i].data = r;
        uv_poll_start(&r->poll[i], UV_READABLE, rt_on_poll);
    }
    uv_check_init(loop, &r->check);
    r->check.data = r;
    uv_check_start(&r->check, rt_on_check);
    uv_timer_init(loop, &r->tick);
    r->tick.data = r;
    uv_timer_start(&r->tick, rt_on_tick, 50, 50);
    r->handles_open = 1;
    if ((st = rt_zfront_init(r))) goto fail;
    *out = r;
    return PDM_OK;
fail:
    rt_router_close(r);
    if (r->handles_open) uv_run(loop, UV_RUN_DEFAULT);
    rt_router_free(r);
    return st ? st : PDM_EIO;
}

/* Ends every open request with an error, closes the loop handles. */
void rt_router_close(pdm_router_t *r)
{
    while (r->head)
        rt_req_fail(r, r->head, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "the router is shutting down");
    if (r->handles_open) {
        for (int i = 0; i < 3; i++) uv_close((uv_handle_t *)&r->poll[i], NULL);
        uv_close((uv_handle_t *)&r->check, NULL);
        uv_close((uv_handle_t *)&r->tick, NULL);
    }
}

void rt_router_free(pdm_router_t *r)
{
    if (!r) return;
    rt_zfront_fini(r);
    if (r->client_sock) zmq_close(r->client_sock);
    if (r->node_sock) zmq_close(r->node_sock);
    if (r->admin_sock) zmq_close(r->admin_sock);
    rt_curve_stop(r);
    if (r->zctx) zmq_ctx_term(r->zctx);
    for (int i = 0; i < RT_MAX_NODES; i++) free(r->nodes[i].ucx);
    for (int g = 0; g < RT_MAX_GROUPS; g++) {
        pdm_prefill_conv_free(&r->groups[g].conv);
        pdm_prefill_pool_fini(&r->groups[g].pool);
    }
    pdm_metrics_free(r->m.reg);
    rt_kvindex_destroy(r->kvidx);
    pdm_model_free(r->model);
    free(r->secret);
    free(r->admin_token);
    free(r);
}
