/*
 * pdctl - the router's admin CLI (proto/pdmesh.proto, admin API), over libpdmesh.
 *
 *   pdctl [--router ENDPOINT] [--token-file FILE] [--json] [--timeout MS] COMMAND [ARGS]
 *
 * The admin token comes from --token-file, $PDMESH_ADMIN_TOKEN_FILE or $PDMESH_ADMIN_TOKEN,
 * never from a command-line value (argv is visible to every user of the machine).
 * stdout carries the answer (a table, or JSON with --json); errors go to stderr.
 * Exit status: 0 ok, 1 the router refused or failed the command, 2 usage error,
 * 3 router unreachable or not answering, 4 unauthorized (missing or wrong token).
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/meshconf.h"
#include "common/pdm.h"
#include "sdk/pdmesh_admin.h"

#define PDCTL_DEFAULT_ROUTER "tcp://127.0.0.1:7702"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdctl [options] COMMAND [ARGS]\n"
            "\n"
            "commands:\n"
            "  nodes                 list the registered nodes\n"
            "  node NAME             one node in detail\n"
            "  drain NAME            stop sending new work to a node\n"
            "  undrain NAME          let a drained node take work again\n"
            "  stats                 router counters\n"
            "  policy get [KEY]      scheduling policy values (all without KEY)\n"
            "  policy set KEY VALUE  change a policy value\n"
            "  lut show              the prefill partition lookup table (JSON)\n"
            "  lut load FILE         load a partition lookup table (JSON file)\n"
            "  requests              requests in flight\n"
            "  cancel ID             cancel a request by its router id\n"
            "  cache                 the decode nodes' prefix pools, the prefill groups' pools\n"
            "                        of conversations (tier group) and the router's index\n"
            "  routers               every router of --router EP1,EP2 (or the config): up or\n"
            "                        not, and the nodes registered with it\n"
            "\n"
            "options:\n"
            "  --router ENDPOINT     admin socket (default $PDMESH_ADMIN_ROUTER or %s)\n"
            "  --token-file FILE     admin token file (else $PDMESH_ADMIN_TOKEN_FILE, then\n"
            "                        $PDMESH_ADMIN_TOKEN; never a command-line value)\n"
            "  --json                machine-readable output\n"
            "  --timeout MS          how long to wait for the router (default 5000)\n"
            "  --mesh | --config F   the mesh started by 'pdmesh up [--config F]': its admin\n"
            "                        endpoint and run_dir/admin-token (default config %s)\n"
            "  --curve-server-key F --curve-key F   CURVE: the router's public key file and\n"
            "                        this client's key file (else $PDMESH_CURVE_SERVER_KEY_FILE /\n"
            "                        $PDMESH_CURVE_KEY_FILE, or run_dir/curve with --mesh)\n"
            "\n"
            "exit status: 0 ok, 1 refused/failed, 2 usage, 3 unreachable/no answer, "
            "4 unauthorized\n",
            PDCTL_DEFAULT_ROUTER, CLI_MESH_DEFAULT_CONFIG);
}

static int usage_error(const char *msg, const char *arg)
{
    fprintf(stderr, "pdctl: ");
    fprintf(stderr, msg, arg);
    fprintf(stderr, "\n(run 'pdctl --help' for usage)\n");
    return 2;
}

static const char *role_name(Pdmesh__Role r)
{
    return r == PDMESH__ROLE__ROLE_PREFILL ? "prefill"
           : r == PDMESH__ROLE__ROLE_DECODE ? "decode" : "-";
}

/* ---- JSON rendering of a reply ---- */

