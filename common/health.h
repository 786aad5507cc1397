/*
 * health.h - a node daemon's health file: its liveness and readiness as a file that a probe
 * reads, for Kubernetes exec probes (`pdmesh health`) and pdmesh up's supervisor.
 *
 * The node link (common/nodelink.c) rewrites the file every second from its own thread. It
 * holds when the daemon's loop last asked for a message, so a compute step or a lock that
 * hangs shows as a growing `main_age_ms` even though the link still runs; a process that is
 * frozen (SIGSTOP, a stuck page fault) or gone stops rewriting it, so its `written_ms` ages.
 * `registered` is readiness: the node holds a registration with a router. A node that lost
 * its router stays live (it registers again by itself) but is not ready.
 *
 * One line of text, key=value, written to a temporary name and renamed: a reader never sees
 * half a file.
 */
#ifndef PDM_HEALTH_H
#define PDM_HEALTH_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    long pid;
    uint64_t written_ms;  /* wall clock (ms since the Unix epoch) of the write */
    uint64_t main_age_ms; /* since the daemon's loop last asked for a message */
    int registered;
    uint64_t epoch;
    char node_id[129];
} pdm_health_t;

/* Writes `h` to `path` atomically (path.tmp, then rename). */
int pdm_health_write(const char *path, const pdm_health_t *h);

/* Reads a health file: PDM_ENOTFOUND if absent, PDM_EINVAL if it is not one. */
int pdm_health_read(const char *path, pdm_health_t *out);

/* Judges a health record at wall-clock time now_ms: 0 if healthy, else 1 with the reason in
 * `why`. Unhealthy when the file is older than max_age_ms (the process is frozen or gone),
 * when the daemon's loop has not turned for stall_ms, or, with need_ready, when the node is
 * not registered. */
int pdm_health_judge(const pdm_health_t *h, uint64_t now_ms, uint64_t max_age_ms,
                     uint64_t stall_ms, int need_ready, char *why, size_t why_len);

/* Wall clock in ms since the Unix epoch. */
uint64_t pdm_health_now_ms(void);

#endif /* PDM_HEALTH_H */
