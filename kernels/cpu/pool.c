/*
 * pool.c - a persistent thread pool: threads are created once and woken per task.
 *
 * A task is `nth` shares, cb(arg, 0..nth-1, nth). The caller publishes it and every thread,
 * the caller included, claims shares from one counter until none is left; the caller then
 * waits only for the shares that were claimed by someone else. So a worker that another
 * process keeps off its core does not hold the step: the caller runs its share too (before,
 * each share belonged to its thread and the caller waited for a descheduled worker for a whole
 * time slice, several milliseconds, a few hundred times a decode step). A share's result must
 * depend on its index only (every caller in the engine splits by `ith`, or claims chunks from
 * its own counter), never on which thread runs it, and a share must not wait for another.
 *
 * Waking must be cheap too: a decode step publishes a few hundred small tasks, so workers spin
 * on the task word for a short while (yielding the core after the first microseconds) before
 * sleeping on a condition variable, and the caller waits for the claimed shares the same way.
 * The caller's thread is thread 0.
 */
#include "../kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/* Waiting: PDM__SPIN_PAUSES pause instructions (the uncontended case: the next task or the
 * last share is microseconds away), then sched_yield() up to PDM__SPIN_ITERS in all (when
 * other processes share the cores, a spinning thread must not hold the core that the thread it
 * waits for needs), then sleep on the condition variable. */
#define PDM__SPIN_PAUSES 2000
#define PDM__SPIN_ITERS 6000

/* The task word: the task's generation in the high 32 bits, the next unclaimed share in the
 * low 32. Claiming is a compare-and-swap on the whole word, so a share is only ever claimed
 * for the task that is current: a worker that wakes late for an old generation fails the swap
 * and finds the new one. */
#define PDM__GEN(w) ((uint32_t)((w) >> 32))
#define PDM__SHARE(w) ((uint32_t)(w))

struct pdm_kern_pool {
    int n_threads;
    pthread_t *threads;        /* [n_threads - 1] */
    pthread_mutex_t mutex;
    pthread_cond_t wake;       /* a new generation was published or stop */
    pthread_cond_t done;       /* every share of the current task has finished */
    _Atomic uint64_t task;     /* generation << 32 | next unclaimed share */
    atomic_int finished;       /* shares of the current task that have finished */
    atomic_int stop;
    int sleepers;              /* workers waiting on `wake` (under mutex) */
    int caller_waits;          /* the caller sleeps on `done` (under mutex) */
    pdm_kern_task_cb cb;
    void *arg;
};

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

/* Claims and runs shares of generation `gen` until none is left or the task word moves on.
 * Returns the number of shares this thread ran. */
static int pdm__run_shares(pdm_kern_pool_t *pool, uint32_t gen)
{
    const int nth = pool->n_threads;
    int ran = 0;
    uint64_t w = atomic_load_explicit(&pool->task, memory_order_acquire);
    while (PDM__GEN(w) == gen && PDM__SHARE(w) < (uint32_t)nth) {
        if (!atomic_compare_exchange_weak_explicit(&pool->task, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* w now holds the current word */
        pool->cb(pool->arg, (int)PDM__SHARE(w), nth);
        ran++;
        if (atomic_fetch_add_explicit(&pool->finished, 1, memory_order_acq_rel) + 1 == nth) {
            pthread_mutex_lock(&pool->mutex);
            if (pool->caller_waits) pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mutex);
        }
        w = atomic_load_explicit(&pool->task, memory_order_acquire);
    }
    return ran;
}

static void *pdm__worker(void *p)
{
    pdm_kern_pool_t *pool = p;
    uint32_t seen = 0; /* the pool starts at generation 0, which carries no task */
    for (;;) {
        int spins = 0;
        uint64_t w;
        while (PDM__GEN(w = atomic_load_explicit(&pool->task, memory_order_acquire)) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < PDM__SPIN_ITERS) {
                pdm__cpu_relax(spins);
                continue;
            }
            pthread_mutex_lock(&pool->mutex);
            pool->sleepers++;
            while (PDM__GEN(atomic_load(&pool->task)) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            pool->sleepers--;
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop)) break;
        seen = PDM__GEN(w); /* skipped generations were finished by the others */
        pdm__run_shares(pool, seen);
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
    atomic_init(&pool->task, 0);
    atomic_init(&pool->finished, 0);
    atomic_init(&pool->stop, 0);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!pool->threads) goto err_free;
    }
    int started = 1;
    for (; started < n_threads; started++)
        if (pthread_create(&pool->threads[started - 1], NULL, pdm__worker, pool) != 0) break;
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
    const int nth = pool->n_threads;
    /* Every share of the previous task has finished and its word says so (next share >= nth),
     * so nobody reads cb/arg or `finished` until the new word is published below. */
    pool->cb = cb;
    pool->arg = arg;
    atomic_store_explicit(&pool->finished, 0, memory_order_relaxed);
    uint32_t gen = PDM__GEN(atomic_load_explicit(&pool->task, memory_order_relaxed)) + 1;
    if (gen == 0) gen = 1; /* 0 is the workers' starting "seen": never a task */
    pthread_mutex_lock(&pool->mutex);
    atomic_store_explicit(&pool->task, (uint64_t)gen << 32, memory_order_release);
    if (pool->sleepers) pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);

    pdm__run_shares(pool, gen);

    /* Every share is claimed now; wait for those that other threads are running. */
    int spins = 0;
    while (atomic_load_explicit(&pool->finished, memory_order_acquire) < nth) {
        if (++spins < PDM__SPIN_ITERS) {
            pdm__cpu_relax(spins);
            continue;
        }
        pthread_mutex_lock(&pool->mutex);
        pool->caller_waits = 1;
        while (atomic_load(&pool->finished) < nth) pthread_cond_wait(&pool->done, &pool->mutex);
        pool->caller_waits = 0;
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
