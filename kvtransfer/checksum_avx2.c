/* checksum_avx2.c - KV block checksum built with -mavx2 (see checksum.inc). */
#include <stddef.h>
#include <stdint.h>

uint64_t pdm__kvt_checksum_avx2(uint64_t seed, const void *k, const void *v, size_t bytes);

#define PDM__CK_FN pdm__kvt_checksum_avx2
#include "kvtransfer/checksum.inc"
