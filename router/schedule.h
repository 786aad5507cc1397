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

#endif
