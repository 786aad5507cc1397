/*
 * pdmesh.c - the local command-line tool: generate, tokenize, detokenize, make-test-model,
 * quantize, perplexity and kld (cli/perplexity.c).
 *
 * stdout carries only what the command produces (generated text, token ids); diagnostics and
 * statistics go to stderr. Exit status: 0 success, 1 runtime error, 2 usage error.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/curve.h"
#include "common/pdm.h"
#include "cli/cli.h"
#include "decode_node/decode.h"
#include "model/model.h"

#define PDM__MAX_STOPS 16


static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdmesh <command> [options]\n"
            "\n"
            "commands:\n"
            "  generate    --prompt TEXT [--chat] [-n N] [--temp T] [--top-k K] [--top-p P]\n"
            "              [--min-p P] [--repeat-penalty R] [--seed S] [--stop STR]...\n"
            "              [--threads N] [--batch N] [--ctx N] [--kv-dtype f32|f16|q8]\n"
            "              [--stats] [--json] [--ignore-eos]\n"
            "              [--chat-template NAME]  chatml, llama3, gemma, mistral-v7, ... instead\n"
            "              of the file's template (docs/models.md)\n"
            "              [--turn TEXT]...  later turns of a conversation, each its whole\n"
            "              prompt: the cache keeps the last turn's prompt and answer (fed back\n"
            "              as decode steps) and only what follows their common prefix is\n"
            "              prefilled, as a decode node's prefix pool does; one JSON line a turn\n"
            "              [--router ENDPOINT | --mesh | --config FILE] [--timeout MS]\n"
            "              [--beams B [--n-best N] [--length-penalty X] [--early-stopping R]]\n"
            "              [--ignore-eos]\n"
            "              [--curve-server-key F --curve-key F]\n"
            "              (served by a running mesh through libpdmesh)\n"
            "  tokenize    [--special] TEXT|-      print token ids (- reads stdin)\n"
            "  detokenize  ID...|-                 print the text of token ids\n"
            "  prefill-run --ranks R --method M (--prompt TEXT|--prompt-file F|--random N)\n"
            "              [--chat [--chat-template NAME]] [--length N] [--cached P] [--partition a,b,..]\n"
            "              [--table FILE] [--calibration FILE] [--threads N] [--pin] [--ctx N]\n"
            "              [--kv-dtype f32|f16|q8] [--timeout S] [--kv-out FILE]\n"
            "              [--logits-out FILE] [--repeat N] [--plan] [--json]\n"
            "              [--prompt-logprobs]  (every rank also scores its prompt tokens)\n"
            "              methods: single tsp kvr-e kvr-s kvr-p cp-kv cp-q auto\n"
            "  partition-search --ranks R --lengths N,N,.. [--out FILE] [--reps N]\n"
            "              [--min-stride N] [--threads N] [--pin]   KVR-S lookup table\n"
            "  calibrate   [--length N] [--out FILE] [--pin]  achieved compute and link speed\n"
            "  disagg-run  --prefill-ranks R --method M (--prompt TEXT|--prompt-file F|--random N)...\n"
            "              [-n N] [--temp T] [--top-k K] [--top-p P] [--min-p P]\n"
            "              [--repeat-penalty R] [--seed S] [--stop S] [--chat] [--chat-template NAME]\n"
            "              [--decode-batch N]\n"
            "              [--kv-dtype f32|f16|q8] [--json]\n"
            "              [--beams B] [--length-penalty X] [--n-best N] [--early-stopping R]\n"
            "              [--kv-fast-budget BYTES] [--kv-slow-tier ram|file:DIR] [--kv-window R]\n"
            "              [--reuse-prefix [--block-tokens N]]   follow-up turns as the router\n"
            "              prefill group -> KV stream -> decode node, end to end\n"
            "  plan        --context N [--beams B] [--fast-budget BYTES] [--chunk C] [--json]\n"
            "              memory of each KV placement (resident, layer-/head-wise offload)\n"
            "  up          [--config deploy/local/default.yaml]   start a local mesh (router,\n"
            "              prefill groups, decode nodes); waits until every node is alive\n"
            "  keygen      --out PREFIX    a CURVE keypair: PREFIX.key (public + secret, 0600)\n"
            "              and PREFIX.pub (docs/router.md, CURVE)\n"
            "  down        [--config FILE | --run-dir DIR]     stop it (SIGTERM, then SIGKILL)\n"
            "  status      [--config FILE | --run-dir DIR]     its processes, restarts, last exits\n"
            "  health      --file F [--max-age S] [--stall S] [--ready]   a node's health file\n"
            "              (pdmesh-prefill/-decode --health-file): exit 0 healthy, 1 not\n"
            "  perplexity  --file TEXT [--ctx N] [--batch N] [--chunks K] [--threads T] [--json]\n"
            "              [--exact] [--kl-divergence-base FILE] [--kv-dtype f16|f32]\n"
            "              perplexity as llama-perplexity computes it (chunks of --ctx, 512,\n"
            "              second half scored); --kl-divergence-base FILE saves log-probs\n"
            "  perplexity  --kl-divergence --kl-divergence-base FILE [--chunks K] [--exact]\n"
            "              [--json]   KL divergence against a saved base (docs/fidelity.md)\n"
            "  kld         BASE OTHER [--chunks K] [--json]   KL(BASE || OTHER) of two bases\n"
            "  make-test-model --out FILE [--layers N] [--d-model N] [--ffn N] [--heads N]\n"
            "              [--kv-heads N] [--head-dim N] [--wtype T] [--emb-type T] [--untied]\n"
            "              [--seed S] [--arch llama|llama3|qwen2|qwen3|gemma3]  (--arch: that\n"
            "              architecture's preset shape, docs/models.md; other options refine it)\n"
            "              T: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k\n"
            "              iq4_nl iq4_xs (the K types and iq4_xs need d_model and ffn\n"
            "              multiples of 256); default q4_1 matrices, q8_0 embeddings\n"
            "  quantize    IN OUT TYPE   convert an f32/f16/bf16 GGUF's matrices to TYPE (as\n"
            "              above, or q4_k_m: q6_k for attn_v, ffn_down and embeddings)\n"
            "\n"
            "common options:\n"
            "  --model FILE   GGUF model (default: $PDMESH_MODEL or "
            "models/SmolLM2-135M-Instruct.Q4_1.gguf)\n");
}

/* ---- generate ----------------------------------------------------------------------- */

