/*
 * kvfile.h - KV files: a whole conversation's KV cache in f32, written by the ranks of a
 * group (each its own rows) and read back to compare methods with the single-process engine.
 *
 * Format: a 64-byte header "PDMKV001", u32 n_layers, n_kv_heads, head_dim, n_tokens
 * (little-endian), zeros; then for each layer, for each kv head: K [n_tokens][head_dim] f32,
 * then V.
 */
#ifndef PDM_PREFILL_KVFILE_H
#define PDM_PREFILL_KVFILE_H

#include <stdint.h>

#include "model/model.h"
#include "prefill_node/task.h"

/* Writes this rank's owned KV (all layers and heads, f32) at its positions into a KV file of
 * the whole conversation, creating it if needed; every rank of the group writes its own rows
 * into the same file. */
int pdm_prefill_rank_dump_kv(const pdm_prefill_rank_t *r, const char *path);

/* Reads a whole file; *data is [n_layers][n_kv_heads][2][n_tokens][head_dim] f32 (free()). */
int pdm_kvfile_read(const char *path, const pdm_model_hparams_t *hp, int32_t *n_tokens,
                    float **data);

#endif /* PDM_PREFILL_KVFILE_H */
