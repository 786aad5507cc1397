/*
 * Message framing (8-byte header + protobuf), budgeted unpacking, ZeroMQ send helpers, the
 * admin token loader and random bytes. See common/wire.h and proto/pdmesh.proto. The HMAC /
 * SHA-256 primitives (node-only) are in common/auth.c.
 */
#include "common/wire.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <zmq.h>

#include "common/pdm.h"

static const struct {
    int type;
    const char *name;
    const ProtobufCMessageDescriptor *desc;
} pdm__types[] = {
    {PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST, "GenerateRequest", &pdmesh__generate_request__descriptor},
    {PDMESH__MSG_TYPE__MSG_CANCEL_REQUEST, "CancelRequest", &pdmesh__cancel_request__descriptor},
    {PDMESH__MSG_TYPE__MSG_TOKEN_CHUNK, "TokenChunk", &pdmesh__token_chunk__descriptor},
    {PDMESH__MSG_TYPE__MSG_GENERATE_RESULT, "GenerateResult", &pdmesh__generate_result__descriptor},
    {PDMESH__MSG_TYPE__MSG_ERROR, "Error", &pdmesh__error__descriptor},
    {PDMESH__MSG_TYPE__MSG_ACCEPTED, "Accepted", &pdmesh__accepted__descriptor},
    {PDMESH__MSG_TYPE__MSG_PING, "Ping", &pdmesh__ping__descriptor},
    {PDMESH__MSG_TYPE__MSG_PONG, "Pong", &pdmesh__ping__descriptor},
    {PDMESH__MSG_TYPE__MSG_REGISTER, "Register", &pdmesh__register__descriptor},
    {PDMESH__MSG_TYPE__MSG_REGISTER_ACK, "RegisterAck", &pdmesh__register_ack__descriptor},
    {PDMESH__MSG_TYPE__MSG_HEARTBEAT, "Heartbeat", &pdmesh__heartbeat__descriptor},
    {PDMESH__MSG_TYPE__MSG_HEARTBEAT_ACK, "HeartbeatAck", &pdmesh__heartbeat_ack__descriptor},
    {PDMESH__MSG_TYPE__MSG_GROUP_WIRE, "GroupWire", &pdmesh__group_wire__descriptor},
    {PDMESH__MSG_TYPE__MSG_PREFILL_TASK, "PrefillTask", &pdmesh__prefill_task__descriptor},
    {PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, "PrefillResult", &pdmesh__prefill_result__descriptor},
    {PDMESH__MSG_TYPE__MSG_DECODE_TASK, "DecodeTask", &pdmesh__decode_task__descriptor},
    {PDMESH__MSG_TYPE__MSG_DECODE_RESERVED, "DecodeReserved", &pdmesh__decode_reserved__descriptor},
    {PDMESH__MSG_TYPE__MSG_DECODE_START, "DecodeStart", &pdmesh__decode_start__descriptor},
    {PDMESH__MSG_TYPE__MSG_DECODE_TOKENS, "DecodeTokens", &pdmesh__decode_tokens__descriptor},
    {PDMESH__MSG_TYPE__MSG_DECODE_RESULT, "DecodeResult", &pdmesh__decode_result__descriptor},
    {PDMESH__MSG_TYPE__MSG_CANCEL_TASK, "CancelTask", &pdmesh__cancel_task__descriptor},
    {PDMESH__MSG_TYPE__MSG_DEREGISTER, "Deregister", &pdmesh__deregister__descriptor},
    {PDMESH__MSG_TYPE__MSG_GROUP_READY, "GroupReady", &pdmesh__group_ready__descriptor},
    {PDMESH__MSG_TYPE__MSG_STATS_REQUEST, "StatsRequest", &pdmesh__stats_request__descriptor},
    {PDMESH__MSG_TYPE__MSG_NODE_STATS, "NodeStats", &pdmesh__node_stats__descriptor},
    {PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG, "GroupPingPong", &pdmesh__group_ping_pong__descriptor},
    {PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG_RESULT, "GroupPingPongResult",
     &pdmesh__group_ping_pong_result__descriptor},
    {PDMESH__MSG_TYPE__MSG_ADMIN_REQUEST, "AdminRequest", &pdmesh__admin_request__descriptor},
    {PDMESH__MSG_TYPE__MSG_ADMIN_REPLY, "AdminReply", &pdmesh__admin_reply__descriptor},
    {PDMESH__MSG_TYPE__MSG_KV_EVENTS, "KvEvents", &pdmesh__kv_events__descriptor},
};

