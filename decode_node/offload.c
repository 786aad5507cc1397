/*
 * offload.c - head-wise KV offload (HeadInfer §3-4, Alg. 1; App. A.3 for the memory plan):
 * two tiers, per-(layer, kv head) placement, attention over head groups with a ping-pong
 * buffer in the fast tier filled by a copy worker.
 *
 * Pipeline of one store (all its offloaded head groups, layer by layer, one "visit" per group
 * and decode step; visit v uses half v % 2 of the ping-pong buffer):
 *
 *   visit v (group g of layer l, token at slot n):
 *     - if half v%2 does not already hold g with n rows: submit its prefetch (pipeline start)
 *     - submit the prefetch of visit v+1 (the next group; after the last group of the step,
 *       group 0 with n+1 rows, for the next step) into the other half: visit v-1, which read
 *       that half, has finished computing (Alg. 1 line 25, "async prefetch next KV")
 *     - wait for half v%2 (bounded), store the new K/V row into it, attention of g's heads
 *     - submit the write-back of row n of g's heads to the slow tier (line 26, "async update")
 *
 * The worker runs jobs in submission order, so a write-back of row n always lands before the
 * prefetch that reads it, and a half is never overwritten before the write-back out of it.
 */
#include "decode_node/offload.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/pdm.h"

#define PDM__ALIGN 64
static size_t pdm__round(size_t x) { return (x + PDM__ALIGN - 1) & ~(size_t)(PDM__ALIGN - 1); }

/* ---- Tiers ------------------------------------------------------------------------------ */

struct pdm_kvtier {
    const pdm_kvtier_ops_t *ops;
    char dir[512]; /* file tier: where the files go */
    pthread_mutex_t lock;
    pdm_kvtier_stats_t st;
};

static void pdm__memcpy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }

static int pdm__ram_alloc(pdm_kvtier_t *t, size_t bytes, void **out)
{
    (void)t;
    void *p = aligned_alloc(PDM__ALIGN, pdm__round(bytes ? bytes : 1));
    if (!p) return pdm_error_set(PDM_ENOMEM, "KV tier ram: cannot allocate %zu bytes", bytes);
    *out = p;
    return PDM_OK;
}

static void pdm__ram_release(pdm_kvtier_t *t, void *p, size_t bytes)
{
    (void)t;
    (void)bytes;
    free(p);
}

/* One unlinked file per allocation, mapped shared: the pages live in the page cache and can be
 * written out to the disk under memory pressure, which is what lets the slow tier exceed RAM. */
static int pdm__file_alloc(pdm_kvtier_t *t, size_t bytes, void **out)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/pdmesh-kv-XXXXXX", t->dir);
    int fd = mkstemp(path);
    if (fd < 0)
        return pdm_error_set(PDM_EIO, "KV tier file: cannot create a file in %s: %s", t->dir,
                             strerror(errno));
    unlink(path);
    size_t len = bytes ? bytes : 1;
    if (ftruncate(fd, (off_t)len) != 0) {
        int e = errno;
        close(fd);
        return pdm_error_set(PDM_EIO, "KV tier file: cannot size %zu bytes in %s: %s", len,
                             t->dir, strerror(e));
    }
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return pdm_error_set(PDM_EIO, "KV tier file: cannot map %zu bytes in %s: %s", len,
                             t->dir, strerror(e));
    *out = p;
    return PDM_OK;
}

static void pdm__file_release(pdm_kvtier_t *t, void *p, size_t bytes)
{
    (void)t;
    munmap(p, bytes ? bytes : 1);
}

static const pdm_kvtier_ops_t pdm__ram_ops = {"ram", pdm__ram_alloc, pdm__ram_release,
                                              pdm__memcpy};
static const pdm_kvtier_ops_t pdm__file_ops = {"file", pdm__file_alloc, pdm__file_release,
                                               pdm__memcpy};

int pdm_kvtier_create(const char *spec, int64_t budget, pdm_kvtier_t **out)
{
    if (!spec || budget < 0)
        return pdm_error_set(PDM_EINVAL, "KV tier: missing spec or negative budget");
    const pdm_kvtier_ops_t *ops = NULL;
    const char *dir = NULL;
    if (!strcmp(spec, "ram")) ops = &pdm__ram_ops;
    else if (!strncmp(spec, "file:", 5) && spec[5]) {
        ops = &pdm__file_ops;
        dir = spec + 5;
        if (access(dir, W_OK) != 0)
            return pdm_error_set(PDM_EINVAL, "KV tier: '%s' is not a writable directory", dir);
    } else {
        return pdm_error_set(PDM_EINVAL, "KV tier: '%s' is not ram or file:DIR", spec);
    }
    pdm_kvtier_t *t = calloc(1, sizeof(*t));
    if (!t) return pdm_error_set(PDM_ENOMEM, "KV tier: out of memory");
    t->ops = ops;
    if (dir) snprintf(t->dir, sizeof(t->dir), "%s", dir);
    pthread_mutex_init(&t->lock, NULL);
    t->st.budget = budget;
    *out = t;
    return PDM_OK;
}

