/*
 * decode_bench.c - batched decode throughput of pdm_decode_step on the real model.
 *
 * For each context C: one sequence is prefilled with C random tokens (pdm_model_prefill), and
 * its KV cache is copied (memcpy of the filled slots of every (layer, head) array) into the
 * caches of max(B) sequences, so that every sequence attends over its own C tokens of KV in its
 * own memory, as on the decode node, without paying B prefills. Then, for each batch B:
 *   - W warm-up steps and K timed steps of pdm_decode_step over B sequences (B tokens a step);
 *   - every cache is rewound to C tokens before the next B.
 * The single-sequence reference is pdm_model_decode (a prefill of one token) on one cache at
 * context C, K timed steps.
 *
 * --breakdown additionally times the phases of a step (embed, attn_in, per-sequence KV store +
 * attention, attn_out_ffn, logits) with a copy of decode_node/step.c's loop built from the
 * same public calls; its total is reported beside the real step's.
 *
 * Prints one JSON object per (C, B) and one per C for the single-sequence reference.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "model/model.h"

#define MAX_LIST 16

typedef struct {
    const char *model;
    int threads[MAX_LIST], n_threads;
    int batches[MAX_LIST], n_batches;
    int contexts[MAX_LIST], n_contexts;
    int steps, warmup;
    pdm_dtype_t kv_dtype;
    int breakdown;
    uint64_t seed;
} opts_t;

static int parse_list(const char *s, int *out, int *n)
{
    *n = 0;
    while (*s && *n < MAX_LIST) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 1 << 20) return -1;
        out[(*n)++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return *n ? 0 : -1;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: decode_bench [--model PATH] [--threads 1,2] [--batches 1,4,16,64]\n"
            "                    [--contexts 512,4096] [--steps K] [--warmup W]\n"
            "                    [--kv-dtype f16|f32] [--breakdown] [--seed S]\n");
}

static int parse(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.model = NULL, .steps = 16, .warmup = 2, .kv_dtype = PDM_DT_F16,
                  .seed = 1234};
    parse_list("1", o->threads, &o->n_threads);
    parse_list("1,4,16,64", o->batches, &o->n_batches);
    parse_list("512,4096", o->contexts, &o->n_contexts);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--breakdown")) {
            o->breakdown = 1;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            exit(0);
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        if (!v) {
            usage();
            return -1;
        }
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--threads")) {
            if (parse_list(v, o->threads, &o->n_threads)) return -1;
        }
        else if (!strcmp(a, "--steps")) o->steps = atoi(v);
        else if (!strcmp(a, "--warmup")) o->warmup = atoi(v);
        else if (!strcmp(a, "--seed")) o->seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--batches")) {
            if (parse_list(v, o->batches, &o->n_batches)) return -1;
        } else if (!strcmp(a, "--contexts")) {
            if (parse_list(v, o->contexts, &o->n_contexts)) return -1;
        } else if (!strcmp(a, "--kv-dtype")) {
            if (!strcmp(v, "f16")) o->kv_dtype = PDM_DT_F16;
            else if (!strcmp(v, "f32")) o->kv_dtype = PDM_DT_F32;
            else return -1;
        } else {
            usage();
            return -1;
        }
    }
    if (o->steps < 1 || o->warmup < 0) return -1;
    if (!o->model) o->model = pdm_model_default_path();
    return 0;
}

static uint64_t rng(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Copies the first n slots of every head array of `src` into `dst` (same shape). */
static void cache_copy(pdm_kv_cache_t *dst, const pdm_kv_cache_t *src, int32_t n)
{
    size_t bytes = (size_t)n * src->head_dim * pdm_dtype_row_bytes(src->dtype, 1);
    for (uint32_t i = 0; i < src->n_layers * src->n_kv_heads; i++) {
        memcpy(dst->k[i], src->k[i], bytes);
        memcpy(dst->v[i], src->v[i], bytes);
    }
    dst->n_tokens = n;
    dst->pos0 = src->pos0;
}

static void fail(const char *what)
{
    fprintf(stderr, "decode_bench: %s: %s\n", what, pdm_error_last());
    exit(1);
}

