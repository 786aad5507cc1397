/*
 * ops_avx2.c - the x86 kernels (ops_x86.inc) built for AVX2 + FMA + F16C. Compiled with
 * -mavx2 -mfma -mf16c; only reached after select.c has checked CPUID.
 */
#define PDM_X86_OPS pdm_kern_ops_avx2
#define PDM_X86_NAME "avx2"
#include "ops_x86.inc"
