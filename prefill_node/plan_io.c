/*
 * plan_io.c - the planner's measured inputs on disk (plan_io.h): KVR partition tables
 * (KV-Runahead §4.2) and the calibration of compute and bandwidth (context parallelism §3.4),
 * as small JSON files. The planning itself is pure and lives in plan.c.
 */
#include "prefill_node/plan_io.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

/* Reads a whole small JSON file. */
static int pdm__json_load(const char *path, cJSON **out)
{
    char *buf;
    int st = pdm_file_read(path, 1u << 20, &buf, NULL);
    if (st) return st;
    cJSON *o = cJSON_Parse(buf);
    free(buf);
    if (!o) return pdm_error_set(PDM_EFORMAT, "%s: not valid JSON", path);
    *out = o;
    return PDM_OK;
}

static int pdm__json_save(const char *path, cJSON *o)
{
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    if (!s) return pdm_error_set(PDM_ENOMEM, "out of memory");
    FILE *f = fopen(path, "wb");
    int st = PDM_OK;
    if (!f || fputs(s, f) < 0 || fputc('\n', f) < 0)
        st = pdm_error_set(PDM_EIO, "%s: cannot write", path);
    if (f && fclose(f) && !st) st = pdm_error_set(PDM_EIO, "%s: cannot write", path);
    free(s);
    return st;
}

/* ---- Partition tables ------------------------------------------------------------------ */

int pdm_partition_table_load(const char *path, pdm_partition_table_t *t)
{
    cJSON *o;
    int st = pdm__json_load(path, &o);
    if (st) return st;
    memset(t, 0, sizeof(*t));
    const cJSON *ranks = cJSON_GetObjectItem(o, "ranks"), *entries = cJSON_GetObjectItem(o, "entries");
    if (!cJSON_IsNumber(ranks) || ranks->valueint < 1 || ranks->valueint > PDM_PREFILL_MAX_RANKS ||
        !cJSON_IsArray(entries)) {
        cJSON_Delete(o);
        return pdm_error_set(PDM_EFORMAT, "%s: a partition table needs \"ranks\" and "
                             "\"entries\"", path);
    }
    t->ranks = ranks->valueint;
    const cJSON *e;
    cJSON_ArrayForEach(e, entries)
    {
        const cJSON *len = cJSON_GetObjectItem(e, "length"), *ch = cJSON_GetObjectItem(e, "chunks");
        const cJSON *ttft = cJSON_GetObjectItem(e, "ttft");
        const cJSON *ttft_cp = cJSON_GetObjectItem(e, "ttft_cp_kv");
        int chunks[PDM_PREFILL_MAX_RANKS], n = 0, bad = !cJSON_IsNumber(len) || !cJSON_IsArray(ch) ||
                                                   cJSON_GetArraySize(ch) != t->ranks;
        long sum = 0;
        const cJSON *c;
        if (!bad) cJSON_ArrayForEach(c, ch)
            {
                if (!cJSON_IsNumber(c) || c->valueint < 1) bad = 1;
                else sum += (chunks[n++] = c->valueint);
            }
        if (bad || sum != len->valueint) {
            cJSON_Delete(o);
            return pdm_error_set(PDM_EFORMAT, "%s: entry %d is malformed (chunks must be %d "
                                 "positive sizes summing to length)", path, t->n_entries,
                                 t->ranks);
        }
        st = pdm_partition_table_put(t, len->valueint, chunks,
                                     cJSON_IsNumber(ttft) ? ttft->valuedouble : 0,
                                     cJSON_IsNumber(ttft_cp) ? ttft_cp->valuedouble : 0);
        if (st) break;
    }
    cJSON_Delete(o);
    return st;
}

int pdm_partition_table_save(const char *path, const pdm_partition_table_t *t)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "ranks", t->ranks);
    cJSON *arr = cJSON_AddArrayToObject(o, "entries");
    for (int i = 0; i < t->n_entries; i++) {
        int chunks[PDM_PREFILL_MAX_RANKS];
        /* the entry's own fractions, rounded as a lookup of its length rounds them */
        pdm_partition_table_lookup(t, t->entries[i].length, 1, chunks);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "length", t->entries[i].length);
        cJSON_AddItemToObject(e, "chunks", cJSON_CreateIntArray(chunks, t->ranks));
        cJSON_AddNumberToObject(e, "ttft", t->entries[i].ttft);
        if (t->entries[i].ttft_cp > 0)
            cJSON_AddNumberToObject(e, "ttft_cp_kv", t->entries[i].ttft_cp);
        cJSON_AddItemToArray(arr, e);
    }
    return pdm__json_save(path, o);
}

/* ---- Calibration ------------------------------------------------------------------------ */

int pdm_calibration_load(const char *path, pdm_calibration_t *c)
{
    cJSON *o;
    int st = pdm__json_load(path, &o);
    if (st) return st;
    const cJSON *f = cJSON_GetObjectItem(o, "flops"), *bw = cJSON_GetObjectItem(o, "bandwidth");
    const cJSON *lat = cJSON_GetObjectItem(o, "latency");
    memset(c, 0, sizeof(*c));
    if (!cJSON_IsNumber(f) || !cJSON_IsNumber(bw) || !(f->valuedouble > 0) ||
        !(bw->valuedouble > 0)) {
        cJSON_Delete(o);
        return pdm_error_set(PDM_EFORMAT, "%s: calibration needs positive \"flops\" and "
                             "\"bandwidth\" (run pdmesh calibrate)", path);
    }
    c->flops = f->valuedouble;
    c->bandwidth = bw->valuedouble;
    c->latency = cJSON_IsNumber(lat) ? lat->valuedouble : 0;
    cJSON_Delete(o);
    return PDM_OK;
}

int pdm_calibration_save(const char *path, const pdm_calibration_t *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "flops", c->flops);
    cJSON_AddNumberToObject(o, "bandwidth", c->bandwidth);
    cJSON_AddNumberToObject(o, "latency", c->latency);
    return pdm__json_save(path, o);
}