int pdm_kvtier_create_ops(const pdm_kvtier_ops_t *ops, int64_t budget, pdm_kvtier_t **out)
{
    if (!ops || !ops->alloc || !ops->release || !ops->copy || budget < 0)
        return pdm_error_set(PDM_EINVAL, "KV tier: incomplete backend");
    pdm_kvtier_t *t = calloc(1, sizeof(*t));
    if (!t) return pdm_error_set(PDM_ENOMEM, "KV tier: out of memory");
    t->ops = ops;
    pthread_mutex_init(&t->lock, NULL);
    t->st.budget = budget;
    *out = t;
    return PDM_OK;
}

void pdm_kvtier_destroy(pdm_kvtier_t *t)
{
    if (!t) return;
    pthread_mutex_destroy(&t->lock);
    free(t);
}

int pdm_kvtier_alloc(pdm_kvtier_t *t, size_t bytes, void **out)
{
    pthread_mutex_lock(&t->lock);
    if (t->st.budget > 0 && t->st.used + (int64_t)bytes > t->st.budget) {
        t->st.refused++;
        int64_t used = t->st.used, budget = t->st.budget;
        pthread_mutex_unlock(&t->lock);
        return pdm_error_set(PDM_EOVERFLOW, "KV tier %s: %zu bytes do not fit the budget "
                             "(%lld of %lld bytes used)", t->ops->name, bytes, (long long)used,
                             (long long)budget);
    }
    t->st.used += (int64_t)bytes; /* reserved before the allocation: the peak never lags */
    pthread_mutex_unlock(&t->lock);
    int st = t->ops->alloc(t, bytes, out);
    pthread_mutex_lock(&t->lock);
    if (st) t->st.used -= (int64_t)bytes;
    else {
        t->st.allocs++;
        if (t->st.used > t->st.peak) t->st.peak = t->st.used;
    }
    pthread_mutex_unlock(&t->lock);
    return st;
}

void pdm_kvtier_free(pdm_kvtier_t *t, void *p, size_t bytes)
{
    if (!p) return;
    t->ops->release(t, p, bytes);
    pthread_mutex_lock(&t->lock);
    t->st.used -= (int64_t)bytes;
    pthread_mutex_unlock(&t->lock);
}

void pdm_kvtier_stats(const pdm_kvtier_t *t, pdm_kvtier_stats_t *st)
{
    pthread_mutex_lock((pthread_mutex_t *)&t->lock);
    *st = t->st;
    pthread_mutex_unlock((pthread_mutex_t *)&t->lock);
}

const char *pdm_kvtier_name(const pdm_kvtier_t *t) { return t->ops->name; }

/* ---- Policy -------------------------------------------------------------------------------- */

void pdm_kvoff_params_default(pdm_kvoff_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->fast_budget = 0;
    p->slow_tier = "ram";
    /* Measured with bench/decode-memory (docs/decode-memory.md, "Choosing the group size"):
     * below 8K tokens a group of all heads of a layer keeps the per-group overhead (a wait, a
     * job, a pool dispatch) small against the attention itself; at 8K-32K two heads; from
     * 32K on one head costs no more per token than larger groups and needs the least fast
     * memory. */
    p->group_ctx[0] = 8192;
    p->group_size[0] = 0;
    p->group_ctx[1] = 32768;
    p->group_size[1] = 2;
    p->n_steps = 2;
    p->wait_timeout = 30;
    p->resident_share = 0.5;
}

int pdm_kvoff_parse_groups(const char *s, pdm_kvoff_params_t *p)
{
    int n = 0;
    const char *c = s;
    while (c && *c) {
        char *end;
        long ctx = strtol(c, &end, 10);
        if (end == c || *end != ':' || ctx < 1 || ctx > (1L << 30)) goto bad;
        c = end + 1;
        long g = strtol(c, &end, 10);
        if (end == c || g < 0 || g > PDM_MAX_KV_HEADS || n == PDM_KVOFF_MAX_STEPS) goto bad;
        if (n > 0 && ctx <= p->group_ctx[n - 1]) goto bad;
        p->group_ctx[n] = (int32_t)ctx;
        p->group_size[n] = (int32_t)g;
        n++;
        if (*end == ',') c = end + 1;
        else if (*end == 0) c = end;
        else goto bad;
    }
    p->n_steps = n;
    return PDM_OK;
bad:
    return pdm_error_set(PDM_EINVAL, "KV offload: bad group steps '%s' (CTX:G,CTX:G,... with "
                         "increasing CTX, G = 0 for all heads)", s);
}

int pdm_kvoff_group_for(const pdm_kvoff_params_t *p, int32_t capacity, uint32_t n_kv_heads)
{
    int g = 1;
    if (p->force_group > 0) g = p->force_group;
    else
        for (int i = 0; i < p->n_steps; i++)
            if (capacity <= p->group_ctx[i]) {
                g = p->group_size[i] > 0 ? p->group_size[i] : (int)n_kv_heads;
                break;
            }
    return PDM_MAX(1, PDM_MIN(g, (int)n_kv_heads));
}

