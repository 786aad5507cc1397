/*
 * registry.c - nodes and prefill groups: registration with an HMAC proof, epochs, heartbeats,
 * leases, deregistration and group wiring; and the node socket's dispatcher, which checks a
 * message's sender and epoch and hands the messages about tasks to the request state machine
 * (request.c). A node that is lost is reported to it as an event (rt_req_on_node_lost); the
 * registry never walks the requests itself.
 *
 * Epochs: every registration gets a new epoch from one router-wide counter. Messages that carry
 * an epoch must carry the sender's current one; anything else is answered ERR_STALE_EPOCH and
 * dropped. A node is found by its ZeroMQ routing identity and must also match by epoch, so a
 * restarted process (new identity) cannot speak for its predecessor's tasks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "router/features.h"
#include "router/internal.h"
#include "router/prefix.h"
#include "router/registry.h"
#include "router/request.h"

static uint64_t rt_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

const char *rt_node_state(const rt_node_t *n)
{
    return n->dead ? "dead" : n->draining ? "draining" : "alive";
}

int rt_group_usable(const pdm_router_t *r, int g)
{
    if (g < 0 || g >= RT_MAX_GROUPS || !r->groups[g].used || !r->groups[g].wired ||
        r->groups[g].suspect_until > pdm_now())
        return 0;
    for (uint32_t k = 0; k < r->groups[g].size; k++)
        if (!rt_node_usable(r, r->groups[g].member[k])) return 0;
    return 1;
}

static int rt_group_of(pdm_router_t *r, const rt_node_t *n)
{
    if (n->role != PDMESH__ROLE__ROLE_PREFILL) return -1;
    for (int g = 0; g < RT_MAX_GROUPS; g++)
        if (r->groups[g].used && !strcmp(r->groups[g].name, n->group)) return g;
    return -1;
}

/* Node i is gone (dead, re-registered or deregistered): its group is no longer wired, and the
 * request state machine fails every attempt that involved either. */
static void rt_node_lost(pdm_router_t *r, int i, const char *why)
{
    rt_node_t *n = &r->nodes[i];
    int g = rt_group_of(r, n);
    int member = g >= 0 && n->rank < r->groups[g].size && r->groups[g].member[n->rank] == i;
    if (g >= 0 && r->groups[g].wired && member) {
        r->groups[g].wired = 0;
        if (r->groups[g].elastic)
            pdm_log_warn("router: prefill group %s lost %s (%s); it re-forms with the ranks "
                         "before it", r->groups[g].name, n->id, why);
        else
            pdm_log_warn("router: prefill group %s broke (%s %s); it re-forms when that rank "
                         "registers again (the other ranks re-join on a new GroupWire)",
                         r->groups[g].name, n->id, why);
    }
    rt_prefix_node_reset(r, i);
    rt_req_on_node_lost(r, i, g, why);
}

/* The ranks an elastic group should have now: 0..k-1, every one registered and usable (not
 * dead, not draining), up to the first gap. A static group: its declared size. */
static uint32_t rt_group_want(const pdm_router_t *r, const rt_group_t *gr)
{
    if (!gr->elastic) return gr->size;
    uint32_t k = 0;
    while (k < PDM_PREFILL_MAX_RANKS && rt_node_usable(r, gr->member[k])) k++;
    return k;
}

/* Wires group g (GroupWire to each rank: its rank, the size, every rank's UCX address) once
 * every rank it needs is registered. An elastic group already wired is wired anew when its
 * membership changed (a rank joined, drained or died): at once if no task is in flight, else
 * `rewire` holds new tasks back until the running ones end (rt_registry_tick calls this
 * again), so a group that grows or shrinks fails nothing that was queued. */
