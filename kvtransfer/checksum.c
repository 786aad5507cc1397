/* checksum.c - KV block checksum, baseline x86-64 build, and the runtime choice. */
#include <stddef.h>
#include <stdint.h>

#include "kvtransfer/kvtransfer.h"

uint64_t pdm__kvt_checksum_base(uint64_t seed, const void *k, const void *v, size_t bytes);
uint64_t pdm__kvt_checksum_avx2(uint64_t seed, const void *k, const void *v, size_t bytes);

#define PDM__CK_FN pdm__kvt_checksum_base
#include "kvtransfer/checksum.inc"

uint64_t pdm_kvt_block_checksum(uint64_t request_id, const void *k, const void *v, size_t bytes)
{
#if defined(__x86_64__)
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0; /* idempotent race */
    if (avx2) return pdm__kvt_checksum_avx2(request_id, k, v, bytes);
#endif
    return pdm__kvt_checksum_base(request_id, k, v, bytes);
}

uint64_t pdm_kvt_block_checksum_generic(uint64_t request_id, const void *k, const void *v,
                                        size_t bytes)
{
    return pdm__kvt_checksum_base(request_id, k, v, bytes);
}
