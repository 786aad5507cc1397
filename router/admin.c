/*
 * admin.c - the admin socket (pdctl): every AdminOp of proto/pdmesh.proto, each call checked
 * against the admin token (file or environment; without one configured every call is refused).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "router/internal.h"
#include "router/admin.h"
#include "router/kvindex.h"
#include "router/registry.h"

static int rt_token_ok(const pdm_router_t *r, const char *tok)
{
    if (!r->admin_token || !tok) return 0;
    size_t a = strlen(r->admin_token), b = strlen(tok);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) diff |= (unsigned)(r->admin_token[i] ^ (i < b ? tok[i] : 0));
    return diff == 0;
}

static void rt_admin_error(pdm_router_t *r, const uint8_t *ident, size_t ident_len, int code,
                           const char *msg)
{
    Pdmesh__AdminReply rep = PDMESH__ADMIN_REPLY__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.code = code;
    e.message = (char *)msg;
    rep.ok = 0;
    rep.error = &e;
    rt_send(r->admin_sock, ident, ident_len, PDMESH__MSG_TYPE__MSG_ADMIN_REPLY, &rep.base);
}

static void rt_fill_node(const pdm_router_t *r, const rt_node_t *n, Pdmesh__NodeInfo *ni,
                         Pdmesh__Capacity *cap, Pdmesh__Load *load)
{
    pdmesh__node_info__init(ni);
    pdmesh__capacity__init(cap);
    pdmesh__load__init(load);
    ni->node_id = (char *)n->id;
    ni->role = n->role;
    ni->group = (char *)n->group;
    ni->rank = n->rank;
    ni->state = (char *)rt_node_state(n);
    ni->epoch = n->epoch;
    ni->last_heartbeat_ms_ago = (pdm_now() - n->last_hb) * 1e3;
    cap->kv_tokens = n->kv_tokens;
    cap->max_sequences = n->max_sequences;
    cap->max_batch = n->max_batch;
    cap->threads = n->threads;
    cap->max_prompt = n->max_prompt;
    load->running = n->running;
    load->held = n->held;
    load->kv_tokens_used = n->kv_used;
    load->kv_tokens_free = n->kv_free;
    load->offload_bytes = n->offload;
    ni->capacity = cap;
    ni->load = load;
    ni->pid = n->pid;
    ni->features = n->features;
    (void)r;
}

/* Policy keys: name, pointer kind, bounds. */
typedef struct {
    const char *key;
    int *i;
    uint32_t *u;
    long min, max;
} rt_policy_t;

static int rt_policies(pdm_router_t *r, rt_policy_t *p)
{
    rt_config_t *c = &r->cfg;
    int n = 0;
    p[n++] = (rt_policy_t){"local_threshold", NULL, &c->local_threshold, 0, 1 << 20};
    p[n++] = (rt_policy_t){"max_attempts", &c->max_attempts, NULL, 1, 15};
    p[n++] = (rt_policy_t){"queue_max", &c->queue_max, NULL, 1, 1 << 20};
    p[n++] = (rt_policy_t){"per_client_max", &c->per_client_max, NULL, 0, 1 << 20};
    p[n++] = (rt_policy_t){"max_tokens", NULL, &c->max_tokens, 1, 1 << 20};
    p[n++] = (rt_policy_t){"default_max_tokens", NULL, &c->default_max_tokens, 1, 1 << 20};
    p[n++] = (rt_policy_t){"max_prompt_tokens", NULL, &c->max_prompt_tokens, 1, 1 << 22};
    p[n++] = (rt_policy_t){"max_beams", NULL, &c->max_beams, 1, 8};
    p[n++] = (rt_policy_t){"default_deadline_ms", NULL, &c->default_deadline_ms, 1, 3600000};
    p[n++] = (rt_policy_t){"group_inflight", &c->group_inflight, NULL, 1, 64};
    p[n++] = (rt_policy_t){"adaptive_group", &c->adaptive_group, NULL, 0, 2};
    p[n++] = (rt_policy_t){"block_tokens", &c->block_tokens, NULL, 1, 4096};
    p[n++] = (rt_policy_t){"prefix_reuse", &c->prefix_reuse, NULL, 0, 1};
    p[n++] = (rt_policy_t){"group_pool_tokens", &c->group_pool_tokens, NULL, 0, 1 << 24};
    p[n++] = (rt_policy_t){"pool_local_max", NULL, &c->pool_local_max, 0, 1 << 20};
    p[n++] = (rt_policy_t){"pool_delta", &c->pool_delta, NULL, 0, 1};
    p[n++] = (rt_policy_t){"prefill_batch_max", &c->prefill_batch_max, NULL, 1, RT_BATCH_MAX};
    p[n++] = (rt_policy_t){"prefill_batch_tokens", &c->prefill_batch_tokens, NULL, 1, 8192};
    p[n++] = (rt_policy_t){"prefill_chunk_tokens", &c->prefill_chunk_tokens, NULL, 0, 1 << 20};
    return n;
}

