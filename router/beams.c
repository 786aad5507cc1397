/*
 * beams.c - beam search through the router (issue 7): admission checks, the decode node's KV
 * reservation for a beam search, and the beam fields of DecodeTask / DecodeStart /
 * GenerateResult.
 *
 * A beam request (beams > 1) runs on one decode node as one sequence whose beams share the
 * prompt's KV (decode_node/beam.h, segmented cache of Wu et al. §3.2-3.3). Its tokens are not
 * streamed: the decode node reports the n-best list when the search ends, and the router
 * returns the best hypothesis as the result's tokens/text and the list as
 * GenerateResult.beams. Because nothing reached the client before the end, a failed attempt
 * (decode node dead, transfer failed) restarts the search from the prompt elsewhere, and no
 * token can be duplicated.
 */
#include <stdio.h>
#include <string.h>

#include "decode_node/beam.h"
#include "decode_node/decode.h"
#include "router/internal.h"
#include "router/beams.h"

int rt_beams_admit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, rt_req_t *q, int *code)
{
    const int INV = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
    *code = INV;
    if (req->beams <= 1) {
        if (req->n_best > 1)
            return pdm_error_set(PDM_EINVAL, "n_best %u needs beam search (beams > 1)", req->n_best);
        return PDM_OK;
    }
    uint32_t limit = PDM_MIN(r->cfg.max_beams, (uint32_t)PDM_BEAM_MAX_WIDTH);
    if (req->beams > limit)
        return pdm_error_set(PDM_EINVAL, "beams %u over the limit of %u", req->beams, limit);
    if (req->n_best > req->beams)
        return pdm_error_set(PDM_EINVAL, "n_best %u exceeds beams %u", req->n_best, req->beams);
    if (req->stream)
        return pdm_error_set(PDM_EINVAL, "beam search (beams %u) cannot be streamed: the n best "
                             "are known only when the search ends", req->beams);
    if (req->n_stop)
        return pdm_error_set(PDM_EINVAL, "stop strings are not supported with beam search");
    if (req->ignore_eos)
        return pdm_error_set(PDM_EINVAL, "ignore_eos is not supported with beam search (a beam "
                             "ends with its end-of-generation token)");
    if (!(req->length_penalty >= -100 && req->length_penalty <= 100))
        return pdm_error_set(PDM_EINVAL, "length_penalty must be in [-100, 100]");
    pdm_beam_stop_t es = PDM_BEAM_STOP_HEURISTIC;
    if (req->early_stopping && req->early_stopping[0] &&
        pdm_beam_stop_parse(req->early_stopping, &es))
        return pdm_error_set(PDM_EINVAL, "early_stopping \"%.32s\": heuristic, early or never",
                             req->early_stopping);
    if (!rt_beams_any_node(r, req->beams)) {
        *code = PDMESH__ERROR_CODE__ERR_UNAVAILABLE;
        return pdm_error_set(PDM_EUNSUPPORTED, "no decode node runs a beam search of %u beams "
                             "(at most its batch)", req->beams);
    }
    q->beams = req->beams;
    q->n_best = req->n_best ? req->n_best : 1;
    /* proto3 cannot tell 0 from unset: 0 means the usual 1 (score = mean log probability) */
    q->length_penalty = req->length_penalty != 0 ? req->length_penalty : 1.0f;
    snprintf(q->early_stopping, sizeof(q->early_stopping), "%s", pdm_beam_stop_name(es));
    return PDM_OK;
}

int rt_beams_node_ok(const pdm_router_t *r, int i, const rt_req_t *q)
{
    /* n samples take a beam search's rows too (decode_node/nsamp.h) */
    const uint32_t width = q->beams > 1 ? q->beams : q->n_samples;
    return width <= 1 || r->nodes[i].max_beams >= width;
}

int rt_beams_any_node(const pdm_router_t *r, uint32_t beams)
{
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (rt_node_usable(r, i) && r->nodes[i].role == PDMESH__ROLE__ROLE_DECODE &&
            r->nodes[i].max_beams >= beams)
            return 1;
    return 0;
}

int64_t rt_kv_need(const rt_node_t *n, const rt_req_t *q, uint32_t n_in, uint32_t remaining,
                   int local)
{
    if (q->beams > 1) return pdm_beam_kv_slots((int)q->beams, (int32_t)n_in, (int32_t)remaining);
    if (q->n_samples > 1) /* n samples: eq. (3) of beam.h with BW = n */
        return pdm_beam_kv_slots((int)q->n_samples, (int32_t)n_in, (int32_t)remaining);
    if (q->resumed_choice) /* one sample; its delivered tokens in its response segments */
        return pdm_beam_kv_slots(1, (int32_t)q->n_prompt, (int32_t)q->max_new);
    const int64_t all = (int64_t)n_in + remaining;
    if (!n->kv_win_rows || !n->kv_layers) return all;
    /* the node's rule (pdm_kvwin_plan), from the layout it announced */
    int64_t need = pdm_kvwin_slots(n->kv_layers, n->kv_win_layers, (int32_t)n->kv_win_rows, all);
    if (!local && all > n->kv_win_rows && n_in > n->kv_win_rows)
        need += ((int64_t)n->kv_win_layers * n_in + n->kv_layers - 1) / n->kv_layers;
    return PDM_MIN(need, all + (int64_t)n_in); /* (never more than full KV plus staging) */
}

void rt_beams_task(const rt_req_t *q, Pdmesh__DecodeTask *t)
{
    if (q->n_samples > 1) t->n_samples = q->n_samples;
    else if (q->resumed_choice) t->n_samples = 1; /* one sample, computed as when shared */
    if (q->beams <= 1) return;
    t->beams = q->beams;
    t->n_best = q->n_best;
    t->length_penalty = q->length_penalty;
    t->early_stopping = (char *)q->early_stopping;
}

void rt_beams_start(const rt_req_t *q, Pdmesh__DecodeStart *s)
{
    if ((q->beams <= 1 && q->n_samples <= 1 && !q->resumed_choice) || q->n_prompt == 0) return;
    s->prompt_last = q->prompt[q->n_prompt - 1];
}

void rt_beams_result(const rt_req_t *q, Pdmesh__GenerateResult *res)
{
    if (q->beams <= 1 || !q->res_beams) return;
    res->beams = q->res_beams;
    res->n_beams = q->n_res_beams;
}
