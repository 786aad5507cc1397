/*
 * pdm-sdk-itest - drives libpdmesh against a live mesh for tests/integration/sdk.sh.
 *
 *   pdm-sdk-itest generate ENDPOINT N PROMPT       blocking, greedy; prints the text
 *   pdm-sdk-itest stream ENDPOINT N PROMPT         streaming, greedy; prints the chunks as they
 *                                                  come; fails if they differ from the result
 *   pdm-sdk-itest tokens ENDPOINT N PROMPT         blocking; prints the completion token ids
 *   pdm-sdk-itest concurrent ENDPOINT THREADS EXPECTED.json
 *        EXPECTED.json: [{"prompt": "...", "n": N, "tokens": [...]}, ...] from the
 *        single-process engine; thread i sends prompt i % count, half of them streaming, all
 *        through ONE shared client; every output must equal its expected tokens
 *   pdm-sdk-itest cancel ENDPOINT PROMPT           streams 400 tokens, cancels from another
 *                                                  thread after the first chunk; must return
 *                                                  ECANCELLED at once
 *   pdm-sdk-itest timeout ENDPOINT MS              a call against a router that never answers
 *                                                  must end with ETIMEOUT within MS (+ slack)
 *   pdm-sdk-itest hold ENDPOINT THREADS PROMPT     streams long requests until killed
 *   pdm-sdk-itest ping ENDPOINT N                  N ping round trips through the client's I/O
 *                                                  thread; prints p50/p99 (a measurement)
 *   pdm-sdk-itest sampling ENDPOINT N K PROMPT REF.json
 *        greedy with presence_penalty 0.5, frequency_penalty 0.5, logit_bias {13: -100},
 *        logprobs with K alternatives, blocking and streaming: tokens equal REF.json's
 *        (pdmesh generate --json with the same flags), each logprob within LP_TOL of its, the
 *        alternatives sorted and the chosen token first; prompt_logprobs with prompt_only:
 *        one entry per prompt token (the first NAN), nothing generated, and the same values
 *        again with a completion; then two calls at temperature 0.8 with seed 11 are equal
 *        and one with seed 12 differs
 *   pdm-sdk-itest ha-loop ENDPOINTS THREADS SECONDS N PROMPTS.json
 *        ENDPOINTS: a router list (EP1,EP2). THREADS threads, one client each, stream greedy
 *        requests of N tokens for SECONDS, prompt j % count of PROMPTS.json (["...", ...]),
 *        while routers die and come back (tests/integration/test_ha.py). One JSON line per
 *        request: {"prompt": j, "status": rc, "name": ..., "text": result, "stream": the
 *        chunks' text joined, "tokens": [...], "gap": 1 if a chunk's index was not the
 *        count of tokens before it (a lost or repeated token), "ms": elapsed, "timeout_ms"}.
 *        Every other request asks n = 2 choices, greedy and seeded (HA_SEED at
 *        HA_TEMPERATURE) in turn: its line adds "n", "seeded" and "choices" [{"text",
 *        "stream", "gap"}], its "text"/"stream" are choice 0's
 * Exit status 0 when the check holds, 1 otherwise (with a message on stderr).
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sdk/pdmesh_client.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define PDM_NCHOICES_TEST 3

static void greedy(pdm_client_request_t *q, const char *prompt, long n)
{
    pdm_client_request_init(q);
    q->prompt = prompt;
    q->max_tokens = (uint32_t)n;
    q->temperature = 0;
    q->timeout_ms = 300000;
}

typedef struct {
    char *buf;
    size_t len, cap;
    int print;
    atomic_int chunks;
} acc_t;

static int acc_cb(const pdm_client_chunk_t *ch, void *data)
{
    acc_t *a = data;
    if (a->len + ch->text_len + 1 > a->cap) {
        a->cap = (a->len + ch->text_len + 1) * 2;
        a->buf = realloc(a->buf, a->cap);
    }
    memcpy(a->buf + a->len, ch->text, ch->text_len);
    a->len += ch->text_len;
    a->buf[a->len] = 0;
    if (a->print) {
        fwrite(ch->text, 1, ch->text_len, stdout);
        fflush(stdout);
    }
    atomic_fetch_add(&a->chunks, 1);
    return 0;
}

static int fail(const char *what, const pdm_client_result_t *r, int rc)
{
    fprintf(stderr, "pdm-sdk-itest: %s: %s (%s)\n", what, r->error, pdm_client_status_name(rc));
    return 1;
}

/* ---- concurrent ---- */

typedef struct {
    pdm_client_t *c;
    const char *prompt;
    long n;
    const cJSON *tokens;
    int stream, ok;
    char why[400];
} job_t;