static void rt_group_try_wire(pdm_router_t *r, int g)
{
    rt_group_t *gr = &r->groups[g];
    uint32_t want = rt_group_want(r, gr);
    if (gr->wired) {
        if (!gr->elastic) return;
        int same = want == gr->size;
        for (uint32_t k = 0; same && k < want; k++)
            same = r->nodes[gr->member[k]].epoch == gr->member_epoch[k];
        if (same) {
            gr->rewire = 0;
            return;
        }
        if (gr->inflight > 0) {
            if (!gr->rewire)
                pdm_log_info("router: prefill group %s goes from %u to %u ranks once its %d "
                             "task(s) in flight end", gr->name, gr->size, want, gr->inflight);
            gr->rewire = 1;
            return;
        }
        gr->wired = 0;
    }
    if (want < 1) return;
    for (uint32_t k = 0; k < want; k++) {
        int i = gr->member[k];
        if (i < 0 || !r->nodes[i].used || r->nodes[i].dead) return;
    }
    gr->size = want;
    gr->rewire = 0;
    ProtobufCBinaryData addrs[PDM_PREFILL_MAX_RANKS];
    const void *datas[PDM_PREFILL_MAX_RANKS];
    size_t lens[PDM_PREFILL_MAX_RANKS];
    for (uint32_t k = 0; k < gr->size; k++) {
        addrs[k].data = r->nodes[gr->member[k]].ucx;
        addrs[k].len = r->nodes[gr->member[k]].ucx_len;
        datas[k] = addrs[k].data;
        lens[k] = addrs[k].len;
    }
    gr->formation = pdm_prefill_formation(datas, lens, (int)gr->size);
    /* ordered only if every rank has it (features.h): a rank of an older version neither
     * forwards nor follows, so the whole group then runs each rank's own copies */
    uint64_t feats[PDM_PREFILL_MAX_RANKS];
    uint32_t lacking = 0;
    for (uint32_t k = 0; k < gr->size; k++) feats[k] = r->nodes[gr->member[k]].features;
    gr->ordered = rt_feat_group_ordered(feats, gr->size, &lacking);
    if (!gr->ordered && gr->size > 1)
        pdm_log_warn("router: group %s: rank %u (%s) lacks ordered tasks (older version); "
                     "running unordered", gr->name, lacking, r->nodes[gr->member[lacking]].id);
    gr->wire_gen++;
    gr->wire_stale = 0;
    for (uint32_t k = 0; k < gr->size; k++) {
        rt_node_t *n = &r->nodes[gr->member[k]];
        Pdmesh__GroupWire w = PDMESH__GROUP_WIRE__INIT;
        w.ordered = gr->ordered;
        w.epoch = n->epoch;
        w.group = gr->name;
        w.rank = k;
        w.size = gr->size;
        w.ucx_addresses = addrs;
        w.n_ucx_addresses = gr->size;
        rt_send(r->node_sock, n->ident, n->ident_len, PDMESH__MSG_TYPE__MSG_GROUP_WIRE, &w.base);
        gr->member_epoch[k] = n->epoch;
    }
    gr->wired = 1;
    gr->inflight = 0;
    gr->solo_inflight = 0;
    memset(gr->rank_tasks, 0, sizeof(gr->rank_tasks));
    for (uint32_t k = 0; k < gr->size; k++) gr->rank_free_at[k] = pdm_now();
    gr->has_cost = 0; /* the model follows the new size; what it learned starts again */
    gr->reuse_pending = 0;
    pdm_prefill_conv_reset(&gr->conv); /* fresh ranks hold nothing */
    pdm_prefill_pool_clear(&gr->pool);
    gr->pool_reset = 1; /* and in case a rank kept its process: empty its pool too */
    pdm_log_info("router: prefill group %s wired (%u ranks%s%s)", gr->name, gr->size,
                 gr->elastic ? ", elastic" : "", gr->ordered || gr->size < 2 ? "" : ", unordered");
}

/* Rank 0 of group g refused a task of its current wiring as planned for another formation
 * (request.c set wire_stale): the ranks are in a formation this router did not wire (another
 * router re-wired an elastic group it sees differently), so the GroupWire goes out again and
 * the group re-forms as this router plans it. Once per wiring: the other tasks refused under
 * it only wait for the new one. Its tasks still in flight stay counted (they run, or are
 * refused, under the new wiring). */
