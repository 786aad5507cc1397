/*
 * core.h - the router's life (router/core.c), for main.c.
 */
#ifndef PDM_ROUTER_CORE_H
#define PDM_ROUTER_CORE_H

#include "router/internal.h"

void rt_config_default(rt_config_t *c);

int rt_router_create(uv_loop_t *loop, const rt_config_t *cfg, pdm_router_t **out);
void rt_router_close(pdm_router_t *r);   /* closes handles (run the loop afterwards) */
void rt_router_free(pdm_router_t *r);

#endif