static void *job_main(void *arg)
{
    job_t *j = arg;
    pdm_client_request_t q;
    greedy(&q, j->prompt, j->n);
    pdm_client_result_t r;
    acc_t acc = {0};
    int rc = j->stream ? pdm_client_generate_stream(j->c, &q, acc_cb, &acc, &r)
                       : pdm_client_generate(j->c, &q, &r);
    if (rc) {
        snprintf(j->why, sizeof(j->why), "%s (%s)", r.error, pdm_client_status_name(rc));
    } else if ((size_t)cJSON_GetArraySize(j->tokens) != r.n_tokens) {
        snprintf(j->why, sizeof(j->why), "%zu tokens, expected %d", r.n_tokens,
                 cJSON_GetArraySize(j->tokens));
    } else {
        j->ok = 1;
        for (size_t i = 0; i < r.n_tokens; i++)
            if (cJSON_GetArrayItem(j->tokens, (int)i)->valueint != r.tokens[i]) {
                snprintf(j->why, sizeof(j->why), "token %zu is %d, expected %d", i, r.tokens[i],
                         cJSON_GetArrayItem(j->tokens, (int)i)->valueint);
                j->ok = 0;
                break;
            }
        if (j->ok && j->stream && strcmp(acc.buf ? acc.buf : "", r.text)) {
            snprintf(j->why, sizeof(j->why), "streamed text differs from the result");
            j->ok = 0;
        }
    }
    free(acc.buf);
    pdm_client_result_fini(&r);
    return NULL;
}

static int cmd_concurrent(const char *ep, int threads, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fprintf(stderr, "cannot open %s\n", path), 1;
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = 0;
    cJSON *exp = cJSON_Parse(text);
    int count = exp ? cJSON_GetArraySize(exp) : 0;
    if (!count) return fprintf(stderr, "bad %s\n", path), 1;
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return fprintf(stderr, "%s\n", pdm_client_last_error()), 1;
    job_t *jobs = calloc((size_t)threads, sizeof(*jobs));
    pthread_t *th = calloc((size_t)threads, sizeof(*th));
    double t0 = now_s();
    for (int i = 0; i < threads; i++) {
        const cJSON *e = cJSON_GetArrayItem(exp, i % count);
        jobs[i] = (job_t){.c = c, .prompt = cJSON_GetObjectItem(e, "prompt")->valuestring,
                          .n = (long)cJSON_GetObjectItem(e, "n")->valuedouble,
                          .tokens = cJSON_GetObjectItem(e, "tokens"), .stream = i % 2};
        pthread_create(&th[i], NULL, job_main, &jobs[i]);
    }
    int ok = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        ok += jobs[i].ok;
        if (!jobs[i].ok) fprintf(stderr, "client %d (%s): %s\n", i, jobs[i].prompt, jobs[i].why);
    }
    printf("%d/%d clients equal the single-process engine (%.1f s)\n", ok, threads, now_s() - t0);
    free(jobs);
    free(th);
    pdm_client_destroy(c);
    cJSON_Delete(exp);
    return ok == threads ? 0 : 1;
}

/* ---- cancel ---- */

typedef struct {
    pdm_client_t *c;
    uint64_t id;
    acc_t acc;
} canceller_t;

static void *canceller(void *arg)
{
    canceller_t *k = arg;
    double until = now_s() + 120;
    while (atomic_load(&k->acc.chunks) == 0 && now_s() < until) usleep(2000);
    pdm_client_cancel(k->c, k->id);
    return NULL;
}

static int cmd_cancel(const char *ep, const char *prompt)
{
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return fprintf(stderr, "%s\n", pdm_client_last_error()), 1;
    canceller_t k = {.c = c, .id = pdm_client_new_id(c)};
    pdm_client_request_t q;
    greedy(&q, prompt, 400);
    q.id = k.id;
    q.ignore_eos = 1;
    pthread_t t;
    pthread_create(&t, NULL, canceller, &k);
    pdm_client_result_t r;
    double t0 = now_s();
    int rc = pdm_client_generate_stream(c, &q, acc_cb, &k.acc, &r);
    double dt = now_s() - t0;
    pthread_join(t, NULL);
    int status = 0;
    if (rc != PDM_CLIENT_ECANCELLED) {
        fprintf(stderr, "cancel: %zu tokens (finish %d) arrived before the cancel took effect\n",
                r.n_tokens, (int)r.finish);
        status = fail("cancel: expected ECANCELLED", &r, rc);
    } else if (r.n_tokens >= 400) {
        fprintf(stderr, "cancel: all 400 tokens arrived before the cancel\n");
        status = 1;
    } else {
        printf("cancelled after %zu streamed tokens, %.2f s\n", r.n_tokens, dt);
    }
    free(k.acc.buf);
    pdm_client_result_fini(&r);
    pdm_client_destroy(c);
    return status;
}

static int cmd_timeout(const char *ep, int ms)
{
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return fprintf(stderr, "%s\n", pdm_client_last_error()), 1;
    pdm_client_request_t q;
    greedy(&q, "hello", 8);
    q.timeout_ms = ms;
    pdm_client_result_t r;
    double t0 = now_s();
    int rc = pdm_client_generate(c, &q, &r);
    double dt = now_s() - t0;
    int status = 0;
    if (rc != PDM_CLIENT_ETIMEOUT) status = fail("timeout: expected ETIMEOUT", &r, rc);
    else if (dt < ms / 1000.0 * 0.95 || dt > ms / 1000.0 + 2.0) {
        fprintf(stderr, "timeout: took %.3f s for a %d ms timeout\n", dt, ms);
        status = 1;
    } else {
        printf("ETIMEOUT after %.3f s: %s\n", dt, r.error);
    }
    pdm_client_result_fini(&r);
    pdm_client_destroy(c);
    return status;
}