void rt_on_admin_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                       const void *frame, size_t len)
{
    pdm_wire_msg_t *wm;
    if (pdm_wire_unpack_or_reply(r->admin_sock, ident, ident_len, frame, len, 1u << 20, &wm)) return;
    if (pdm_wire_type(wm) == PDMESH__MSG_TYPE__MSG_PING) {
        Pdmesh__Ping pong = PDMESH__PING__INIT;
        pong.nonce = ((Pdmesh__Ping *)pdm_wire_message(wm))->nonce;
        rt_send(r->admin_sock, ident, ident_len, PDMESH__MSG_TYPE__MSG_PONG, &pong.base);
        pdm_wire_msg_free(wm);
        return;
    }
    if (pdm_wire_type(wm) != PDMESH__MSG_TYPE__MSG_ADMIN_REQUEST) {
        pdm_wire_send_error(r->admin_sock, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE,
                            0, "%s is not an admin message", pdm_wire_type_name(pdm_wire_type(wm)));
        pdm_wire_msg_free(wm);
        return;
    }
    const Pdmesh__AdminRequest *a = (Pdmesh__AdminRequest *)pdm_wire_message(wm);
    if (!rt_token_ok(r, a->token)) {
        rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNAUTHORIZED,
                       r->admin_token ? "admin token missing or wrong"
                                      : "no admin token is configured on the router");
        pdm_wire_msg_free(wm);
        return;
    }
    Pdmesh__AdminReply rep = PDMESH__ADMIN_REPLY__INIT;
    rep.ok = 1;
    enum { MAXN = RT_MAX_NODES + RT_MAX_GROUPS };
    Pdmesh__NodeInfo *ni = NULL, **nip = NULL;
    Pdmesh__Capacity *caps = NULL;
    Pdmesh__Load *loads = NULL;
    Pdmesh__PoolStats *pools = NULL;
    Pdmesh__RequestInfo *ri = NULL, **rip = NULL;
    Pdmesh__KeyValue kv[32], *kvp[32];
    char vals[32][160];
    char *text = NULL;
    const char *name = a->name ? a->name : "";
    int found = -1;
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (r->nodes[i].used && !strcmp(r->nodes[i].id, name)) found = i;
    switch (a->op) {
    case PDMESH__ADMIN_OP__ADMIN_NODES:
    case PDMESH__ADMIN_OP__ADMIN_NODE: {
        ni = calloc(MAXN, sizeof(*ni));
        nip = calloc(MAXN, sizeof(*nip));
        caps = calloc(MAXN, sizeof(*caps));
        loads = calloc(MAXN, sizeof(*loads));
        if (!ni || !nip || !caps || !loads) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL, "out of memory");
            goto done;
        }
        if (a->op == PDMESH__ADMIN_OP__ADMIN_NODE && found < 0) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND, "no such node");
            goto done;
        }
        size_t k = 0;
        for (int i = 0; i < RT_MAX_NODES; i++) {
            if (!r->nodes[i].used || (a->op == PDMESH__ADMIN_OP__ADMIN_NODE && i != found)) continue;
            rt_fill_node(r, &r->nodes[i], &ni[k], &caps[k], &loads[k]);
            nip[k] = &ni[k];
            k++;
        }
        rep.nodes = nip;
        rep.n_nodes = k;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_CACHE: {
        /* The decode nodes' prefix pools as their KV events last reported them, what the
         * global index holds for each, and the router's lookup counts. */
        ni = calloc(MAXN, sizeof(*ni));
        nip = calloc(MAXN, sizeof(*nip));
        caps = calloc(MAXN, sizeof(*caps));
        loads = calloc(MAXN, sizeof(*loads));
        pools = calloc(MAXN, sizeof(*pools));
        if (!ni || !nip || !caps || !loads || !pools) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL, "out of memory");
            goto done;
        }
        size_t k = 0;
        for (int i = 0; i < RT_MAX_NODES; i++) {
            const rt_node_t *n = &r->nodes[i];
            if (!n->used || n->role != PDMESH__ROLE__ROLE_DECODE || !n->pool_tokens) continue;
            rt_fill_node(r, n, &ni[k], &caps[k], &loads[k]);
            caps[k].pool_tokens = n->pool_tokens;
            pools[k] = n->pool;
            if (!pools[k].budget_tokens) pools[k].budget_tokens = n->pool_tokens;
            ni[k].pool = &pools[k];
            ni[k].index_blocks = rt_kvindex_node_blocks(r->kvidx, i);
            nip[k] = &ni[k];
            k++;
        }
        /* The prefill groups' pools of conversations (prefill_node/pool.h), as the router's
         * mirror holds them, under the group's rank 0: role prefill, tier "group". */
        for (int g = 0; g < RT_MAX_GROUPS && r->cfg.group_pool_tokens > 0; g++) {
            const rt_group_t *gr = &r->groups[g];
            if (!gr->used || !gr->wired || gr->member[0] < 0) continue;
            rt_fill_node(r, &r->nodes[gr->member[0]], &ni[k], &caps[k], &loads[k]);
            pdmesh__pool_stats__init(&pools[k]);
            pools[k].budget_tokens = (uint64_t)rt_group_pool_budget(r, gr);
            pools[k].tokens = (uint64_t)gr->pool.tokens;
            pools[k].entries = (uint32_t)gr->pool.n;
            pools[k].lookups = gr->pool_tasks;
            pools[k].hits = gr->pool_hits;
            pools[k].reused_tokens = gr->pool_hit_tokens;
            pools[k].evictions = gr->pool.evictions;
            pools[k].corrupt = gr->pool_corrupt;
            ni[k].pool = &pools[k];
            nip[k] = &ni[k];
            k++;
        }
        rep.nodes = nip;
        rep.n_nodes = k;
        static const char *keys[] = {"lookups", "hits", "hit_rate", "index_blocks",
                                     "index_replaced"};
        snprintf(vals[0], sizeof(vals[0]), "%llu", (unsigned long long)r->pool_lookups);
        snprintf(vals[1], sizeof(vals[1]), "%llu", (unsigned long long)r->pool_hits);
        snprintf(vals[2], sizeof(vals[2]), "%.3f",
                 r->pool_lookups ? (double)r->pool_hits / (double)r->pool_lookups : 0.0);
        snprintf(vals[3], sizeof(vals[3]), "%zu", rt_kvindex_entries(r->kvidx));
        snprintf(vals[4], sizeof(vals[4]), "%llu",
                 (unsigned long long)rt_kvindex_replaced(r->kvidx));
        for (int v = 0; v < 5; v++) {
            pdmesh__key_value__init(&kv[v]);
            kv[v].key = (char *)keys[v];
            kv[v].value = vals[v];
            kvp[v] = &kv[v];
        }
        rep.values = kvp;
        rep.n_values = 5;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_DRAIN:
    case PDMESH__ADMIN_OP__ADMIN_UNDRAIN:
        if (found < 0) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND, "no such node");
            goto done;
        }
        /* A draining node gets no new work; what it runs finishes. */
        r->nodes[found].draining = a->op == PDMESH__ADMIN_OP__ADMIN_DRAIN;
        pdm_log_info("router: %s %s", name, r->nodes[found].draining ? "draining" : "undrained");
        break;
    case PDMESH__ADMIN_OP__ADMIN_STATS: {
        size_t len2 = 0;
        text = pdm_metrics_render(pdm_router_metrics(r), &len2);
        rep.text = text;
        int queued = 0;
        for (rt_req_t *q = r->head; q; q = q->next) queued += q->state == RQ_QUEUED;
        static const char *keys[] = {"open_requests", "queued_requests", "ready", "model"};
        snprintf(vals[0], sizeof(vals[0]), "%d", r->n_req);
        snprintf(vals[1], sizeof(vals[1]), "%d", queued);
        snprintf(vals[2], sizeof(vals[2]), "%d", pdm_router_ready(r));
        snprintf(vals[3], sizeof(vals[3]), "%s", r->model_name);
        int k = 0;
        for (; k < 4; k++) {
            pdmesh__key_value__init(&kv[k]);
            kv[k].key = (char *)keys[k];
            kv[k].value = vals[k];
            kvp[k] = &kv[k];
        }
        rep.values = kvp;
        rep.n_values = (size_t)k;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_POLICY_GET:
    case PDMESH__ADMIN_OP__ADMIN_POLICY_SET: {
        rt_policy_t pol[24];
        int np = rt_policies(r, pol), k = 0;
        const char *key = a->key ? a->key : "";
        if (a->op == PDMESH__ADMIN_OP__ADMIN_POLICY_SET) {
            const char *v = a->value ? a->value : "";
            int ok = 0;
            if (!strcmp(key, "method")) {
                pdm_prefill_method_t m;
                if (pdm_prefill_method_parse(v, &m)) {
                    rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                                   pdm_error_last());
                    goto done;
                }
                snprintf(r->cfg.method, sizeof(r->cfg.method), "%s", v);
                ok = 1;
            }
            for (int i = 0; i < np && !ok; i++) {
                if (strcmp(pol[i].key, key)) continue;
                long x;
                if (pdm_parse_long(v, pol[i].min, pol[i].max, &x)) {
                    char m2[160];
                    snprintf(m2, sizeof(m2), "%s must be an integer in [%ld, %ld]", key, pol[i].min,
                             pol[i].max);
                    rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT, m2);
                    goto done;
                }
                if (pol[i].i) *pol[i].i = (int)x;
                else *pol[i].u = (uint32_t)x;
                ok = 1;
            }
            if (!ok) {
                rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND, "unknown policy key");
                goto done;
            }
            r->limits.max_prompt_tokens = r->cfg.max_prompt_tokens;
            r->limits.max_tokens = r->cfg.max_tokens;
            r->limits.max_beams = r->cfg.max_beams;
        }
        if (!key[0] || !strcmp(key, "method")) {
            pdmesh__key_value__init(&kv[k]);
            kv[k].key = "method";
            kv[k].value = r->cfg.method;
            kvp[k] = &kv[k];
            k++;
        }
        for (int i = 0; i < np && k < 32; i++) {
            if (key[0] && strcmp(key, pol[i].key)) continue;
            pdmesh__key_value__init(&kv[k]);
            kv[k].key = (char *)pol[i].key;
            snprintf(vals[k], sizeof(vals[k]), "%ld", pol[i].i ? (long)*pol[i].i : (long)*pol[i].u);
            kv[k].value = vals[k];
            kvp[k] = &kv[k];
            k++;
        }
        if (!k) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND, "unknown policy key");
            goto done;
        }
        rep.values = kvp;
        rep.n_values = (size_t)k;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_LUT_SHOW:
    case PDMESH__ADMIN_OP__ADMIN_LUT_LOAD: {
        /* The table travels as the JSON of pdm_partition_table_save/_load. */
        char path[] = "/tmp/pdmesh-lut-XXXXXX";
        int fd = mkstemp(path);
        if (fd < 0) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL, "cannot make a temp file");
            goto done;
        }
        if (a->op == PDMESH__ADMIN_OP__ADMIN_LUT_LOAD) {
            const char *v = a->value ? a->value : "";
            pdm_partition_table_t t;
            int wst = write(fd, v, strlen(v)) == (ssize_t)strlen(v) ? PDM_OK : PDM_EIO;
            close(fd);
            if (!wst) wst = pdm_partition_table_load(path, &t);
            unlink(path);
            if (wst) {
                rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT,
                               pdm_error_last());
                goto done;
            }
            r->table = t;
            r->has_table = 1;
            break;
        }
        close(fd);
        if (!r->has_table) {
            unlink(path);
            rep.text = "{}";
            break;
        }
        if (pdm_partition_table_save(path, &r->table) ||
            pdm_file_read(path, 1u << 20, &text, NULL)) {
            unlink(path);
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL, "cannot render the table");
            goto done;
        }
        unlink(path);
        rep.text = text;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_REQUESTS: {
        size_t k = 0, n = (size_t)r->n_req;
        ri = calloc(n ? n : 1, sizeof(*ri));
        rip = calloc(n ? n : 1, sizeof(*rip));
        if (!ri || !rip) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INTERNAL, "out of memory");
            goto done;
        }
        static const char *states[] = {"queued", "reserving", "prefill", "decode", "shared"};
        for (rt_req_t *q = r->head; q && k < n; q = q->next, k++) {
            pdmesh__request_info__init(&ri[k]);
            ri[k].router_request_id = q->id;
            ri[k].client_request_id = q->client_id;
            ri[k].state = (char *)states[q->state];
            ri[k].prompt_tokens = q->n_prompt;
            ri[k].generated = q->n_gen;
            ri[k].age_ms = (pdm_now() - q->t_arrival) * 1e3;
            ri[k].prefill_group = q->group_name;
            ri[k].decode_node = q->dnode_name;
            ri[k].attempts = q->attempt;
            rip[k] = &ri[k];
        }
        rep.requests = rip;
        rep.n_requests = k;
        break;
    }
    case PDMESH__ADMIN_OP__ADMIN_CANCEL:
        if (pdm_router_cancel(r, a->request_id)) {
            rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_NOT_FOUND, pdm_error_last());
            goto done;
        }
        break;
    default:
        rt_admin_error(r, ident, ident_len, PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT, "unknown admin op");
        goto done;
    }
    rt_send(r->admin_sock, ident, ident_len, PDMESH__MSG_TYPE__MSG_ADMIN_REPLY, &rep.base);
done:
    free(ni);
    free(nip);
    free(caps);
    free(loads);
    free(pools);
    free(ri);
    free(rip);
    free(text);
    pdm_wire_msg_free(wm);
}
