/*
 * pdmesh-router - the router daemon: registry, scheduling and request lifecycle on one libuv
 * loop with the ZeroMQ client, node and admin sockets (router/core.c) and the HTTP front end.
 * See docs/router.md.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/core.h"
#include "router/http.h"

static pdm_router_t *g_router;
static uv_signal_t g_sig[2];
static int g_stopping;
static pdm_http_t *g_http;

static void rt_on_signal(uv_signal_t *h, int signum)
{
    if (g_stopping) return;
    g_stopping = 1;
    pdm_log_warn("router: signal %d: shutting down", signum);
    if (g_http) pdm_http_stop(g_http);
    g_http = NULL;
    rt_router_close(g_router);
    uv_close((uv_handle_t *)&g_sig[0], NULL);
    uv_close((uv_handle_t *)&g_sig[1], NULL);
    (void)h;
}

/* --http HOST:PORT ("[v6]:PORT", or "off"). The host is kept in a static buffer. */
static int rt_parse_http(const char *arg, rt_config_t *cfg)
{
    static char host[64];
    long port;
    if (!strcmp(arg, "off")) {
        cfg->http_port = -1;
        return 0;
    }
    const char *colon = strrchr(arg, ':');
    if (!colon || colon == arg || pdm_parse_long(colon + 1, 0, 65535, &port)) return -1;
    const char *h = arg;
    size_t n = (size_t)(colon - arg);
    if (h[0] == '[' && n >= 2 && h[n - 1] == ']') h++, n -= 2;
    if (n == 0 || n >= sizeof(host)) return -1;
    memcpy(host, h, n);
    host[n] = 0;
    cfg->http_host = host;
    cfg->http_port = (int)port;
    return 0;
}

static void rt_usage(FILE *f)
{
    fprintf(f,
            "usage: pdmesh-router [options]\n"
            "  --model FILE              GGUF of the served model (tokenizer, chat template)\n"
            "  --chat-template NAME      chat format instead of the file's template (chatml,\n"
            "                            llama3, gemma, mistral-v7, ...; docs/models.md)\n"
            "  --client EP --node EP --admin EP   ZeroMQ endpoints (default tcp://127.0.0.1:7700/1/2)\n"
            "  --http-host H --http-port P        OpenAI-compatible HTTP (default 127.0.0.1:8080,\n"
            "                            -1: off)\n"
            "  --http HOST:PORT | off     the same in one option ([::1]:8080 for IPv6; port 0: any)\n"
            "  --http-max-conns N        HTTP connections served at once (0: from ulimit -n, the\n"
            "                            default; see docs/http.md, Abusive clients)\n"
            "  --http-max-conns-per-peer N   per source address (IPv6: /64) (0: half the slots,\n"
            "                            at most 256; -1: no limit, e.g. behind a proxy)\n"
            "  --http-head-timeout-ms N  request line and headers within (5000; else 408)\n"
            "  --http-body-timeout-ms N  request body within, after the headers (15000; else 408)\n"
            "  --http-idle-timeout-ms N  keep-alive connection idle between requests (30000)\n"
            "  --secret-file F           cluster secret (else $PDMESH_SECRET_FILE / $PDMESH_SECRET)\n"
            "  --admin-token-file F      admin token (else $PDMESH_ADMIN_TOKEN_FILE / $PDMESH_ADMIN_TOKEN)\n"
            "  --curve-secret-file F     CURVE on the client/node/admin sockets with this server\n"
            "                            key file (mode 0600; see docs/router.md, CURVE)\n"
            "  --curve-allow F           allowed client public keys (Z85, one a line, # comments)\n"
            "  --heartbeat-ms N --lease-ms N      (1000 / 3000)\n"
            "  --queue-max N             open requests admitted (256)\n"
            "  --per-client-max N        open requests per client (64)\n"
            "  --max-prompt-tokens N --max-tokens N --default-max-tokens N   (4096 / 1024 / 128)\n"
            "  --max-beams N             widest beam search a request may ask for (8, 1: none)\n"
            "  --deadline-ms N           default request deadline (120000)\n"
            "  --max-attempts N          dispatches per request incl. retries/migrations (4, <= 15)\n"
            "  --local-threshold N       prompts shorter than N tokens are prefilled by the decode\n"
            "                            node (16; 0: always use a prefill group when one is up)\n"
            "  --method M                prefill method for groups (auto)\n"
            "  --partition-table F --calibration F   for kvr-s/kvr-p/auto\n"
            "  --block-tokens N          prefix-hash block size; least prefix reused (64)\n"
            "  --prefix-reuse 0|1        follow-up turns prefill only what follows the prefix\n"
            "                            their group still holds (1)\n"
            "  --group-pool-tokens N     each prefill group keeps finished conversations' KV up\n"
            "                            to N tokens (LRU; ranks cap it with --pool-tokens) for\n"
            "                            follow-ups of any of them (0: only the last one)\n"
            "  --pool-local-max N        a prompt whose prefix a decode node's pool holds is\n"
            "                            prefilled there if at most N tokens are left (512)\n"
            "  --pool-delta 0|1          if more are left, the prompt goes through a group to\n"
            "                            that node, which receives only the rest's KV (1)\n"
            "  --group-inflight N        prefill tasks queued per group (2)\n"
            "  --adaptive-group 0|1|2    while requests wait, a group's idle ranks may prefill\n"
            "                            different prompts alone (solo tasks): 1 by the cost\n"
            "                            model, 2 whenever others wait, 0 never (0)\n"
            "  --prefill-batch-max N     queued prompts one rank prefills as one batch task\n"
            "                            (solo ranks, 1-rank groups; 1: no batching) (1)\n"
            "  --prefill-batch-tokens N  prompt tokens a batch task holds at most (2048)\n"
            "  --prefill-chunk-tokens N  a group prefills a longer prompt in chunks of N tokens,\n"
            "                            other tasks going between them; needs a group pool\n"
            "                            that holds the prompt (--group-pool-tokens) (0: off)\n");
}