static void *hold_main(void *arg)
{
    job_t *j = arg;
    for (;;) {
        pdm_client_request_t q;
        greedy(&q, j->prompt, 200);
        q.ignore_eos = 1;
        acc_t acc = {.print = 0};
        pdm_client_result_t r;
        pdm_client_generate_stream(j->c, &q, acc_cb, &acc, &r);
        free(acc.buf);
        pdm_client_result_fini(&r);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int cmd_ping(const char *ep, int n)
{
    pdm_client_t *c;
    if (n < 1 || pdm_client_create(ep, NULL, &c)) return 1;
    double *t = calloc((size_t)n, sizeof(double));
    for (int i = 0; i < n; i++) {
        double t0 = now_s();
        if (pdm_client_ping(c, 5000)) {
            fprintf(stderr, "ping: %s\n", pdm_client_last_error());
            free(t);
            pdm_client_destroy(c);
            return 1;
        }
        t[i] = (now_s() - t0) * 1e6;
    }
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    printf("ping round trip over %d: p50 %.0f us, p99 %.0f us\n", n, t[n / 2], t[(n * 99) / 100]);
    free(t);
    pdm_client_destroy(c);
    return 0;
}

/* ---- sampling ---- */

/* |SDK - engine| for one log-probability on sdk.sh's mesh: its prefill group has 2 ranks,
 * whose Q4_1 matmuls quantize activations to 8 bits over other row blocks than the single
 * process's, so the prompt's KV differs at ~1e-2 and later logprobs by up to ~0.1 (measured:
 * 0.08 on this prompt); the tokens stay equal. (A 1-rank group is exact:
 * tests/integration/test_http_mesh.py checks 2e-3.) */
#define LP_TOL 0.15

/* r's log-probabilities against the engine's "logprobs" list. */
static int check_logprobs(const char *what, const pdm_client_logprob_t *lp, size_t n,
                          const int32_t *tokens, const cJSON *ref, int k)
{
    if ((size_t)cJSON_GetArraySize(ref) != n) {
        fprintf(stderr, "%s: %zu logprobs, the engine has %d\n", what, n,
                cJSON_GetArraySize(ref));
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        const cJSON *e = cJSON_GetArrayItem(ref, (int)i);
        double want = cJSON_GetObjectItem(e, "logprob")->valuedouble;
        if (lp[i].token != tokens[i] || !(fabs(lp[i].logprob - want) < LP_TOL) ||
            lp[i].n_top != (size_t)k) {
            fprintf(stderr, "%s: token %zu: %d logprob %g (%zu alternatives), engine %g\n", what,
                    i, lp[i].token, lp[i].logprob, lp[i].n_top, want);
            return 1;
        }
        for (size_t j = 0; j < lp[i].n_top; j++)
            if ((j && lp[i].top[j].logprob > lp[i].top[j - 1].logprob) ||
                (j == 0 && lp[i].top[0].token != lp[i].token) || !lp[i].top[j].text) {
                fprintf(stderr, "%s: token %zu: alternatives out of order\n", what, i);
                return 1;
            }
    }
    return 0;
}

typedef struct {
    int32_t tokens[4096];
    float lps[4096];
    size_t n;
} lp_acc_t;

static int lp_cb(const pdm_client_chunk_t *ch, void *data)
{
    lp_acc_t *a = data;
    for (size_t i = 0; i < ch->n_logprobs && a->n < 4096; i++, a->n++) {
        a->tokens[a->n] = ch->logprobs[i].token;
        a->lps[a->n] = ch->logprobs[i].logprob;
    }
    return 0;
}

static int cmd_sampling(const char *ep, long n, int k, const char *prompt, const char *ref_path)
{
    FILE *f = fopen(ref_path, "r");
    char buf[1 << 18];
    size_t len = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f) fclose(f);
    buf[len] = 0;
    cJSON *ref = cJSON_Parse(buf);
    const cJSON *ref_lp = ref ? cJSON_GetObjectItem(ref, "logprobs") : NULL;
    const cJSON *ref_tok = ref ? cJSON_GetObjectItem(ref, "tokens") : NULL;
    if (!ref_lp || !ref_tok) {
        fprintf(stderr, "sampling: cannot read %s\n", ref_path);
        cJSON_Delete(ref);
        return 1;
    }
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) {
        cJSON_Delete(ref);
        return 1;
    }
    const int32_t bias_id = 13;
    const float bias = -100;
    pdm_client_request_t q;
    greedy(&q, prompt, n);
    q.presence_penalty = 0.5f;
    q.frequency_penalty = 0.5f;
    q.logit_bias_ids = &bias_id;
    q.logit_bias_values = &bias;
    q.n_logit_bias = 1;
    q.logprobs = 1;
    q.top_logprobs = (uint32_t)k;
    int status = 0;
    static lp_acc_t acc;
    for (int stream = 0; stream < 2 && !status; stream++) {
        pdm_client_result_t r;
        acc.n = 0;
        int rc = stream ? pdm_client_generate_stream(c, &q, lp_cb, &acc, &r)
                        : pdm_client_generate(c, &q, &r);
        if (rc) status = fail("sampling", &r, rc);
        else if (r.n_tokens != (size_t)cJSON_GetArraySize(ref_tok)) status = 1;
        for (size_t i = 0; !status && i < r.n_tokens; i++)
            if (r.tokens[i] != cJSON_GetArrayItem(ref_tok, (int)i)->valueint) status = 1;
        if (status && !rc) fprintf(stderr, "sampling: tokens differ from the engine's\n");
        if (!status && r.n_logprobs != r.n_tokens) {
            fprintf(stderr, "sampling: %zu logprobs for %zu tokens\n", r.n_logprobs, r.n_tokens);
            status = 1;
        }
        if (!status)
            status = check_logprobs(stream ? "stream result" : "result", r.logprobs,
                                    r.n_logprobs, r.tokens, ref_lp, k);
        if (!status && stream) { /* the chunks carried the same entries */
            if (acc.n != r.n_tokens) status = 1;
            for (size_t i = 0; !status && i < acc.n; i++)
                if (acc.tokens[i] != r.tokens[i] || acc.lps[i] != r.logprobs[i].logprob)
                    status = 1;
            if (status)
                fprintf(stderr, "sampling: the chunks' logprobs differ from the result's\n");
        }
        pdm_client_result_fini(&r);
    }
    /* prompt log-probabilities: scoring only, then with a completion (the same values) */
    float first_pass[512];
    size_t n_first = 0;
    for (int gen = 0; gen < 2 && !status; gen++) {
        pdm_client_request_t s;
        greedy(&s, prompt, n);
        s.prompt_logprobs = 1;
        s.prompt_only = !gen;
        s.logprobs = 1;
        s.top_logprobs = (uint32_t)k;
        pdm_client_result_t r;
        int rc = pdm_client_generate(c, &s, &r);
        if (rc) {
            status = fail("prompt logprobs", &r, rc);
            pdm_client_result_fini(&r);
            break;
        }
        const size_t np = r.n_prompt_logprobs;
        if (np != r.usage.prompt_tokens || np < 2 || np > 512 ||
            !isnan(r.prompt_logprobs[0].logprob) || (!gen && r.n_tokens != 0) ||
            (gen && r.n_tokens == 0) || (gen && np != n_first)) {
            fprintf(stderr, "prompt logprobs: %zu entries for %u prompt tokens, %zu generated\n",
                    np, r.usage.prompt_tokens, r.n_tokens);
            status = 1;
        }
        for (size_t i = 1; !status && i < np; i++) {
            const pdm_client_logprob_t *e = &r.prompt_logprobs[i];
            if (!(e->logprob <= 0) || e->n_top != (size_t)k ||
                (gen && e->logprob != first_pass[i])) {
                fprintf(stderr, "prompt logprobs: entry %zu: %g with %zu alternatives\n", i,
                        e->logprob, e->n_top);
                status = 1;
            }
            if (!gen) first_pass[i] = e->logprob;
        }
        n_first = np;
        pdm_client_result_fini(&r);
    }
    /* seeded sampling */
    char *text[3] = {0};
    for (int i = 0; i < 3 && !status; i++) {
        pdm_client_request_t s;
        greedy(&s, prompt, n);
        s.temperature = 0.8f;
        s.seed = i < 2 ? 11 : 12;
        pdm_client_result_t r;
        int rc = pdm_client_generate(c, &s, &r);
        if (rc) status = fail("seeded", &r, rc);
        else text[i] = strdup(r.text);
        pdm_client_result_fini(&r);
    }
    if (!status && (strcmp(text[0], text[1]) || !strcmp(text[0], text[2]))) {
        fprintf(stderr, "seed: '%s' / '%s' (same seed) / '%s' (another)\n", text[0], text[1],
                text[2]);
        status = 1;
    }
    for (int i = 0; i < 3; i++) free(text[i]);
    cJSON_Delete(ref);
    pdm_client_destroy(c);
    return status;
}