/* ---- Copy worker ----------------------------------------------------------------------- */

typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
} pdm__copy_t;

typedef struct {
    int n;
    pdm__copy_t cp[2 * PDM_MAX_KV_HEADS];
} pdm__job_t;

#define PDM__RING 8 /* jobs in flight: a bound on the queue */

struct pdm_kvoff_engine {
    pdm_kvoff_params_t p;
    char slow_spec[600];
    pdm_kvtier_t *fast, *slow;
    pthread_t worker;
    int started;
    pthread_mutex_t lock;
    pthread_cond_t work, done_cv;
    pdm__job_t ring[PDM__RING];
    uint64_t submitted, done; /* job ids are 1, 2, ...: job i is done iff done >= i */
    int stop;
    pdm_kvoff_stats_t st;      /* counters; tier stats are filled on request */
    int64_t live_stores;
};

static void *pdm__worker_main(void *arg)
{
    pdm_kvoff_engine_t *e = arg;
    pthread_mutex_lock(&e->lock);
    for (;;) {
        while (!e->stop && e->done == e->submitted) pthread_cond_wait(&e->work, &e->lock);
        if (e->done == e->submitted) break; /* stop, and nothing left */
        pdm__job_t *j = &e->ring[e->done % PDM__RING];
        pthread_mutex_unlock(&e->lock);
        for (int i = 0; i < j->n; i++) e->fast->ops->copy(j->cp[i].dst, j->cp[i].src, j->cp[i].bytes);
        pthread_mutex_lock(&e->lock);
        e->done++;
        pthread_cond_broadcast(&e->done_cv);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

static void pdm__deadline(struct timespec *ts, double seconds)
{
    clock_gettime(CLOCK_REALTIME, ts);
    double s = (double)ts->tv_sec + ts->tv_nsec * 1e-9 + seconds;
    ts->tv_sec = (time_t)s;
    ts->tv_nsec = (long)((s - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Queues a job (waiting, bounded, for room in the ring); *id is its id. */
static int pdm__submit(pdm_kvoff_engine_t *e, const pdm__job_t *j, uint64_t *id)
{
    struct timespec ts;
    pdm__deadline(&ts, e->p.wait_timeout);
    pthread_mutex_lock(&e->lock);
    while (e->submitted - e->done >= PDM__RING) {
        if (pthread_cond_timedwait(&e->done_cv, &e->lock, &ts) == ETIMEDOUT &&
            e->submitted - e->done >= PDM__RING) {
            pthread_mutex_unlock(&e->lock);
            return pdm_error_set(PDM_ETIMEOUT, "KV offload: the copy worker did not take a job "
                                 "within %.1f s", e->p.wait_timeout);
        }
    }
    pdm__job_t *slot = &e->ring[e->submitted % PDM__RING];
    slot->n = j->n;
    memcpy(slot->cp, j->cp, sizeof(pdm__copy_t) * (size_t)j->n);
    *id = ++e->submitted;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->lock);
    return PDM_OK;
}

/* Waits (bounded) until job `id` is done; `count` says whether to count it as a prefetch wait. */
static int pdm__wait(pdm_kvoff_engine_t *e, uint64_t id, int count)
{
    pthread_mutex_lock(&e->lock);
    if (e->done >= id) {
        pthread_mutex_unlock(&e->lock);
        return PDM_OK;
    }
    double t0 = pdm_now();
    struct timespec ts;
    pdm__deadline(&ts, e->p.wait_timeout);
    int st = PDM_OK;
    while (e->done < id) {
        if (pthread_cond_timedwait(&e->done_cv, &e->lock, &ts) == ETIMEDOUT && e->done < id) {
            st = PDM_ETIMEOUT;
            break;
        }
    }
    if (count) {
        e->st.prefetch_waits++;
        e->st.wait_seconds += pdm_now() - t0;
    }
    pthread_mutex_unlock(&e->lock);
    if (st)
        return pdm_error_set(PDM_ETIMEOUT, "KV offload: a copy did not finish within %.1f s",
                             e->p.wait_timeout);
    return PDM_OK;
}

int pdm_kvoff_engine_create(const pdm_kvoff_params_t *p, pdm_kvoff_engine_t **out)
{
    if (p->fast_budget <= 0 || !(p->wait_timeout > 0) || p->n_steps < 0 ||
        p->n_steps > PDM_KVOFF_MAX_STEPS || p->force_group < 0)
        return pdm_error_set(PDM_EINVAL, "KV offload: the fast budget must be > 0 bytes and the "
                             "timeout > 0");
    pdm_kvoff_engine_t *e = calloc(1, sizeof(*e));
    if (!e) return pdm_error_set(PDM_ENOMEM, "KV offload: out of memory");
    e->p = *p;
    snprintf(e->slow_spec, sizeof(e->slow_spec), "%s", p->slow_tier ? p->slow_tier : "ram");
    e->p.slow_tier = e->slow_spec;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    int st = pdm_kvtier_create("ram", p->fast_budget, &e->fast);
    if (!st) st = pdm_kvtier_create(e->slow_spec, 0, &e->slow);
    if (!st && pthread_create(&e->worker, NULL, pdm__worker_main, e) != 0)
        st = pdm_error_set(PDM_ENOMEM, "KV offload: cannot start the copy worker");
    if (st) {
        pdm_kvoff_engine_destroy(e);
        return st;
    }
    e->started = 1;
    *out = e;
    return PDM_OK;
}

void pdm_kvoff_engine_destroy(pdm_kvoff_engine_t *e)
{
    if (!e) return;
    if (e->started) {
        pthread_mutex_lock(&e->lock);
        e->stop = 1;
        pthread_cond_signal(&e->work);
        pthread_mutex_unlock(&e->lock);
        /* The worker finishes the queued copies (memcpy only), then exits. */
        struct timespec ts;
        pdm__deadline(&ts, e->p.wait_timeout);
        if (pthread_timedjoin_np(e->worker, NULL, &ts) != 0) {
            fprintf(stderr, "pdmesh: KV offload: the copy worker did not stop within %.1f s; "
                    "leaking it\n", e->p.wait_timeout);
            pthread_detach(e->worker);
            return; /* the worker may still touch the engine: leaking is safe, freeing is not */
        }
    }
    pdm_kvtier_destroy(e->fast);
    pdm_kvtier_destroy(e->slow);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

void pdm_kvoff_engine_stats(pdm_kvoff_engine_t *e, pdm_kvoff_stats_t *st)
{
    pthread_mutex_lock(&e->lock);
    *st = e->st;
    pthread_mutex_unlock(&e->lock);
    pdm_kvtier_stats(e->fast, &st->fast);
    pdm_kvtier_stats(e->slow, &st->slow);
}

const pdm_kvoff_params_t *pdm_kvoff_engine_params(const pdm_kvoff_engine_t *e) { return &e->p; }

/* ---- Stores -------------------------------------------------------------------------------- */

typedef struct {
    int layer, h0, h1; /* kv heads [h0, h1) of `layer` */
} pdm__group_t;

struct pdm_kvoff {
    pdm_kvoff_engine_t *e;
    pdm_kv_cache_t cache;
    uint32_t L, H, hd;
    size_t esz, arr; /* bytes per element, per K (or V) array (64-aligned) */
    int group, resident;
    int *res;        /* [L] resident heads of each layer: heads [0, res[l]) */
    int *first;      /* [L + 1] first group index of each layer */
    pdm__group_t *groups;
    int n_groups;
    void *fast_res, *pp, *slow;
    size_t fast_res_bytes, pp_bytes, slow_bytes;
    /* pipeline */
    uint64_t visit;
    int half_g[2];
    int32_t half_rows[2];
    uint64_t half_job[2];
    uint64_t last_job;
};

pdm_kv_cache_t *pdm_kvoff_cache(pdm_kvoff_t *s) { return &s->cache; }

int pdm_kvoff_sync(pdm_kvoff_t *s) { return s->last_job ? pdm__wait(s->e, s->last_job, 0) : PDM_OK; }

void pdm_kvoff_placement(const pdm_kvoff_t *s, int *group, int *resident, int64_t *fast_bytes,
                         int64_t *slow_bytes)
{
    if (group) *group = s->group;
    if (resident) *resident = s->resident;
    if (fast_bytes) *fast_bytes = (int64_t)(s->fast_res_bytes + s->pp_bytes);
    if (slow_bytes) *slow_bytes = (int64_t)s->slow_bytes;
}

/* The placement rule shared by pdm_kvoff_create and pdm_kvplan: group size and resident head
 * count for a store of head-pair size hb (K + V array) given `free` fast bytes. Returns
 * PDM_EOVERFLOW when not even a ping-pong buffer of one head fits. */
static int pdm__place(const pdm_kvoff_params_t *p, uint32_t L, uint32_t H, int32_t capacity,
                      size_t hb, int64_t free_b, int *group, int *resident)
{
    const int64_t total = (int64_t)L * H;
    const double share = p->resident_share > 0 && p->resident_share < 1 ? p->resident_share : 1;
    const int64_t avail = share < 1 ? (int64_t)((double)free_b * share) : free_b;
    if (!p->no_resident && (int64_t)hb * total <= avail) {
        *group = 0;
        *resident = (int)total;
        return PDM_OK;
    }
    int g = pdm_kvoff_group_for(p, capacity, H);
    while (g > 1 && (int64_t)(2 * (size_t)g * hb) > free_b) g--;
    if ((int64_t)(2 * (size_t)g * hb) > free_b)
        return pdm_error_set(PDM_EOVERFLOW, "decode node full: the fast KV tier has %lld bytes free, a "
                             "ping-pong buffer of one head of %d tokens needs %zu",
                             (long long)free_b, capacity, 2 * hb);
    int64_t r = p->no_resident ? 0 : (avail - (int64_t)(2 * (size_t)g * hb)) / (int64_t)hb;
    *group = g;
    *resident = (int)PDM_MAX(0, PDM_MIN(r, total - 1));
    return PDM_OK;
}

void pdm_kvoff_destroy(pdm_kvoff_t *s)
{
    if (!s) return;
    if (s->last_job && pdm__wait(s->e, s->last_job, 0)) {
        /* The worker still holds this store's buffers: leaking them is safe, freeing is not. */
        fprintf(stderr, "pdmesh: KV offload: %s; leaking the store\n", pdm_error_last());
        return;
    }
    pdm_kvtier_free(s->e->fast, s->fast_res, s->fast_res_bytes);
    pdm_kvtier_free(s->e->fast, s->pp, s->pp_bytes);
    pdm_kvtier_free(s->e->slow, s->slow, s->slow_bytes);
    pthread_mutex_lock(&s->e->lock);
    s->e->live_stores--;
    pthread_mutex_unlock(&s->e->lock);
    free(s->cache.k);
    free(s->cache.v);
    free(s->cache.scale);
    free(s->res);
    free(s->first);
    free(s->groups);
    free(s);
}

int pdm_kvoff_create(pdm_kvoff_engine_t *e, const pdm_model_hparams_t *hp, int32_t capacity,
                     pdm_dtype_t dtype, pdm_kvoff_t **out)
{
    if (capacity < 1 || (dtype != PDM_DT_F32 && dtype != PDM_DT_F16 && dtype != PDM_DT_I8) ||
        hp->n_kv_heads > PDM_MAX_KV_HEADS)
        return pdm_error_set(PDM_EINVAL, "KV offload: invalid capacity %d or dtype %s",
                             capacity, pdm_dtype_name(dtype));
    const uint32_t L = hp->n_layers, H = hp->n_kv_heads;
    size_t arr;
    if (pdm_size_mul((size_t)capacity * hp->head_dim, pdm_dtype_row_bytes(dtype, 1), &arr))
        return pdm_error_set(PDM_EOVERFLOW, "KV offload: %d tokens overflow", capacity);
    arr = pdm__round(arr);
    const size_t hb = 2 * arr;
    pdm_kvtier_stats_t fs;
    pdm_kvtier_stats(e->fast, &fs);
    int group, resident;
    int st = pdm__place(&e->p, L, H, capacity, hb, fs.budget - fs.used, &group, &resident);
    if (st) return st;

    pdm_kvoff_t *s = calloc(1, sizeof(*s));
    if (!s) return pdm_error_set(PDM_ENOMEM, "KV offload: out of memory");
    s->e = e;
    s->L = L;
    s->H = H;
    s->hd = hp->head_dim;
    s->esz = pdm_dtype_row_bytes(dtype, 1);
    s->arr = arr;
    s->group = group;
    s->resident = resident;
    s->half_g[0] = s->half_g[1] = -1;
    s->cache.n_layers = L;
    s->cache.n_kv_heads = H;
    s->cache.head_dim = hp->head_dim;
    s->cache.capacity = capacity;
    s->cache.dtype = dtype;
    s->cache.offload = s;
    s->cache.k = calloc((size_t)L * H, sizeof(void *));
    s->cache.v = calloc((size_t)L * H, sizeof(void *));
    /* q8: each head's K and V scale, set by the prompt (prefill or the stream's headers);
     * 1 for the float dtypes */
    s->cache.scale = malloc(2 * (size_t)L * H * sizeof(float));
    for (size_t i = 0; s->cache.scale && i < 2 * (size_t)L * H; i++) s->cache.scale[i] = 1.0f;
    s->res = calloc(L, sizeof(int));
    s->first = calloc(L + 1, sizeof(int));
    s->groups = calloc((size_t)L * H, sizeof(pdm__group_t));
    pthread_mutex_lock(&e->lock);
    e->live_stores++;
    pthread_mutex_unlock(&e->lock);
    if (!s->cache.k || !s->cache.v || !s->cache.scale || !s->res || !s->first || !s->groups) {
        pdm_kvoff_destroy(s);
        return pdm_error_set(PDM_ENOMEM, "KV offload: out of memory");
    }
    /* Resident heads spread evenly over the layers (HeadInfer's H_on), heads [0, res[l]). */
    for (uint32_t l = 0; l < L; l++)
        s->res[l] = resident / (int)L + ((int)l < resident % (int)L ? 1 : 0);
    const int64_t n_off = (int64_t)L * H - resident;
    s->fast_res_bytes = (size_t)resident * hb;
    s->pp_bytes = n_off > 0 ? 2 * (size_t)group * hb : 0;
    s->slow_bytes = (size_t)n_off * hb;
    st = PDM_OK;
    if (s->fast_res_bytes) st = pdm_kvtier_alloc(e->fast, s->fast_res_bytes, &s->fast_res);
    if (!st && s->pp_bytes) st = pdm_kvtier_alloc(e->fast, s->pp_bytes, &s->pp);
    if (!st && s->slow_bytes) st = pdm_kvtier_alloc(e->slow, s->slow_bytes, &s->slow);
    if (st) {
        pdm_kvoff_destroy(s);
        return st;
    }
    size_t fi = 0, si = 0;
    for (uint32_t l = 0; l < L; l++) {
        s->first[l] = s->n_groups;
        for (uint32_t h = 0; h < H; h++) {
            char *home;
            if ((int)h < s->res[l]) home = (char *)s->fast_res + (fi++) * hb;
            else home = (char *)s->slow + (si++) * hb;
            s->cache.k[l * H + h] = home;
            s->cache.v[l * H + h] = home + arr;
        }
        for (int h = s->res[l]; h < (int)H; h += group)
            s->groups[s->n_groups++] = (pdm__group_t){(int)l, h, PDM_MIN(h + group, (int)H)};
    }
    s->first[L] = s->n_groups;
    pthread_mutex_lock(&e->lock);
    e->st.stores++;
    e->st.resident_heads += resident;
    e->st.offloaded_heads += n_off;
    e->st.last_group = group ? group : (int)H;
    pthread_mutex_unlock(&e->lock);
    *out = s;
    return PDM_OK;
}

/* Staging arrays of head j of a group in half b: K at 2j, V at 2j + 1. */
static char *pdm__stage(const pdm_kvoff_t *s, int half, int j, int is_v)
{
    return (char *)s->pp + (size_t)half * s->group * 2 * s->arr + (size_t)(2 * j + is_v) * s->arr;
}

static int pdm__prefetch(pdm_kvoff_t *s, int g, int32_t rows, int half)
{
    const pdm__group_t *gr = &s->groups[g];
    pdm__job_t j = {.n = 0};
    const size_t bytes = (size_t)rows * s->hd * s->esz;
    for (int h = gr->h0; h < gr->h1 && bytes; h++) {
        j.cp[j.n++] = (pdm__copy_t){pdm__stage(s, half, h - gr->h0, 0),
                                    pdm_kv_cache_k(&s->cache, (uint32_t)gr->layer, (uint32_t)h),
                                    bytes};
        j.cp[j.n++] = (pdm__copy_t){pdm__stage(s, half, h - gr->h0, 1),
                                    pdm_kv_cache_v(&s->cache, (uint32_t)gr->layer, (uint32_t)h),
                                    bytes};
    }
    uint64_t id;
    int st = pdm__submit(s->e, &j, &id);
    if (st) {
        s->half_g[half] = -1;
        return st;
    }
    s->half_g[half] = g;
    s->half_rows[half] = rows;
    s->half_job[half] = id;
    s->last_job = id;
    pthread_mutex_lock(&s->e->lock);
    s->e->st.prefetches++;
    s->e->st.prefetch_bytes += (int64_t)(bytes * (size_t)j.n);
    pthread_mutex_unlock(&s->e->lock);
    return PDM_OK;
}

static int pdm__writeback(pdm_kvoff_t *s, int g, int32_t slot, int half)
{
    const pdm__group_t *gr = &s->groups[g];
    pdm__job_t j = {.n = 0};
    const size_t row = (size_t)s->hd * s->esz, off = (size_t)slot * row;
    for (int h = gr->h0; h < gr->h1; h++) {
        j.cp[j.n++] = (pdm__copy_t){
            (char *)pdm_kv_cache_k(&s->cache, (uint32_t)gr->layer, (uint32_t)h) + off,
            pdm__stage(s, half, h - gr->h0, 0) + off, row};
        j.cp[j.n++] = (pdm__copy_t){
            (char *)pdm_kv_cache_v(&s->cache, (uint32_t)gr->layer, (uint32_t)h) + off,
            pdm__stage(s, half, h - gr->h0, 1) + off, row};
    }
    uint64_t id;
    int st = pdm__submit(s->e, &j, &id);
    if (st) return st;
    s->last_job = id;
    pthread_mutex_lock(&s->e->lock);
    s->e->st.writeback_bytes += (int64_t)(row * (size_t)j.n);
    pthread_mutex_unlock(&s->e->lock);
    return PDM_OK;
}

/* Stores head h's new K and V row at kd / vd: q8 with the head's fixed scales (nothing is
 * re-quantized, model/kv_quant.c), else converted to the cache's float dtype. */
static void pdm__store_row(const pdm_kern_ops_t *ops, const pdm_kv_cache_t *c, int layer, int h,
                           const pdm_act_t *row, uint32_t hd, void *kd, void *vd)
{
    const float *k = row->k + (size_t)h * hd, *v = row->v + (size_t)h * hd;
    if (c->dtype == PDM_DT_I8) {
        const float *sc = c->scale + 2 * ((size_t)layer * c->n_kv_heads + (size_t)h);
        pdm_q8_quantize_row(k, kd, hd, sc[0]);
        pdm_q8_quantize_row(v, vd, hd, sc[1]);
    } else {
        ops->kv_store(c->dtype, k, kd, (int)hd);
        ops->kv_store(c->dtype, v, vd, (int)hd);
    }
}

int pdm_kvoff_attention(pdm_kvoff_t *s, pdm_model_ctx_t *ctx, int layer, pdm_act_t *row)
{
    pdm_kv_cache_t *c = &s->cache;
    const int32_t n = c->n_tokens;
    if (row->n != 1 || layer < 0 || (uint32_t)layer >= s->L)
        return pdm_error_set(PDM_EINVAL, "KV offload: attention takes one row of a valid layer");
    if (n >= c->capacity)
        return pdm_error_set(PDM_EOVERFLOW, "KV offload: the cache is full (%d tokens)",
                             c->capacity);
    const pdm_kern_ops_t *ops = pdm_model_ctx_ops(ctx);
    const size_t off = (size_t)n * s->hd * s->esz;
    const int r = s->res[layer];
    /* Resident heads (Alg. 1 lines 22-23): new row at home, attention over home. */
    if (r > 0) {
        for (int h = 0; h < r; h++)
            pdm__store_row(ops, c, layer, h, row, s->hd,
                           (char *)pdm_kv_cache_k(c, (uint32_t)layer, (uint32_t)h) + off,
                           (char *)pdm_kv_cache_v(c, (uint32_t)layer, (uint32_t)h) + off);
        pdm_kv_view_t view;
        pdm_kv_cache_view(c, (uint32_t)layer, 0, n + 1, &view);
        pdm_model_attention_heads(ctx, layer, row, &view, 1, 0, r);
    }
    /* Offloaded heads, group by group through the ping-pong buffer (lines 24-28). */
    for (int g = s->first[layer]; g < s->first[layer + 1]; g++) {
        const pdm__group_t *gr = &s->groups[g];
        const int half = (int)(s->visit % 2), other = 1 - half;
        int st = PDM_OK;
        if (s->half_g[half] != g || s->half_rows[half] != n) st = pdm__prefetch(s, g, n, half);
        const int next = g + 1 < s->n_groups ? g + 1 : 0;
        const int32_t next_rows = g + 1 < s->n_groups ? n : n + 1;
        /* The next visit's prefetch overlaps this group's compute; with a single group it
         * reads the row this visit writes back, so it goes after the write-back. */
        if (!st && next != g) st = pdm__prefetch(s, next, next_rows, other);
        if (!st) st = pdm__wait(s->e, s->half_job[half], 1);
        if (st) {
            s->half_g[0] = s->half_g[1] = -1;
            return st;
        }
        pdm_kv_view_t view = {.dtype = c->dtype, .pos0 = c->pos0, .n_tokens = n + 1};
        for (int h = gr->h0; h < gr->h1; h++) {
            char *k = pdm__stage(s, half, h - gr->h0, 0), *v = pdm__stage(s, half, h - gr->h0, 1);
            pdm__store_row(ops, c, layer, h, row, s->hd, k + off, v + off);
            view.k[h] = k;
            view.v[h] = v;
            view.k_scale[h] = c->scale[2 * ((size_t)layer * s->H + (size_t)h)];
            view.v_scale[h] = c->scale[2 * ((size_t)layer * s->H + (size_t)h) + 1];
        }
        pdm_model_attention_heads(ctx, layer, row, &view, 1, gr->h0, gr->h1);
        st = pdm__writeback(s, g, n, half);
        if (!st && next == g) st = pdm__prefetch(s, next, next_rows, other);
        if (st) {
            s->half_g[0] = s->half_g[1] = -1;
            return st;
        }
        s->visit++;
    }
    return PDM_OK;
}

/* ---- Memory plan ------------------------------------------------------------------------- */

static int64_t pdm__mat_bytes(const pdm_kern_mat_t *m) { return (int64_t)m->row_bytes * m->rows; }

/* Activation bytes of a batch of `rows` tokens: pdm_act_alloc's tensors plus the context's
 * scratch (forward.c: xn, tmp, gate, up, converted activations). */
static int64_t pdm__act_bytes(const pdm_model_hparams_t *hp, int64_t rows)
{
    const int64_t q = (int64_t)hp->n_heads * hp->head_dim, kv = (int64_t)hp->n_kv_heads * hp->head_dim;
    const int64_t widest = PDM_MAX((int64_t)hp->d_model, PDM_MAX((int64_t)hp->n_ff, q));
    int64_t per_row = 4 * (1 + hp->d_model + 2 * q + 2 * kv + hp->n_heads) /* act */ +
                      4 * (2 * hp->d_model + 2 * (int64_t)hp->n_ff) /* scratch */ +
                      (int64_t)pdm_dtype_row_bytes(PDM_DT_Q8_1, (widest + 31) / 32 * 32);
    return per_row * rows;
}

int pdm_kvplan(const pdm_model_t *m, int32_t context, int beams, int64_t fast_budget, int chunk,
               pdm_dtype_t dtype, const pdm_kvoff_params_t *p, pdm_kvplan_row_t rows[4])
{
    const pdm_model_hparams_t *hp = &m->hp;
    if (context < 1 || beams < 1 || chunk < 1)
        return pdm_error_set(PDM_EINVAL, "plan: context, beams and chunk must be >= 1");
    int64_t weights = pdm__mat_bytes(&m->tok_embd);
    if (m->output.data != m->tok_embd.data) weights += pdm__mat_bytes(&m->output);
    weights += (int64_t)hp->d_model * 4 * (1 + 2 * (int64_t)hp->n_layers);
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        const pdm_model_layer_t *L = &m->layers[l];
        weights += pdm__mat_bytes(&L->wq) + pdm__mat_bytes(&L->wk) + pdm__mat_bytes(&L->wv) +
                   pdm__mat_bytes(&L->wo) + pdm__mat_bytes(&L->w_gate) +
                   pdm__mat_bytes(&L->w_up) + pdm__mat_bytes(&L->w_down);
    }
    const size_t hb = 2 * pdm__round((size_t)context * hp->head_dim * pdm_dtype_row_bytes(dtype, 1));
    const int64_t heads = (int64_t)hp->n_layers * hp->n_kv_heads, total = heads * (int64_t)hb;
    pdm_kvplan_row_t base = {.weights = weights,
                             .act_prefill = pdm__act_bytes(hp, context),
                             .act_chunked = pdm__act_bytes(hp, PDM_MIN(context, chunk)),
                             .act_decode = pdm__act_bytes(hp, beams)};
    int n = 0;
    rows[n] = base;
    rows[n].name = "all-resident";
    rows[n].kv_fast = total * beams;
    n++;
    /* Layer-wise offload (App. A.3): a ping-pong buffer of one layer's heads per sequence. */
    rows[n] = base;
    rows[n].name = "layer-wise";
    rows[n].group = (int)hp->n_kv_heads;
    rows[n].kv_fast = 2 * (int64_t)hb * hp->n_kv_heads * beams;
    rows[n].kv_slow = total * beams;
    n++;
    /* Head-wise: a ping-pong buffer of one group (S x D_h x 2 for a group of one head). */
    int g = pdm_kvoff_group_for(p, context, hp->n_kv_heads);
    rows[n] = base;
    rows[n].name = "head-wise";
    rows[n].group = g;
    rows[n].kv_fast = 2 * (int64_t)hb * g * beams;
    rows[n].kv_slow = total * beams;
    n++;
    if (fast_budget > 0) {
        /* As pdm_kvoff_create places `beams` stores one after another under the budget. */
        pdm_kvplan_row_t r = base;
        r.name = "head-wise+resident";
        pdm_kvoff_params_t q = *p;
        q.no_resident = 0;
        int64_t used = 0;
        for (int b = 0; b < beams; b++) {
            int gg, res;
            if (pdm__place(&q, hp->n_layers, hp->n_kv_heads, context, hb, fast_budget - used,
                           &gg, &res))
                return n; /* does not fit the budget: no such row */
            int64_t f = (int64_t)res * (int64_t)hb + (res < heads ? 2 * (int64_t)gg * (int64_t)hb : 0);
            used += f;
            r.kv_fast += f;
            r.kv_slow += (heads - res) * (int64_t)hb;
            r.group = res < heads ? gg : 0;
        }
        rows[n++] = r;
    }
    return n;
}

/* ---- Reporting --------------------------------------------------------------------------- */

void *pdm_kvoff_stats_json(const pdm_kvoff_stats_t *st, const pdm_kvoff_params_t *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddNumberToObject(o, "fast_budget", (double)st->fast.budget);
    cJSON_AddNumberToObject(o, "fast_bytes", (double)st->fast.used);
    cJSON_AddNumberToObject(o, "fast_peak", (double)st->fast.peak);
    cJSON_AddStringToObject(o, "slow_tier", p && p->slow_tier ? p->slow_tier : "ram");
    cJSON_AddNumberToObject(o, "slow_bytes", (double)st->slow.used);
    cJSON_AddNumberToObject(o, "slow_peak", (double)st->slow.peak);
    cJSON_AddNumberToObject(o, "resident_heads", (double)st->resident_heads);
    cJSON_AddNumberToObject(o, "offloaded_heads", (double)st->offloaded_heads);
    cJSON_AddNumberToObject(o, "group", st->last_group);
    cJSON_AddNumberToObject(o, "prefetches", (double)st->prefetches);
    cJSON_AddNumberToObject(o, "prefetch_bytes", (double)st->prefetch_bytes);
    cJSON_AddNumberToObject(o, "writeback_bytes", (double)st->writeback_bytes);
    cJSON_AddNumberToObject(o, "prefetch_waits", (double)st->prefetch_waits);
    cJSON_AddNumberToObject(o, "wait_seconds", st->wait_seconds);
    return o;
}