static cJSON *node_json(const Pdmesh__NodeInfo *n)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "node_id", n->node_id ? n->node_id : "");
    cJSON_AddStringToObject(o, "role", role_name(n->role));
    cJSON_AddStringToObject(o, "group", n->group ? n->group : "");
    cJSON_AddNumberToObject(o, "rank", n->rank);
    cJSON_AddStringToObject(o, "state", n->state ? n->state : "");
    cJSON_AddNumberToObject(o, "epoch", (double)n->epoch);
    cJSON_AddNumberToObject(o, "last_heartbeat_ms_ago", n->last_heartbeat_ms_ago);
    cJSON_AddNumberToObject(o, "pid", n->pid);
    char feats[128], hex[24];
    pdm_feat_format(n->features, feats, sizeof(feats));
    snprintf(hex, sizeof(hex), "0x%llx", (unsigned long long)n->features);
    cJSON_AddStringToObject(o, "features", feats); /* "none": a node of an older version */
    cJSON_AddStringToObject(o, "features_mask", hex);
    if (n->capacity) {
        cJSON *c = cJSON_AddObjectToObject(o, "capacity");
        cJSON_AddNumberToObject(c, "kv_tokens", (double)n->capacity->kv_tokens);
        cJSON_AddNumberToObject(c, "max_sequences", n->capacity->max_sequences);
        cJSON_AddNumberToObject(c, "max_batch", n->capacity->max_batch);
        cJSON_AddNumberToObject(c, "threads", n->capacity->threads);
        cJSON_AddNumberToObject(c, "max_prompt", n->capacity->max_prompt);
    }
    if (n->load) {
        cJSON *l = cJSON_AddObjectToObject(o, "load");
        cJSON_AddNumberToObject(l, "running", n->load->running);
        cJSON_AddNumberToObject(l, "held", n->load->held);
        cJSON_AddNumberToObject(l, "kv_tokens_used", (double)n->load->kv_tokens_used);
        cJSON_AddNumberToObject(l, "kv_tokens_free", (double)n->load->kv_tokens_free);
        cJSON_AddNumberToObject(l, "offload_bytes", (double)n->load->offload_bytes);
    }
    if (n->pool) {
        const Pdmesh__PoolStats *p = n->pool;
        cJSON *c = cJSON_AddObjectToObject(o, "pool");
        cJSON_AddNumberToObject(c, "budget_tokens", (double)p->budget_tokens);
        cJSON_AddNumberToObject(c, "tokens", (double)p->tokens);
        cJSON_AddNumberToObject(c, "blocks", (double)p->blocks);
        cJSON_AddNumberToObject(c, "bytes", (double)p->bytes);
        cJSON_AddNumberToObject(c, "entries", p->entries);
        cJSON_AddNumberToObject(c, "lookups", (double)p->lookups);
        cJSON_AddNumberToObject(c, "hits", (double)p->hits);
        cJSON_AddNumberToObject(c, "hit_rate", p->lookups ? (double)p->hits / (double)p->lookups : 0);
        cJSON_AddNumberToObject(c, "reused_tokens", (double)p->reused_tokens);
        cJSON_AddNumberToObject(c, "evictions", (double)p->evictions);
        cJSON_AddNumberToObject(c, "corrupt", (double)p->corrupt);
        cJSON_AddStringToObject(c, "tier", n->role == PDMESH__ROLE__ROLE_PREFILL ? "group"
                                           : p->file_tokens                 ? "ram+file"
                                                                            : "ram");
        cJSON_AddNumberToObject(c, "file_tokens", (double)p->file_tokens);
        cJSON_AddNumberToObject(c, "index_blocks", (double)n->index_blocks);
    }
    return o;
}

static cJSON *request_json(const Pdmesh__RequestInfo *q)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "router_request_id", (double)q->router_request_id);
    cJSON_AddNumberToObject(o, "client_request_id", (double)q->client_request_id);
    cJSON_AddStringToObject(o, "state", q->state ? q->state : "");
    cJSON_AddNumberToObject(o, "prompt_tokens", q->prompt_tokens);
    cJSON_AddNumberToObject(o, "generated", q->generated);
    cJSON_AddNumberToObject(o, "age_ms", q->age_ms);
    cJSON_AddStringToObject(o, "prefill_group", q->prefill_group ? q->prefill_group : "");
    cJSON_AddStringToObject(o, "decode_node", q->decode_node ? q->decode_node : "");
    cJSON_AddNumberToObject(o, "attempts", q->attempts);
    return o;
}

