/*
 * pdmesh generate --router ENDPOINT: the same command as the local engine mode, served by a
 * running mesh through libpdmesh (sdk/pdmesh_client.h). The answer streams to stdout as it is
 * generated; --stats prints TTFT and tokens/s (measured here, at the client) to stderr;
 * --json prints one object shaped like the local mode's.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/meshconf.h"
#include "common/pdm.h"
#include "sdk/pdmesh_client.h"

#define PDM__REMOTE_MAX_STOPS 16

/* 1 if argv asks for the remote mode: --router ENDPOINT, or --mesh / --config FILE (a mesh
 * started by pdmesh up). */
int cli_generate_wants_router(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (!strcmp(argv[i], "--router") || !strncmp(argv[i], "--router=", 9) ||
            !strcmp(argv[i], "--mesh") || !strcmp(argv[i], "--config") ||
            !strncmp(argv[i], "--config=", 9))
            return 1;
    }
    return 0;
}

static int print_chunk(const pdm_client_chunk_t *chunk, void *data)
{
    if (!*(int *)data) {
        fwrite(chunk->text, 1, chunk->text_len, stdout);
        fflush(stdout);
    }
    return 0;
}

static const char *finish_name(pdm_client_finish_t f)
{
    /* the local mode's names: EOS and stop strings are both "stop" */
    return f == PDM_CLIENT_FINISH_LENGTH ? "length" : f == PDM_CLIENT_FINISH_NONE ? "none" : "stop";
}

/* A beam search's answer: the best beam, then the other hypotheses of the n-best list. */
static void print_beams(const pdm_client_result_t *res)
{
    fputs(res->text, stdout);
    for (size_t i = 1; i < res->n_beams; i++)
        printf("\n--- beam %zu (score %.4f, logprob %.4f, %s) ---\n%s", i + 1, res->beams[i].score,
               res->beams[i].logprob, finish_name(res->beams[i].finish), res->beams[i].text);
}

/* {"token", "text", "logprob"} as the local mode prints it (bytes >= 0x80 as '?'). */
static cJSON *logprob_entry(const pdm_client_logprob_t *e)
{
    char text[256];
    size_t n = e->text_len < sizeof(text) - 1 ? e->text_len : sizeof(text) - 1;
    for (size_t i = 0; i < n; i++)
        text[i] = (unsigned char)e->text[i] >= 0x80 ? '?' : e->text[i];
    text[n] = 0;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "token", e->token);
    cJSON_AddStringToObject(o, "text", text);
    cJSON_AddNumberToObject(o, "logprob", e->logprob);
    return o;
}

/* "logprobs": [{token, text, logprob, top: [...]}], the local mode's --json --logprobs. */
static void add_logprobs(cJSON *root, const pdm_client_result_t *res)
{
    cJSON *arr = cJSON_AddArrayToObject(root, "logprobs");
    for (size_t i = 0; arr && i < res->n_logprobs; i++) {
        cJSON *e = logprob_entry(&res->logprobs[i]);
        cJSON *top = cJSON_AddArrayToObject(e, "top");
        for (size_t k = 0; top && k < res->logprobs[i].n_top; k++)
            cJSON_AddItemToArray(top, logprob_entry(&res->logprobs[i].top[k]));
        cJSON_AddItemToArray(arr, e);
    }
}

/* "beams": [{tokens, text, score, logprob, finish_reason}], best first. */
static void add_beams_json(cJSON *root, const pdm_client_result_t *res)
{
    cJSON *arr = cJSON_AddArrayToObject(root, "beams");
    for (size_t i = 0; i < res->n_beams; i++) {
        const pdm_client_beam_t *b = &res->beams[i];
        cJSON *o = cJSON_CreateObject();
        cJSON *t = cJSON_AddArrayToObject(o, "tokens");
        for (size_t k = 0; k < b->n_tokens; k++) cJSON_AddItemToArray(t, cJSON_CreateNumber(b->tokens[k]));
        cJSON_AddStringToObject(o, "text", b->text ? b->text : "");
        cJSON_AddNumberToObject(o, "score", b->score);
        cJSON_AddNumberToObject(o, "logprob", b->logprob);
        cJSON_AddStringToObject(o, "finish_reason", finish_name(b->finish));
        cJSON_AddItemToArray(arr, o);
    }
}

