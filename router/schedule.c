/*
 * schedule.c - dispatch policy: where each QUEUED request goes next. A decode node by free KV
 * and load (ARCHITECTURE.md); a prefill group by the prefix it last prefilled (salted SHA-256
 * block keys), else the least busy one; local prefill on the decode node for short prompts,
 * migrations, and while no group is usable. With --adaptive-group, per request the whole
 * group or one idle rank of it alone (a solo task), from the queue and the cost model
 * (adapt.h). The choice goes to the request state machine (rt_req_dispatch), which plans the
 * attempt and sends its tasks.
 */
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/beams.h"
#include "router/features.h"
#include "router/registry.h"
#include "router/request.h"
#include "router/prefix.h"
#include "router/kvindex.h"
#include "router/schedule.h"

static int rt_pick_decode(pdm_router_t *r, const rt_req_t *q, int local)
{
    int best = -1;
    double best_score = 0, now = pdm_now();
    for (int i = 0; i < RT_MAX_NODES; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!rt_node_usable(r, i) || n->role != PDMESH__ROLE__ROLE_DECODE) continue;
        if (n->full_until > now || !rt_beams_node_ok(r, i, q)) continue;
        if (n->max_sequences && n->tasks >= (int)n->max_sequences) continue;
        int64_t free_kv = (int64_t)n->kv_tokens - n->kv_reserved;
        if (n->kv_tokens && free_kv < rt_kv_need(n, q, q->n_prompt, q->max_new, local)) continue;
        /* Most free KV, then fewest running sequences (ARCHITECTURE.md: decode node by free
         * KV capacity and load). */
        double score = (double)free_kv - 512.0 * (n->tasks + n->running);
        if (best < 0 || score > best_score) best = i, best_score = score;
    }
    return best;
}

/* A whole-group task may be sent to group g now: below its queue limit and no solo task in
 * flight (its ranks would wait for the busy one). */
static int rt_group_task_ok(const pdm_router_t *r, int g)
{
    return r->groups[g].inflight < r->cfg.group_inflight && !r->groups[g].solo_inflight;
}

/* Whether load-adaptive groups apply to group g (on, and more than one rank). */
static int rt_group_adaptive(const pdm_router_t *r, int g)
{
    return r->cfg.adaptive_group && r->groups[g].size > 1;
}

/* Rank k of group g holds no task. */
static int rt_rank_idle(const rt_group_t *gr, uint32_t k)
{
    return gr->rank_tasks[k] == 0;
}

/* A group can take another task: usable, no planned partial prefill waiting for its decode
 * reservation (the ranks must see that task next), not about to be wired anew (an elastic
 * group whose membership changed), and either a whole-group task may go or (adaptive) one
 * of its ranks is idle for a solo task. */
static int rt_group_has_room(const pdm_router_t *r, int g)
{
    if (!rt_group_usable(r, g) || r->groups[g].reuse_pending || r->groups[g].rewire) return 0;
    if (rt_group_task_ok(r, g)) return 1;
    if (!rt_group_adaptive(r, g)) return 0;
    for (uint32_t k = 0; k < r->groups[g].size; k++)
        if (rt_rank_idle(&r->groups[g], k)) return 1;
    return 0;
}

/* Whether a QUEUED request waits for a prefill group (not a migration, not a short prompt
 * prefilled locally). */
static int rt_wants_group(const pdm_router_t *r, const rt_req_t *q)
{
    return q->state == RQ_QUEUED && !q->chunk_id && q->n_gen == 0 &&
           q->n_prompt >= r->cfg.local_threshold;
}

/* The tokens of q's prompt a whole-group task would reuse once group g is idle: of the
 * conversation its mirror holds (pdm_prefill_conv_followup_start, as request.c plans it), or,
 * while a whole-group task is in flight, of that task's prompt, which the group will hold
 * then (an estimate: the common prefix of at least block_tokens). */
