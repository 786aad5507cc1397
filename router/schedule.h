/*
 * schedule.h - the router's dispatch policy (router/schedule.c). Internal to the router.
 */
#ifndef PDM_ROUTER_SCHEDULE_H
#define PDM_ROUTER_SCHEDULE_H

#include "router/internal.h"

/* Dispatches every QUEUED request for which a decode node (and, unless it is prefilled
 * locally, a prefill group with room) is free; the others wait for the next call. A request
 * whose tokens were all delivered before its node failed ends here. */
void rt_schedule(pdm_router_t *r);

/* Request q ended normally on decode node `node`: if that node keeps a prefix pool, its
 * block keys of the prompt and the generated tokens fed back (what the pool now holds) point
 * at the node, so a follow-up turn is prefilled there from the pooled KV. */
void rt_decode_prefix_note(pdm_router_t *r, const rt_req_t *q, int node);

#endif
