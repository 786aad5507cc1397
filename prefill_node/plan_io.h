/*
 * plan_io.h - the planner's measured inputs as JSON files: KVR partition tables written by
 * pdmesh partition-search (KV-Runahead §4.2) and the calibration written by pdmesh calibrate
 * (context parallelism §3.4). Kept apart from plan.h, whose functions do no I/O.
 *
 * On error the functions return a negative status with the message set (pdm_error_last):
 * -errno for a file that cannot be opened, PDM_EFORMAT for malformed contents, PDM_EIO for a
 * failed write. A failed load leaves the output zeroed or partly filled; do not use it.
 */
#ifndef PDM_PREFILL_PLAN_IO_H
#define PDM_PREFILL_PLAN_IO_H

#include "prefill_node/plan.h"

/* {"ranks": R, "entries": [{"length": n, "chunks": [R sizes summing to n], "ttft": s,
 * "ttft_cp_kv": s (optional)}, ...]} */
int pdm_partition_table_load(const char *path, pdm_partition_table_t *t);
int pdm_partition_table_save(const char *path, const pdm_partition_table_t *t);

/* {"flops": C, "bandwidth": BW, "latency": s}; flops and bandwidth must be positive. */
int pdm_calibration_load(const char *path, pdm_calibration_t *c);
int pdm_calibration_save(const char *path, const pdm_calibration_t *c);

#endif /* PDM_PREFILL_PLAN_IO_H */