static void rt_group_rewire_stale(pdm_router_t *r, int g)
{
    if (g < 0 || !r->groups[g].wire_stale) return;
    rt_group_t *gr = &r->groups[g];
    const double now = pdm_now();
    if (now < gr->stale_rewire_at + r->cfg.lease_ms / 1e3) return; /* (wire_stale stays) */
    gr->stale_rewire_at = now;
    const int inflight = gr->inflight, solo_inflight = gr->solo_inflight;
    int rank_tasks[PDM_PREFILL_MAX_RANKS];
    memcpy(rank_tasks, gr->rank_tasks, sizeof(rank_tasks));
    pdm_log_info("router: prefill group %s: its ranks are in another formation than the one "
                 "wired; wiring it again", gr->name);
    gr->wire_stale = 0;
    gr->wired = 0;
    rt_group_try_wire(r, g);
    if (!gr->wired) return; /* a rank is gone: it re-forms when the rank is back */
    gr->inflight = inflight;
    gr->solo_inflight = solo_inflight;
    memcpy(gr->rank_tasks, rank_tasks, sizeof(rank_tasks));
}

static void rt_on_register(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                           const Pdmesh__Register *m)
{
    void *s = r->node_sock;
    const int INV = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
    if (!m->node_id || !m->node_id[0] || strlen(m->node_id) >= RT_NAME_MAX) {
        pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: node_id must be 1..%d bytes",
                            RT_NAME_MAX - 1);
        return;
    }
    /* Authentication first: nothing about an unauthenticated node is kept. */
    uint64_t now_ms = rt_unix_ms();
    double skew = ((double)now_ms - (double)m->timestamp_ms) / 1e3;
    if (skew > r->cfg.max_skew_s || skew < -r->cfg.max_skew_s) {
        pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNAUTHORIZED, 0,
                            "register: timestamp is %.0f s off the router's clock", skew);
        return;
    }
    if (!pdm_auth_verify(r->secret, r->secret_len, m->node_id, m->nonce, m->timestamp_ms,
                         m->proof.data, m->proof.len)) {
        pdm_log_warn("router: registration of %s refused: bad proof", m->node_id);
        pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNAUTHORIZED, 0,
                            "register: the proof does not match the cluster secret");
        return;
    }
    /* A proof is good for one registration: a replayed Register (same node id and nonce within
     * the skew window) is refused. */
    uint8_t idh[32];
    pdm_sha256(m->node_id, strlen(m->node_id), idh);
    double tnow = pdm_now();
    for (unsigned k = 0; k < PDM_ARRAY_SIZE(r->seen); k++)
        if (r->seen[k].t > 0 && tnow - r->seen[k].t < 2 * r->cfg.max_skew_s &&
            r->seen[k].nonce == m->nonce && !memcmp(r->seen[k].id, idh, 8)) {
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNAUTHORIZED, 0,
                                "register: replayed proof");
            return;
        }
    unsigned slot = r->seen_next++ % PDM_ARRAY_SIZE(r->seen);
    r->seen[slot].nonce = m->nonce;
    memcpy(r->seen[slot].id, idh, 8);
    r->seen[slot].t = tnow;
    if (m->role != PDMESH__ROLE__ROLE_PREFILL && m->role != PDMESH__ROLE__ROLE_DECODE) {
        pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: role must be prefill or decode");
        return;
    }
    if (m->ucx_address.len < 1 || m->ucx_address.len > 8192) {
        pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: UCX address of 1..8192 bytes");
        return;
    }
    if (ident_len > RT_IDENT_MAX) {
        pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: routing id too long");
        return;
    }
    int g = -1;
    if (m->role == PDMESH__ROLE__ROLE_PREFILL) {
        /* group_size 0: an elastic group (rt_group_want) */
        if (!m->group || !m->group[0] || strlen(m->group) >= 64 ||
            m->group_size > PDM_PREFILL_MAX_RANKS || m->rank >= PDM_PREFILL_MAX_RANKS ||
            (m->group_size && m->rank >= m->group_size)) {
            pdm_wire_send_error(s, ident, ident_len, INV, 0,
                                "register: prefill needs group (1..63 bytes), group_size "
                                "1..%d and rank < group_size, or group_size 0 (elastic) and "
                                "rank < %d", PDM_PREFILL_MAX_RANKS, PDM_PREFILL_MAX_RANKS);
            return;
        }
        for (int k = 0; k < RT_MAX_GROUPS && g < 0; k++)
            if (r->groups[k].used && !strcmp(r->groups[k].name, m->group)) g = k;
        if (g >= 0 && r->groups[g].elastic != (m->group_size == 0)) {
            pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: group %s is %s", m->group,
                                r->groups[g].elastic ? "elastic (group_size 0)"
                                                     : "of a fixed size");
            return;
        }
        if (g >= 0 && !r->groups[g].elastic && r->groups[g].size != m->group_size) {
            pdm_wire_send_error(s, ident, ident_len, INV, 0,
                                "register: group %s has %u ranks, not %u", m->group,
                                r->groups[g].size, m->group_size);
            return;
        }
        if (g >= 0) {
            int other = r->groups[g].member[m->rank];
            if (other >= 0 && strcmp(r->nodes[other].id, m->node_id) && !r->nodes[other].dead) {
                pdm_wire_send_error(s, ident, ident_len, INV, 0,
                                    "register: rank %u of group %s is held by live node %s",
                                    m->rank, m->group, r->nodes[other].id);
                return;
            }
        }
    }
    int i = -1, fresh = -1;
    for (int k = 0; k < RT_MAX_NODES; k++) {
        if (r->nodes[k].used && !strcmp(r->nodes[k].id, m->node_id)) i = k;
        if (!r->nodes[k].used && fresh < 0) fresh = k;
    }
    if (i >= 0 && r->nodes[i].role != (int)m->role) {
        pdm_wire_send_error(s, ident, ident_len, INV, 0, "register: %s is registered with another role",
                            m->node_id);
        return;
    }
    if (i < 0 && fresh < 0) {
        pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_OVERLOADED, 0,
                            "register: the registry is full (%d nodes)", RT_MAX_NODES);
        return;
    }
    if (g < 0 && m->role == PDMESH__ROLE__ROLE_PREFILL) {
        for (int k = 0; k < RT_MAX_GROUPS && g < 0; k++)
            if (!r->groups[k].used) g = k;
        if (g < 0) {
            pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_OVERLOADED, 0,
                                "register: too many prefill groups (%d)", RT_MAX_GROUPS);
            return;
        }
        rt_group_t *gr = &r->groups[g];
        memset(gr, 0, sizeof(*gr));
        gr->used = 1;
        snprintf(gr->name, sizeof(gr->name), "%s", m->group);
        gr->size = m->group_size;
        gr->elastic = m->group_size == 0;
        for (int k = 0; k < PDM_PREFILL_MAX_RANKS; k++) gr->member[k] = -1;
    }
    if (i >= 0 && !r->nodes[i].dead && m->generation &&
        r->nodes[i].generation == m->generation && r->nodes[i].pid == m->pid &&
        r->nodes[i].ucx_len == m->ucx_address.len &&
        !memcmp(r->nodes[i].ucx, m->ucx_address.data, m->ucx_address.len)) {
        /* The same registration sent again (its ack was late; the retry came over a fresh
         * connection): the same epoch, nothing lost, answers to the new connection - unless
         * this copy is older than the one taken (the first attempt, delivered late over the
         * connection the node has since dropped): answering there would move the node to a
         * dead connection, refuse its heartbeats and make it register anew as if it had
         * restarted (its group re-wired under running tasks: a 30 s stall in test_ha.py). */
        rt_node_t *n = &r->nodes[i];
        if (m->timestamp_ms < n->reg_ts_ms) {
            pdm_log_info("router: %s: an older copy of its registration: ignored", n->id);
            return;
        }
        n->reg_ts_ms = m->timestamp_ms;
        memcpy(n->ident, ident, ident_len);
        n->ident_len = ident_len;
        n->last_hb = pdm_now();
        Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
        ack.epoch = n->epoch;
        ack.heartbeat_ms = (uint32_t)r->cfg.heartbeat_ms;
        ack.lease_ms = (uint32_t)r->cfg.lease_ms;
        ack.router_id = r->router_id;
        rt_send(s, ident, ident_len, PDMESH__MSG_TYPE__MSG_REGISTER_ACK, &ack.base);
        return;
    }
    int draining = 0;
    if (i >= 0) {
        /* A new incarnation: whatever the old one was doing is lost. */
        draining = r->nodes[i].draining;
        if (!r->nodes[i].dead) rt_node_lost(r, i, "registered again (restarted)");
        int og = rt_group_of(r, &r->nodes[i]);
        if (og >= 0 && r->groups[og].member[r->nodes[i].rank] == i)
            r->groups[og].member[r->nodes[i].rank] = -1;
        free(r->nodes[i].ucx);
    } else {
        i = fresh;
    }
    rt_node_t *n = &r->nodes[i];
    memset(n, 0, sizeof(*n));
    n->used = 1;
    snprintf(n->id, sizeof(n->id), "%s", m->node_id);
    n->role = m->role;
    snprintf(n->group, sizeof(n->group), "%s", m->group ? m->group : "");
    n->rank = m->rank;
    n->gsize = m->group_size;
    n->features = m->features;
    memcpy(n->ident, ident, ident_len);
    n->ident_len = ident_len;
    n->ucx = malloc(m->ucx_address.len);
    if (n->ucx) memcpy(n->ucx, m->ucx_address.data, m->ucx_address.len);
    n->ucx_len = n->ucx ? m->ucx_address.len : 0;
    if (m->capacity) {
        n->kv_tokens = m->capacity->kv_tokens;
        n->max_sequences = m->capacity->max_sequences;
        n->max_batch = m->capacity->max_batch;
        n->threads = m->capacity->threads;
        n->max_prompt = m->capacity->max_prompt;
        n->max_beams = m->capacity->max_beams;
        n->pool_tokens = m->capacity->pool_tokens;
        n->kv_layers = m->capacity->kv_layers;
        n->kv_win_layers = m->capacity->kv_windowed_layers;
        n->kv_win_rows = m->capacity->kv_window_rows;
        if (n->kv_win_layers > n->kv_layers) n->kv_win_layers = n->kv_win_rows = 0;
    }
    n->epoch = ++r->next_epoch;
    n->last_hb = n->registered_at = pdm_now();
    n->pid = m->pid;
    n->generation = m->generation;
    n->reg_ts_ms = m->timestamp_ms;
    n->draining = draining;
    Pdmesh__RegisterAck ack = PDMESH__REGISTER_ACK__INIT;
    ack.epoch = n->epoch;
    ack.heartbeat_ms = (uint32_t)r->cfg.heartbeat_ms;
    ack.lease_ms = (uint32_t)r->cfg.lease_ms;
    ack.router_id = r->router_id;
    /* A new epoch: whatever the index held for this node is from its previous life. */
    rt_prefix_node_reset(r, (int)(n - r->nodes));
    if (n->role == PDMESH__ROLE__ROLE_DECODE && n->pool_tokens) {
        /* so that its KV events name blocks with this router's keys (common/wire.h) */
        ack.prefix_salt.data = r->prefix_salt;
        ack.prefix_salt.len = sizeof(r->prefix_salt);
        ack.prefix_block_tokens = (uint32_t)r->pool_block_tokens;
        ack.prefix_model = r->model_name;
    }
    rt_send(s, ident, ident_len, PDMESH__MSG_TYPE__MSG_REGISTER_ACK, &ack.base);
    pdm_log_info("router: %s registered (%s, epoch %llu)", n->id,
                 n->role == PDMESH__ROLE__ROLE_DECODE ? "decode" : "prefill",
                 (unsigned long long)n->epoch);
    if (g >= 0) {
        r->groups[g].member[n->rank] = i;
        rt_group_try_wire(r, g);
    }
}

