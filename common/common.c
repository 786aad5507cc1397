/*
 * common.c - status strings, thread-local error messages, logging, clocks, number and hex
 * parsing.
 */
#define _POSIX_C_SOURCE 200809L
#include "pdm.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>


const char *pdm_strerror(int status)
{
    switch (status) {
    case PDM_OK:
        return "success";
#define PDM__ERR_CASE(name, code, msg)                                                         \
    case code:                                                                                 \
        return msg;
        PDM_ERRNO_MAP(PDM__ERR_CASE)
#undef PDM__ERR_CASE
    default:
        break;
    }
    if (status < 0 && status > -4096) return strerror(-status);
    return status > 0 ? "in progress" : "unknown error";
}

static _Thread_local char pdm__err_msg[1024];
static _Thread_local int pdm__err_status;

int pdm_error_set(int status, const char *fmt, ...)
{
    /* Formatted apart first: callers wrap the last message ("%s", pdm_error_last()), and
     * vsnprintf must not read the buffer it writes. */
    char msg[sizeof(pdm__err_msg)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    memcpy(pdm__err_msg, msg, sizeof(msg));
    pdm__err_status = status;
    return status;
}

const char *pdm_error_last(void)
{
    if (pdm__err_msg[0]) return pdm__err_msg;
    return pdm_strerror(pdm__err_status);
}

void pdm_error_clear(void)
{
    pdm__err_msg[0] = '\0';
    pdm__err_status = 0;
}

static int pdm__log_level = -1;

static int pdm__log_level_get(void)
{
    if (pdm__log_level < 0) {
        const char *env = getenv("PDMESH_LOG");
        int level = PDM_LOG_WARN;
        if (env) {
            if (!strcasecmp(env, "error")) level = PDM_LOG_ERROR;
            else if (!strcasecmp(env, "info")) level = PDM_LOG_INFO;
            else if (!strcasecmp(env, "debug")) level = PDM_LOG_DEBUG;
        }
        pdm__log_level = level;
    }
    return pdm__log_level;
}

void pdm_log_set_level(pdm_log_level_t level) { pdm__log_level = (int)level; }

int pdm_log_enabled(pdm_log_level_t level) { return (int)level <= pdm__log_level_get(); }

void pdm_log(pdm_log_level_t level, const char *fmt, ...)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    if (!pdm_log_enabled(level)) return;
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    /* One write per line so that lines from several processes do not interleave. */
    fprintf(stderr, "pdmesh %s: %s\n", names[level], line);
}

double pdm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int pdm_parse_long(const char *s, long min, long max, long *out)
{
    if (!s || !*s) return PDM_EINVAL;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*end != '\0') return PDM_EINVAL;
    if (errno == ERANGE || v < min || v > max) return PDM_ERANGE;
    *out = v;
    return PDM_OK;
}

int pdm_parse_double(const char *s, double min, double max, double *out)
{
    if (!s || !*s) return PDM_EINVAL;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (*end != '\0' || isnan(v)) return PDM_EINVAL;
    if (errno == ERANGE || v < min || v > max) return PDM_ERANGE;
    *out = v;
    return PDM_OK;
}

char *pdm_hex_encode(const void *data, size_t len)
{
    static const char digits[] = "0123456789abcdef";
    char *s = malloc(2 * len + 1);
    if (!s) return NULL;
    for (size_t i = 0; i < len; i++) {
        s[2 * i] = digits[((const uint8_t *)data)[i] >> 4];
        s[2 * i + 1] = digits[((const uint8_t *)data)[i] & 15];
    }
    s[2 * len] = 0;
    return s;
}

static int pdm__hex_digit(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int pdm_hex_decode(const char *s, uint8_t **out, size_t *len)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n % 2) return PDM_EFORMAT;
    uint8_t *b = malloc(n / 2);
    if (!b) return PDM_ENOMEM;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = pdm__hex_digit(s[2 * i]), lo = pdm__hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            free(b);
            return PDM_EFORMAT;
        }
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    *out = b;
    *len = n / 2;
    return PDM_OK;
}

void pdm_feat_format(uint64_t features, char *buf, size_t cap)
{
    static const char *const names[] = {"ordered_group", "delta_kv"};
    size_t used = 0;
    if (!cap) return;
    buf[0] = 0;
    if (!features) {
        snprintf(buf, cap, "none");
        return;
    }
    for (unsigned bit = 0; bit < 64 && used + 1 < cap; bit++) {
        if (!(features >> bit & 1)) continue;
        char unknown[16];
        const char *name = names[PDM_MIN(bit, PDM_ARRAY_SIZE(names) - 1)];
        if (bit >= PDM_ARRAY_SIZE(names)) {
            snprintf(unknown, sizeof(unknown), "bit%u", bit);
            name = unknown;
        }
        const int n = snprintf(buf + used, cap - used, "%s%s", used ? "," : "", name);
        if (n < 0) break;
        used = PDM_MIN(used + (size_t)n, cap - 1);
    }
}