int main(int argc, char **argv)
{
    rt_config_t cfg;
    rt_config_default(&cfg);
    pdm_http_config_t http_cfg = {0}; /* zeros: router/http.h's defaults */
    cfg.model_path = pdm_model_default_path();
    enum { O_MAXBEAMS = 2000 }; /* router/beams.c */
    enum {
        O_CLIENT = 1000, O_NODE, O_ADMIN, O_HTTP_HOST, O_HTTP_PORT, O_SECRET, O_TOKEN, O_HB, O_LEASE,
        O_QUEUE, O_PERCLIENT, O_MAXPROMPT, O_MAXTOK, O_DEFTOK, O_DEADLINE, O_ATTEMPTS, O_LOCAL,
        O_METHOD, O_TABLE, O_CALIB, O_BLOCK, O_GINF, O_HTTP, O_CURVE_SECRET, O_CURVE_ALLOW,
        O_PREFIX_REUSE, O_POOL_LOCAL, O_POOL_DELTA, O_GROUP_POOL, O_HTTP_CONNS, O_HTTP_PER_PEER, O_HTTP_HEAD, O_HTTP_BODY, O_HTTP_IDLE,
        O_CHAT_TEMPLATE, O_ADAPTIVE, O_BATCH_MAX, O_BATCH_TOKENS,
        O_CHUNK_TOKENS
    };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},
        {"chat-template", required_argument, 0, O_CHAT_TEMPLATE},
        {"client", required_argument, 0, O_CLIENT},
        {"node", required_argument, 0, O_NODE},
        {"admin", required_argument, 0, O_ADMIN},
        {"http-host", required_argument, 0, O_HTTP_HOST},
        {"http-port", required_argument, 0, O_HTTP_PORT},
        {"http", required_argument, 0, O_HTTP},
        {"http-max-conns", required_argument, 0, O_HTTP_CONNS},
        {"http-max-conns-per-peer", required_argument, 0, O_HTTP_PER_PEER},
        {"http-head-timeout-ms", required_argument, 0, O_HTTP_HEAD},
        {"http-body-timeout-ms", required_argument, 0, O_HTTP_BODY},
        {"http-idle-timeout-ms", required_argument, 0, O_HTTP_IDLE},
        {"secret-file", required_argument, 0, O_SECRET},
        {"admin-token-file", required_argument, 0, O_TOKEN},
        {"heartbeat-ms", required_argument, 0, O_HB},
        {"lease-ms", required_argument, 0, O_LEASE},
        {"queue-max", required_argument, 0, O_QUEUE},
        {"per-client-max", required_argument, 0, O_PERCLIENT},
        {"max-prompt-tokens", required_argument, 0, O_MAXPROMPT},
        {"max-tokens", required_argument, 0, O_MAXTOK},
        {"default-max-tokens", required_argument, 0, O_DEFTOK},
        {"deadline-ms", required_argument, 0, O_DEADLINE},
        {"max-beams", required_argument, 0, O_MAXBEAMS},
        {"max-attempts", required_argument, 0, O_ATTEMPTS},
        {"local-threshold", required_argument, 0, O_LOCAL},
        {"method", required_argument, 0, O_METHOD},
        {"partition-table", required_argument, 0, O_TABLE},
        {"calibration", required_argument, 0, O_CALIB},
        {"block-tokens", required_argument, 0, O_BLOCK},
        {"prefix-reuse", required_argument, 0, O_PREFIX_REUSE},
        {"group-pool-tokens", required_argument, 0, O_GROUP_POOL},
        {"pool-local-max", required_argument, 0, O_POOL_LOCAL},
        {"pool-delta", required_argument, 0, O_POOL_DELTA},
        {"group-inflight", required_argument, 0, O_GINF},
        {"adaptive-group", required_argument, 0, O_ADAPTIVE},
        {"prefill-batch-max", required_argument, 0, O_BATCH_MAX},
        {"prefill-batch-tokens", required_argument, 0, O_BATCH_TOKENS},
        {"prefill-chunk-tokens", required_argument, 0, O_CHUNK_TOKENS},
        {"curve-secret-file", required_argument, 0, O_CURVE_SECRET},
        {"curve-allow", required_argument, 0, O_CURVE_ALLOW},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    long v;
    while ((c = getopt_long(argc, argv, "hm:", opts, NULL)) != -1) {
#define NUM(lo, hi, dst)                                                                        \
    do {                                                                                        \
        if (pdm_parse_long(optarg, lo, hi, &v)) goto bad;                                       \
        dst = v;                                                                                \
    } while (0)
        switch (c) {
        case 'm': cfg.model_path = optarg; break;
        case O_CHAT_TEMPLATE:
            if (pdm_chat_from_name(optarg) == PDM_CHAT_UNKNOWN) {
                fprintf(stderr, "pdmesh-router: unknown --chat-template '%s' (known: %s)\n",
                        optarg, pdm_chat_names());
                return 2;
            }
            cfg.chat_template = optarg;
            break;
        case O_CLIENT: cfg.client_ep = optarg; break;
        case O_NODE: cfg.node_ep = optarg; break;
        case O_ADMIN: cfg.admin_ep = optarg; break;
        case O_HTTP_HOST: cfg.http_host = optarg; break;
        case O_HTTP_PORT: NUM(-1, 65535, cfg.http_port); break;
        case O_HTTP: if (rt_parse_http(optarg, &cfg)) goto bad; break;
        case O_HTTP_CONNS: NUM(0, 1 << 20, http_cfg.max_connections); break;
        case O_HTTP_PER_PEER: NUM(-1, 1 << 20, http_cfg.max_connections_per_peer); break;
        case O_HTTP_HEAD:
            if (pdm_parse_long(optarg, 1, 3600000, &v)) goto bad;
            http_cfg.head_timeout = v / 1000.0;
            break;
        case O_HTTP_BODY:
            if (pdm_parse_long(optarg, 1, 3600000, &v)) goto bad;
            http_cfg.body_timeout = v / 1000.0;
            break;
        case O_HTTP_IDLE:
            if (pdm_parse_long(optarg, 1, 3600000, &v)) goto bad;
            http_cfg.idle_timeout = v / 1000.0;
            break;
        case O_SECRET: cfg.secret_file = optarg; break;
        case O_TOKEN: cfg.admin_token_file = optarg; break;
        case O_CURVE_SECRET: cfg.curve_secret_file = optarg; break;
        case O_CURVE_ALLOW: cfg.curve_allow_file = optarg; break;
        case O_HB: NUM(10, 60000, cfg.heartbeat_ms); break;
        case O_LEASE: NUM(30, 600000, cfg.lease_ms); break;
        case O_QUEUE: NUM(1, 1 << 20, cfg.queue_max); break;
        case O_PERCLIENT: NUM(0, 1 << 20, cfg.per_client_max); break;
        case O_MAXPROMPT: NUM(1, 1 << 22, cfg.max_prompt_tokens); break;
        case O_MAXTOK: NUM(1, 1 << 20, cfg.max_tokens); break;
        case O_DEFTOK: NUM(1, 1 << 20, cfg.default_max_tokens); break;
        case O_DEADLINE: NUM(1, 3600000, cfg.default_deadline_ms); break;
        case O_MAXBEAMS: NUM(1, 8, cfg.max_beams); break;
        case O_ATTEMPTS: NUM(1, 15, cfg.max_attempts); break;
        case O_LOCAL: NUM(0, 1 << 22, cfg.local_threshold); break;
        case O_METHOD: {
            pdm_prefill_method_t m;
            if (pdm_prefill_method_parse(optarg, &m)) goto bad;
            snprintf(cfg.method, sizeof(cfg.method), "%s", optarg);
            break;
        }
        case O_TABLE: cfg.partition_table = optarg; break;
        case O_CALIB: cfg.calibration = optarg; break;
        case O_BLOCK: NUM(1, 4096, cfg.block_tokens); break;
        case O_PREFIX_REUSE: NUM(0, 1, cfg.prefix_reuse); break;
        case O_GROUP_POOL: NUM(0, 1 << 24, cfg.group_pool_tokens); break;
        case O_POOL_LOCAL: NUM(0, 1 << 20, cfg.pool_local_max); break;
        case O_POOL_DELTA: NUM(0, 1, cfg.pool_delta); break;
        case O_GINF: NUM(1, 64, cfg.group_inflight); break;
        case O_ADAPTIVE: NUM(0, 2, cfg.adaptive_group); break;
        case O_BATCH_MAX: NUM(1, RT_BATCH_MAX, cfg.prefill_batch_max); break;
        case O_BATCH_TOKENS: NUM(1, 8192, cfg.prefill_batch_tokens); break;
        case O_CHUNK_TOKENS: NUM(0, 1 << 20, cfg.prefill_chunk_tokens); break;
        case 'h': rt_usage(stdout); return 0;
        default: rt_usage(stderr); return 2;
        }
#undef NUM
    }
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-router: invalid option value%s%s\n", optarg ? ": " : "",
                optarg ? optarg : "");
        return 2;
    }
    if (cfg.lease_ms <= cfg.heartbeat_ms) {
        fprintf(stderr, "pdmesh-router: --lease-ms must be longer than --heartbeat-ms\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    uv_loop_t loop;
    uv_loop_init(&loop);
    if (rt_router_create(&loop, &cfg, &g_router)) {
        fprintf(stderr, "pdmesh-router: %s\n", pdm_error_last());
        uv_loop_close(&loop);
        return 1;
    }
    uv_signal_init(&loop, &g_sig[0]);
    uv_signal_init(&loop, &g_sig[1]);
    uv_signal_start(&g_sig[0], rt_on_signal, SIGINT);
    uv_signal_start(&g_sig[1], rt_on_signal, SIGTERM);

    /* The HTTP front end (router/http.c) on the same loop, after the core is up and before
     * the loop runs (--http-port -1: none). */
    if (cfg.http_port >= 0) {
        http_cfg.host = cfg.http_host;
        http_cfg.port = cfg.http_port;
        if (pdm_http_start(g_router, &http_cfg, &g_http)) {
            fprintf(stderr, "pdmesh-router: HTTP: %s\n", pdm_error_last());
            rt_on_signal(&g_sig[0], 0);
            uv_run(&loop, UV_RUN_DEFAULT);
            rt_router_free(g_router);
            uv_loop_close(&loop);
            return 1;
        }
    }
    fprintf(stderr, "pdmesh-router: serving %s; client %s, node %s, admin %s\n",
            pdm_router_model_name(g_router), cfg.client_ep, cfg.node_ep, cfg.admin_ep);
    uv_run(&loop, UV_RUN_DEFAULT);
    rt_router_free(g_router);
    uv_loop_close(&loop);
    return 0;
}
