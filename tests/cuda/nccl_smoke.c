/*
 * nccl_smoke.c - the NCCL group transport on one process and one device: a unique id, a
 * one-rank communicator, and a clean teardown. Skips (exit 0, with a message) when no CUDA
 * device is present, which is the case on CI and development machines without GPUs.
 */
#include <stdio.h>

#include "common/pdm.h"
#include "kvtransfer/kvtransfer.h"

int main(void)
{
    uint8_t id[PDM_KVT_NCCL_ID_BYTES];
    if (pdm_kvt_nccl_unique_id(id)) {
        printf("nccl smoke: skipped: %s\n", pdm_error_last());
        return 0;
    }
    pdm_kvt_nccl_t *c;
    int st = pdm_kvt_nccl_create(id, 0, 1, 0, 10.0, &c);
    if (st == PDM_EUNSUPPORTED) {
        printf("nccl smoke: skipped: no CUDA device (%s)\n", pdm_error_last());
        return 0;
    }
    if (st) {
        printf("nccl smoke: FAILED: %s\n", pdm_error_last());
        return 1;
    }
    pdm_kvt_nccl_destroy(c);
    printf("nccl smoke: passed\n");
    return 0;
}