#define PDM__MAX_TURNS 64 /* (the usage message says 64) */

typedef struct {
    const char *model_path;
    const char *prompt;
    const char *turns[PDM__MAX_TURNS]; /* --turn TEXT: later turns' whole prompts */
    int n_turns;
    const char *chat_template; /* --chat-template NAME, or NULL: the file's */
    int chat, stats, json;
    long n_predict, threads, batch, ctx;
    pdm_dtype_t kv_dtype;
    pdm_sampler_params_t sp;
    const char *stops[PDM__MAX_STOPS];
    int n_stops;
    int ignore_eos; /* end-of-generation tokens do not end it (their text is left out) */
} gen_opts_t;

/* Length of the longest suffix of text[0..len) that is a proper prefix of a stop string:
 * that much text must be held back while streaming. */
static size_t stop_holdback(const char *text, size_t len, const gen_opts_t *o)
{
    size_t hold = 0;
    for (int s = 0; s < o->n_stops; s++) {
        size_t sl = strlen(o->stops[s]);
        for (size_t k = PDM_MIN(sl - 1, len); k > hold; k--)
            if (!memcmp(text + len - k, o->stops[s], k)) {
                hold = k;
                break;
            }
    }
    return hold;
}

/* Offset of the earliest stop string in text, or -1. */
static long stop_find(const char *text, const gen_opts_t *o)
{
    long best = -1;
    for (int s = 0; s < o->n_stops; s++) {
        const char *p = strstr(text, o->stops[s]);
        if (p && (best < 0 || p - text < best)) best = p - text;
    }
    return best;
}

/* {"token", "text", "logprob"}: text is the token's bytes made valid UTF-8 (cJSON needs it). */
static cJSON *logprob_entry(const pdm_tokenizer_t *tk, int32_t id, float logprob)
{
    char piece[256];
    int w = pdm_tokenizer_token_bytes(tk, id, 1, piece, sizeof(piece) - 1);
    piece[w > 0 ? w : 0] = 0;
    for (int i = 0; i < w; i++) /* bytes of a partial character: '?' (the ids are exact) */
        if ((unsigned char)piece[i] >= 0x80) piece[i] = '?';
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "token", id);
    cJSON_AddStringToObject(e, "text", piece);
    cJSON_AddNumberToObject(e, "logprob", logprob);
    return e;
}