static int32_t rt_adapt_cached(const pdm_router_t *r, const rt_req_t *q, int g)
{
    const rt_group_t *gr = &r->groups[g];
    if (!r->cfg.prefix_reuse || gr->reuse_pending) return 0;
    const rt_req_t *last = NULL;
    for (const rt_req_t *w = r->head; w; w = w->next)
        if (w != q && w->state != RQ_QUEUED && w->group == g && w->solo_rank < 0 &&
            (!last || w->t_dispatch > last->t_dispatch))
            last = w;
    if (!last) {
        pdm_prefill_method_t want = PDM_PREFILL_AUTO;
        pdm_prefill_method_parse(r->cfg.method, &want);
        pdm_prefill_followup_params_t fp = {
            .method = want, .ranks = (int)gr->size, .tokens = q->prompt,
            .n_tokens = (int32_t)q->n_prompt, .min_cached = r->cfg.block_tokens, .reuse = 1};
        uint64_t source;
        return pdm_prefill_conv_followup_start(pdm_prefill_pool_pick(&gr->pool, &gr->conv, &fp,
                                                                     &source), &fp);
    }
    uint32_t same = 0, most = PDM_MIN(last->n_prompt, q->n_prompt - 1);
    while (same < most && last->prompt[same] == q->prompt[same]) same++;
    return same >= (uint32_t)r->cfg.block_tokens ? (int32_t)same : 0;
}

/* Load-adaptive parallelism: whole group (-1), one rank alone (its index) or wait (-2) for
 * q on group g, from the queue behind q and the group's cost model (adapt.h). */
static int rt_adapt_choose(pdm_router_t *r, rt_req_t *q, int g)
{
    rt_group_t *gr = &r->groups[g];
    /* A solo rank does not score prompt tokens (PrefillTask.solo): those go whole. */
    if (!rt_group_adaptive(r, g) || (q->want_plp && !q->plp_sent))
        return rt_group_task_ok(r, g) ? -1 : -2;
    if (!gr->has_cost) {
        rt_adapt_cost_init(&gr->cost, &r->model->hp, (int)gr->size,
                           r->has_calib ? &r->calib : NULL);
        gr->has_cost = 1;
    }
    const double now = pdm_now();
    double busy[PDM_PREFILL_MAX_RANKS];
    for (uint32_t k = 0; k < gr->size; k++) /* a busy rank past its estimate: soon free */
        busy[k] = rt_rank_idle(gr, k) ? 0 : PDM_MAX(0.05, gr->rank_free_at[k] - now);
    int32_t queue[RT_ADAPT_MAX_QUEUE];
    int nq = 0;
    for (rt_req_t *w = q; w && nq < RT_ADAPT_MAX_QUEUE; w = w->next)
        if (w == q || rt_wants_group(r, w)) queue[nq++] = (int32_t)w->n_prompt;
    const int32_t cached = rt_adapt_cached(r, q, g);
    rt_adapt_input_t in = {.busy = busy, .group_ok = rt_group_task_ok(r, g), .queue = queue,
                           .n_queue = nq, .head_cached = cached,
                           .rule = (rt_adapt_rule_t)r->cfg.adaptive_group};
    int rank = -1;
    double cg = 0, cs = 0;
    rt_adapt_choice_t c = rt_adapt_decide(&gr->cost, &in, &rank, &cg, &cs);
    /* request.c plans a partial prefill only on an idle group: a task that counts on one
     * waits for the group's tasks in flight instead of queueing behind them */
    if (c == RT_ADAPT_GROUP && cached > 0 && gr->inflight > 0) c = RT_ADAPT_WAIT;
    pdm_log_debug("router: request %llu on %s: queue %d, %d cached; sums of completion times: "
                  "group %.3f s, solo %.3f s (lines: group %.2fx%+.3f, solo %.2fx%+.3f) -> %s",
                  (unsigned long long)q->id, gr->name, nq, cached, cg, cs, gr->cost.group.a,
                  gr->cost.group.b, gr->cost.solo.a, gr->cost.solo.b,
                  c == RT_ADAPT_SOLO ? "solo" : c == RT_ADAPT_GROUP ? "group" : "wait");
    return c == RT_ADAPT_SOLO ? rank : c == RT_ADAPT_GROUP ? -1 : -2;
}

/* The group for a prompt: the usable group that last prefilled its longest known prefix,
 * else the least busy usable group; -1 if none has room. (What that group still holds, and so
 * what a task can reuse, its mirror tells: pdm_prefill_conv_plan_task in request.c.) */
