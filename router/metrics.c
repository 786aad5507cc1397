/*
 * metrics.c - the router's Prometheus registry and its text exposition (format 0.0.4).
 */
#include "router/metrics.h"

#include <math.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PDM__MAX_METRICS 64
#define PDM__MAX_BUCKETS 32

typedef struct {
    char label[96];
    double value;                          /* counter, gauge; histogram: sum */
    uint64_t count;                        /* histogram */
    uint64_t buckets[PDM__MAX_BUCKETS];    /* histogram: cumulative at render time */
} pdm__series_t;

struct pdm_metric {
    pdm_metric_kind_t kind;
    char name[96], help[256], label_name[48];
    double bounds[PDM__MAX_BUCKETS];
    size_t n_bounds;
    pdm__series_t series[PDM_METRICS_MAX_SERIES + 1]; /* + "other" */
    size_t n_series;
};

struct pdm_metrics {
    pdm_metric_t *m[PDM__MAX_METRICS];
    size_t n;
};

pdm_metrics_t *pdm_metrics_create(void) { return calloc(1, sizeof(pdm_metrics_t)); }

void pdm_metrics_free(pdm_metrics_t *m)
{
    if (!m) return;
    for (size_t i = 0; i < m->n; i++) free(m->m[i]);
    free(m);
}

static int pdm__name_ok(const char *s)
{
    if (!s || !*s || strlen(s) >= 96) return 0;
    for (const char *p = s; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' || *p == ':' ||
              (p != s && *p >= '0' && *p <= '9')))
            return 0;
    return 1;
}

pdm_metric_t *pdm_metrics_add(pdm_metrics_t *m, pdm_metric_kind_t kind, const char *name,
                              const char *help, const char *label_name, const double *buckets,
                              size_t n_buckets)
{
    if (!m || m->n == PDM__MAX_METRICS || !pdm__name_ok(name) ||
        (label_name && (!pdm__name_ok(label_name) || strlen(label_name) >= 48)))
        return NULL;
    if (kind == PDM_METRIC_HISTOGRAM) {
        if (!buckets || n_buckets < 1 || n_buckets > PDM__MAX_BUCKETS) return NULL;
        for (size_t i = 1; i < n_buckets; i++)
            if (!(buckets[i] > buckets[i - 1])) return NULL;
    }
    for (size_t i = 0; i < m->n; i++)
        if (!strcmp(m->m[i]->name, name)) return NULL;
    pdm_metric_t *x = calloc(1, sizeof(*x));
    if (!x) return NULL;
    x->kind = kind;
    snprintf(x->name, sizeof(x->name), "%s", name);
    snprintf(x->help, sizeof(x->help), "%s", help ? help : "");
    if (label_name) snprintf(x->label_name, sizeof(x->label_name), "%s", label_name);
    if (kind == PDM_METRIC_HISTOGRAM) {
        memcpy(x->bounds, buckets, sizeof(double) * n_buckets);
        x->n_bounds = n_buckets;
    }
    m->m[m->n++] = x;
    return x;
}

static pdm__series_t *pdm__series(pdm_metric_t *x, const char *label)
{
    if (!x) return NULL;
    if (!x->label_name[0]) label = "";
    if (!label) label = "";
    for (size_t i = 0; i < x->n_series; i++)
        if (!strncmp(x->series[i].label, label, sizeof(x->series[i].label) - 1)) return &x->series[i];
    if (x->n_series >= PDM_METRICS_MAX_SERIES) label = "other";
    for (size_t i = 0; i < x->n_series; i++)
        if (!strcmp(x->series[i].label, label)) return &x->series[i];
    if (x->n_series > PDM_METRICS_MAX_SERIES) return NULL; /* cannot happen: "other" exists */
    pdm__series_t *s = &x->series[x->n_series++];
    snprintf(s->label, sizeof(s->label), "%s", label);
    return s;
}

void pdm_metric_inc(pdm_metric_t *x, const char *label_value, double by)
{
    if (!x || x->kind == PDM_METRIC_HISTOGRAM || !isfinite(by)) return;
    if (x->kind == PDM_METRIC_COUNTER && by < 0) return;
    pdm__series_t *s = pdm__series(x, label_value);
    if (s) s->value += by;
}