static void print_json(const Pdmesh__AdminReply *a, Pdmesh__AdminOp op)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddBoolToObject(root, "ok", a->ok);
    if (op == PDMESH__ADMIN_OP__ADMIN_NODES || op == PDMESH__ADMIN_OP__ADMIN_CACHE) {
        cJSON *arr = cJSON_AddArrayToObject(root, "nodes");
        for (size_t i = 0; i < a->n_nodes; i++) cJSON_AddItemToArray(arr, node_json(a->nodes[i]));
    } else if (op == PDMESH__ADMIN_OP__ADMIN_NODE && a->n_nodes) {
        cJSON_AddItemToObject(root, "node", node_json(a->nodes[0]));
    } else if (op == PDMESH__ADMIN_OP__ADMIN_REQUESTS) {
        cJSON *arr = cJSON_AddArrayToObject(root, "requests");
        for (size_t i = 0; i < a->n_requests; i++)
            cJSON_AddItemToArray(arr, request_json(a->requests[i]));
    } else if (op == PDMESH__ADMIN_OP__ADMIN_LUT_SHOW) {
        cJSON *t = cJSON_Parse(a->text ? a->text : "");
        if (t) cJSON_AddItemToObject(root, "table", t);
        else cJSON_AddStringToObject(root, "table_text", a->text ? a->text : "");
    }
    if (a->n_values) {
        cJSON *v = cJSON_AddObjectToObject(root, "values");
        for (size_t i = 0; i < a->n_values; i++) {
            const char *k = a->values[i]->key ? a->values[i]->key : "";
            const char *s = a->values[i]->value ? a->values[i]->value : "";
            char *end;
            double d = strtod(s, &end);
            if (*s && !*end) cJSON_AddNumberToObject(v, k, d);
            else cJSON_AddStringToObject(v, k, s);
        }
    }
    char *js = cJSON_Print(root);
    if (js) puts(js);
    free(js);
    cJSON_Delete(root);
}

/* ---- human output ---- */

static void print_node_detail(const Pdmesh__NodeInfo *n)
{
    printf("node:            %s\n", n->node_id ? n->node_id : "");
    printf("role:            %s\n", role_name(n->role));
    if (n->role == PDMESH__ROLE__ROLE_PREFILL)
        printf("group:           %s (rank %u)\n", n->group ? n->group : "", n->rank);
    printf("state:           %s\n", n->state ? n->state : "");
    printf("epoch:           %llu\n", (unsigned long long)n->epoch);
    printf("last heartbeat:  %.0f ms ago\n", n->last_heartbeat_ms_ago);
    printf("pid:             %u\n", n->pid);
    char feats[128];
    pdm_feat_format(n->features, feats, sizeof(feats));
    printf("features:        %s (0x%llx)%s\n", feats, (unsigned long long)n->features,
           n->features ? "" : ": an older version");
    if (n->capacity)
        printf("capacity:        kv_tokens %llu, max_sequences %u, max_batch %u, threads %u, "
               "max_prompt %u\n", (unsigned long long)n->capacity->kv_tokens,
               n->capacity->max_sequences, n->capacity->max_batch, n->capacity->threads,
               n->capacity->max_prompt);
    if (n->load)
        printf("load:            running %u, held %u, kv used %llu, kv free %llu, "
               "offloaded %llu bytes\n", n->load->running, n->load->held,
               (unsigned long long)n->load->kv_tokens_used,
               (unsigned long long)n->load->kv_tokens_free,
               (unsigned long long)n->load->offload_bytes);
}