static int rt_pick_group(pdm_router_t *r, rt_req_t *q)
{
    enum { MAXB = 256 };
    int room = 0; /* no hashing while every group is busy (the queue is scanned often) */
    for (int g = 0; g < RT_MAX_GROUPS && !room; g++)
        room = rt_group_has_room(r, g);
    if (!room) return -1;
    uint8_t (*h)[32] = malloc(sizeof(uint8_t[32]) * MAXB);
    int nb = h ? rt_block_hashes(r, q->prompt, q->n_prompt, h, MAXB) : 0;
    int best = -1;
    if (r->cfg.prefix_reuse && r->cfg.group_pool_tokens > 0) {
        /* The groups' mirrors say exactly which conversations each group holds (pool.h):
         * the one that can reuse the most of this prompt, at least a block. */
        pdm_prefill_method_t want = PDM_PREFILL_AUTO;
        pdm_prefill_method_parse(r->cfg.method, &want);
        int32_t most = 0;
        for (int g = 0; g < RT_MAX_GROUPS; g++) {
            if (!rt_group_has_room(r, g)) continue;
            const rt_group_t *gr = &r->groups[g];
            pdm_prefill_followup_params_t fp = {
                .method = want, .ranks = (int)gr->size, .tokens = q->prompt,
                .n_tokens = (int32_t)q->n_prompt, .min_cached = r->cfg.block_tokens, .reuse = 1};
            uint64_t source;
            const int32_t s = pdm_prefill_conv_followup_start(
                pdm_prefill_pool_pick(&gr->pool, &gr->conv, &fp, &source), &fp);
            if (s > most) {
                most = s;
                best = g;
            }
        }
    }
    for (int b = nb - 1; b >= 0 && best < 0; b--) {
        size_t s = rt_prefix_slot(h[b]);
        int g = r->prefix[s].group;
        if (r->prefix[s].stamp && !memcmp(r->prefix[s].hash, h[b], 32) && rt_group_has_room(r, g))
            best = g;
    }
    for (int g = 0; g < RT_MAX_GROUPS && best < 0; g++) {
        if (!rt_group_has_room(r, g)) continue;
        if (best < 0 || r->groups[g].inflight < r->groups[best].inflight) best = g;
    }
    if (best >= 0)
        for (int b = 0; b < nb; b++) {
            size_t s = rt_prefix_slot(h[b]);
            memcpy(r->prefix[s].hash, h[b], 32);
            r->prefix[s].group = best;
            r->prefix[s].stamp = ++r->prefix_stamp;
        }
    free(h);
    return best;
}

/* Whether decode node d can take q now (the checks rt_pick_decode makes). */
static int rt_decode_has_room(pdm_router_t *r, const rt_req_t *q, int d)
{
    const rt_node_t *n = &r->nodes[d];
    return !(n->full_until > pdm_now() || (n->max_sequences && n->tasks >= (int)n->max_sequences) ||
             (n->kv_tokens && (int64_t)n->kv_tokens - n->kv_reserved <
                                  rt_kv_need(n, q, q->n_prompt, q->max_new, 1)));
}

/* The usable decode node with room to prefill q's prompt from its prefix pool: the one the
 * global index (the nodes' KV events, kvindex.h) says holds the longest prefix, ties going to
 * fewer tasks and then less reserved KV. (Dynamo's KV router scores workers by cached blocks
 * against load with a weight; cached tokens come first here, as they did in the policy this
 * replaces, and pool_local_max bounds what the chosen node computes.) *cached: the expected
 * reused tokens. *held: the longest prefix any live decode node holds, room or not (full, at
 * its sequence limit, short of KV, or draining: how a miss is told apart from one caused by
 * load). -1 if none; *looked 1 when the prompt was looked up at all (some usable node
 * pools, no beams, more than one block). */
