/*
 * pdm_grammar_bench.c - the cost of structured output on the decode path: TPOT (one decode
 * step + sampling) without and with a response_format constraint, on one thread, for a chat
 * request per schema, greedy and sampled (temperature 0.8, seed 1). Runs alternate
 * constrained / unconstrained `rounds` times so that load drifts hit both alike; the
 * constrained run generates until end of sequence or max_new tokens, the unconstrained one as
 * many tokens (ignoring end of sequence), so both attend over the same context lengths. It reports per mode the medians of the
 * runs' mean step times (thread CPU time, and wall time), the grammar's own CPU time per step
 * (sampling with the mask + accept, minus unconstrained sampling), the trie walks and
 * cache hits, the CPU model and the load average before and after (a benchmark: it measures
 * and reports, it does not pass or fail). Output: one JSON object on stdout.
 *
 *   pdm-grammar-bench MODEL [rounds] [max_new]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/model.h"

/* This thread's CPU seconds: on a shared, loaded machine the wall clock also counts the time
 * the thread waited for a core; CPU time is what the step itself costs. */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    const char *name, *prompt, *schema;
} bench_case_t;

static const bench_case_t cases[] = {
    {"json_object", "List three fruits with their colors as a JSON object.",
     "{\"type\":\"object\"}"},
    {"person_schema", "John is 31 years old and lives in Paris. Give his name, age and city as "
                      "JSON.",
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
     "\"integer\"},\"city\":{\"type\":\"string\"}},\"required\":[\"name\",\"age\",\"city\"],"
     "\"additionalProperties\":false}"},
    {"story_schema", "Write a story about a dragon who learns to cook, in 6 sentences.",
     "{\"type\":\"object\",\"properties\":{\"title\":{\"type\":\"string\"},\"sentences\":{"
     "\"type\":\"array\",\"items\":{\"type\":\"string\"},\"minItems\":6,\"maxItems\":6}},"
     "\"required\":[\"title\",\"sentences\"]}"},
};

typedef struct {
    double wall_ms;    /* mean wall time per generated token */
    double step_ms;    /* mean CPU time (forward + sampling [+ grammar]) per generated token */
    double grammar_ms; /* mean sampling + grammar time per token (the part that changes) */
    int tokens;
    uint64_t walks, hits;
} run_t;

static int run(pdm_model_t *m, pdm_model_ctx_t *ctx, const pdm_vocab_trie_t *trie,
               const int32_t *prompt, int n_prompt, const pdm_grammar_t *g, float temp,
               int max_new, int ignore_eos, run_t *out)
{
    const pdm_model_hparams_t *hp = &m->hp;
    pdm_kv_cache_t *cache = NULL;
    pdm_sampler_t *s = NULL;
    pdm_gmatch_t *gm = NULL;
    float *logits = malloc(sizeof(float) * hp->n_vocab);
    int32_t *hist = malloc(sizeof(int32_t) * (size_t)max_new);
    pdm_sampler_params_t sp;
    pdm_sampler_params_default(&sp);
    sp.temperature = temp;
    sp.seed = 1;
    int st = !logits || !hist;
    if (!st) st = pdm_kv_cache_create(hp, n_prompt + max_new + 1, PDM_DT_F32, &cache);
    if (!st) st = pdm_sampler_create(&sp, (int32_t)hp->n_vocab, &s);
    if (!st && g) {
        if (!(gm = pdm_gmatch_create(g, trie))) st = 1;
        else pdm_sampler_set_grammar(s, gm);
    }
    if (!st) st = pdm_model_prefill(ctx, cache, prompt, n_prompt, logits);
    double t_step = 0, t_sample = 0, t_wall = 0;
    int n = 0;
    while (!st && n < max_new) {
        double w0 = pdm_now(), t0 = cpu_now();
        int32_t tok = pdm_sampler_sample(s, logits, hist, n, NULL);
        if (gm) pdm_gmatch_accept_token(gm, tok);
        double t1 = cpu_now();
        hist[n++] = tok;
        if (!ignore_eos && pdm_tokenizer_is_eog(m->tokenizer, tok)) {
            t_sample += t1 - t0;
            t_step += t1 - t0;
            t_wall += pdm_now() - w0;
            break;
        }
        st = pdm_model_decode(ctx, cache, tok, logits);
        t_sample += t1 - t0;
        t_step += cpu_now() - t0;
        t_wall += pdm_now() - w0;
    }
    if (!st) {
        out->tokens = n;
        out->step_ms = 1e3 * t_step / n;
        out->wall_ms = 1e3 * t_wall / n;
        out->grammar_ms = 1e3 * t_sample / n;
        out->walks = out->hits = 0;
        if (gm) pdm_gmatch_stats(gm, &out->walks, &out->hits);
    }
    pdm_gmatch_destroy(gm);
    pdm_sampler_destroy(s);
    pdm_kv_cache_destroy(cache);
    free(logits);
    free(hist);
    return st;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void cpu_model(char *buf, size_t cap)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, cap, "unknown");
    while (f && fgets(line, sizeof(line), f)) {
        if (strncmp(line, "model name", 10)) continue;
        char *c = strchr(line, ':');
        if (c) snprintf(buf, cap, "%s", c + 2);
        buf[strcspn(buf, "\n")] = 0;
        break;
    }
    if (f) fclose(f);
}

