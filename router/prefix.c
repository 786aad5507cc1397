/*
 * prefix.c - the router's prefix index: salted block keys of token sequences, and the decode
 * nodes' KV events feeding the global index of which node's prefix pool holds each key
 * (kvindex.h). Used by the scheduler (schedule.c) to place prompts and by the registry
 * (registry.c), which hands it the events; depends on neither.
 */
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/prefix.h"
#include "router/kvindex.h"
#include "router/metrics.h"

/* The shared definition of the keys (common/wire.h), with this router's salt and model. */
int rt_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32],
                           int max)
{
    pdm_prefix_key_params_t kp = {.model = r->model_name, .block_tokens = r->cfg.block_tokens};
    memcpy(kp.salt, r->prefix_salt, sizeof(kp.salt));
    return pdm_prefix_block_keys(&kp, tok, n, out, max);
}

int rt_pool_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32],
                         int max)
{
    pdm_prefix_key_params_t kp = {.model = r->model_name, .block_tokens = r->pool_block_tokens};
    memcpy(kp.salt, r->prefix_salt, sizeof(kp.salt));
    return pdm_prefix_block_keys(&kp, tok, n, out, max);
}

size_t rt_prefix_slot(const uint8_t *h)
{
    return ((size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16) % RT_PREFIX_SLOTS;
}

void rt_prefix_node_reset(pdm_router_t *r, int node)
{
    rt_kvindex_drop_node(r->kvidx, node);
    rt_node_t *n = &r->nodes[node];
    n->kvev_seq = 0;
    pdmesh__pool_stats__init(&n->pool);
    n->kvev_corrupt_seen = 0;
}

void rt_prefix_on_kv_events(pdm_router_t *r, int node, const Pdmesh__KvEvents *m)
{
    rt_node_t *n = &r->nodes[node];
    if (n->role != PDMESH__ROLE__ROLE_DECODE) {
        pdm_metric_inc(r->m.kv_events, "malformed", 1);
        return;
    }
    if (!m->reset && m->seq != n->kvev_seq + 1) {
        /* A message lost (the link's queue was full) or replayed: what the index holds for
         * this node may be wrong in either direction. Dropping it costs misses only; the
         * node's next snapshot (it sends one every PDM_KVEV_SNAPSHOT_S) rebuilds it. */
        pdm_metric_inc(r->m.kv_events, "stale", 1);
        if (m->seq <= n->kvev_seq) return;
        pdm_log_warn("router: %s: KV events %llu after %llu: its index entries are dropped "
                     "until its next snapshot", n->id, (unsigned long long)m->seq,
                     (unsigned long long)n->kvev_seq);
        rt_kvindex_drop_node(r->kvidx, node);
    }
    n->kvev_seq = m->seq;
    if (m->reset) {
        rt_kvindex_drop_node(r->kvidx, node);
        pdm_metric_inc(r->m.kv_events, "reset", 1);
    }
    size_t budget = PDM_KVEV_MAX_KEYS; /* the node's cap; more is a broken node: ignored */
    for (size_t e = 0; e < m->n_events; e++) {
        const Pdmesh__KvEvent *ev = m->events[e];
        const int stored = ev->kind == PDMESH__KV_EVENT_KIND__KV_EVENT_STORED;
        if (!stored && ev->kind != PDMESH__KV_EVENT_KIND__KV_EVENT_EVICTED) {
            pdm_metric_inc(r->m.kv_events, "malformed", 1);
            continue;
        }
        const int tier = ev->tier == PDMESH__KV_TIER__KV_TIER_FILE ? RT_KVIDX_TIER_FILE
                                                                   : RT_KVIDX_TIER_RAM;
        for (size_t k = 0; k < ev->n_block_keys && budget; k++, budget--) {
            if (ev->block_keys[k].len != 32) {
                pdm_metric_inc(r->m.kv_events, "malformed", 1);
                continue;
            }
            if (stored) rt_kvindex_store(r->kvidx, ev->block_keys[k].data, node, tier);
            else rt_kvindex_evict(r->kvidx, ev->block_keys[k].data, node);
            pdm_metric_inc(r->m.kv_events, stored ? "stored" : "evicted", 1);
        }
    }
    if (m->pool) {
        const Pdmesh__PoolStats *p = m->pool;
        n->pool = *p; /* scalars only */
        if (p->corrupt > n->kvev_corrupt_seen) {
            pdm_metric_inc(r->m.pool_corrupt, n->id, (double)(p->corrupt - n->kvev_corrupt_seen));
            n->kvev_corrupt_seen = p->corrupt;
        }
    }
}

void rt_prefix_metrics(pdm_router_t *r)
{
    for (int i = 0; i < RT_MAX_NODES; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!n->used || n->role != PDMESH__ROLE__ROLE_DECODE || !n->pool_tokens) continue;
        const int live = !n->dead;
        pdm_metric_set(r->m.pool_tokens, n->id, live ? (double)n->pool.tokens : 0);
        pdm_metric_set(r->m.pool_bytes, n->id, live ? (double)n->pool.bytes : 0);
        pdm_metric_set(r->m.pool_blocks, n->id, live ? (double)n->pool.blocks : 0);
    }
    pdm_metric_set(r->m.kv_index_blocks, NULL, (double)rt_kvindex_entries(r->kvidx));
    pdm_metric_set(r->m.pool_hit_rate, NULL,
                   r->pool_lookups ? (double)r->pool_hits / (double)r->pool_lookups : 0);
}