const ProtobufCMessageDescriptor *pdm_wire_descriptor(int type)
{
    for (size_t i = 0; i < PDM_ARRAY_SIZE(pdm__types); i++)
        if (pdm__types[i].type == type) return pdm__types[i].desc;
    return NULL;
}

const char *pdm_wire_type_name(int type)
{
    for (size_t i = 0; i < PDM_ARRAY_SIZE(pdm__types); i++)
        if (pdm__types[i].type == type) return pdm__types[i].name;
    return "unknown";
}

int pdm_wire_pack(int type, const ProtobufCMessage *msg, uint8_t **out, size_t *len)
{
    const ProtobufCMessageDescriptor *d = pdm_wire_descriptor(type);
    if (!d || !msg || msg->descriptor != d)
        return pdm_error_set(PDM_EINVAL, "wire: message does not match type %d (%s)", type,
                             pdm_wire_type_name(type));
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *b = malloc(PDM_WIRE_HDR + n);
    if (!b) return pdm_error_set(PDM_ENOMEM, "wire: out of memory packing %zu bytes", n);
    b[0] = 'P';
    b[1] = 'D';
    b[2] = PDM_WIRE_VERSION;
    b[3] = 0;
    b[4] = (uint8_t)(type >> 8);
    b[5] = (uint8_t)type;
    b[6] = b[7] = 0;
    protobuf_c_message_pack(msg, b + PDM_WIRE_HDR);
    *out = b;
    *len = PDM_WIRE_HDR + n;
    return PDM_OK;
}

int pdm_wire_peek(const void *frame, size_t len, size_t cap, int *type)
{
    const uint8_t *b = frame;
    if (len > cap)
        return pdm_error_set(PDM_EOVERFLOW, "frame of %zu bytes exceeds the limit of %zu", len,
                             cap);
    if (len < PDM_WIRE_HDR || b[0] != 'P' || b[1] != 'D')
        return pdm_error_set(PDM_EFORMAT, "not a pdmesh frame (%zu bytes, bad header)", len);
    if (b[2] != PDM_WIRE_VERSION)
        return pdm_error_set(PDM_EFORMAT, "unsupported protocol version %u (this is %u)", b[2],
                             PDM_WIRE_VERSION);
    int t = (b[4] << 8) | b[5];
    if (!pdm_wire_descriptor(t))
        return pdm_error_set(PDM_EUNSUPPORTED, "unknown message type %d", t);
    *type = t;
    return PDM_OK;
}

/* protobuf-c allocator with a budget: every block carries its size in front, and allocation
 * fails once the message has taken `budget` bytes. */
typedef struct {
    size_t used, budget;
} pdm__budget_t;

static void *pdm__budget_alloc(void *ctx, size_t size)
{
    pdm__budget_t *b = ctx;
    if (size > b->budget - b->used) return NULL;
    size_t *p = malloc(sizeof(size_t) + size);
    if (!p) return NULL;
    b->used += size;
    p[0] = size;
    return p + 1;
}

static void pdm__budget_free(void *ctx, void *ptr)
{
    if (!ptr) return;
    pdm__budget_t *b = ctx;
    size_t *p = (size_t *)ptr - 1;
    b->used -= p[0];
    free(p);
}

struct pdm_wire_msg {
    pdm__budget_t budget;
    ProtobufCAllocator alloc;
    int type;
    ProtobufCMessage *msg;
};

