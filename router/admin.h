/*
 * admin.h - the admin socket (router/admin.c). Internal to the router.
 */
#ifndef PDM_ROUTER_ADMIN_H
#define PDM_ROUTER_ADMIN_H

#include "router/internal.h"

/* Handles one message frame from the admin socket and answers it. */
void rt_on_admin_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len,
                       const void *frame, size_t len);

#endif