/* --json --logprobs K: "logprobs": [{token, text, logprob, top: [{token, text, logprob}]}],
 * the single-process engine's reference for the mesh's (model.h "Sampling", step 4). */
static void add_logprobs_json(cJSON *root, const pdm_tokenizer_t *tk, const int32_t *ids,
                              const pdm_token_logprobs_t *lp, long n)
{
    cJSON *arr = cJSON_AddArrayToObject(root, "logprobs");
    for (long i = 0; arr && i < n; i++) {
        cJSON *e = logprob_entry(tk, ids[i], lp[i].logprob);
        cJSON *top = cJSON_AddArrayToObject(e, "top");
        for (int k = 0; top && k < lp[i].n_top; k++)
            cJSON_AddItemToArray(top, logprob_entry(tk, lp[i].top_ids[k], lp[i].top_logprobs[k]));
        cJSON_AddItemToArray(arr, e);
    }
}

/* One run of generate: the model, its context and the cache that carries a conversation from
 * one turn to the next (--turn). */
typedef struct {
    const gen_opts_t *o;
    pdm_model_t *model;
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    int32_t *held;                /* [cache->capacity] the token of each filled cache row: the
                                   * turn's prompt, then the generated tokens fed back */
    float *logits;                /* [n_vocab] */
    int32_t *out_ids;             /* [n_predict + 1] the turn's generated tokens */
    pdm_token_logprobs_t *out_lp; /* [n_predict + 1] with --logprobs, else NULL */
} gen_run_t;

/* Generates one turn: rows [0, cached) of the cache already hold prompt_ids[0, cached) (a
 * former turn's), the rest of the prompt is prefilled in batches of --batch, then every
 * generated token but the last is fed back as a decode step of one token, as a decode node
 * does. Prints the text (or the turn's JSON line). Returns 0, or 1 after printing the error. */