int cmd_generate_remote(int argc, char **argv)
{
    const char *router = NULL, *prompt = NULL, *config = NULL;
    const char *curve_srv = NULL, *curve_key = NULL;
    char mesh_srv[1100], mesh_key[1100];
    const char *stops[PDM__REMOTE_MAX_STOPS];
    int n_stops = 0, chat = 0, stats = 0, json = 0;
    long n_predict = 128, timeout_ms = 120000, beams = 0, n_best = 0;
    pdm_client_request_t req;
    pdm_client_request_init(&req);
    pdm_sampler_params_t sp; /* the local mode's defaults, copied into req after parsing */
    pdm_sampler_params_default(&sp);
    sp.repeat_penalty = 0; /* unset: the router's default (off) */
    sp.seed = 0;           /* unset: the router picks one */
    enum { O_STOP = 256, O_ROUTER, O_TIMEOUT, O_BEAMS, O_LOCAL_ONLY, O_MESH, O_CONFIG, O_CSRV,
           O_CKEY, O_NBEST, O_LP, O_ES, O_IGNORE_EOS, O_CHAT_TEMPLATE };
    static const struct option opts[] = {
        {"router", required_argument, 0, O_ROUTER}, {"prompt", required_argument, 0, 'p'},
        {"mesh", no_argument, 0, O_MESH},          {"config", required_argument, 0, O_CONFIG},
        {"chat", no_argument, 0, 'c'},             {"n-predict", required_argument, 0, 'n'},
        {"stats", no_argument, 0, 's'},            {"json", no_argument, 0, 'j'},
        CLI_SAMPLING_LONG_OPTS,                    {"stop", required_argument, 0, O_STOP},
        {"timeout", required_argument, 0, O_TIMEOUT},
        {"beams", required_argument, 0, O_BEAMS},  {"model", required_argument, 0, 'm'},
        {"n-best", required_argument, 0, O_NBEST}, {"length-penalty", required_argument, 0, O_LP},
        {"early-stopping", required_argument, 0, O_ES},
        {"ignore-eos", no_argument, 0, O_IGNORE_EOS},
        {"threads", required_argument, 0, O_LOCAL_ONLY},
        {"batch", required_argument, 0, O_LOCAL_ONLY},
        {"ctx", required_argument, 0, O_LOCAL_ONLY},
        {"kv-dtype", required_argument, 0, O_LOCAL_ONLY},
        {"curve-server-key", required_argument, 0, O_CSRV},
        {"curve-key", required_argument, 0, O_CKEY},
        {"chat-template", required_argument, 0, O_CHAT_TEMPLATE},
        {0, 0, 0, 0}};
    int c;
    double dv;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:cn:sj", opts, NULL)) != -1) {
        int sampling = cli_sampling_flag_parse(c, optarg, &sp);
        if (sampling < 0) return 2;
        if (sampling) continue;
        switch (c) {
        case O_ROUTER: router = optarg; break;
        case O_CSRV: curve_srv = optarg; break;
        case O_CKEY: curve_key = optarg; break;
        case O_MESH: config = CLI_MESH_DEFAULT_CONFIG; break;
        case O_CONFIG: config = optarg; break;
        case 'm': break; /* the router serves its own model */
        case 'p': prompt = optarg; break;
        case 'c': chat = 1; break;
        case 's': stats = 1; break;
        case 'j': json = 1; break;
        case 'n':
            if (pdm_parse_long(optarg, 1, 1 << 20, &n_predict))
                return cli_usage_error("invalid -n '%s' (1..1048576 with --router)", optarg);
            break;
        case O_STOP:
            if (n_stops == PDM__REMOTE_MAX_STOPS)
                return cli_usage_error("too many --stop strings%s", "");
            if (!*optarg) return cli_usage_error("empty --stop string%s", "");
            stops[n_stops++] = optarg;
            break;
        case O_TIMEOUT:
            if (pdm_parse_long(optarg, 1, 3600000, &timeout_ms))
                return cli_usage_error("invalid --timeout '%s' (1..3600000 ms)", optarg);
            break;
        case O_BEAMS:
            if (pdm_parse_long(optarg, 1, 64, &beams))
                return cli_usage_error("invalid --beams '%s' (1..64)", optarg);
            break;
        case O_NBEST:
            if (pdm_parse_long(optarg, 1, 64, &n_best))
                return cli_usage_error("invalid --n-best '%s' (1..64)", optarg);
            break;
        case O_LP:
            if (pdm_parse_double(optarg, -100, 100, &dv))
                return cli_usage_error("invalid --length-penalty '%s' (-100..100)", optarg);
            req.length_penalty = (float)dv;
            break;
        case O_ES: req.early_stopping = optarg; break;
        case O_IGNORE_EOS: req.ignore_eos = 1; break;
        case O_LOCAL_ONLY:
            return cli_usage_error("%s", "--threads, --batch, --ctx and --kv-dtype apply to "
                                         "local generation only, not with --router");
        case O_CHAT_TEMPLATE:
            return cli_usage_error("%s", "the router renders chats with its model's format: give "
                                         "--chat-template to pdmesh-router (router.chat_template "
                                         "in a mesh config), not to a remote generate");
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (optind < argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!prompt) return cli_usage_error("%s", "generate needs --prompt TEXT");
    req.temperature = sp.temperature;
    req.top_k = sp.top_k;
    req.top_p = sp.top_p;
    req.min_p = sp.min_p;
    req.repeat_penalty = sp.repeat_penalty;
    req.seed = sp.seed;
    req.presence_penalty = sp.presence_penalty;
    req.frequency_penalty = sp.frequency_penalty;
    req.logit_bias_ids = sp.bias_ids;
    req.logit_bias_values = sp.bias_values;
    req.n_logit_bias = (size_t)sp.n_bias;
    req.logprobs = sp.logprobs >= 0;
    req.top_logprobs = sp.logprobs > 0 ? (uint32_t)sp.logprobs : 0;
    cli_mesh_t mesh;
    if (router && config)
        return cli_usage_error("%s", "give either --router ENDPOINT or --mesh/--config FILE");
    if (config) {
        char err[1400];
        if (cli_mesh_config(config, &mesh, err, sizeof(err))) {
            fprintf(stderr, "%s: %s\n", cli_prog, err);
            return 1;
        }
        router = mesh.client;
        if (!curve_srv && !curve_key && !getenv("PDMESH_CURVE_SERVER_KEY_FILE") &&
            cli_mesh_curve_files(&mesh, mesh_srv, sizeof(mesh_srv), mesh_key, sizeof(mesh_key))) {
            curve_srv = mesh_srv;
            curve_key = mesh_key;
        }
    }
    if (!curve_srv != !curve_key)
        return cli_usage_error("%s", "--curve-server-key and --curve-key go together");
    if (!router || !*router) return cli_usage_error("%s", "--router needs an ENDPOINT");

    pdm_client_options_t copt = {.timeout_ms = (int)timeout_ms,
                                 .curve_server_key_file = curve_srv,
                                 .curve_key_file = curve_key};
    pdm_client_t *client;
    if (pdm_client_create(router, &copt, &client)) {
        fprintf(stderr, "%s: cannot create a client for %s: %s\n", cli_prog, router,
                pdm_client_last_error());
        return 1;
    }
    pdm_client_message_t msg = {.role = "user", .content = prompt};
    if (chat) {
        req.messages = &msg;
        req.n_messages = 1;
    } else {
        req.prompt = prompt;
    }
    req.max_tokens = (uint32_t)n_predict;
    req.stop = stops;
    req.n_stop = (size_t)n_stops;
    req.beams = (uint32_t)beams;
    req.n_best = beams > 1 ? (uint32_t)(n_best ? n_best : 1) : 0;
    if (n_best > 1 && beams <= 1) return cli_usage_error("%s", "--n-best needs --beams > 1");
    pdm_client_result_t res;
    /* a beam search is not streamed: the best beam is printed when the search ends */
    int rc = beams > 1 ? pdm_client_generate(client, &req, &res)
                       : pdm_client_generate_stream(client, &req, print_chunk, &json, &res);
    if (!rc && beams > 1 && !json) print_beams(&res);
    int status = 0;
    if (rc) {
        if (!json && res.n_tokens) printf("\n");
        fprintf(stderr, "%s: generation failed (%s): %s\n", cli_prog, pdm_client_status_name(rc),
                res.error);
        status = 1;
    } else {
        double decode_ms = res.client_total_ms - res.client_ttft_ms;
        double tps = res.n_tokens > 1 && decode_ms > 0 ? (double)(res.n_tokens - 1) * 1e3 / decode_ms
                                                       : 0.0;
        if (json) {
            cJSON *root = cJSON_CreateObject();
            cJSON *ids = cJSON_AddArrayToObject(root, "tokens");
            for (size_t i = 0; i < res.n_tokens; i++)
                cJSON_AddItemToArray(ids, cJSON_CreateNumber(res.tokens[i]));
            cJSON_AddStringToObject(root, "text", res.text);
            if (req.logprobs) add_logprobs(root, &res);
            cJSON_AddStringToObject(root, "finish_reason", finish_name(res.finish));
            cJSON_AddNumberToObject(root, "prompt_tokens", res.usage.prompt_tokens);
            cJSON_AddNumberToObject(root, "completion_tokens", (double)res.n_tokens);
            cJSON_AddNumberToObject(root, "ttft_s", res.client_ttft_ms / 1e3);
            cJSON_AddNumberToObject(root, "decode_tokens_per_s", tps);
            cJSON_AddNumberToObject(root, "router_ttft_ms", res.usage.ttft_ms);
            cJSON_AddStringToObject(root, "prefill_method", res.usage.prefill_method);
            cJSON_AddStringToObject(root, "decode_node", res.usage.decode_node);
            cJSON_AddNumberToObject(root, "request_id", (double)res.router_id);
            if (res.n_beams) add_beams_json(root, &res);
            cli_print_json_line(root);
        } else {
            printf("\n");
        }
        fflush(stdout);
        if (stats)
            fprintf(stderr, "prompt tokens: %u, generated: %zu (%s)\nTTFT: %.3f s (router: "
                            "%.3f s)\ndecode: %.1f tokens/s\nprefill: %s%s%s, decode node: %s\n",
                    res.usage.prompt_tokens, res.n_tokens, finish_name(res.finish),
                    res.client_ttft_ms / 1e3, res.usage.ttft_ms / 1e3, tps,
                    res.usage.prefill_method[0] ? res.usage.prefill_method : "-",
                    res.usage.prefill_group[0] ? " on " : "", res.usage.prefill_group,
                    res.usage.decode_node[0] ? res.usage.decode_node : "-");
    }
    pdm_client_result_fini(&res);
    pdm_client_destroy(client);
    return status;
}