void pdm_metric_set(pdm_metric_t *x, const char *label_value, double v)
{
    if (!x || x->kind != PDM_METRIC_GAUGE) return;
    pdm__series_t *s = pdm__series(x, label_value);
    if (s) s->value = v;
}

void pdm_metric_observe(pdm_metric_t *x, const char *label_value, double v)
{
    if (!x || x->kind != PDM_METRIC_HISTOGRAM || !isfinite(v)) return;
    pdm__series_t *s = pdm__series(x, label_value);
    if (!s) return;
    s->value += v;
    s->count++;
    for (size_t i = 0; i < x->n_bounds; i++)
        if (v <= x->bounds[i]) s->buckets[i]++;
}

typedef struct {
    char *buf;
    size_t len, cap;
    int oom;
} pdm__sb_t;

static void pdm__sb(pdm__sb_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void pdm__sb(pdm__sb_t *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *nb = realloc(b->buf, cap);
        if (!nb) {
            b->oom = 1;
            return;
        }
        b->buf = nb;
        b->cap = cap;
    }
}

/* Label values are escaped (\\, \", \n) as the exposition format requires. */
static void pdm__label(pdm__sb_t *b, const pdm_metric_t *x, const pdm__series_t *s,
                       const char *extra)
{
    if (!x->label_name[0] && !extra) return;
    pdm__sb(b, "{");
    if (x->label_name[0]) {
        pdm__sb(b, "%s=\"", x->label_name);
        for (const char *p = s->label; *p; p++) {
            if (*p == '\\') pdm__sb(b, "\\\\");
            else if (*p == '"') pdm__sb(b, "\\\"");
            else if (*p == '\n') pdm__sb(b, "\\n");
            else pdm__sb(b, "%c", *p);
        }
        pdm__sb(b, "\"%s", extra ? "," : "");
    }
    if (extra) pdm__sb(b, "%s", extra);
    pdm__sb(b, "}");
}

static void pdm__num(pdm__sb_t *b, double v)
{
    if (isinf(v)) pdm__sb(b, v > 0 ? "+Inf" : "-Inf");
    else if (isnan(v)) pdm__sb(b, "NaN");
    else pdm__sb(b, "%.17g", v);
}

char *pdm_metrics_render(const pdm_metrics_t *m, size_t *len)
{
    pdm__sb_t b = {malloc(4096), 0, 4096, 0};
    if (!b.buf) return NULL;
    b.buf[0] = 0;
    for (size_t i = 0; m && i < m->n; i++) {
        const pdm_metric_t *x = m->m[i];
        static const char *kinds[] = {"counter", "gauge", "histogram"};
        pdm__sb(&b, "# HELP %s %s\n# TYPE %s %s\n", x->name, x->help, x->name, kinds[x->kind]);
        for (size_t k = 0; k < x->n_series; k++) {
            const pdm__series_t *s = &x->series[k];
            if (x->kind != PDM_METRIC_HISTOGRAM) {
                pdm__sb(&b, "%s", x->name);
                pdm__label(&b, x, s, NULL);
                pdm__sb(&b, " ");
                pdm__num(&b, s->value);
                pdm__sb(&b, "\n");
                continue;
            }
            for (size_t j = 0; j <= x->n_bounds; j++) {
                char le[64];
                if (j < x->n_bounds) snprintf(le, sizeof(le), "le=\"%.17g\"", x->bounds[j]);
                else snprintf(le, sizeof(le), "le=\"+Inf\"");
                pdm__sb(&b, "%s_bucket", x->name);
                pdm__label(&b, x, s, le);
                pdm__sb(&b, " %llu\n",
                        (unsigned long long)(j < x->n_bounds ? s->buckets[j] : s->count));
            }
            pdm__sb(&b, "%s_sum", x->name);
            pdm__label(&b, x, s, NULL);
            pdm__sb(&b, " ");
            pdm__num(&b, s->value);
            pdm__sb(&b, "\n%s_count", x->name);
            pdm__label(&b, x, s, NULL);
            pdm__sb(&b, " %llu\n", (unsigned long long)s->count);
        }
    }
    if (b.oom) {
        free(b.buf);
        return NULL;
    }
    if (len) *len = b.len;
    return b.buf;
}
