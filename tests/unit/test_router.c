/*
 * test_router.c - the router's Prometheus registry (router/metrics.c). The router itself is
 * tested with real processes in tests/integration/run.sh.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/metrics.h"
#include "tests.h"

START_TEST(test_metrics_render)
{
    pdm_metrics_t *m = pdm_metrics_create();
    ck_assert_ptr_nonnull(m);
    static const double b[] = {0.1, 1};
    pdm_metric_t *c = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_requests_total", "Requests.",
                                      "outcome", NULL, 0);
    pdm_metric_t *g = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth", "Queue.", NULL,
                                      NULL, 0);
    pdm_metric_t *h = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_ttft_seconds", "TTFT.",
                                      NULL, b, 2);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(g);
    ck_assert_ptr_nonnull(h);
    /* bad registrations */
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth", "dup", NULL, NULL, 0));
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_GAUGE, "bad name", "x", NULL, NULL, 0));
    static const double nb[] = {1, 0.5};
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "h2", "x", NULL, nb, 2));
    pdm_metric_inc(c, "ok", 2);
    pdm_metric_inc(c, "ok", 1);
    pdm_metric_inc(c, "err\"x", 1);
    pdm_metric_inc(c, "ok", -5); /* counters never go down */
    pdm_metric_set(g, NULL, 7);
    pdm_metric_observe(h, NULL, 0.05);
    pdm_metric_observe(h, NULL, 0.5);
    pdm_metric_observe(h, NULL, 5);
    size_t len;
    char *t = pdm_metrics_render(m, &len);
    ck_assert_ptr_nonnull(t);
    ck_assert_uint_eq(len, strlen(t));
    ck_assert_ptr_nonnull(strstr(t, "# TYPE pdmesh_requests_total counter\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_requests_total{outcome=\"ok\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_requests_total{outcome=\"err\\\"x\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_queue_depth 7\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"0.10000000000000001\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"1\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"+Inf\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_count 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_sum 5.5499999999999998\n"));
    free(t);
    pdm_metrics_free(m);
}
END_TEST

START_TEST(test_metrics_series_bound)
{
    pdm_metrics_t *m = pdm_metrics_create();
    pdm_metric_t *c = pdm_metrics_add(m, PDM_METRIC_COUNTER, "x_total", "x", "node", NULL, 0);
    char name[32];
    for (int i = 0; i < 3 * PDM_METRICS_MAX_SERIES; i++) {
        snprintf(name, sizeof(name), "n%d", i);
        pdm_metric_inc(c, name, 1);
    }
    char *t = pdm_metrics_render(m, NULL);
    ck_assert_ptr_nonnull(strstr(t, "x_total{node=\"other\"} "));
    size_t lines = 0;
    for (char *p = t; *p; p++) lines += *p == '\n';
    ck_assert_uint_le(lines, PDM_METRICS_MAX_SERIES + 3);
    free(t);
    pdm_metrics_free(m);
}
END_TEST

Suite *suite_router(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("metrics");
    tcase_add_test(tc, test_metrics_render);
    tcase_add_test(tc, test_metrics_series_bound);
    suite_add_tcase(s, tc);
    return s;
}
