/*
 * Message framing and authentication for the control plane (proto/pdmesh.proto).
 *
 * One pdmesh message = one ZeroMQ frame: an 8-byte header ('P', 'D', version, 0, type as a
 * big-endian u16, 0, 0) followed by the protobuf bytes of the message the type names. The
 * receiver checks the size against a cap before anything else, rejects unknown types, and
 * unpacks with an allocator that refuses to allocate more than a per-message budget
 * (PITFALLS.md, protobuf-c), so a hostile frame costs at most that budget.
 */
#ifndef PDM_WIRE_H
#define PDM_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "proto/pdmesh.pb-c.h"

#define PDM_WIRE_HDR 8
#define PDM_WIRE_VERSION 1
/* Default frame cap: a 64K-token prompt as token ids is ~320 KB; 4 MB leaves room for text. */
#define PDM_WIRE_MAX_FRAME (4u << 20)

/* Descriptor of the protobuf message carried by a type, NULL for an unknown type. */
const ProtobufCMessageDescriptor *pdm_wire_descriptor(int type);
const char *pdm_wire_type_name(int type);

/* Packs header + message into a malloc'ed buffer (*out, *len). PDM_ENOMEM / PDM_EINVAL. */
int pdm_wire_pack(int type, const ProtobufCMessage *msg, uint8_t **out, size_t *len);

/* Checks the header of a frame of len bytes against cap; *type on success. PDM_EFORMAT
 * (bad magic/version/short), PDM_EOVERFLOW (over cap), PDM_EUNSUPPORTED (unknown type). The
 * error message says which. */
int pdm_wire_peek(const void *frame, size_t len, size_t cap, int *type);

/* An unpacked message with its allocator. */
typedef struct pdm_wire_msg pdm_wire_msg_t;

/* pdm_wire_peek, then unpacks the message within a budget of `budget` bytes of allocations
 * (0: 8 x the frame size + 4 KB). Release with pdm_wire_msg_free. */
int pdm_wire_unpack(const void *frame, size_t len, size_t cap, size_t budget,
                    pdm_wire_msg_t **out);
int pdm_wire_type(const pdm_wire_msg_t *m);
/* The message; cast to the struct its type names (e.g. (Pdmesh__Register *)). */
ProtobufCMessage *pdm_wire_message(const pdm_wire_msg_t *m);
void pdm_wire_msg_free(pdm_wire_msg_t *m);

/* The Error code that tells a peer why its frame was refused, from pdm_wire_unpack's status:
 * ERR_TOO_LARGE, ERR_UNKNOWN_TYPE or ERR_BAD_MESSAGE. */
int pdm_wire_refusal_code(int unpack_status);

/* For servers: pdm_wire_unpack, and when the frame is refused, an Error reply to `ident` on
 * `zsock` whose code says why (ERR_TOO_LARGE, ERR_UNKNOWN_TYPE, ERR_BAD_MESSAGE). Returns the
 * unpack status. */
int pdm_wire_unpack_or_reply(void *zsock, const void *ident, size_t ident_len, const void *frame,
                             size_t len, size_t cap, pdm_wire_msg_t **out);

/* ZeroMQ helpers. Sends [identity frame if ident] + one message frame, non-blocking
 * (ZMQ_DONTWAIT); PDM_EOVERFLOW when the peer's queue is full, PDM_EPEER when a ROUTER with
 * ZMQ_ROUTER_MANDATORY does not know the identity. */
int pdm_wire_send(void *zsock, const void *ident, size_t ident_len, int type,
                  const ProtobufCMessage *msg);
/* Sends an Error message (code, request id, formatted text). */
int pdm_wire_send_error(void *zsock, const void *ident, size_t ident_len, int code,
                        uint64_t request_id, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* ---- authentication (OpenSSL; common/auth.c, node-only: not in libpdmesh) ----
 * pdm_auth_load_admin_token and pdm_random_bytes (common/wire.c) are in libpdmesh. */

/* proof = HMAC-SHA256(secret, node_id || 0x00 || nonce (8 bytes BE) || timestamp_ms (8 BE)). */
void pdm_auth_proof(const void *secret, size_t secret_len, const char *node_id, uint64_t nonce,
                    uint64_t timestamp_ms, uint8_t out[32]);
/* Constant-time check of a proof; 1 if it matches. */
int pdm_auth_verify(const void *secret, size_t secret_len, const char *node_id, uint64_t nonce,
                    uint64_t timestamp_ms, const void *proof, size_t proof_len);
/* Reads the cluster secret with pdm_secret_load (common/pdm.h): the file `path` (an option),
 * else the file named by $PDMESH_SECRET_FILE, else the value of $PDMESH_SECRET. Never from a
 * command-line value. Trailing CR/LF stripped; 16 to PDM_SECRET_MAX bytes. *out is malloc'ed.
 * PDM_ENOTFOUND when none is configured. */
int pdm_auth_load_secret(const char *path, uint8_t **out, size_t *len);
/* The shortest admin token the router and the SDK accept. */
#define PDM_AUTH_ADMIN_TOKEN_MIN 8
/* Reads the admin token (text) with pdm_secret_load: the file `path`, else the file named by
 * $PDMESH_ADMIN_TOKEN_FILE, else $PDMESH_ADMIN_TOKEN; PDM_AUTH_ADMIN_TOKEN_MIN to
 * PDM_SECRET_MAX bytes, no NUL. `file_option` names the caller's option in the message when
 * none is configured (PDM_ENOTFOUND). *out is malloc'ed. */
int pdm_auth_load_admin_token(const char *path, const char *file_option, char **out);
/* SHA-256 of data. */
void pdm_sha256(const void *data, size_t len, uint8_t out[32]);
/* Prefix block keys, the one definition the router (prefix routing, router/prefix.c) and the
 * decode nodes (KV events of their prefix pools, decode_node/node.c) share: SHA-256 with tagged
 * fields (PITFALLS.md: cache keys): a domain tag, the mesh's salt, the model name, the
 * parent block's key and the block's tokens, each length-prefixed. Key i names the whole
 * prefix up to the end of block i (block_tokens tokens each, 64 when <= 0); only whole blocks
 * are keyed. Writes at most max keys to out and returns how many (0 when out of memory). */
typedef struct {
    uint8_t salt[16];
    const char *model;
    int block_tokens;
} pdm_prefix_key_params_t;
int pdm_prefix_block_keys(const pdm_prefix_key_params_t *p, const int32_t *tok, uint32_t n,
                          uint8_t (*out)[32], int max);
/* The mesh's salt: HMAC-SHA256 of a fixed label under the cluster secret, cut to 16 bytes.
 * Secret to the mesh like the secret itself, and the same in every router of it (and across
 * their restarts), so that one decode node's KV events name its blocks for all of them. */
void pdm_prefix_salt_derive(const void *secret, size_t secret_len, uint8_t out[16]);
/* KvEvents (proto/pdmesh.proto): at most this many block keys per message (a 32-byte key and
 * its framing: ~36 KB), and a decode node sends a full snapshot of its pool at least every
 * PDM_KVEV_SNAPSHOT_S seconds (anti-entropy for a message lost on the way). */
#define PDM_KVEV_MAX_KEYS 1024
#define PDM_KVEV_SNAPSHOT_S 30.0
/* Random bytes from the OS (getrandom). */
int pdm_random_bytes(void *buf, size_t len);

#endif