static int gen_turn(gen_run_t *g, int turn, const int32_t *prompt_ids, size_t n_prompt,
                    int32_t cached)
{
    const gen_opts_t *o = g->o;
    pdm_kv_cache_t *cache = g->cache;
    pdm_sampler_t *sampler = NULL;
    char *text = NULL;
    size_t text_len = 0, text_cap = 0, emitted = 0;
    int status = 1;
    if (pdm_sampler_create(&o->sp, (int32_t)g->model->hp.n_vocab, &sampler)) {
        cli_runtime_error("cannot set up sampling");
        return 1;
    }
    cache->n_tokens = cached; /* rows after it are overwritten */
    memcpy(g->held, prompt_ids, n_prompt * sizeof(int32_t));
    const char *finish = "length";
    double t0 = pdm_now(), t_first = t0, t_end;
    if (pdm_model_prefill(g->ctx, cache, prompt_ids + cached, (int)(n_prompt - (size_t)cached),
                          g->logits)) {
        cli_runtime_error("prefill failed");
        goto out;
    }
    pdm_detok_t detok;
    pdm_detok_init(&detok, 0);
    long n_out = 0;
    int hit_stop_string = 0;
    char piece[256];
    for (;;) {
        if (n_out >= o->n_predict) break;
        if (cache->n_tokens >= cache->capacity && n_out > 0) {
            finish = "length";
            break;
        }
        /* the history is the completion so far (model.h "Sampling"), as on the mesh */
        int32_t tok = pdm_sampler_sample(sampler, g->logits, g->out_ids, (int)n_out,
                                         g->out_lp ? &g->out_lp[n_out] : NULL);
        if (n_out == 0) t_first = pdm_now();
        g->out_ids[n_out++] = tok;
        const int eog = pdm_tokenizer_is_eog(g->model->tokenizer, tok);
        if (eog && !o->ignore_eos) {
            finish = "stop";
            break;
        }
        int pl = eog ? 0 : pdm_detok_feed(&detok, g->model->tokenizer, tok, piece, sizeof(piece));
        if (pl < 0) pl = 0;
        if (text_len + (size_t)pl + 1 > text_cap) {
            size_t cap = PDM_MAX(text_cap * 2, text_len + (size_t)pl + 256);
            char *nt = realloc(text, cap);
            if (!nt) {
                fprintf(stderr, "%s: out of memory\n", cli_prog);
                goto out;
            }
            text = nt;
            text_cap = cap;
        }
        memcpy(text + text_len, piece, (size_t)pl);
        text_len += (size_t)pl;
        text[text_len] = '\0';
        long stop_at = o->n_stops ? stop_find(text, o) : -1;
        if (stop_at >= 0) {
            hit_stop_string = 1;
            text_len = (size_t)stop_at;
            text[text_len] = '\0';
            finish = "stop";
            break;
        }
        size_t safe = text_len - stop_holdback(text, text_len, o);
        if (!o->json && safe > emitted) {
            fwrite(text + emitted, 1, safe - emitted, stdout);
            fflush(stdout);
            emitted = safe;
        }
        if (n_out >= o->n_predict || cache->n_tokens >= cache->capacity) break;
        g->held[cache->n_tokens] = tok;
        if (pdm_model_decode(g->ctx, cache, tok, g->logits)) {
            cli_runtime_error("decode failed");
            goto out;
        }
    }
    t_end = pdm_now();
    if (!hit_stop_string) {
        /* bytes of an unfinished UTF-8 character at the end become U+FFFD */
        int fl = pdm_detok_flush(&detok, piece, sizeof(piece));
        if (fl > 0) {
            char *nt = realloc(text, text_len + (size_t)fl + 1);
            if (nt) {
                text = nt;
                memcpy(text + text_len, piece, (size_t)fl);
                text_len += (size_t)fl;
                text[text_len] = '\0';
            }
        }
    }
    if (!o->json && text_len > emitted) fwrite(text + emitted, 1, text_len - emitted, stdout);

    const size_t n_new = n_prompt - (size_t)cached;
    double prefill_s = t_first - t0, decode_s = t_end - t_first;
    double prefill_tps = prefill_s > 0 ? (double)n_new / prefill_s : 0.0;
    double decode_tps = n_out > 1 && decode_s > 0 ? (double)(n_out - 1) / decode_s : 0.0;
    if (o->json) {
        cJSON *root = cJSON_CreateObject();
        cJSON *ids = cJSON_AddArrayToObject(root, "tokens");
        for (long i = 0; i < n_out; i++)
            cJSON_AddItemToArray(ids, cJSON_CreateNumber(g->out_ids[i]));
        cJSON_AddStringToObject(root, "text", text ? text : "");
        if (g->out_lp) add_logprobs_json(root, g->model->tokenizer, g->out_ids, g->out_lp, n_out);
        cJSON_AddStringToObject(root, "finish_reason", finish);
        cJSON_AddNumberToObject(root, "prompt_tokens", (double)n_prompt);
        cJSON_AddNumberToObject(root, "completion_tokens", (double)n_out);
        if (o->n_turns) {
            cJSON_AddNumberToObject(root, "turn", turn);
            cJSON_AddNumberToObject(root, "cached_tokens", cached);
        }
        cJSON_AddNumberToObject(root, "ttft_s", prefill_s);
        cJSON_AddNumberToObject(root, "prefill_tokens_per_s", prefill_tps);
        cJSON_AddNumberToObject(root, "decode_tokens_per_s", decode_tps);
        cJSON_AddStringToObject(root, "kernels", pdm_model_ctx_ops(g->ctx)->name);
        cJSON_AddNumberToObject(root, "threads", (double)o->threads);
        cli_print_json_line(root);
    } else {
        printf("\n");
    }
    fflush(stdout);
    if (o->stats) {
        if (o->n_turns) fprintf(stderr, "turn %d: %d prompt tokens cached\n", turn, (int)cached);
        fprintf(stderr, "prompt tokens: %zu, generated: %ld (%s)\nTTFT: %.3f s\n"
                        "prefill: %.1f tokens/s\ndecode: %.1f tokens/s\nkernels: %s, threads: %ld\n",
                n_prompt, n_out, finish, prefill_s, prefill_tps, decode_tps,
                pdm_model_ctx_ops(g->ctx)->name, o->threads);
    }
    status = 0;
out:
    free(text);
    pdm_sampler_destroy(sampler);
    return status;
}

/* The rows a turn reuses: the longest common prefix of the cache's tokens and the turn's
 * prompt, at most all but its last token (whose logits are needed), and none unless it has
 * PDM_DECODE_POOL_MIN tokens: the decode node's prefix-pool rule (decode_node/decode.h). */
static int32_t gen_reuse(const int32_t *held, int32_t n_held, const int32_t *ids, size_t n)
{
    int32_t k = 0, lim = PDM_MIN(n_held, (int32_t)n - 1);
    while (k < lim && held[k] == ids[k]) k++;
    return k >= PDM_DECODE_POOL_MIN ? k : 0;
}