/* The live node behind a routing identity, checked against a message epoch (0: none). */
static int rt_node_by_ident(pdm_router_t *r, const uint8_t *ident, size_t ident_len)
{
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (r->nodes[i].used && !r->nodes[i].dead && r->nodes[i].ident_len == ident_len &&
            !memcmp(r->nodes[i].ident, ident, ident_len))
            return i;
    return -1;
}

static int rt_check_sender(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                           uint64_t epoch, int has_epoch, const char *what)
{
    int i = rt_node_by_ident(r, ident, ident_len);
    if (i < 0 || (has_epoch && epoch != r->nodes[i].epoch)) {
        char text[160];
        snprintf(text, sizeof(text), "%s: %s", what,
                 i < 0 ? "unknown or expired node: register again" : "stale epoch");
        Pdmesh__Error e = PDMESH__ERROR__INIT;
        e.code = PDMESH__ERROR_CODE__ERR_STALE_EPOCH;
        e.message = text;
        e.epoch = has_epoch ? epoch : 0; /* so that a node registered anew since ignores it */
        rt_send(r->node_sock, ident, ident_len, PDMESH__MSG_TYPE__MSG_ERROR, &e.base);
        return -1;
    }
    return i;
}

static const char *rt_str(const char *s)
{
    return s ? s : "";
}