static void loadavg(char *buf, size_t cap)
{
    FILE *f = fopen("/proc/loadavg", "r");
    snprintf(buf, cap, "?");
    if (f && fgets(buf, (int)cap, f)) buf[strcspn(buf, "\n")] = 0;
    if (f) fclose(f);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: pdm-grammar-bench MODEL [rounds] [max_new]\n");
        return 2;
    }
    const int rounds = argc > 2 ? atoi(argv[2]) : 5;
    const int max_new = argc > 3 ? atoi(argv[3]) : 160;
    pdm_model_t *m = NULL;
    pdm_model_ctx_t *ctx = NULL;
    if (pdm_model_load(argv[1], &m) || pdm_model_ctx_create(m, 1, 512, &ctx)) {
        fprintf(stderr, "pdm-grammar-bench: %s\n", pdm_error_last());
        return 1;
    }
    char cpu[256], load0[128], load1[128];
    cpu_model(cpu, sizeof(cpu));
    loadavg(load0, sizeof(load0));
    double t0 = pdm_now();
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(m->tokenizer);
    const double trie_ms = 1e3 * (pdm_now() - t0);
    printf("{\"model\": \"%s\", \"cpu\": \"%s\", \"threads\": 1, \"rounds\": %d, "
           "\"max_new\": %d, \"trie_build_ms\": %.1f, \"loadavg_before\": \"%s\", \"cases\": [",
           argv[1], cpu, rounds, max_new, trie_ms, load0);
    int first = 1;
    for (size_t c = 0; c < PDM_ARRAY_SIZE(cases); c++) {
        const char *role = "user";
        char *text = pdm_tokenizer_chat_render(m->tokenizer, &role, &cases[c].prompt, 1, 1);
        int32_t ids[1024];
        size_t n_ids = 0;
        pdm_grammar_t *g = NULL;
        if (!text || pdm_tokenizer_encode(m->tokenizer, text, strlen(text),
                                          PDM_TOKENIZE_ADD_BOS | PDM_TOKENIZE_SPECIAL, ids, 1024,
                                          &n_ids) ||
            pdm_grammar_compile(cases[c].schema, strlen(cases[c].schema), &g)) {
            fprintf(stderr, "pdm-grammar-bench: %s\n", pdm_error_last());
            return 1;
        }
        free(text);
        for (int mode = 0; mode < 2; mode++) {
            const float temp = mode ? 0.8f : 0.0f;
            double free_ms[64], con_ms[64], free_s[64], con_s[64], free_w[64], con_w[64];
            run_t last_free = {0}, last_con = {0};
            for (int r = 0; r < rounds && r < 64; r++) {
                /* the unconstrained run generates as many tokens as the constrained one (past
                 * an end of sequence if need be): both steps then attend over the same
                 * context lengths */
                if (run(m, ctx, trie, ids, (int)n_ids, g, temp, max_new, 0, &last_con) ||
                    run(m, ctx, trie, ids, (int)n_ids, NULL, temp, last_con.tokens, 1,
                        &last_free)) {
                    fprintf(stderr, "pdm-grammar-bench: %s\n", pdm_error_last());
                    return 1;
                }
                free_ms[r] = last_free.step_ms;
                con_ms[r] = last_con.step_ms;
                free_w[r] = last_free.wall_ms;
                con_w[r] = last_con.wall_ms;
                free_s[r] = last_free.grammar_ms;
                con_s[r] = last_con.grammar_ms;
            }
            const int nr = rounds < 64 ? rounds : 64;
            const double f = median(free_ms, nr), k = median(con_ms, nr);
            const double fs = median(free_s, nr), ks = median(con_s, nr);
            const double fw = median(free_w, nr), kw = median(con_w, nr);
            printf("%s\n  {\"case\": \"%s\", \"mode\": \"%s\", \"tokens_free\": %d, "
                   "\"tokens_constrained\": %d, \"tpot_cpu_free_ms\": %.3f, "
                   "\"tpot_cpu_constrained_ms\": %.3f, \"ratio_cpu\": %.4f, "
                   "\"tpot_wall_free_ms\": %.3f, \"tpot_wall_constrained_ms\": %.3f, "
                   "\"ratio_wall\": %.4f, \"sample_free_ms\": %.4f, "
                   "\"sample_constrained_ms\": %.4f, \"grammar_overhead_ms\": %.4f, "
                   "\"ratio_from_overhead\": %.4f, \"mask_walks\": %llu, \"mask_cache_hits\": "
                   "%llu}",
                   first ? "" : ",", cases[c].name, mode ? "sampled_t0.8" : "greedy",
                   last_free.tokens, last_con.tokens, f, k, k / f, fw, kw, kw / fw, fs, ks, ks - fs,
                   (f + ks - fs) / f, (unsigned long long)last_con.walks,
                   (unsigned long long)last_con.hits);
            fflush(stdout);
            first = 0;
        }
        pdm_grammar_destroy(g);
    }
    loadavg(load1, sizeof(load1));
    printf("\n], \"loadavg_after\": \"%s\"}\n", load1);
    pdm_vocab_trie_destroy(trie);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return 0;
}
