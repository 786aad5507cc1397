/*
 * select.c - picks the kernel variant once, from CPUID or PDMESH_KERNELS.
 */
#include "ops_internal.h"

#include <cpuid.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* F16C is CPUID leaf 1, ECX bit 29; read directly because clang 14's
 * __builtin_cpu_supports does not know the name. */
static int pdm__has_f16c(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    return (ecx >> 29) & 1;
}

static int pdm__has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && pdm__has_f16c();
}

/* Every feature ops_avx512.c is compiled for (AVX512_FLAGS in the Makefile). Zen 4/5 and
 * Intel since Ice Lake have them all; BF16 is left out of the check because the kernels do
 * not use BF16 instructions (the flag only lets the compiler know they exist). */
static int pdm__has_avx512(void)
{
    __builtin_cpu_init();
    return pdm__has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

static const pdm_kern_ops_t *pdm__supported[4];
static const pdm_kern_ops_t *pdm__chosen;
static pthread_once_t pdm__once = PTHREAD_ONCE_INIT;

static void pdm__select(void)
{
    int n = 0;
    if (pdm__has_avx512()) pdm__supported[n++] = &pdm_kern_ops_avx512;
    if (pdm__has_avx2()) pdm__supported[n++] = &pdm_kern_ops_avx2;
    pdm__supported[n++] = &pdm_kern_ops_generic;
    pdm__supported[n] = NULL;
    pdm__chosen = pdm__supported[0];

    const char *env = getenv("PDMESH_KERNELS");
    if (env && *env) {
        const pdm_kern_ops_t *want = NULL;
        for (int i = 0; pdm__supported[i]; i++)
            if (!strcmp(pdm__supported[i]->name, env)) want = pdm__supported[i];
        if (want) pdm__chosen = want;
        else
            fprintf(stderr, "pdmesh warn: PDMESH_KERNELS=%s is not available on this CPU; "
                            "using %s\n", env, pdm__chosen->name);
    }
}

const pdm_kern_ops_t *pdm_kern_ops_get(void)
{
    pthread_once(&pdm__once, pdm__select);
    return pdm__chosen;
}

const pdm_kern_ops_t *const *pdm_kern_ops_list(void)
{
    pthread_once(&pdm__once, pdm__select);
    return pdm__supported;
}

const pdm_kern_ops_t *pdm_kern_ops_find(const char *name)
{
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int i = 0; list[i]; i++)
        if (!strcmp(list[i]->name, name)) return list[i];
    return NULL;
}

#ifndef PDM_WITH_CUDA
/* CPU-only builds: the CUDA variant lives in kernels/cuda and is linked by `make cuda`. */
const pdm_kern_ops_t *pdm_kern_ops_cuda(char *why, size_t why_len)
{
    if (why && why_len) snprintf(why, why_len, "not built with CUDA (make cuda builds it)");
    return NULL;
}

void pdm_kern_cuda_release(void) {}
#endif