/* Structured output: json_schema and json_object give JSON; an unsupported keyword is refused
 * with a message naming it. */
static int cmd_structured(const char *ep, long n)
{
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return 1;
    static const pdm_client_message_t msg = {.role = "user",
                                             .content = "John is 31. Give his name and age as JSON."};
    pdm_client_request_t q;
    greedy(&q, NULL, n);
    q.messages = &msg;
    q.n_messages = 1;
    q.json_schema = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                    "\"age\":{\"type\":\"integer\"}},\"required\":[\"name\",\"age\"]}";
    int status = 0;
    pdm_client_result_t r;
    int rc = pdm_client_generate(c, &q, &r);
    if (rc) {
        status = fail("structured", &r, rc);
    } else {
        cJSON *v = cJSON_Parse(r.text);
        if (!v || !cJSON_IsNumber(cJSON_GetObjectItem(v, "age")) ||
            !cJSON_IsString(cJSON_GetObjectItem(v, "name"))) {
            fprintf(stderr, "structured: not valid against the schema: %s\n", r.text);
            status = 1;
        }
        cJSON_Delete(v);
    }
    pdm_client_result_fini(&r);
    q.json_schema = NULL;
    q.json_object = 1;
    if (!status && !(rc = pdm_client_generate(c, &q, &r))) {
        if (r.text[strspn(r.text, " \n")] != '{') {
            fprintf(stderr, "structured: json_object gave %s\n", r.text);
            status = 1;
        }
        pdm_client_result_fini(&r);
    } else if (!status) {
        status = fail("structured json_object", &r, rc);
    }
    q.json_object = 0;
    q.json_schema = "{\"type\":\"string\",\"format\":\"email\"}";
    rc = pdm_client_generate(c, &q, &r);
    if (!status && (rc != PDM_CLIENT_EINVALID_ARGUMENT || !strstr(r.error, "format"))) {
        fprintf(stderr, "structured: unsupported keyword: rc %d, %s\n", rc,
                r.error);
        status = 1;
    }
    pdm_client_result_fini(&r);
    pdm_client_destroy(c);
    if (!status) printf("structured: ok\n");
    return status;
}

