/*
 * pool.c - a persistent thread pool: threads are created once and woken per task.
 *
 * A decode step dispatches a few hundred small tasks, so waking must be cheap: workers spin
 * on a generation counter for a short while (yielding the core after the first microseconds)
 * before sleeping on a condition variable, and the caller spins on the pending count the same
 * way. The caller's thread is worker 0.
 */
#include "../kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

/* Waiting: PDM__SPIN_PAUSES pause instructions (the uncontended case: the next task or the
 * last worker is microseconds away), then sched_yield() up to PDM__SPIN_ITERS in all (when
 * other processes share the cores, a spinning thread must not hold the core that the thread it
 * waits for needs), then sleep on the condition variable. */
#define PDM__SPIN_PAUSES 2000
#define PDM__SPIN_ITERS 6000

struct pdm_kern_pool {
    int n_threads;
    pthread_t *threads;        /* [n_threads - 1] */
    pthread_mutex_t mutex;
    pthread_cond_t wake;       /* a new generation was published or stop */
    pthread_cond_t done;       /* pending reached 0 */
    atomic_uint generation;    /* bumped once per task */
    atomic_int pending;        /* workers still running the current task */
    atomic_int stop;
    int sleepers;              /* workers waiting on `wake` (under mutex) */
    pdm_kern_task_cb cb;
    void *arg;
};

typedef struct {
    pdm_kern_pool_t *pool;
    int ith;
} pdm__worker_arg_t;

static inline void pdm__cpu_relax(int spins)
{
    if (spins > PDM__SPIN_PAUSES) {
        sched_yield();
        return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *pdm__worker(void *p)
{
    pdm__worker_arg_t *wa = p;
    pdm_kern_pool_t *pool = wa->pool;
    int ith = wa->ith;
    free(wa);
    /* The pool starts at generation 0 and a task may be published before this thread first
     * runs, so start from 0 rather than from whatever the counter says now. */
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool->generation, memory_order_acquire) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < PDM__SPIN_ITERS) {
                pdm__cpu_relax(spins);
                continue;
            }
            pthread_mutex_lock(&pool->mutex);
            pool->sleepers++;
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            pool->sleepers--;
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop)) break;
        seen++; /* the caller publishes one generation per task and waits for it */
        pool->cb(pool->arg, ith, pool->n_threads);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mutex);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mutex);
        }
    }
    return NULL;
}

pdm_kern_pool_t *pdm_kern_pool_create(int n_threads)
{
    if (n_threads < 1) n_threads = 1;
    pdm_kern_pool_t *pool = calloc(1, sizeof(*pool));
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->stop, 0);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!pool->threads) goto err_free;
    }
    int started = 1;
    for (; started < n_threads; started++) {
        pdm__worker_arg_t *wa = malloc(sizeof(*wa));
        if (!wa) break;
        wa->pool = pool;
        wa->ith = started;
        if (pthread_create(&pool->threads[started - 1], NULL, pdm__worker, wa) != 0) {
            free(wa);
            break;
        }
    }
    if (started < n_threads) {
        pool->n_threads = started; /* destroy joins only the threads that exist */
        pdm_kern_pool_destroy(pool);
        return NULL;
    }
    return pool;

err_free:
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool);
    return NULL;
}

void pdm_kern_pool_destroy(pdm_kern_pool_t *pool)
{
    if (!pool) return;
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i - 1], NULL);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool->threads);
    free(pool);
}

int pdm_kern_pool_size(const pdm_kern_pool_t *pool) { return pool ? pool->n_threads : 1; }

void pdm_kern_pool_run(pdm_kern_pool_t *pool, pdm_kern_task_cb cb, void *arg)
{
    if (!pool || pool->n_threads == 1) {
        cb(arg, 0, 1);
        return;
    }
    pool->cb = cb;
    pool->arg = arg;
    atomic_store(&pool->pending, pool->n_threads - 1);
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    if (pool->sleepers) pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);

    cb(arg, 0, pool->n_threads);

    int spins = 0;
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0) {
        if (++spins < PDM__SPIN_ITERS) {
            pdm__cpu_relax(spins);
            continue;
        }
        pthread_mutex_lock(&pool->mutex);
        while (atomic_load(&pool->pending) > 0) pthread_cond_wait(&pool->done, &pool->mutex);
        pthread_mutex_unlock(&pool->mutex);
    }
}

void pdm_kern_split(int64_t n, int ith, int nth, int64_t align, int64_t *begin, int64_t *end)
{
    if (align < 1) align = 1;
    int64_t units = (n + align - 1) / align;
    int64_t per = units / nth, extra = units % nth;
    int64_t ub = ith * per + (ith < extra ? ith : extra);
    int64_t ue = ub + per + (ith < extra ? 1 : 0);
    int64_t b = ub * align, e = ue * align;
    *begin = b < n ? b : n;
    *end = e < n ? e : n;
}