static int rt_pick_decode_prefix(pdm_router_t *r, const rt_req_t *q, uint32_t *cached,
                                 uint32_t *held, int *looked)
{
    enum { MAXB = 512 };
    int any = 0;
    *cached = *held = 0;
    *looked = 0;
    for (int i = 0; i < RT_MAX_NODES && !any; i++)
        any = rt_node_usable(r, i) && r->nodes[i].role == PDMESH__ROLE__ROLE_DECODE &&
              r->nodes[i].pool_tokens;
    const uint32_t bt = (uint32_t)r->pool_block_tokens;
    if (!any || q->beams > 1 || q->n_samples > 1 || q->n_prompt <= bt) return -1;
    *looked = 1;
    uint8_t (*h)[32] = malloc(sizeof(uint8_t[32]) * MAXB);
    uint16_t blocks[RT_KVIDX_MAX_NODES];
    int nb = h ? rt_pool_block_hashes(r, q->prompt, q->n_prompt, h, MAXB) : 0, best = -1;
    if (nb == 0 || !rt_kvindex_match(r->kvidx, (const uint8_t(*)[32])h, nb, blocks, NULL)) {
        free(h);
        return -1;
    }
    free(h);
    for (int d = 0; d < RT_MAX_NODES && d < RT_KVIDX_MAX_NODES; d++) {
        if (!blocks[d] || !r->nodes[d].used || r->nodes[d].dead ||
            r->nodes[d].role != PDMESH__ROLE__ROLE_DECODE)
            continue;
        /* the node never reuses the last prompt token (its logits are needed) */
        const uint32_t t = PDM_MIN((uint32_t)blocks[d] * bt, q->n_prompt - 1);
        if (t > *held) *held = t; /* alive: a draining node has no room either */
        if (r->nodes[d].draining || !rt_decode_has_room(r, q, d)) continue;
        const rt_node_t *n = &r->nodes[d], *b = best >= 0 ? &r->nodes[best] : NULL;
        if (!b || t > *cached ||
            (t == *cached && (n->tasks < b->tasks ||
                              (n->tasks == b->tasks && n->kv_reserved < b->kv_reserved)))) {
            best = d;
            *cached = t;
        }
    }
    return best;
}

/* Counts q's prefix-pool lookup once, when it is dispatched: `reason` names the miss, NULL when
 * it goes to node pd expecting `expect` pooled tokens (a hit or an `evicted` miss, told when
 * its DecodeResult says how many it reused: rt_req_on_decode_result). */
static void rt_pool_count(pdm_router_t *r, rt_req_t *q, const char *reason, int pd,
                          uint32_t expect)
{
    if (q->pool_looked) return;
    q->pool_looked = 1;
    r->pool_lookups++;
    pdm_metric_inc(r->m.pool_lookups, NULL, 1);
    if (reason) {
        pdm_metric_inc(r->m.pool_misses, reason, 1);
        return;
    }
    q->pool_node = pd;
    q->pool_expect = expect;
}

/* Delta transfer (issue 19): the prefix of q that decode node pd's pool holds (`cached`
 * tokens, as rt_pick_decode_prefix found them) and that the node takes from it when q goes
 * through a group: whole blocks only, never the last prompt token; 0 when no delta applies.
 * Excluded: turned off (pool_delta), refused once for q (no_delta: the node's pool lost the
 * prefix or held it corrupt), a local prefill or migration (the node finds its prefix by
 * itself), a resumed choice of OpenAI's n (its logits come from the owner rank's whole row,
 * kept simple: streamed in full); beams, n > 1 and prompt log-probabilities never get a pd. */
static uint32_t rt_delta_prefix(const pdm_router_t *r, const rt_req_t *q, int pd, uint32_t cached,
                                int want_local)
{
    const uint32_t bt = (uint32_t)r->pool_block_tokens;
    if (pd < 0 || !r->cfg.pool_delta || q->no_delta || want_local || q->resumed_choice ||
        q->n_gen > 0 || bt == 0 || !rt_node_usable(r, pd))
        return 0;
    return PDM_MIN(cached, q->n_prompt - 1) / bt * bt;
}

/* Whether decode node pd and every rank of group g registered with the delta transfer
 * (features.h): a node or rank of an older version gets the whole prompt streamed. */
static int rt_delta_supported(const pdm_router_t *r, int pd, int g)
{
    const rt_group_t *gr = &r->groups[g];
    uint64_t feats[PDM_PREFILL_MAX_RANKS];
    for (uint32_t k = 0; k < gr->size && k < PDM_PREFILL_MAX_RANKS; k++)
        feats[k] = gr->member[k] >= 0 ? r->nodes[gr->member[k]].features : 0;
    return rt_feat_delta(r->nodes[pd].features, feats, PDM_MIN(gr->size, PDM_PREFILL_MAX_RANKS));
}