typedef struct {
    const char *ep;
    cJSON *prompts;
    double until;
    uint32_t n;
    pthread_mutex_t *out_mu;
} ha_job_t;

typedef struct {
    char *buf;
    size_t len;
    uint32_t next;  /* index the next chunk must start at */
    int gap;
    double last, max_pause; /* seconds: the last chunk's time, the longest wait for one */
} ha_acc_t;

static int ha_cb(const pdm_client_chunk_t *ch, void *data)
{
    ha_acc_t *a = data;
    if (ch->index != a->next) a->gap = 1;
    double now = now_s();
    if (a->last > 0 && now - a->last > a->max_pause) a->max_pause = now - a->last;
    a->last = now;
    a->next = ch->index + (uint32_t)ch->n_tokens;
    char *b = realloc(a->buf, a->len + ch->text_len + 1);
    if (!b) return 1;
    memcpy(b + a->len, ch->text, ch->text_len);
    a->len += ch->text_len;
    b[a->len] = 0;
    a->buf = b;
    return 0;
}

/* OpenAI's n in the HA loop: the choices' streams, each checked for contiguity, and the
 * longest wait for a chunk of any choice. */
#define HA_CHOICES 2
#define HA_SEED 7          /* test_ha.py sends the same seeded request to a router it keeps */
#define HA_TEMPERATURE 0.8f

typedef struct {
    ha_acc_t choice[HA_CHOICES];
    int bad;               /* a chunk named a choice outside 0..HA_CHOICES-1 */
    double last, max_pause;
    size_t pre_len[HA_CHOICES]; /* each choice's text bytes before the longest pause */
} ha_nacc_t;

static int ha_ncb(const pdm_client_chunk_t *ch, void *data)
{
    ha_nacc_t *a = data;
    if (ch->choice >= HA_CHOICES) {
        a->bad = 1;
        return 0;
    }
    double now = now_s();
    if (a->last > 0 && now - a->last > a->max_pause) {
        a->max_pause = now - a->last;
        for (int i = 0; i < HA_CHOICES; i++) a->pre_len[i] = a->choice[i].len;
    }
    a->last = now;
    return ha_cb(ch, &a->choice[ch->choice]);
}

/* One streamed request with n = HA_CHOICES (greedy, or seeded with HA_SEED at
 * HA_TEMPERATURE) into o1: "n", "seeded", "choices" [{text, stream, pre: the stream's text
 * before the longest pause, gap}], and choice 0's text and stream as the request's. */
static int ha_nrequest(pdm_client_t *c, pdm_client_request_t *q, int seeded, cJSON *o1,
                       pdm_client_result_t *r)
{
    q->n = HA_CHOICES;
    if (seeded) {
        q->temperature = HA_TEMPERATURE;
        q->seed = HA_SEED;
    }
    ha_nacc_t acc;
    memset(&acc, 0, sizeof(acc));
    int rc = pdm_client_generate_stream(c, q, ha_ncb, &acc, r);
    cJSON_AddNumberToObject(o1, "n", HA_CHOICES);
    cJSON_AddNumberToObject(o1, "seeded", seeded);
    cJSON *chs = cJSON_AddArrayToObject(o1, "choices");
    int gap = acc.bad;
    for (int i = 0; i < HA_CHOICES; i++) {
        cJSON *x = cJSON_CreateObject();
        const char *text = (size_t)i < r->n_choices ? r->choices[i].text : "";
        cJSON_AddStringToObject(x, "text", text);
        cJSON_AddStringToObject(x, "stream", acc.choice[i].buf ? acc.choice[i].buf : "");
        if (acc.choice[i].buf) acc.choice[i].buf[acc.pre_len[i]] = 0;
        cJSON_AddStringToObject(x, "pre", acc.choice[i].buf ? acc.choice[i].buf : "");
        cJSON_AddNumberToObject(x, "gap", acc.choice[i].gap);
        cJSON_AddItemToArray(chs, x);
        gap |= acc.choice[i].gap;
    }
    cJSON_AddStringToObject(o1, "text", r->n_choices ? r->choices[0].text : "");
    cJSON_AddStringToObject(o1, "stream", cJSON_GetObjectItem(
                                              cJSON_GetArrayItem(chs, 0), "stream")->valuestring);
    cJSON_AddNumberToObject(o1, "gap", gap);
    cJSON_AddNumberToObject(o1, "max_gap", acc.max_pause);
    for (int i = 0; i < HA_CHOICES; i++) free(acc.choice[i].buf);
    return rc;
}