int pdm_wire_unpack(const void *frame, size_t len, size_t cap, size_t budget,
                    pdm_wire_msg_t **out)
{
    int t, rc = pdm_wire_peek(frame, len, cap, &t);
    if (rc) return rc;
    pdm_wire_msg_t *u = malloc(sizeof(*u));
    if (!u) return pdm_error_set(PDM_ENOMEM, "wire: out of memory");
    u->budget.used = 0;
    u->budget.budget = budget ? budget : 8 * len + 4096;
    u->alloc.alloc = pdm__budget_alloc;
    u->alloc.free = pdm__budget_free;
    u->alloc.allocator_data = &u->budget;
    u->type = t;
    u->msg = protobuf_c_message_unpack(pdm_wire_descriptor(t), &u->alloc, len - PDM_WIRE_HDR,
                                       (const uint8_t *)frame + PDM_WIRE_HDR);
    if (!u->msg) {
        int over = u->budget.used >= u->budget.budget / 2;
        free(u);
        return pdm_error_set(PDM_EFORMAT, "malformed %s message (%zu bytes)%s",
                             pdm_wire_type_name(t), len,
                             over ? " or over its memory budget" : "");
    }
    *out = u;
    return PDM_OK;
}

int pdm_wire_type(const pdm_wire_msg_t *m) { return m->type; }
ProtobufCMessage *pdm_wire_message(const pdm_wire_msg_t *m) { return m->msg; }

void pdm_wire_msg_free(pdm_wire_msg_t *m)
{
    if (!m) return;
    protobuf_c_message_free_unpacked(m->msg, &m->alloc);
    free(m);
}

int pdm_wire_refusal_code(int unpack_status)
{
    return unpack_status == PDM_EOVERFLOW      ? PDMESH__ERROR_CODE__ERR_TOO_LARGE
           : unpack_status == PDM_EUNSUPPORTED ? PDMESH__ERROR_CODE__ERR_UNKNOWN_TYPE
                                               : PDMESH__ERROR_CODE__ERR_BAD_MESSAGE;
}

int pdm_wire_unpack_or_reply(void *zsock, const void *ident, size_t ident_len, const void *frame,
                             size_t len, size_t cap, pdm_wire_msg_t **out)
{
    int st = pdm_wire_unpack(frame, len, cap, 0, out);
    if (st) {
        int code = pdm_wire_refusal_code(st);
        char why[512];
        snprintf(why, sizeof(why), "%s", pdm_error_last());
        pdm_wire_send_error(zsock, ident, ident_len, code, 0, "%s", why);
        pdm_error_set(st, "%s", why);
    }
    return st;
}

int pdm_wire_send(void *zsock, const void *ident, size_t ident_len, int type,
                  const ProtobufCMessage *msg)
{
    uint8_t *buf;
    size_t len;
    int rc = pdm_wire_pack(type, msg, &buf, &len);
    if (rc) return rc;
    if (ident && zmq_send(zsock, ident, ident_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) goto fail;
    if (zmq_send(zsock, buf, len, ZMQ_DONTWAIT) < 0) goto fail;
    free(buf);
    return PDM_OK;
fail:;
    int e = errno;
    free(buf);
    if (e == EHOSTUNREACH)
        return pdm_error_set(PDM_EPEER, "send %s: peer unknown or gone", pdm_wire_type_name(type));
    if (e == EAGAIN)
        return pdm_error_set(PDM_EOVERFLOW, "send %s: peer queue full", pdm_wire_type_name(type));
    return pdm_error_set(PDM_EIO, "send %s: %s", pdm_wire_type_name(type), zmq_strerror(e));
}

int pdm_wire_send_error(void *zsock, const void *ident, size_t ident_len, int code,
                        uint64_t request_id, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    e.code = (Pdmesh__ErrorCode)code;
    e.message = text;
    e.request_id = request_id;
    return pdm_wire_send(zsock, ident, ident_len, PDMESH__MSG_TYPE__MSG_ERROR, &e.base);
}

/* ---- the admin token and random bytes (the SDK uses both) ---- */

int pdm_auth_load_admin_token(const char *path, const char *file_option, char **out)
{
    const pdm_secret_source_t src = {.what = "admin token",
                                     .file = path,
                                     .file_option = file_option,
                                     .env_file = "PDMESH_ADMIN_TOKEN_FILE",
                                     .env_value = "PDMESH_ADMIN_TOKEN",
                                     .min_len = PDM_AUTH_ADMIN_TOKEN_MIN};
    return pdm_secret_load(&src, out, NULL);
}

int pdm_random_bytes(void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len) {
        ssize_t r = getrandom(p, len, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return pdm_error_set(PDM_EIO, "getrandom: %s", strerror(errno));
        }
        p += r;
        len -= (size_t)r;
    }
    return PDM_OK;
}
