/*
 * The node agent: router mode of pdmesh-prefill and pdmesh-decode.
 *
 * The daemons keep their stdio JSON command loop (prefill_node/main.c, decode_node/main.c).
 * In router mode, pdm_agent_start (called before pdm_ctl_open) puts a pipe on file
 * descriptor 0 (commands to the loop) and another on file descriptor 1 (the loop's events,
 * which pdm_ctl_open then takes as its protocol stream), and starts one thread that owns a
 * ZeroMQ DEALER socket to the router's node socket. The thread
 *   - registers (HMAC proof with the cluster secret from a file or the environment),
 *   - heartbeats on its own clock, so a long prefill or decode step never misses a lease,
 *   - translates router messages (GroupWire, PrefillTask, DecodeTask, DecodeStart,
 *     CancelTask) into the loop's JSON commands and the loop's events into PrefillResult,
 *     DecodeReserved, DecodeTokens and DecodeResult,
 *   - re-registers (new epoch) when the router answers with ERR_STALE_EPOCH / ERR_NOT_FOUND,
 *   - exits the process with status 3 when the router refuses its proof (ERR_UNAUTHORIZED).
 *
 * Task identity on the JSON side: id = task_id * 16 + (attempt mod 16), so two attempts of one
 * request never share a reservation or a KV stream tag.
 */
#ifndef PDM_AGENT_H
#define PDM_AGENT_H

#include <stdint.h>

enum { PDM_AGENT_PREFILL = 1, PDM_AGENT_DECODE = 2 };

typedef struct {
    const char *endpoint;    /* router node socket, e.g. tcp://127.0.0.1:7701 */
    const char *node_id;     /* stable name */
    const char *secret_file; /* NULL: $PDMESH_SECRET_FILE or $PDMESH_SECRET */
    const char *curve_server_key_file, *curve_key_file; /* CURVE (common/curve.h); NULL:
                                        * $PDMESH_CURVE_SERVER_KEY_FILE / $PDMESH_CURVE_KEY_FILE */
    int role;
    const char *group;       /* prefill */
    uint32_t rank, group_size;
    const char *model_id;
    uint64_t kv_tokens;
    uint32_t max_sequences, max_batch, threads, max_prompt;
    uint32_t max_beams;      /* decode: widest beam search (0: none) */
    int heartbeat_ms;        /* until the router's RegisterAck says otherwise (1000) */
} pdm_agent_params_t;

void pdm_agent_params_default(pdm_agent_params_t *p);

/* Sets up the pipes and starts the agent thread (see above). The strings must outlive the
 * process (argv). */
int pdm_agent_start(const pdm_agent_params_t *p);

#define PDM_AGENT_WIRE_ID(task, attempt) ((uint64_t)(task) * 16u + ((attempt) & 15u))

#endif