void rt_on_node_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len, const void *frame,
                      size_t len)
{
    void *s = r->node_sock;
    pdm_wire_msg_t *wm;
    if (pdm_wire_unpack_or_reply(s, ident, ident_len, frame, len, PDM_WIRE_MAX_FRAME, &wm)) return;
    int type = pdm_wire_type(wm);
    ProtobufCMessage *msg = pdm_wire_message(wm);
    double now = pdm_now();
    int i;
    switch (type) {
    case PDMESH__MSG_TYPE__MSG_REGISTER:
        rt_on_register(r, ident, ident_len, (Pdmesh__Register *)msg);
        break;
    case PDMESH__MSG_TYPE__MSG_HEARTBEAT: {
        Pdmesh__Heartbeat *h = (Pdmesh__Heartbeat *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, h->epoch, 1, "heartbeat")) < 0) break;
        rt_node_t *n = &r->nodes[i];
        n->last_hb = now;
        if (h->draining && !n->draining) { /* shutting down: nothing new; it leaves when idle */
            n->draining = 1;
            pdm_log_info("router: %s draining (it is shutting down)", n->id);
        }
        if (h->load) {
            n->running = h->load->running;
            n->held = h->load->held;
            n->kv_used = h->load->kv_tokens_used;
            n->kv_free = h->load->kv_tokens_free;
            n->offload = h->load->offload_bytes;
        }
        Pdmesh__HeartbeatAck ack = PDMESH__HEARTBEAT_ACK__INIT;
        ack.epoch = n->epoch;
        ack.draining = n->draining;
        rt_send(s, ident, ident_len, PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK, &ack.base);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DEREGISTER: {
        Pdmesh__Deregister *d = (Pdmesh__Deregister *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, d->epoch, 1, "deregister")) < 0) break;
        r->nodes[i].dead = 1;
        rt_node_lost(r, i, "deregistered");
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_RESERVED: {
        Pdmesh__DecodeReserved *d = (Pdmesh__DecodeReserved *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, d->epoch, 1, "reserved")) < 0) break;
        r->nodes[i].last_hb = now;
        rt_req_on_reserved(r, i, d);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_PREFILL_RESULT: {
        Pdmesh__PrefillResult *p = (Pdmesh__PrefillResult *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, p->epoch, 1, "prefill result")) < 0) break;
        r->nodes[i].last_hb = now;
        rt_req_on_prefill_result(r, i, p);
        rt_group_rewire_stale(r, rt_group_of(r, &r->nodes[i]));
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_TOKENS: {
        Pdmesh__DecodeTokens *d = (Pdmesh__DecodeTokens *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, 0, 0, "tokens")) < 0) break;
        r->nodes[i].last_hb = now;
        rt_req_on_tokens(r, i, d);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_DECODE_RESULT: {
        Pdmesh__DecodeResult *d = (Pdmesh__DecodeResult *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, d->epoch, 1, "decode result")) < 0) break;
        r->nodes[i].last_hb = now;
        rt_req_on_decode_result(r, i, d);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_GROUP_READY: {
        Pdmesh__GroupReady *g = (Pdmesh__GroupReady *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, g->epoch, 1, "group ready")) < 0) break;
        r->nodes[i].last_hb = now;
        if (!g->ok) /* the rank registers again, which re-wires the group */
            pdm_log_warn("router: %s did not join group %s: %s", r->nodes[i].id, rt_str(g->group),
                         g->error && g->error->message ? g->error->message : "failed");
        else
            pdm_log_info("router: %s joined group %s (%s)", r->nodes[i].id, rt_str(g->group),
                         rt_str(g->transports));
        break;
    }
    case PDMESH__MSG_TYPE__MSG_ERROR: { /* a node refused a frame; never answered (no loops) */
        Pdmesh__Error *e = (Pdmesh__Error *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, 0, 0, "error")) < 0) break;
        pdm_log_warn("router: %s: error %d: %s", r->nodes[i].id, e->code, rt_str(e->message));
        if (e->task_id) rt_req_on_task_error(r, i, e);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_KV_EVENTS: {
        Pdmesh__KvEvents *k = (Pdmesh__KvEvents *)msg;
        if ((i = rt_check_sender(r, ident, ident_len, k->epoch, 1, "kv events")) < 0) break;
        rt_prefix_on_kv_events(r, i, k);
        break;
    }
    case PDMESH__MSG_TYPE__MSG_NODE_STATS:
    case PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG_RESULT:
        break; /* answers to requests of a local harness; the router sends none */
    case PDMESH__MSG_TYPE__MSG_PING: {
        Pdmesh__Ping *p = (Pdmesh__Ping *)msg;
        Pdmesh__Ping pong = PDMESH__PING__INIT;
        pong.nonce = p->nonce;
        rt_send(s, ident, ident_len, PDMESH__MSG_TYPE__MSG_PONG, &pong.base);
        break;
    }
    default:
        pdm_wire_send_error(s, ident, ident_len, PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE, 0,
                            "%s is not a message for the node socket", pdm_wire_type_name(type));
        break;
    }
    pdm_wire_msg_free(wm);
}

