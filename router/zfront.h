/*
 * zfront.h - the ZeroMQ client front end (router/zfront.c). Internal to the router.
 */
#ifndef PDM_ROUTER_ZFRONT_H
#define PDM_ROUTER_ZFRONT_H

#include "router/internal.h"

int rt_zfront_init(pdm_router_t *r);
void rt_zfront_fini(pdm_router_t *r);
/* Cancels the requests of clients that are gone (their replies could not be sent). */
void rt_zfront_sweep(pdm_router_t *r);
/* Handles one message frame from the client socket. */
void rt_on_client_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                        const void *frame, size_t len);

#endif