static void print_human(const Pdmesh__AdminReply *a, Pdmesh__AdminOp op)
{
    switch (op) {
    case PDMESH__ADMIN_OP__ADMIN_NODES:
        printf("%-20s %-8s %-12s %4s %-9s %6s %8s %7s %10s %10s %8s %s\n", "NODE", "ROLE",
               "GROUP", "RANK", "STATE", "EPOCH", "HB_AGO", "RUNNING", "KV_USED", "KV_FREE", "PID",
               "FEATURES");
        for (size_t i = 0; i < a->n_nodes; i++) {
            const Pdmesh__NodeInfo *n = a->nodes[i];
            const Pdmesh__Load *l = n->load;
            char feats[128]; /* "none": an older version (docs/deployment.md "Versions") */
            pdm_feat_format(n->features, feats, sizeof(feats));
            printf("%-20s %-8s %-12s %4u %-9s %6llu %6.0fms %7u %10llu %10llu %8u %s\n",
                   n->node_id ? n->node_id : "", role_name(n->role),
                   n->group && *n->group ? n->group : "-", n->rank, n->state ? n->state : "",
                   (unsigned long long)n->epoch, n->last_heartbeat_ms_ago, l ? l->running : 0,
                   (unsigned long long)(l ? l->kv_tokens_used : 0),
                   (unsigned long long)(l ? l->kv_tokens_free : 0), n->pid, feats);
        }
        if (!a->n_nodes) printf("(no nodes registered)\n");
        break;
    case PDMESH__ADMIN_OP__ADMIN_NODE:
        if (a->n_nodes) print_node_detail(a->nodes[0]);
        break;
    case PDMESH__ADMIN_OP__ADMIN_CACHE:
        printf("%-20s %-9s %-8s %10s %10s %8s %12s %7s %8s %8s %8s %7s\n", "NODE", "STATE", "TIER",
               "TOKENS", "BUDGET", "BLOCKS", "BYTES", "ENTRIES", "LOOKUPS", "HIT_RATE",
               "EVICTED", "CORRUPT");
        for (size_t i = 0; i < a->n_nodes; i++) {
            const Pdmesh__NodeInfo *n = a->nodes[i];
            const Pdmesh__PoolStats *p = n->pool;
            if (!p) continue;
            const int group = n->role == PDMESH__ROLE__ROLE_PREFILL;
            char name[96];
            snprintf(name, sizeof(name), "%s%s", group ? "group " : "",
                     group ? (n->group ? n->group : "") : (n->node_id ? n->node_id : ""));
            printf("%-20s %-9s %-8s %10llu %10llu %8llu %12llu %7u %8llu %7.1f%% %8llu %7llu\n",
                   name, n->state ? n->state : "",
                   group ? "group" : p->file_tokens ? "ram+file" : "ram", (unsigned long long)p->tokens,
                   (unsigned long long)p->budget_tokens, (unsigned long long)p->blocks,
                   (unsigned long long)p->bytes, p->entries, (unsigned long long)p->lookups,
                   p->lookups ? 100.0 * (double)p->hits / (double)p->lookups : 0.0,
                   (unsigned long long)p->evictions, (unsigned long long)p->corrupt);
        }
        if (!a->n_nodes) printf("(no decode node keeps a prefix pool)\n");
        for (size_t i = 0; i < a->n_values; i++)
            printf("router %-14s %s\n", a->values[i]->key ? a->values[i]->key : "",
                   a->values[i]->value ? a->values[i]->value : "");
        break;
    case PDMESH__ADMIN_OP__ADMIN_REQUESTS:
        printf("%-10s %-10s %-8s %7s %9s %9s %-12s %-12s %8s\n", "ID", "CLIENT_ID", "STATE",
               "PROMPT", "GENERATED", "AGE", "GROUP", "DECODE", "ATTEMPTS");
        for (size_t i = 0; i < a->n_requests; i++) {
            const Pdmesh__RequestInfo *q = a->requests[i];
            printf("%-10llu %-10llu %-8s %7u %9u %7.0fms %-12s %-12s %8u\n",
                   (unsigned long long)q->router_request_id,
                   (unsigned long long)q->client_request_id, q->state ? q->state : "",
                   q->prompt_tokens, q->generated, q->age_ms,
                   q->prefill_group && *q->prefill_group ? q->prefill_group : "-",
                   q->decode_node && *q->decode_node ? q->decode_node : "-", q->attempts);
        }
        if (!a->n_requests) printf("(no requests in flight)\n");
        break;
    case PDMESH__ADMIN_OP__ADMIN_LUT_SHOW:
        printf("%s\n", a->text ? a->text : "");
        break;
    default: {
        size_t w = 0;
        for (size_t i = 0; i < a->n_values; i++)
            if (a->values[i]->key) w = PDM_MAX(w, strlen(a->values[i]->key));
        for (size_t i = 0; i < a->n_values; i++)
            printf("%-*s  %s\n", (int)w, a->values[i]->key ? a->values[i]->key : "",
                   a->values[i]->value ? a->values[i]->value : "");
        if (!a->n_values && op != PDMESH__ADMIN_OP__ADMIN_STATS &&
            op != PDMESH__ADMIN_OP__ADMIN_POLICY_GET)
            printf("ok\n");
        break;
    }
    }
}

/* pdctl routers: each admin endpoint of the list asked for its nodes. 0 when at least one
 * router answered, 3 when none did, 4 when one refused the token. */