static int cmd_generate(int argc, char **argv)
{
    if (cli_generate_wants_router(argc, argv)) return cmd_generate_remote(argc, argv);
    gen_opts_t o = {.model_path = pdm_model_default_path(), .n_predict = 128, .threads = 0,
                    .batch = 512, .ctx = 0, .kv_dtype = PDM_DT_F16};
    pdm_sampler_params_default(&o.sp);
    o.sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    enum { O_STOP = 256, O_BATCH, O_CTX, O_KV, O_IGNORE_EOS, O_CHAT_TEMPLATE, O_TURN };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},     {"prompt", required_argument, 0, 'p'},
        {"chat", no_argument, 0, 'c'},            {"n-predict", required_argument, 0, 'n'},
        {"threads", required_argument, 0, 't'},   {"stats", no_argument, 0, 's'},
        {"json", no_argument, 0, 'j'},            CLI_SAMPLING_LONG_OPTS,
        {"stop", required_argument, 0, O_STOP},
        {"batch", required_argument, 0, O_BATCH}, {"ctx", required_argument, 0, O_CTX},
        {"kv-dtype", required_argument, 0, O_KV}, {"help", no_argument, 0, 'h'},
        {"ignore-eos", no_argument, 0, O_IGNORE_EOS},
        {"chat-template", required_argument, 0, O_CHAT_TEMPLATE},
        {"turn", required_argument, 0, O_TURN},
        {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:p:cn:t:sjh", opts, NULL)) != -1) {
        int sampling = cli_sampling_flag_parse(c, optarg, &o.sp);
        if (sampling < 0) return 2;
        if (sampling) continue;
        switch (c) {
        case 'm': o.model_path = optarg; break;
        case 'p': o.prompt = optarg; break;
        case 'c': o.chat = 1; break;
        case 's': o.stats = 1; break;
        case 'j': o.json = 1; break;
        case 'n':
            if (pdm_parse_long(optarg, 0, 1 << 20, &o.n_predict))
                return cli_usage_error("invalid -n '%s' (0..1048576)", optarg);
            break;
        case 't':
            if (pdm_parse_long(optarg, 1, 256, &o.threads))
                return cli_usage_error("invalid --threads '%s' (1..256)", optarg);
            break;
        case O_BATCH:
            if (pdm_parse_long(optarg, 1, 65536, &o.batch))
                return cli_usage_error("invalid --batch '%s' (1..65536)", optarg);
            break;
        case O_CTX:
            if (pdm_parse_long(optarg, 1, 1 << 24, &o.ctx))
                return cli_usage_error("invalid --ctx '%s'", optarg);
            break;
        case O_IGNORE_EOS: o.ignore_eos = 1; break;
        case O_CHAT_TEMPLATE:
            if (pdm_chat_from_name(optarg) == PDM_CHAT_UNKNOWN)
                return cli_usage_error("unknown --chat-template '%s'", optarg);
            o.chat_template = optarg;
            break;
        case O_STOP:
            if (o.n_stops == PDM__MAX_STOPS) return cli_usage_error("too many --stop strings%s", "");
            if (!*optarg) return cli_usage_error("empty --stop string%s", "");
            o.stops[o.n_stops++] = optarg;
            break;
        case O_TURN:
            if (o.n_turns == PDM__MAX_TURNS)
                return cli_usage_error("too many --turn options (at most %s)", "64");
            o.turns[o.n_turns++] = optarg;
            break;
        case O_KV:
            if (pdm_kv_dtype_parse(optarg, &o.kv_dtype))
                return cli_usage_error("invalid --kv-dtype '%s' (f32, f16 or q8)", optarg);
            break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (optind < argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!o.prompt) return cli_usage_error("%s", "generate needs --prompt TEXT");
    if (o.n_turns && o.chat)
        return cli_usage_error("%s", "--turn continues plain prompts; with --chat give the "
                                     "rendered conversation as the turns' prompts instead");
    if (o.n_turns && o.kv_dtype == PDM_DT_I8)
        return cli_usage_error("%s", "--turn needs an f16 or f32 KV cache (q8 fixes its scales "
                                     "from the first prompt)");
    if (o.threads == 0) o.threads = PDM_MAX(1, sysconf(_SC_NPROCESSORS_ONLN));

    int status = 1;
    const int n_turns = 1 + o.n_turns;
    gen_run_t g = {.o = &o};
    int32_t *ids[1 + PDM__MAX_TURNS] = {0};
    size_t n_ids[1 + PDM__MAX_TURNS] = {0};
    char *rendered = NULL;
    if (cli_load_model(o.model_path, &g.model)) return 1;
    const pdm_model_hparams_t *hp = &g.model->hp;

    const char *prompt_text = o.prompt;
    int flags = PDM_TOKENIZE_ADD_BOS;
    if (o.chat) {
        const char *role = "user";
        if (o.chat_template &&
            pdm_tokenizer_set_chat_template(g.model->tokenizer, o.chat_template)) {
            cli_runtime_error("--chat-template");
            goto out;
        }
        rendered = pdm_tokenizer_chat_render(g.model->tokenizer, &role, &o.prompt, 1, 1);
        if (!rendered) {
            cli_runtime_error("cannot apply the chat template");
            goto out;
        }
        prompt_text = rendered;
        flags |= PDM_TOKENIZE_SPECIAL;
    }
    long n_ctx = o.ctx ? o.ctx : (long)hp->n_ctx_train, capacity = 0;
    for (int k = 0; k < n_turns; k++) {
        const char *t = k ? o.turns[k - 1] : prompt_text;
        if (cli_tokenize_alloc(g.model->tokenizer, t, strlen(t), flags, &ids[k], &n_ids[k])) {
            cli_runtime_error("cannot tokenize the prompt");
            goto out;
        }
        if (n_ids[k] == 0) {
            fprintf(stderr, "%s: the prompt%s is empty after tokenization\n", cli_prog,
                    k ? " of a --turn" : "");
            goto out;
        }
        if ((long)n_ids[k] >= n_ctx) {
            fprintf(stderr, "%s: the prompt%s has %zu tokens, more than the context allows (%ld); "
                            "shorten it or raise --ctx\n", cli_prog, k ? " of a --turn" : "",
                    n_ids[k], n_ctx);
            goto out;
        }
        capacity = PDM_MAX(capacity, PDM_MIN(n_ctx, (long)n_ids[k] + o.n_predict));
    }
    if (pdm_model_ctx_create(g.model, (int)o.threads, (int)o.batch, &g.ctx) ||
        pdm_kv_cache_create(hp, (int32_t)capacity, o.kv_dtype, &g.cache)) {
        cli_runtime_error("cannot set up generation");
        goto out;
    }
    g.logits = malloc(hp->n_vocab * sizeof(float));
    g.out_ids = malloc((size_t)(o.n_predict + 1) * sizeof(int32_t));
    g.held = malloc((size_t)capacity * sizeof(int32_t));
    if (o.sp.logprobs >= 0) g.out_lp = malloc((size_t)(o.n_predict + 1) * sizeof(*g.out_lp));
    if (!g.logits || !g.out_ids || !g.held || (o.sp.logprobs >= 0 && !g.out_lp)) {
        fprintf(stderr, "%s: out of memory\n", cli_prog);
        goto out;
    }
    for (int k = 0; k < n_turns; k++) {
        const int32_t cached = k ? gen_reuse(g.held, g.cache->n_tokens, ids[k], n_ids[k]) : 0;
        if (gen_turn(&g, k, ids[k], n_ids[k], cached)) goto out;
    }
    status = 0;

out:
    for (int k = 0; k < n_turns; k++) free(ids[k]);
    free(g.logits);
    free(g.out_ids);
    free(g.out_lp);
    free(g.held);
    free(rendered);
    pdm_kv_cache_destroy(g.cache);
    pdm_model_ctx_destroy(g.ctx);
    pdm_model_free(g.model);
    return status;
}

/* ---- tokenize / detokenize ------------------------------------------------------------ */

static int cmd_tokenize(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    int special = 0, bos = 0;
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"special", no_argument, 0, 's'},
                                         {"bos", no_argument, 0, 'b'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:sbh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 's': special = 1; break;
        case 'b': bos = 1; break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (argc - optind != 1) return cli_usage_error("%s", "tokenize needs one TEXT argument (or -)");
    char *owned = NULL;
    const char *text = argv[optind];
    size_t len = strlen(text);
    if (!strcmp(text, "-")) {
        if (!(owned = cli_read_stdin(&len))) return cli_runtime_error("cannot read stdin");
        text = owned;
    }
    /* Only the tokenizer is needed, so vocabulary-only GGUF files (llama.cpp's
     * ggml-vocab-*.gguf) work too and no weights are read. */
    pdm_gguf_t *g;
    pdm_tokenizer_t *tok;
    if (pdm_gguf_open(model_path, &g) != PDM_OK) {
        free(owned);
        return cli_runtime_error("cannot open the model file");
    }
    int rc = pdm_tokenizer_create(g, &tok);
    pdm_gguf_close(g);
    if (rc != PDM_OK) {
        free(owned);
        return cli_runtime_error("cannot build the tokenizer");
    }
    int32_t *ids = NULL;
    size_t n = 0;
    int flags = (special ? PDM_TOKENIZE_SPECIAL : 0) | (bos ? PDM_TOKENIZE_ADD_BOS : 0);
    int status = 0;
    if (cli_tokenize_alloc(tok, text, len, flags, &ids, &n)) {
        status = cli_runtime_error("cannot tokenize");
    } else {
        for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
    }
    free(ids);
    free(owned);
    pdm_tokenizer_destroy(tok);
    return status;
}

static int cmd_detokenize(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    int special = 0;
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"special", no_argument, 0, 's'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "m:sh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 's': special = 1; break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (optind >= argc) return cli_usage_error("%s", "detokenize needs token ids (or -)");
    char *owned = NULL;
    size_t len;
    if (argc - optind == 1 && !strcmp(argv[optind], "-")) {
        if (!(owned = cli_read_stdin(&len))) return cli_runtime_error("cannot read stdin");
    }
    pdm_model_t *model;
    if (cli_load_model(model_path, &model)) {
        free(owned);
        return 1;
    }
    int status = 0;
    pdm_detok_t d;
    pdm_detok_init(&d, special);
    char buf[512];
    char *save = NULL, *tokstr = owned ? strtok_r(owned, " \t\r\n,", &save) : NULL;
    for (int i = optind;; i++) {
        const char *s = owned ? tokstr : (i < argc ? argv[i] : NULL);
        if (!s) break;
        long id;
        if (pdm_parse_long(s, 0, INT32_MAX, &id)) {
            fprintf(stderr, "%s: '%s' is not a token id\n", cli_prog, s);
            status = 2;
            break;
        }
        int n = pdm_detok_feed(&d, model->tokenizer, (int32_t)id, buf, sizeof(buf));
        if (n < 0) {
            status = cli_runtime_error("cannot detokenize");
            break;
        }
        fwrite(buf, 1, (size_t)n, stdout);
        if (owned) tokstr = strtok_r(NULL, " \t\r\n,", &save);
    }
    if (status == 0) {
        int n = pdm_detok_flush(&d, buf, sizeof(buf));
        if (n > 0) fwrite(buf, 1, (size_t)n, stdout);
        printf("\n");
    }
    free(owned);
    pdm_model_free(model);
    return status;
}

/* ---- make-test-model ------------------------------------------------------------------ */

static int cmd_make_test_model(int argc, char **argv)
{
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    const char *out = NULL;
    static const struct option opts[] = {
        {"out", required_argument, 0, 'o'},      {"layers", required_argument, 0, 'l'},
        {"d-model", required_argument, 0, 'd'},  {"ffn", required_argument, 0, 'f'},
        {"heads", required_argument, 0, 'H'},    {"kv-heads", required_argument, 0, 'k'},
        {"wtype", required_argument, 0, 'w'},    {"seed", required_argument, 0, 's'},
        {"ctx", required_argument, 0, 'c'},      {"help", no_argument, 0, 'h'},
        {"emb-type", required_argument, 0, 'e'}, {"untied", no_argument, 0, 'u'},
        {"arch", required_argument, 0, 'a'},     {"head-dim", required_argument, 0, 'D'},
        {0, 0, 0, 0}};
    int c;
    long v;
    /* --arch sets the preset first, so the other options refine it whatever their order */
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "o:l:d:f:H:k:w:s:c:he:ua:D:", opts, NULL)) != -1)
        if (c == 'a' && pdm_testmodel_params_preset(&p, optarg))
            return cli_usage_error("%s", pdm_error_last());
    opterr = 1;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:l:d:f:H:k:w:s:c:he:ua:D:", opts, NULL)) != -1) {
        if (c == 'a') continue;
        if (c == 'h') {
            usage(stdout);
            return 0;
        }
        if (c == 'o') {
            out = optarg;
            continue;
        }
        if (c == 'w' || c == 'e') {
            int t = pdm_dtype_from_name(optarg);
            if (t < 0 || !pdm_dtype_is_weight((pdm_dtype_t)t))
                return cli_usage_error("unknown weight type '%s' (see pdmesh --help)", optarg);
            if (c == 'w') p.wtype = (pdm_dtype_t)t;
            else p.embtype = (pdm_dtype_t)t;
            continue;
        }
        if (c == 'u') {
            p.tied = 0;
            continue;
        }
        if (c == '?' || pdm_parse_long(optarg, 1, 1 << 20, &v))
            return cli_usage_error("invalid value '%s'", c == '?' ? "" : optarg);
        switch (c) {
        case 'l': p.n_layers = (uint32_t)v; break;
        case 'd': p.d_model = (uint32_t)v; break;
        case 'f': p.n_ff = (uint32_t)v; break;
        case 'H': p.n_heads = (uint32_t)v; break;
        case 'k': p.n_kv_heads = (uint32_t)v; break;
        case 's': p.seed = (uint64_t)v; break;
        case 'c': p.n_ctx = (uint32_t)v; break;
        case 'D': p.head_dim = (uint32_t)v; break;
        }
    }
    if (!out) return cli_usage_error("%s", "make-test-model needs --out FILE");
    if (pdm_testmodel_write(out, &p)) return cli_runtime_error("cannot write the test model");
    return 0;
}

