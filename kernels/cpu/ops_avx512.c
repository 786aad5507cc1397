/*
 * ops_avx512.c - the x86 kernels (ops_x86.inc) built for AVX-512 F/BW/VL/DQ with VNNI and
 * BF16: the block dot products become vpdpbusd, and the compiler may use EVEX encodings, 32
 * vector registers and masked tails. Only reached after select.c has checked CPUID for
 * every feature in the build flags.
 */
#if !defined(__AVX512F__) || !defined(__AVX512VNNI__) || !defined(__AVX512VL__)
#error "ops_avx512.c needs the AVX-512 flags of the Makefile"
#endif
#define PDM_X86_OPS pdm_kern_ops_avx512
#define PDM_X86_NAME "avx512"
#include "ops_x86.inc"