static int cmd_routers(char *list, const char *token, long timeout_ms, int json)
{
    cJSON *arr = json ? cJSON_CreateArray() : NULL;
    int up = 0, unauthorized = 0;
    char *save = NULL;
    if (!json) printf("%-32s %-12s %6s %6s\n", "ROUTER", "STATE", "NODES", "ALIVE");
    for (char *ep = strtok_r(list, ",", &save); ep; ep = strtok_r(NULL, ",", &save)) {
        Pdmesh__AdminRequest req = PDMESH__ADMIN_REQUEST__INIT;
        req.op = PDMESH__ADMIN_OP__ADMIN_NODES;
        req.token = (char *)token;
        pdm_admin_reply_t *reply = NULL;
        int rc = pdm_admin_call(ep, &req, (int)timeout_ms, &reply);
        if (rc == PDM_CLIENT_OK) rc = pdm_admin_reply_status(reply);
        size_t nodes = 0, alive = 0;
        if (rc == PDM_CLIENT_OK) {
            const Pdmesh__AdminReply *a = pdm_admin_reply_get(reply);
            nodes = a->n_nodes;
            for (size_t i = 0; i < a->n_nodes; i++)
                alive += a->nodes[i]->state && !strcmp(a->nodes[i]->state, "alive");
            up++;
        }
        unauthorized |= rc == PDM_CLIENT_EUNAUTHORIZED;
        const char *state = rc == PDM_CLIENT_OK ? "up"
                            : rc == PDM_CLIENT_EUNAUTHORIZED ? "unauthorized"
                            : rc == PDM_CLIENT_EUNREACHABLE || rc == PDM_CLIENT_ETIMEOUT
                                ? "unreachable"
                                : "error";
        if (json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "router", ep);
            cJSON_AddStringToObject(o, "state", state);
            cJSON_AddNumberToObject(o, "nodes", (double)nodes);
            cJSON_AddNumberToObject(o, "alive", (double)alive);
            if (rc) cJSON_AddStringToObject(o, "message", pdm_client_last_error());
            cJSON_AddItemToArray(arr, o);
        } else {
            printf("%-32s %-12s %6zu %6zu\n", ep, state, nodes, alive);
        }
        pdm_admin_reply_free(reply);
    }
    if (json) {
        char *js = cJSON_Print(arr);
        if (js) puts(js);
        free(js);
        cJSON_Delete(arr);
    }
    return up ? 0 : unauthorized ? 4 : 3;
}