/* ---- quantize ---------------------------------------------------------------------------- */

static int cmd_quantize(int argc, char **argv)
{
    if (argc == 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        usage(stdout);
        return 0;
    }
    if (argc != 4) return cli_usage_error("%s", "quantize needs IN OUT TYPE");
    if (pdm_model_quantize_file(argv[1], argv[2], argv[3])) {
        fprintf(stderr, "%s: quantize: %s\n", cli_prog, pdm_error_last());
        return 1;
    }
    return 0;
}

/* pdmesh keygen --out PREFIX: a CURVE keypair for the router or a client (common/curve.h). */
static int cmd_keygen(int argc, char **argv)
{
    const char *out = NULL;
    static const struct option opts[] = {{"out", required_argument, 0, 'o'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "o:h", opts, NULL)) != -1) {
        if (c == 'o') out = optarg;
        else if (c == 'h') {
            printf("usage: pdmesh keygen --out PREFIX   (writes PREFIX.key 0600 and PREFIX.pub)\n");
            return 0;
        } else
            return cli_usage_error("%s", "invalid option");
    }
    if (!out || !*out || optind < argc) return cli_usage_error("%s", "keygen needs --out PREFIX");
    char pub[PDM_CURVE_KEY_LEN + 1];
    if (pdm_curve_keygen(out, pub)) {
        fprintf(stderr, "%s: keygen: %s\n", cli_prog, pdm_error_last());
        return 1;
    }
    printf("%s\n", pub);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "detokenize")) return cmd_detokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "make-test-model")) return cmd_make_test_model(argc - 1, argv + 1);
    if (!strcmp(cmd, "quantize")) return cmd_quantize(argc - 1, argv + 1);
    if (!strcmp(cmd, "prefill-run")) return cmd_prefill_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "partition-search")) return cmd_partition_search(argc - 1, argv + 1);
    if (!strcmp(cmd, "calibrate")) return cmd_calibrate(argc - 1, argv + 1);
    if (!strcmp(cmd, "disagg-run")) return cmd_disagg_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "plan")) return cmd_plan(argc - 1, argv + 1);
    if (!strcmp(cmd, "up")) return cmd_up(argc - 1, argv + 1);
    if (!strcmp(cmd, "down")) return cmd_down(argc - 1, argv + 1);
    if (!strcmp(cmd, "status")) return cmd_status(argc - 1, argv + 1);
    if (!strcmp(cmd, "health")) return cmd_health(argc - 1, argv + 1);
    if (!strcmp(cmd, "keygen")) return cmd_keygen(argc - 1, argv + 1);
    if (!strcmp(cmd, "perplexity")) return cmd_perplexity(argc - 1, argv + 1);
    if (!strcmp(cmd, "kld")) return cmd_kld(argc - 1, argv + 1);
    return cli_usage_error("unknown command '%s'", cmd);
}
