/*
 * decode.h - the decode node: sequences whose prompt KV arrived from a prefill group, generated
 * together in one continuous batch.
 *
 * One decode step takes one token of every active sequence: the projections and the FFN run
 * as one batched matrix product over all of them, attention runs per sequence against its own
 * KV cache (ARCHITECTURE.md "Request lifecycle", step 4). Sequences join and leave between
 * steps.
 */
#ifndef PDM_DECODE_H
#define PDM_DECODE_H

#include <stdint.h>

#include "kvtransfer/kvtransfer.h"
#include "model/model.h"

/* ---- One batched step ------------------------------------------------------------------ */

typedef struct {
    pdm_kv_cache_t *cache; /* the sequence's KV; the token goes to slot cache->n_tokens */
    int32_t token;         /* input token of this step */
    float *logits;         /* out: [n_vocab] next-token logits */
} pdm_decode_seq_t;

/* Runs one decode step for `n` sequences (n <= the context's max batch; `act` holds at least
 * n rows). Appends each token's K/V to its cache (n_tokens grows by one). PDM_EOVERFLOW (and
 * nothing changed) if a cache is full. Equal to pdm_model_decode of each sequence alone. */
int pdm_decode_step(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_decode_seq_t *seqs, int n);

#endif /* PDM_DECODE_H */