int main(int argc, char **argv)
{
    const char *router = getenv("PDMESH_ADMIN_ROUTER");
    const char *token_file = NULL, *config = NULL, *router_opt = NULL;
    const char *curve_srv = NULL, *curve_key = NULL;
    int json = 0;
    long timeout_ms = 5000;
    if (!router || !*router) router = PDCTL_DEFAULT_ROUTER;
    enum { O_ROUTER = 256, O_TOKEN_FILE, O_TOKEN, O_TIMEOUT, O_MESH, O_CONFIG, O_CSRV, O_CKEY };
    static const struct option opts[] = {
        {"router", required_argument, 0, O_ROUTER},
        {"token-file", required_argument, 0, O_TOKEN_FILE},
        {"token", required_argument, 0, O_TOKEN},
        {"json", no_argument, 0, 'j'},
        {"timeout", required_argument, 0, O_TIMEOUT},
        {"mesh", no_argument, 0, O_MESH},
        {"config", required_argument, 0, O_CONFIG},
        {"curve-server-key", required_argument, 0, O_CSRV},
        {"curve-key", required_argument, 0, O_CKEY},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "jh", opts, NULL)) != -1) {
        switch (c) {
        case O_ROUTER: router_opt = optarg; break;
        case O_MESH: config = CLI_MESH_DEFAULT_CONFIG; break;
        case O_CONFIG: config = optarg; break;
        case O_TOKEN_FILE: token_file = optarg; break;
        case O_CSRV: curve_srv = optarg; break;
        case O_CKEY: curve_key = optarg; break;
        case O_TOKEN:
            return usage_error("%s", "the admin token is never taken from the command line "
                               "(other users can read it there): use --token-file FILE, "
                               "$PDMESH_ADMIN_TOKEN_FILE or $PDMESH_ADMIN_TOKEN");
        case 'j': json = 1; break;
        case O_TIMEOUT:
            if (pdm_parse_long(optarg, 1, 3600000, &timeout_ms))
                return usage_error("invalid --timeout '%s' (1..3600000 ms)", optarg);
            break;
        case 'h': usage(stdout); return 0;
        default: return usage_error("%s", "invalid option");
        }
    }
    if (optind >= argc) return usage_error("%s", "no command given");
    if (router_opt && config)
        return usage_error("%s", "give either --router ENDPOINT or --mesh/--config FILE");
    if (router_opt) router = router_opt;
    static cli_mesh_t mesh;
    static char mesh_token[1100];
    if (config) {
        char err[1400];
        if (cli_mesh_config(config, &mesh, err, sizeof(err))) {
            fprintf(stderr, "pdctl: %s\n", err);
            return 3;
        }
        router = mesh.admin;
        /* the token pdmesh up generated, unless one was given explicitly */
        if (!token_file && !getenv("PDMESH_ADMIN_TOKEN_FILE") && !getenv("PDMESH_ADMIN_TOKEN")) {
            snprintf(mesh_token, sizeof(mesh_token), "%s/admin-token", mesh.run_dir);
            token_file = mesh_token;
        }
    }
    /* CURVE: the SDK's admin call reads the key files from the environment */
    static char mesh_srv[1100], mesh_key[1100];
    if (config && !curve_srv && !curve_key && !getenv("PDMESH_CURVE_SERVER_KEY_FILE") &&
        cli_mesh_curve_files(&mesh, mesh_srv, sizeof(mesh_srv), mesh_key, sizeof(mesh_key))) {
        curve_srv = mesh_srv;
        curve_key = mesh_key;
    }
    if (!curve_srv != !curve_key)
        return usage_error("%s", "--curve-server-key and --curve-key go together");
    if (curve_srv && (setenv("PDMESH_CURVE_SERVER_KEY_FILE", curve_srv, 1) ||
                      setenv("PDMESH_CURVE_KEY_FILE", curve_key, 1)))
        return usage_error("%s", "cannot set the CURVE environment");
    const char *cmd = argv[optind];
    char **args = argv + optind + 1;
    int nargs = argc - optind - 1;

    if (!strcmp(cmd, "routers")) {
        if (nargs) return usage_error("%s", "usage: pdctl routers");
        char *token = NULL, *list = strdup(router);
        if (!list) return 1;
        if (pdm_admin_load_token(token_file, &token)) {
            fprintf(stderr, "pdctl: %s\n", pdm_client_last_error());
            free(list);
            return 4;
        }
        int st = cmd_routers(list, token, timeout_ms, json);
        free(token);
        free(list);
        return st;
    }
    Pdmesh__AdminRequest req = PDMESH__ADMIN_REQUEST__INIT;
    char *lut_text = NULL;
