/*
 * health.c - the node health file (see common/health.h).
 */
#include "common/health.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/pdm.h"

uint64_t pdm_health_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int pdm_health_write(const char *path, const pdm_health_t *h)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return pdm_error_set(PDM_EINVAL, "health file name too long");
    FILE *f = fopen(tmp, "w");
    if (!f) return pdm_error_set(PDM_EIO, "cannot write the health file %s: %s", tmp, strerror(errno));
    int ok = fprintf(f, "pid=%ld written_ms=%" PRIu64 " main_age_ms=%" PRIu64
                        " registered=%d epoch=%" PRIu64 " node=%s\n",
                     h->pid, h->written_ms, h->main_age_ms, h->registered ? 1 : 0, h->epoch,
                     h->node_id[0] ? h->node_id : "-") > 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return pdm_error_set(PDM_EIO, "cannot write the health file %s: %s", path, strerror(e));
    }
    return PDM_OK;
}

int pdm_health_read(const char *path, pdm_health_t *out)
{
    memset(out, 0, sizeof(*out));
    FILE *f = fopen(path, "r");
    if (!f) return pdm_error_set(PDM_ENOTFOUND, "%s: %s", path, strerror(errno));
    char line[512];
    int got = fgets(line, sizeof(line), f) != NULL;
    fclose(f);
    int reg = 0;
    if (!got || sscanf(line, "pid=%ld written_ms=%" SCNu64 " main_age_ms=%" SCNu64
                             " registered=%d epoch=%" SCNu64 " node=%128s",
                       &out->pid, &out->written_ms, &out->main_age_ms, &reg, &out->epoch,
                       out->node_id) != 6)
        return pdm_error_set(PDM_EINVAL, "%s: not a pdmesh health file", path);
    out->registered = reg != 0;
    return PDM_OK;
}

int pdm_health_judge(const pdm_health_t *h, uint64_t now_ms, uint64_t max_age_ms,
                     uint64_t stall_ms, int need_ready, char *why, size_t why_len)
{
    uint64_t age = now_ms > h->written_ms ? now_ms - h->written_ms : 0;
    if (age > max_age_ms) {
        snprintf(why, why_len, "node %s (pid %ld): no health report for %.1f s (frozen or gone)",
                 h->node_id, h->pid, age / 1000.0);
        return 1;
    }
    if (h->main_age_ms > stall_ms) {
        snprintf(why, why_len, "node %s (pid %ld): its loop has not turned for %.1f s",
                 h->node_id, h->pid, h->main_age_ms / 1000.0);
        return 1;
    }
    if (need_ready && !h->registered) {
        snprintf(why, why_len, "node %s (pid %ld): not registered with a router", h->node_id,
                 h->pid);
        return 1;
    }
    snprintf(why, why_len, "node %s (pid %ld): %s, epoch %" PRIu64 ", loop %.1f s ago, report %.1f s ago",
             h->node_id, h->pid, h->registered ? "registered" : "not registered", h->epoch,
             h->main_age_ms / 1000.0, age / 1000.0);
    return 0;
}
