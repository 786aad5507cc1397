/*
 * curve.h - CURVE on the router's sockets (router/curve.c). Internal to the router.
 */
#ifndef PDM_ROUTER_CURVE_H
#define PDM_ROUTER_CURVE_H

#include "router/internal.h"

/* Loads the key and allowlist, binds and starts the ZAP handler (no-op without CURVE flags);
 * secret gets the server's Z85 secret (41 bytes) or stays untouched. */
int rt_curve_start(pdm_router_t *r, char *secret);
void rt_curve_stop(pdm_router_t *r);

#endif