#define NEED_ARGS(n, what)                                                                      \
    do {                                                                                        \
        if (nargs != (n)) return usage_error("%s", what);                                       \
    } while (0)
    if (!strcmp(cmd, "nodes")) {
        NEED_ARGS(0, "usage: pdctl nodes");
        req.op = PDMESH__ADMIN_OP__ADMIN_NODES;
    } else if (!strcmp(cmd, "cache")) {
        NEED_ARGS(0, "usage: pdctl cache");
        req.op = PDMESH__ADMIN_OP__ADMIN_CACHE;
    } else if (!strcmp(cmd, "node") || !strcmp(cmd, "drain") || !strcmp(cmd, "undrain")) {
        if (nargs != 1) return usage_error("%s needs exactly one node NAME", cmd);
        req.op = !strcmp(cmd, "node")    ? PDMESH__ADMIN_OP__ADMIN_NODE
                 : !strcmp(cmd, "drain") ? PDMESH__ADMIN_OP__ADMIN_DRAIN
                                         : PDMESH__ADMIN_OP__ADMIN_UNDRAIN;
        req.name = args[0];
    } else if (!strcmp(cmd, "stats")) {
        NEED_ARGS(0, "usage: pdctl stats");
        req.op = PDMESH__ADMIN_OP__ADMIN_STATS;
    } else if (!strcmp(cmd, "policy")) {
        if (nargs >= 1 && !strcmp(args[0], "get") && nargs <= 2) {
            req.op = PDMESH__ADMIN_OP__ADMIN_POLICY_GET;
            req.key = nargs == 2 ? args[1] : "";
        } else if (nargs == 3 && !strcmp(args[0], "set")) {
            req.op = PDMESH__ADMIN_OP__ADMIN_POLICY_SET;
            req.key = args[1];
            req.value = args[2];
        } else {
            return usage_error("%s", "usage: pdctl policy get [KEY] | policy set KEY VALUE");
        }
    } else if (!strcmp(cmd, "lut")) {
        if (nargs == 1 && !strcmp(args[0], "show")) {
            req.op = PDMESH__ADMIN_OP__ADMIN_LUT_SHOW;
        } else if (nargs == 2 && !strcmp(args[0], "load")) {
            req.op = PDMESH__ADMIN_OP__ADMIN_LUT_LOAD;
            if (pdm_file_read(args[1], 64u << 20, &lut_text, NULL)) { /* far beyond any table */
                fprintf(stderr, "pdctl: cannot read the table: %s\n", pdm_error_last());
                return 1;
            }
            cJSON *t = cJSON_Parse(lut_text);
            if (!t) {
                fprintf(stderr, "pdctl: %s is not valid JSON\n", args[1]);
                free(lut_text);
                return 1;
            }
            cJSON_Delete(t);
            req.value = lut_text;
        } else {
            return usage_error("%s", "usage: pdctl lut show | lut load FILE");
        }
    } else if (!strcmp(cmd, "requests")) {
        NEED_ARGS(0, "usage: pdctl requests");
        req.op = PDMESH__ADMIN_OP__ADMIN_REQUESTS;
    } else if (!strcmp(cmd, "cancel")) {
        long id;
        if (nargs != 1 || pdm_parse_long(args[0], 1, __LONG_MAX__, &id))
            return usage_error("%s", "usage: pdctl cancel ID (the router's request id, see "
                               "'pdctl requests')");
        req.op = PDMESH__ADMIN_OP__ADMIN_CANCEL;
        req.request_id = (uint64_t)id;
    } else {
        return usage_error("unknown command '%s'", cmd);
    }

    char *token = NULL;
    if (pdm_admin_load_token(token_file, &token)) {
        fprintf(stderr, "pdctl: %s\n", pdm_client_last_error());
        free(lut_text);
        return 4;
    }
    req.token = token;
    pdm_admin_reply_t *reply = NULL;
    /* a list of routers (active-active): the first that answers serves the command */
    char *list = strdup(router), *save = NULL;
    int rc = PDM_CLIENT_ENOMEM;
    for (char *ep = list ? strtok_r(list, ",", &save) : NULL; ep;
         ep = strtok_r(NULL, ",", &save)) {
        pdm_admin_reply_free(reply);
        reply = NULL;
        rc = pdm_admin_call(ep, &req, (int)timeout_ms, &reply);
        if (rc != PDM_CLIENT_EUNREACHABLE && rc != PDM_CLIENT_ETIMEOUT) break;
    }
    free(list);
    free(token);
    free(lut_text);
    int status = 0;
    if (rc == PDM_CLIENT_OK) rc = pdm_admin_reply_status(reply);
    if (rc == PDM_CLIENT_OK) {
        const Pdmesh__AdminReply *a = pdm_admin_reply_get(reply);
        if (json) print_json(a, req.op);
        else print_human(a, req.op);
    } else {
        if (json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddBoolToObject(o, "ok", 0);
            cJSON_AddStringToObject(o, "error", pdm_client_status_name(rc));
            cJSON_AddStringToObject(o, "message", pdm_client_last_error());
            char *js = cJSON_Print(o);
            if (js) puts(js);
            free(js);
            cJSON_Delete(o);
        }
        fprintf(stderr, "pdctl: %s: %s\n", cmd, pdm_client_last_error());
        status = rc == PDM_CLIENT_EUNREACHABLE || rc == PDM_CLIENT_ETIMEOUT ? 3
                 : rc == PDM_CLIENT_EUNAUTHORIZED                           ? 4
                                                                            : 1;
        if (rc == PDM_CLIENT_EUNREACHABLE)
            fprintf(stderr, "pdctl: is pdmesh-router running? (admin endpoint %s; set "
                            "--router)\n", router);
    }
    pdm_admin_reply_free(reply);
    return status;
}