/* Whether queued request w may join a batch task (batch.h): a new prompt for a group (not a
 * migration, not short), no prompt log-probabilities (a batch member does not score its
 * prompt), not OpenAI's n or a choice of it going on alone (they need the owner rank's logits,
 * PrefillTask.want_logits, which a batch member does not send), and not one the prefix pool of
 * a decode node would prefill locally or take a delta transfer for (a batch member streams its
 * whole prompt). */
static int rt_batch_eligible(pdm_router_t *r, const rt_req_t *w)
{
    if (!rt_wants_group(r, w) || (w->want_plp && !w->plp_sent)) return 0;
    if (w->n_samples > 1 || w->resumed_choice) return 0;
    uint32_t cached = 0, held = 0;
    int looked = 0;
    const int pd = rt_pick_decode_prefix(r, w, &cached, &held, &looked);
    return !(pd >= 0 && w->n_prompt - cached <= r->cfg.pool_local_max) &&
           !rt_delta_prefix(r, w, pd, cached, 0);
}

/* Batched prefill (batch.h): lead q, placed on rank `rank` of group g (a solo rank or the
 * only rank) with decode node d, takes the eligible requests queued behind it, in queue
 * (deadline) order, up to the bounds; each is dispatched (its decode node reserves its KV)
 * as a member of batch q->id, and request.c sends the one PrefillTask once all are reserved.
 * Returns 1 if a batch of two or more was formed (q dispatched), 0 when q goes alone. */
static int rt_schedule_batch(pdm_router_t *r, rt_req_t *q, int g, int rank, int d)
{
    enum { SCAN = 64 }; /* queued requests looked at behind the lead */
    rt_req_t *list[SCAN];
    rt_batch_cand_t cand[SCAN];
    int n = 0, pick[RT_BATCH_MAX];
    list[n] = q;
    cand[n++] = (rt_batch_cand_t){q->n_prompt, 1};
    for (rt_req_t *w = q->next; w && n < SCAN; w = w->next) {
        if (w->state != RQ_QUEUED || w->sched_pass == r->sched_pass || !rt_batch_eligible(r, w))
            continue;
        list[n] = w;
        cand[n++] = (rt_batch_cand_t){w->n_prompt, 1};
    }
    const int k = rt_batch_pack(cand, n, r->cfg.prefill_batch_max,
                                (uint32_t)r->cfg.prefill_batch_tokens, pick);
    if (k < 2) return 0;
    const uint64_t batch = q->id;
    int joined = 0;
    for (int i = 0; i < k; i++) {
        rt_req_t *w = list[pick[i]];
        /* the lead's node was picked by the caller; each member's now (after the others'
         * reservations): one without room stays queued */
        const int dw = i == 0 ? d : rt_pick_decode(r, w, 0);
        if (dw < 0) continue;
        w->batch_id = batch;
        w->batch_ready = 0;
        w->waits_for_group = 0;
        rt_req_dispatch(r, w, dw, g, rank);
        joined++;
    }
    pdm_log_debug("router: batch %llu: %d of %d queued request(s) packed", (unsigned long long)batch,
                  joined, n);
    return 1;
}

static int rt_any_group_alive(pdm_router_t *r)
{
    for (int g = 0; g < RT_MAX_GROUPS; g++)
        if (rt_group_usable(r, g)) return 1;
    return 0;
}