static void *ha_main(void *arg)
{
    ha_job_t *j = arg;
    pdm_client_options_t o = {.timeout_ms = 60000};
    pdm_client_t *c;
    if (pdm_client_create(j->ep, &o, &c)) {
        fprintf(stderr, "ha-loop: %s\n", pdm_client_last_error());
        return NULL;
    }
    const int n_prompts = cJSON_GetArraySize(j->prompts);
    for (unsigned k = 0; now_s() < j->until; k++) {
        int pi = (int)((k + (uintptr_t)pthread_self() / 64) % (unsigned)n_prompts);
        pdm_client_request_t q;
        greedy(&q, cJSON_GetArrayItem(j->prompts, pi)->valuestring, j->n);
        q.timeout_ms = o.timeout_ms;
        pdm_client_result_t r;
        ha_acc_t acc = {0};
        double t0 = now_s();
        cJSON *o1 = cJSON_CreateObject();
        /* one request in two has n = 2 choices, greedy and seeded in turn */
        int rc = k % 2 ? ha_nrequest(c, &q, k % 4 == 3, o1, &r)
                       : pdm_client_generate_stream(c, &q, ha_cb, &acc, &r);
        cJSON_AddNumberToObject(o1, "prompt", pi);
        cJSON_AddNumberToObject(o1, "status", rc);
        cJSON_AddStringToObject(o1, "name", pdm_client_status_name(rc));
        cJSON_AddStringToObject(o1, "error", r.error);
        if (k % 2 == 0) {
            cJSON_AddStringToObject(o1, "text", r.text ? r.text : "");
            cJSON_AddStringToObject(o1, "stream", acc.buf ? acc.buf : "");
            cJSON_AddNumberToObject(o1, "gap", acc.gap);
            cJSON_AddNumberToObject(o1, "max_gap", acc.max_pause);
        }
        cJSON *toks = cJSON_AddArrayToObject(o1, "tokens");
        for (size_t i = 0; i < r.n_tokens; i++)
            cJSON_AddItemToArray(toks, cJSON_CreateNumber(r.tokens[i]));
        cJSON_AddNumberToObject(o1, "ms", (now_s() - t0) * 1e3);
        cJSON_AddNumberToObject(o1, "timeout_ms", o.timeout_ms);
        struct timespec wall;
        clock_gettime(CLOCK_REALTIME, &wall);
        cJSON_AddNumberToObject(o1, "t_end", (double)wall.tv_sec + wall.tv_nsec * 1e-9);
        cJSON_AddNumberToObject(o1, "ttft_ms", r.client_ttft_ms);
        cJSON_AddStringToObject(o1, "method", r.usage.prefill_method);
        char *line = cJSON_PrintUnformatted(o1);
        pthread_mutex_lock(j->out_mu);
        printf("%s\n", line);
        fflush(stdout);
        pthread_mutex_unlock(j->out_mu);
        free(line);
        cJSON_Delete(o1);
        free(acc.buf);
        pdm_client_result_fini(&r);
    }
    pdm_client_destroy(c);
    return NULL;
}

static int cmd_ha_loop(const char *ep, int threads, double seconds, uint32_t n, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return fprintf(stderr, "ha-loop: cannot open %s\n", path), 1;
    char buf[1 << 16];
    size_t got = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[got] = 0;
    cJSON *prompts = cJSON_Parse(buf);
    if (!cJSON_IsArray(prompts) || cJSON_GetArraySize(prompts) < 1)
        return fprintf(stderr, "ha-loop: %s is not a list of prompts\n", path), 1;
    if (threads < 1 || threads > 64) threads = 1;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    ha_job_t j = {.ep = ep, .prompts = prompts, .until = now_s() + seconds, .n = n,
                  .out_mu = &mu};
    pthread_t t[64];
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, ha_main, &j);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    cJSON_Delete(prompts);
    return 0;
}

/* ---- n choices and tools ---- */

/* Texts of a streamed request's choices, joined from their chunks. */
typedef struct {
    char text[PDM_NCHOICES_TEST][4096];
    size_t len[PDM_NCHOICES_TEST];
    int bad;
} nchunks_t;

static int on_nchunk(const pdm_client_chunk_t *ch, void *data)
{
    nchunks_t *t = data;
    if (ch->choice >= PDM_NCHOICES_TEST) {
        t->bad = 1;
        return 0;
    }
    size_t *l = &t->len[ch->choice];
    if (*l + ch->text_len < sizeof(t->text[0])) {
        memcpy(t->text[ch->choice] + *l, ch->text, ch->text_len);
        *l += ch->text_len;
        t->text[ch->choice][*l] = 0;
    }
    return 0;
}