int main(int argc, char **argv)
{
    opts_t o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "decode_bench: bad arguments\n");
        return 2;
    }
    pdm_model_t *model;
    if (pdm_model_load(o.model, &model)) fail("loading the model");
    const pdm_model_hparams_t *hp = &model->hp;
    int max_b = 1;
    for (int i = 0; i < o.n_batches; i++)
        if (o.batches[i] > max_b) max_b = o.batches[i];
    const int extra = o.warmup + o.steps + (o.breakdown ? o.warmup + o.steps : 0) + 1;
    int max_c = 1;
    for (int i = 0; i < o.n_contexts; i++)
        if (o.contexts[i] > max_c) max_c = o.contexts[i];
    const int32_t capacity = max_c + extra;

    int max_t = 1;
    for (int i = 0; i < o.n_threads; i++)
        if (o.threads[i] > max_t) max_t = o.threads[i];
    pdm_model_ctx_t *ctx, *pctx;
    pdm_act_t act;
    if (pdm_model_ctx_create(model, max_t, 256, &pctx)) fail("prefill context");
    if (pdm_act_alloc(hp, max_b, &act)) fail("activations");
    pdm_kv_cache_t **caches = calloc((size_t)max_b, sizeof(*caches));
    pdm_decode_seq_t *seqs = calloc((size_t)max_b, sizeof(*seqs));
    float *logits = malloc(sizeof(float) * hp->n_vocab * (size_t)max_b);
    double *lat = malloc(sizeof(double) * (size_t)o.steps);
    if (!caches || !seqs || !logits || !lat) fail("allocation");
    for (int i = 0; i < max_b; i++) {
        if (pdm_kv_cache_create(hp, capacity, o.kv_dtype, &caches[i])) fail("KV cache");
        seqs[i] = (pdm_decode_seq_t){.cache = caches[i],
                                     .logits = logits + (size_t)i * hp->n_vocab};
    }
    uint64_t rs = o.seed | 1;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)max_c);
    if (!prompt) fail("allocation");

    for (int ci = 0; ci < o.n_contexts; ci++) {
        const int C = o.contexts[ci];
        /* Prefill sequence 0, then copy its KV to the others. */
        for (int t = 0; t < C; t++) prompt[t] = (int32_t)(rng(&rs) % hp->n_vocab);
        pdm_kv_cache_clear(caches[0]);
        double tp = pdm_now();
        if (pdm_model_prefill(pctx, caches[0], prompt, C, NULL)) fail("prefill");
        tp = pdm_now() - tp;
        for (int i = 1; i < max_b; i++) cache_copy(caches[i], caches[0], C);
        fprintf(stderr, "decode_bench: context %d prefilled in %.2f s (%.0f tok/s), copied to "
                "%d sequences\n", C, tp, C / tp, max_b - 1);

        for (int ti = 0; ti < o.n_threads; ti++) {
            const int T = o.threads[ti];
            if (pdm_model_ctx_create(model, T, max_b, &ctx)) fail("context");
            /* Single-sequence reference: pdm_model_decode. */
            {
                pdm_kv_cache_t *c = caches[0];
                for (int s = 0; s < o.warmup; s++)
                    if (pdm_model_decode(ctx, c, (int32_t)(rng(&rs) % hp->n_vocab), logits))
                        fail("decode");
                double total = pdm_now();
                for (int s = 0; s < o.steps; s++) {
                    double t = pdm_now();
                    if (pdm_model_decode(ctx, c, (int32_t)(rng(&rs) % hp->n_vocab), logits))
                        fail("decode");
                    lat[s] = pdm_now() - t;
                }
                total = pdm_now() - total;
                c->n_tokens = C;
                double med = median(lat, o.steps);
                printf("{\"kind\":\"single\",\"threads\":%d,\"context\":%d,\"batch\":1,"
                       "\"steps\":%d,\"step_median_s\":%.6e,\"step_mean_s\":%.6e,"
                       "\"tokens_per_s\":%.6e,\"kv_dtype\":\"%s\",\"prefill_s\":%.4f}\n",
                       T, C, o.steps, med, total / o.steps, o.steps / total,
                       pdm_dtype_name(o.kv_dtype), tp);
                fflush(stdout);
            }

            for (int bi = 0; bi < o.n_batches; bi++) {
                const int B = o.batches[bi];
                for (int i = 0; i < B; i++) caches[i]->n_tokens = C;
                for (int s = 0; s < o.warmup; s++) {
                    for (int i = 0; i < B; i++) seqs[i].token = (int32_t)(rng(&rs) % hp->n_vocab);
                    if (pdm_decode_step(ctx, &act, seqs, B)) fail("decode step");
                }
                double total = pdm_now();
                for (int s = 0; s < o.steps; s++) {
                    for (int i = 0; i < B; i++) seqs[i].token = (int32_t)(rng(&rs) % hp->n_vocab);
                    double t = pdm_now();
                    if (pdm_decode_step(ctx, &act, seqs, B)) fail("decode step");
                    lat[s] = pdm_now() - t;
                }
                total = pdm_now() - total;
                double med = median(lat, o.steps);
                printf("{\"kind\":\"batched\",\"threads\":%d,\"context\":%d,\"batch\":%d,"
                       "\"steps\":%d,\"step_median_s\":%.6e,\"step_mean_s\":%.6e,"
                       "\"tokens_per_s\":%.6e,\"kv_dtype\":\"%s\"",
                       T, C, B, o.steps, med, total / o.steps, (double)B * o.steps / total,
                       pdm_dtype_name(o.kv_dtype));
                if (o.breakdown) {
                    double ph[PDM_DECODE_PHASES] = {0};
                    for (int s = 0; s < o.warmup + o.steps; s++) {
                        for (int i = 0; i < B; i++)
                            seqs[i].token = (int32_t)(rng(&rs) % hp->n_vocab);
                        double scratch[PDM_DECODE_PHASES] = {0};
                        if (pdm_decode_step_timed(ctx, &act, seqs, NULL, B,
                                                  s < o.warmup ? scratch : ph))
                            fail("timed step");
                    }
                    printf(",\"phases_s\":{");
                    double sum = 0;
                    for (int p = 0; p < PDM_DECODE_PHASES; p++) {
                        printf("%s\"%s\":%.6e", p ? "," : "", pdm_decode_phase_names[p],
                               ph[p] / o.steps);
                        sum += ph[p] / o.steps;
                    }
                    printf("},\"phases_total_s\":%.6e", sum);
                }
                printf("}\n");
                fflush(stdout);
                for (int i = 0; i < B; i++) caches[i]->n_tokens = C;
            }
            pdm_model_ctx_destroy(ctx);
        }
    }
    for (int i = 0; i < max_b; i++) pdm_kv_cache_destroy(caches[i]);
    free(caches);
    free(seqs);
    free(logits);
    free(lat);
    free(prompt);
    pdm_act_free(&act);
    pdm_model_ctx_destroy(pctx);
    pdm_model_free(model);
    return 0;
}
