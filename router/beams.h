/*
 * beams.h - beam search through the router (router/beams.c): admission and the beam fields
 * of the messages. Internal to the router.
 */
#ifndef PDM_ROUTER_BEAMS_H
#define PDM_ROUTER_BEAMS_H

#include "router/internal.h"

/* Checks and copies a request's beam fields into q (admission). PDM_EINVAL with *code and the
 * error message set for a bad combination (stream, stop strings, ignore_eos, over the limit). */
int rt_beams_admit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, rt_req_t *q, int *code);
/* Whether some usable decode node runs a beam search of this width. */
int rt_beams_any_node(const pdm_router_t *r, uint32_t beams);
/* KV tokens an attempt with n_in prompt tokens and `remaining` new tokens reserves on decode
 * node n (decode_node/beam.h: segments of every beam for a beam search; decode.h: fewer for
 * a node whose local layers keep only their window, plus the staging of a streamed prompt
 * until it arrives). `local`: the node prefills the prompt itself (no staging). */
int64_t rt_kv_need(const rt_node_t *n, const rt_req_t *q, uint32_t n_in, uint32_t remaining,
                   int local);
/* The DecodeTask's beam fields. */
void rt_beams_task(const rt_req_t *q, Pdmesh__DecodeTask *t);
/* The DecodeStart's beam fields. */
void rt_beams_start(const rt_req_t *q, Pdmesh__DecodeStart *s);
/* The GenerateResult's n-best list from q->res_beams (borrowed). */
void rt_beams_result(const rt_req_t *q, Pdmesh__GenerateResult *res);
/* Whether node i can take q (beam width). */
int rt_beams_node_ok(const pdm_router_t *r, int i, const rt_req_t *q);

#endif