/* n = 3 seeded at temperature 0.9 (blocking and streamed): three choices with their own
 * indexes, texts and counts, the stream's chunks name their choice and join to the same texts,
 * completion tokens summed; the same request twice gives the same choices; temperature 0:
 * every choice is the same (greedy) text; n = 9 is refused here. */
static int cmd_nchoices(const char *ep, long n, const char *prompt)
{
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return 1;
    pdm_client_request_t q;
    greedy(&q, prompt, n);
    q.n = PDM_NCHOICES_TEST;
    q.temperature = 0.9f;
    q.seed = 17;
    int status = 0, rc;
    pdm_client_result_t r, again;
    static nchunks_t st;
    memset(&st, 0, sizeof(st));
    if ((rc = pdm_client_generate(c, &q, &r))) {
        status = fail("n=3", &r, rc);
        goto out;
    }
    uint32_t sum = 0;
    int differ = 0;
    for (size_t i = 0; i < r.n_choices; i++) {
        sum += r.choices[i].completion_tokens;
        differ |= strcmp(r.choices[i].text, r.choices[0].text) != 0;
        if (r.choices[i].index != i || r.choices[i].n_tokens != r.choices[i].completion_tokens)
            status = 1;
    }
    if (r.n_choices != PDM_NCHOICES_TEST || status || sum != r.usage.completion_tokens ||
        strcmp(r.text, r.choices[0].text) || !differ) {
        fprintf(stderr, "n=3: %zu choices, %u tokens summed vs %u, differ %d\n", r.n_choices,
                sum, r.usage.completion_tokens, differ);
        status = 1;
    }
    if (!status && (rc = pdm_client_generate_stream(c, &q, on_nchunk, &st, &again)) == 0) {
        for (size_t i = 0; i < again.n_choices; i++)
            if (strcmp(st.text[i], r.choices[i].text) || strcmp(again.choices[i].text,
                                                                  r.choices[i].text)) {
                fprintf(stderr, "n=3 streamed: choice %zu: %s / %s vs %s\n", i, st.text[i],
                        again.choices[i].text, r.choices[i].text);
                status = 1;
            }
        if (st.bad || again.n_choices != PDM_NCHOICES_TEST) status = 1;
        pdm_client_result_fini(&again);
    } else if (!status) {
        status = fail("n=3 streamed", &again, rc);
        pdm_client_result_fini(&again);
    }
    pdm_client_result_fini(&r);
    q.temperature = 0;
    if (!status && !(rc = pdm_client_generate(c, &q, &r))) {
        for (size_t i = 1; i < r.n_choices; i++)
            if (strcmp(r.choices[i].text, r.choices[0].text)) {
                fprintf(stderr, "n=3 greedy: choice %zu differs\n", i);
                status = 1;
            }
        pdm_client_result_fini(&r);
    } else if (!status) {
        status = fail("n=3 greedy", &r, rc);
        pdm_client_result_fini(&r);
    }
    q.n = 9;
    rc = pdm_client_generate(c, &q, &r);
    if (rc != PDM_CLIENT_EINVALID_ARGUMENT) {
        fprintf(stderr, "n=9 not refused: %s\n", pdm_client_status_name(rc));
        status = 1;
    }
    pdm_client_result_fini(&r);
out:
    pdm_client_destroy(c);
    printf("%s\n", status ? "FAIL nchoices" : "ok nchoices");
    return status;
}

/* tool_choice "required" (the grammar forces a call whatever the model): the result's
 * tool_calls_json names one of the tools with arguments that are a JSON object; then a
 * conversation with that call and a tool result is answered; a named function is called. */