void rt_node_metrics(pdm_router_t *r)
{
    static const char *keys[] = {"prefill_alive", "prefill_draining", "prefill_dead",
                                 "decode_alive", "decode_draining", "decode_dead"};
    int count[6] = {0};
    double kv_free = 0, kv_capacity = 0;
    for (int i = 0; i < RT_MAX_NODES; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!n->used) continue;
        int base = n->role == PDMESH__ROLE__ROLE_DECODE ? 3 : 0;
        count[base + (n->dead ? 2 : n->draining ? 1 : 0)]++;
        if (n->role == PDMESH__ROLE__ROLE_DECODE) pdm_metric_set(r->m.offload, n->id, (double)n->offload);
        /* The scheduler's own view (rt_pick_decode): budget minus what the router reserved,
         * over the nodes that may take work. */
        if (n->role == PDMESH__ROLE__ROLE_DECODE && rt_node_usable(r, i)) {
            kv_capacity += (double)n->kv_tokens;
            if ((int64_t)n->kv_tokens > n->kv_reserved)
                kv_free += (double)((int64_t)n->kv_tokens - n->kv_reserved);
        }
    }
    for (int k = 0; k < 6; k++) pdm_metric_set(r->m.nodes, keys[k], count[k]);
    pdm_metric_set(r->m.kv_free, NULL, kv_free);
    pdm_metric_set(r->m.kv_capacity, NULL, kv_capacity);
    int waiting[2] = {0};
    for (rt_req_t *q = r->head; q; q = q->next)
        if (q->state == RQ_QUEUED) waiting[q->waits_for_group ? 1 : 0]++;
    pdm_metric_set(r->m.waiting, "decode", waiting[0]);
    pdm_metric_set(r->m.waiting, "prefill", waiting[1]);
    /* Groups are never forgotten (a broken one re-forms under its name): a group that cannot
     * take work shows 0, so no stale value stays behind. */
    for (int g = 0; g < RT_MAX_GROUPS; g++)
        if (r->groups[g].used)
            pdm_metric_set(r->m.group_inflight, r->groups[g].name,
                           rt_group_usable(r, g) ? r->groups[g].inflight : 0);
    pdm_metric_set(r->m.group_inflight_limit, NULL, r->cfg.group_inflight);
    rt_prefix_metrics(r);
}

void rt_registry_tick(pdm_router_t *r)
{
    double now = pdm_now();
    for (int i = 0; i < RT_MAX_NODES; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!n->used || n->dead) continue;
        if ((now - n->last_hb) * 1e3 > r->cfg.lease_ms) {
            n->dead = 1;
            pdm_log_warn("router: %s missed its lease (%.1f s without a heartbeat)", n->id,
                         now - n->last_hb);
            rt_node_lost(r, i, "missed its lease");
        }
    }
    for (int g = 0; g < RT_MAX_GROUPS; g++)
        if (r->groups[g].used && r->groups[g].elastic) rt_group_try_wire(r, g);
}
