/*
 * pdmesh_admin.h - the router's admin API (proto/pdmesh.proto, AdminRequest/AdminReply) for
 * pdctl and tests. Part of libpdmesh, but unlike pdmesh_client.h it exposes the generated
 * protobuf-c types (build/gen/proto/pdmesh.pb-c.h), so it is meant for pdmesh's own tools.
 */
#ifndef PDMESH_ADMIN_H
#define PDMESH_ADMIN_H

#include <stddef.h>

#include "proto/pdmesh.pb-c.h"
#include "sdk/pdmesh_client.h"

typedef struct pdm_admin_reply pdm_admin_reply_t;

/* Sends req (its token field filled by the caller) to the admin socket at `endpoint` on a
 * fresh DEALER connection and waits up to timeout_ms for the AdminReply.
 * Returns PDM_CLIENT_OK with *out set (release with pdm_admin_reply_free) when a reply came,
 * whether it says ok or not: see pdm_admin_reply_status. Otherwise EUNREACHABLE (no TCP
 * connection could be made), ETIMEOUT (connected, no reply), EPROTOCOL (garbage), or the
 * router's Error reply as its status; the message is in pdm_client_last_error().
 * CURVE: set from $PDMESH_CURVE_SERVER_KEY_FILE and $PDMESH_CURVE_KEY_FILE when both are set
 * (common/curve.h; pdctl --curve-server-key/--curve-key set them). */
int pdm_admin_call(const char *endpoint, const Pdmesh__AdminRequest *req, int timeout_ms,
                   pdm_admin_reply_t **out);
const Pdmesh__AdminReply *pdm_admin_reply_get(const pdm_admin_reply_t *r);
/* PDM_CLIENT_OK if the reply says ok, else its error code as a pdm_client_status_t (and the
 * router's message in pdm_client_last_error()). */
int pdm_admin_reply_status(const pdm_admin_reply_t *r);
void pdm_admin_reply_free(pdm_admin_reply_t *r);

/* Reads the admin token (the one loader, common/wire.h pdm_auth_load_admin_token): the file
 * `path` if given, else the file $PDMESH_ADMIN_TOKEN_FILE, else $PDMESH_ADMIN_TOKEN. Never
 * from a command-line value. Trailing CR/LF stripped; 8 to 4096 bytes, no NUL byte.
 * *out is malloc'ed. EINVALID_ARGUMENT (with a message naming the source) when none is
 * configured or the token cannot be read or is unusable. */
int pdm_admin_load_token(const char *path, char **out);

#endif