static int cmd_tools(const char *ep, long n)
{
    static const char tools[] =
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":"
        "\"Weather of a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":"
        "{\"type\":\"string\"}},\"required\":[\"city\"]}}},{\"type\":\"function\",\"function\""
        ":{\"name\":\"get_time\",\"parameters\":{\"type\":\"object\",\"properties\":{\"zone\":"
        "{\"type\":\"string\"}},\"required\":[\"zone\"],\"additionalProperties\":false}}}]";
    pdm_client_t *c;
    if (pdm_client_create(ep, NULL, &c)) return 1;
    pdm_client_message_t msgs[3] = {{"user", "What is the weather in Paris?", NULL, NULL}};
    pdm_client_request_t q;
    greedy(&q, NULL, n);
    q.messages = msgs;
    q.n_messages = 1;
    q.tools_json = tools;
    q.tool_choice = "required";
    int status = 0, rc;
    pdm_client_result_t r;
    char *calls = NULL;
    if ((rc = pdm_client_generate(c, &q, &r))) {
        status = fail("tools required", &r, rc);
    } else {
        cJSON *v = r.tool_calls_json ? cJSON_Parse(r.tool_calls_json) : NULL;
        cJSON *fn = cJSON_GetObjectItem(cJSON_GetArrayItem(v, 0), "function");
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(fn, "name"));
        const char *args = cJSON_GetStringValue(cJSON_GetObjectItem(fn, "arguments"));
        cJSON *a = args ? cJSON_Parse(args) : NULL;
        if (!name || (strcmp(name, "get_weather") && strcmp(name, "get_time")) ||
            !cJSON_IsObject(a) || r.n_choices != 1 || !r.choices[0].tool_calls_json) {
            fprintf(stderr, "tools required: %s / %s\n", r.text,
                    r.tool_calls_json ? r.tool_calls_json : "(no calls)");
            status = 1;
        }
        cJSON_Delete(a);
        cJSON_Delete(v);
        calls = r.tool_calls_json ? strdup(r.tool_calls_json) : NULL;
    }
    pdm_client_result_fini(&r);
    if (!status && calls) { /* the next turn: the call and its result */
        cJSON *v = cJSON_Parse(calls);
        const char *id = cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetArrayItem(v, 0), "id"));
        msgs[1] = (pdm_client_message_t){"assistant", "", calls, NULL};
        msgs[2] = (pdm_client_message_t){"tool", "{\"temperature\": 21}", NULL, id};
        q.n_messages = 3;
        q.tool_choice = "none";
        if ((rc = pdm_client_generate(c, &q, &r)) || r.tool_calls_json) {
            status = rc ? fail("tools: the next turn", &r, rc) : 1;
            if (!rc) fprintf(stderr, "tools none: calls %s\n", r.tool_calls_json);
        }
        pdm_client_result_fini(&r);
        cJSON_Delete(v);
    }
    q.n_messages = 1;
    q.tool_choice = "get_time";
    if (!status) {
        if ((rc = pdm_client_generate(c, &q, &r)) || !r.tool_calls_json ||
            !strstr(r.tool_calls_json, "\"get_time\"")) {
            status = rc ? fail("tools named", &r, rc) : 1;
            if (!rc) fprintf(stderr, "tools named: %s\n", r.text);
        }
        pdm_client_result_fini(&r);
    }
    free(calls);
    pdm_client_destroy(c);
    printf("%s\n", status ? "FAIL tools" : "ok tools");
    return status;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: see tests/integration/sdk_itest.c\n");
        return 2;
    }
    const char *cmd = argv[1], *ep = argv[2];
    if (!strcmp(cmd, "concurrent") && argc == 5) return cmd_concurrent(ep, atoi(argv[3]), argv[4]);
    if (!strcmp(cmd, "cancel") && argc == 4) return cmd_cancel(ep, argv[3]);
    if (!strcmp(cmd, "timeout") && argc == 4) return cmd_timeout(ep, atoi(argv[3]));
    if (!strcmp(cmd, "ping") && argc == 4) return cmd_ping(ep, atoi(argv[3]));
    if (!strcmp(cmd, "structured") && argc == 4) return cmd_structured(ep, atol(argv[3]));
    if (!strcmp(cmd, "nchoices") && argc == 5) return cmd_nchoices(ep, atol(argv[3]), argv[4]);
    if (!strcmp(cmd, "tools") && argc == 4) return cmd_tools(ep, atol(argv[3]));
    if (!strcmp(cmd, "ha-loop") && argc == 7)
        return cmd_ha_loop(ep, atoi(argv[3]), atof(argv[4]), (uint32_t)atol(argv[5]), argv[6]);
    if (!strcmp(cmd, "sampling") && argc == 7)
        return cmd_sampling(ep, atol(argv[3]), atoi(argv[4]), argv[5], argv[6]);
    if (!strcmp(cmd, "hold") && argc == 5) {
        pdm_client_t *c;
        if (pdm_client_create(ep, NULL, &c)) return 1;
        int n = atoi(argv[3]);
        job_t j = {.c = c, .prompt = argv[4]};
        for (int i = 0; i < n; i++) {
            pthread_t t;
            pthread_create(&t, NULL, hold_main, &j);
        }
        printf("holding\n");
        fflush(stdout);
        for (;;) pause();
    }
    if ((!strcmp(cmd, "generate") || !strcmp(cmd, "stream") || !strcmp(cmd, "tokens")) &&
        argc == 5) {
        pdm_client_t *c;
        if (pdm_client_create(ep, NULL, &c)) return fprintf(stderr, "%s\n", pdm_client_last_error()), 1;
        pdm_client_request_t q;
        greedy(&q, argv[4], atol(argv[3]));
        pdm_client_result_t r;
        acc_t acc = {.print = 1};
        int stream = !strcmp(cmd, "stream");
        int rc = stream ? pdm_client_generate_stream(c, &q, acc_cb, &acc, &r)
                        : pdm_client_generate(c, &q, &r);
        int status = 0;
        if (rc) status = fail(cmd, &r, rc);
        else if (stream && strcmp(acc.buf ? acc.buf : "", r.text)) {
            fprintf(stderr, "stream: chunks '%s' differ from the result '%s'\n", acc.buf, r.text);
            status = 1;
        } else if (!strcmp(cmd, "tokens")) {
            for (size_t i = 0; i < r.n_tokens; i++) printf("%s%d", i ? " " : "", r.tokens[i]);
            printf("\n");
        } else if (!stream) {
            printf("%s", r.text);
        }
        if (!status && strcmp(cmd, "tokens")) printf("\n");
        free(acc.buf);
        pdm_client_result_fini(&r);
        pdm_client_destroy(c);
        return status;
    }
    fprintf(stderr, "pdm-sdk-itest: bad command line\n");
    return 2;
}
