/* Internal helpers shared by the files of libpdmesh (not installed). */
#ifndef PDMESH_CLIENT_INTERNAL_H
#define PDMESH_CLIENT_INTERNAL_H

/* Records a message as the calling thread's pdm_client_last_error() and returns status. */
__attribute__((visibility("hidden"))) int pdm_client__fail(int status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

/* Socket-monitor events libpdmesh watches: connection state and the outcome of the security
 * handshake (a CURVE key the router's ZAP handler refuses, or a plain client meeting a CURVE
 * router, fails the handshake; ZeroMQ then retries silently, so without these events such a
 * client would only ever see timeouts). */
#define PDM_CLIENT__MONITOR_EVENTS                                                             \
    (ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |           \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)

/* Reads one monitor event (its two frames) without blocking: 1 and the event id and value,
 * or 0 when none is waiting. */
__attribute__((visibility("hidden"))) int pdm_client__monitor_event(void *mon, uint16_t *event,
                                                                    uint32_t *value);
/* For a failed security handshake: writes why into msg and returns PDM_CLIENT_EUNAUTHORIZED;
 * 0 for any other event. */
__attribute__((visibility("hidden"))) int pdm_client__handshake_refusal(uint16_t event,
                                                                        uint32_t value,
                                                                        const char *endpoint,
                                                                        char *msg, size_t size);

#endif