void rt_schedule(pdm_router_t *r)
{
    /* groups a request waits for in this pass: no later request overtakes it there (a
     * request waiting for the whole group would otherwise see solo tasks take its ranks one
     * after another) */
    uint32_t held = 0;
    _Static_assert(RT_MAX_GROUPS <= 32, "held is a 32-bit mask");
    rt_req_t *next;
    const uint64_t pass = ++r->sched_pass;
    rt_batch_send_pending(r);
    for (rt_req_t *q = r->head; q; q = next) {
        next = q->next;
        if (q->fail_code) { /* a choice whose leader failed (request.h, rt_leader_end) */
            rt_req_fail(r, q, q->fail_code, "%s", q->fail_msg);
            continue;
        }
        if (q->n_samples) { /* a leader of OpenAI's n with no choice left open ends */
            int open_ = 0;
            for (uint32_t i = 0; i < q->n_samples && i < RT_MAX_CHOICES; i++)
                open_ |= q->choice[i] != NULL;
            /* (choices that all ended normally: their DecodeResult is on its way, and with
             * it the KV bytes of their one transfer) */
            if (!open_ && (q->state != RQ_DECODE || q->choice_failed)) {
                rt_leader_end(r, q, 0, NULL, 1);
                continue;
            }
        }
        if (q->state != RQ_QUEUED || q->sched_pass == pass || q->chunk_id) continue;
        if (q->n_gen >= q->max_new) { /* everything was delivered before the node failed */
            rt_req_finish(r, q, PDMESH__FINISH_REASON__FINISH_LENGTH);
            continue;
        }
        int migrate = q->n_gen > 0;
        int want_local = migrate || q->n_prompt < r->cfg.local_threshold || !rt_any_group_alive(r);
        /* Prompt log-probabilities need every prompt row computed: not from a pooled prefix
         * (a group's prefix reuse is turned off in rt_req_dispatch). */
        const int score_prompt = q->want_plp && !q->plp_sent;
        /* A decode node's prefix pool holds most of the prompt (a chat's next turn): prefill
         * the rest there instead of streaming the whole prompt from a group. */
        uint32_t cached = 0, held_prefix = 0;
        int looked = 0;
        int pd = migrate || score_prompt
                     ? -1 : rt_pick_decode_prefix(r, q, &cached, &held_prefix, &looked);
        if (pd >= 0 && q->n_prompt - cached <= r->cfg.pool_local_max) {
            rt_pool_count(r, q, NULL, pd, cached);
            pdm_metric_inc(r->m.method, "local", 1);
            rt_req_dispatch(r, q, pd, -1, -1);
            continue;
        }
        const char *miss = pd >= 0 ? "delta_over_local_max"
                           : held_prefix ? "routed_elsewhere_load" : "no_match";
        /* Too long a rest for a local prefill: through a group to that node all the same,
         * which takes the prefix from its pool and receives only the rest's KV. */
        uint32_t delta = rt_delta_prefix(r, q, pd, cached, want_local);
        int g = -1, solo = -1;
        if (!want_local) {
            /* no hashing of prompts behind one that holds every group with room */
            int open = 0;
            for (int k = 0; k < RT_MAX_GROUPS && !open; k++)
                open = !(held >> k & 1) && rt_group_has_room(r, k);
            g = open ? rt_pick_group(r, q) : -1;
            if (g >= 0 && (held >> g & 1)) g = -1;
            if (g >= 0 && (solo = rt_adapt_choose(r, q, g)) == -2) {
                held |= 1u << g;
                g = -1;
            }
            q->waits_for_group = g < 0;
            if (g < 0) continue; /* every group is busy: wait */
            /* chunked prefill: a long prompt's whole-group prefill a chunk at a time, other
             * tasks of the group free to go between the chunks (request.c) */
            const int ch = solo < 0 ? rt_req_chunk(r, q, g) : 0;
            if (ch) {
                if (ch < 0) held |= 1u << g;
                continue;
            }
        }
        if (delta && g >= 0 && !rt_delta_supported(r, pd, g)) {
            delta = 0; /* the whole prompt streams, to whichever node fits */
            miss = "delta_unsupported";
        }
        int d = delta && g >= 0 ? pd : rt_pick_decode(r, q, g < 0);
        q->waits_for_group = 0;
        if (d < 0) continue; /* wait for capacity (the deadline bounds the wait) */
        /* local prefills count here, a group's methods in rt_send_prefill */
        pdm_metric_inc(r->m.method, "local", g < 0 ? 1 : 0);
        q->delta_next = g >= 0 ? delta : 0;
        if (looked && q->delta_next) rt_pool_count(r, q, NULL, pd, q->delta_next);
        else if (looked) rt_pool_count(r, q, miss, -1, 0);
        /* Batched prefill: a prompt for one rank alone (a solo rank, or a 1-rank group) takes
         * the eligible prompts queued behind it into the same task (batch.h); not one with a
         * delta transfer (a batch member streams its whole prompt). */
        if (g >= 0 && !q->delta_next && r->cfg.prefill_batch_max > 1 && !score_prompt &&
            q->n_samples <= 1 &&
            !q->resumed_choice &&
            (solo >= 0 || r->groups[g].size == 1) &&
            rt_schedule_batch(r, q, g, solo >= 0 ? solo : 0, d)) {
            next = r->head; /* members behind q left the queue (or failed): look again */
            continue;
        }
        rt_req_dispatch(r, q, d, g, solo);
    }
}
