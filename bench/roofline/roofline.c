/*
 * roofline.c - the machine's ceilings for the engine benchmark's roofline: FMA peak
 * (f32, and int8 VNNI dot products where the CPU has them) and STREAM-like memory bandwidth.
 *
 *   pdm-roofline [--threads N] [--mb MiB per array] [--reps R]
 *
 * Prints one JSON object: peak f32 GFLOP/s (best of R), int8 GOP/s (vpdpbusd, counting a
 * multiply and an add per byte pair), and read / copy / triad bandwidth in GB/s (best of R,
 * STREAM's convention). Each thread works on its own registers / its own slice of the arrays.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define FMA_ITERS 20000000L
/* Twelve independent accumulators (named, so they stay in registers) hide the 4-cycle FMA
 * latency on two or more pipes. */
#define FMA12(op)                                                                                \
    a0 = op(a0, x, y), a1 = op(a1, x, y), a2 = op(a2, x, y), a3 = op(a3, x, y);                \
    a4 = op(a4, x, y), a5 = op(a5, x, y), a6 = op(a6, x, y), a7 = op(a7, x, y);                \
    a8 = op(a8, x, y), a9 = op(a9, x, y), a10 = op(a10, x, y), a11 = op(a11, x, y)

/* Returns the flops done. */
__attribute__((target("avx512f,fma"))) static double fma_avx512(void)
{
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
    __m512 a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x, a8 = x, a9 = x,
           a10 = x, a11 = x;
    for (long it = 0; it < FMA_ITERS; it++) {
        FMA12(_mm512_fmadd_ps);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)FMA_ITERS * 12 * 16 * 2;
}

__attribute__((target("avx2,fma"))) static double fma_avx2(void)
{
    const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
    __m256 a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x, a8 = x, a9 = x,
           a10 = x, a11 = x;
    for (long it = 0; it < FMA_ITERS; it++) {
        FMA12(_mm256_fmadd_ps);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float t[8];
    _mm256_storeu_ps(t, s);
    volatile float sink = t[0];
    (void)sink;
    return (double)FMA_ITERS * 12 * 8 * 2;
}

/* int8 x uint8 dot products with accumulation (vpdpbusd): 64 byte pairs per instruction. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni_avx512(void)
{
    const __m512i x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(-2);
    __m512i a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x, a8 = x, a9 = x,
            a10 = x, a11 = x;
    for (long it = 0; it < FMA_ITERS; it++) {
        FMA12(_mm512_dpbusd_epi32);
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), a2), a3);
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
    volatile int sink = _mm512_reduce_add_epi32(s);
    (void)sink;
    return (double)FMA_ITERS * 12 * 64 * 2;
}

/* Reads n floats with 256-bit loads into four sums the compiler cannot drop; returns bytes. */
__attribute__((target("avx2"))) static double read_sum(const float *a, size_t n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    volatile float sink = t[0];
    (void)sink;
    return (double)n * 4;
}

typedef struct {
    int kind; /* 0 fma f32, 1 vnni int8, 2 read, 3 copy, 4 triad */
    float *a, *b, *c;
    size_t n; /* floats in this thread's slice */
    double ops, t_start, t_end; /* measured by the worker itself: the main thread may be
                                 * scheduled late on a machine with as many cores as workers */
    pthread_barrier_t *barrier;
} job_t;

static int has_avx512 = 0, has_vnni = 0;

static void *run_job(void *p)
{
    job_t *j = p;
    pthread_barrier_wait(j->barrier);
    j->t_start = now_s();
    switch (j->kind) {
    case 0:
        j->ops = has_avx512 ? fma_avx512() : fma_avx2();
        break;
    case 1:
        j->ops = has_vnni ? vnni_avx512() : 0.0;
        break;
    case 2:
        j->ops = read_sum(j->a, j->n);
        break;
    case 3:
        memcpy(j->c, j->a, j->n * sizeof(float));
        j->ops = (double)j->n * 8;
        break;
    default:
        for (size_t i = 0; i < j->n; i++) j->c[i] = j->a[i] + 3.0f * j->b[i];
        j->ops = (double)j->n * 12;
        break;
    }
    j->t_end = now_s();
    return NULL;
}

/* Runs `kind` on n_threads threads; returns ops (flops or bytes) per second. */
static double run(int kind, int n_threads, float *a, float *b, float *c, size_t n)
{
    pthread_t th[64];
    job_t jobs[64];
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)n_threads + 1);
    size_t per = n / (size_t)n_threads;
    for (int t = 0; t < n_threads; t++) {
        jobs[t] = (job_t){.kind = kind, .a = a + t * per, .b = b + t * per, .c = c + t * per,
                          .n = per, .barrier = &barrier};
        pthread_create(&th[t], NULL, run_job, &jobs[t]);
    }
    pthread_barrier_wait(&barrier);
    double ops = 0, t0 = 1e300, t1 = 0;
    for (int t = 0; t < n_threads; t++) {
        pthread_join(th[t], NULL);
        ops += jobs[t].ops;
        t0 = jobs[t].t_start < t0 ? jobs[t].t_start : t0;
        t1 = jobs[t].t_end > t1 ? jobs[t].t_end : t1;
    }
    double dt = t1 - t0;
    pthread_barrier_destroy(&barrier);
    return ops / dt;
}

int main(int argc, char **argv)
{
    int n_threads = 2, reps = 5;
    long mb = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) n_threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mb")) mb = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    }
    if (n_threads < 1 || n_threads > 64 || mb < 1 || reps < 1) {
        fprintf(stderr, "usage: %s [--threads N] [--mb MiB] [--reps R]\n", argv[0]);
        return 2;
    }
    __builtin_cpu_init();
    has_avx512 = __builtin_cpu_supports("avx512f");
    has_vnni = __builtin_cpu_supports("avx512vnni");
    size_t n = (size_t)mb * 1024 * 1024 / sizeof(float);
    float *a = aligned_alloc(64, n * sizeof(float)), *b = aligned_alloc(64, n * sizeof(float));
    float *c = aligned_alloc(64, n * sizeof(float));
    if (!a || !b || !c) {
        fprintf(stderr, "roofline: cannot allocate 3 x %ld MiB\n", mb);
        return 1;
    }
    for (size_t i = 0; i < n; i++) a[i] = 1.0f, b[i] = 2.0f, c[i] = 0.0f;
    double best[5] = {0};
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < 5; k++) {
            double v = run(k, n_threads, a, b, c, n);
            if (v > best[k]) best[k] = v;
        }
    printf("{\"threads\": %d, \"isa\": \"%s\", \"peak_f32_gflops\": %.1f, "
           "\"peak_int8_gops\": %.1f, \"read_gbs\": %.2f, \"copy_gbs\": %.2f, "
           "\"triad_gbs\": %.2f, \"array_mib\": %ld}\n",
           n_threads, has_avx512 ? "avx512" : "avx2", best[0] * 1e-9, best[1] * 1e-9,
           best[2] * 1e-9, best[3] * 1e-9, best[4] * 1e-9, mb);
    free(a);
    free(b);
    free(c);
    return 0;
}
