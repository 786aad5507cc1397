/*
 * launch.c - starts a prefill group of pdmesh-prefill processes on this machine and drives
 * it over the ranks' stdin/stdout (the line protocol described in prefill_node/main.c).
 *
 * Every read has a deadline (poll on the rank's pipe); a rank that dies closes its pipe and
 * fails the operation at once; stopping sends "quit", waits a grace period, then SIGKILLs.
 */
#include "prefill_node/prefill.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/pdm.h"

extern char **environ;

typedef struct {
    pid_t pid;
    int in_fd;  /* we write commands */
    int out_fd; /* we read events */
    char *buf;  /* unread bytes from out_fd */
    size_t len, cap;
} pdm__proc_t;

struct pdm_launch {
    pdm_launch_params_t p;
    pdm__proc_t proc[PDM_KVT_MAX_RANKS + 1]; /* ranks, then the decode node if any */
    int n;                                   /* ranks */
    int n_procs;                             /* processes started */
    int has_decode;
    uint64_t next_request;
    uint32_t next_task;
    char transports[128];
    pdm_prefill_conv_t conv; /* mirror of the group's conversation (conv.c) */
};

int pdm_launch_decode_pid(const pdm_launch_t *l)
{
    return l->has_decode ? (int)l->proc[l->n].pid : -1;
}

void pdm_launch_params_default(pdm_launch_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->bin = "build/bin/pdmesh-prefill";
    p->model = pdm_model_default_path();
    p->ranks = 2;
    p->threads = 1;
    p->ctx_tokens = 8192;
    p->kv_dtype = "f16";
    p->timeout = 120;
    p->wrap = getenv("PDMESH_RANK_WRAP");
}

int pdm_launch_pid(const pdm_launch_t *l, int rank)
{
    return rank >= 0 && rank < l->n ? (int)l->proc[rank].pid : -1;
}

const char *pdm_launch_transports(const pdm_launch_t *l)
{
    return l->transports;
}

/* "rank N" or "the decode node" (index -1) for messages. */
static const char *pdm__who(int rank, char *buf, size_t size)
{
    if (rank < 0)
        snprintf(buf, size, "the decode node");
    else
        snprintf(buf, size, "rank %d", rank);
    return buf;
}

/* Starts argv[0] (searched in PATH if it has no '/') with pipes on its stdin and stdout. */
static int pdm__spawn_argv(char *const *argv, pdm__proc_t *pr)
{
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC)) return pdm_error_set(-errno, "pipe: %s", strerror(errno));
    if (pipe2(out, O_CLOEXEC)) {
        close(in[0]);
        close(in[1]);
        return pdm_error_set(-errno, "pipe: %s", strerror(errno));
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    int err = posix_spawnp(&pr->pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    if (err) {
        close(in[1]);
        close(out[0]);
        return pdm_error_set(-err, "cannot start %s: %s", argv[0], strerror(err));
    }
    pr->in_fd = in[1];
    pr->out_fd = out[0];
    return PDM_OK;
}

static int pdm__spawn(const pdm_launch_params_t *p, int rank, pdm__proc_t *pr)
{
    char threads[16], cpu[16], ctx[16], timeout[32];
    snprintf(threads, sizeof(threads), "%d", p->threads);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(cpu, sizeof(cpu), "%ld", (long)rank % (ncpu > 0 ? ncpu : 1));
    snprintf(ctx, sizeof(ctx), "%d", p->ctx_tokens);
    snprintf(timeout, sizeof(timeout), "%g", p->timeout);
    /* An optional wrapper in front (network namespaces in benchmarks): words split at
     * spaces, "%d" replaced by the rank. */
    char wrap_buf[512], *argv[64];
    int a = 0;
    if (p->wrap && *p->wrap) {
        char expanded[512];
        size_t o = 0;
        for (const char *c = p->wrap; *c && o + 12 < sizeof(expanded); c++) {
            if (c[0] == '%' && c[1] == 'd') {
                o += (size_t)snprintf(expanded + o, sizeof(expanded) - o, "%d", rank);
                c++;
            } else {
                expanded[o++] = *c;
            }
        }
        expanded[o] = 0;
        snprintf(wrap_buf, sizeof(wrap_buf), "%s", expanded);
        char *save = NULL;
        for (char *w = strtok_r(wrap_buf, " ", &save); w && a < 40; w = strtok_r(NULL, " ", &save))
            argv[a++] = w;
    }
    argv[a++] = (char *)p->bin;
    argv[a++] = "--model";
    argv[a++] = (char *)p->model;
    argv[a++] = "--threads";
    argv[a++] = threads;
    argv[a++] = "--ctx";
    argv[a++] = ctx;
    argv[a++] = "--kv-dtype";
    argv[a++] = (char *)p->kv_dtype;
    argv[a++] = "--timeout";
    argv[a++] = timeout;
    if (p->pin) {
        argv[a++] = "--cpu";
        argv[a++] = cpu;
    }
    argv[a] = NULL;
    return pdm__spawn_argv(argv, pr);
}

static int pdm__spawn_decode(const pdm_launch_params_t *p, pdm__proc_t *pr)
{
    char threads[16], batch[16], budget[32];
    snprintf(threads, sizeof(threads), "%d", p->decode_threads > 0 ? p->decode_threads : 1);
    snprintf(batch, sizeof(batch), "%d", p->decode_batch > 0 ? p->decode_batch : 16);
    snprintf(budget, sizeof(budget), "%ld", p->decode_kv_budget > 0 ? p->decode_kv_budget : 1L << 18);
    char *argv[16] = {(char *)p->decode_bin, "--model", (char *)p->model, "--threads", threads,
                      "--batch", batch, "--kv-budget", budget, "--kv-dtype",
                      (char *)(p->decode_kv_dtype ? p->decode_kv_dtype : p->kv_dtype), NULL};
    int a = 11;
    if (p->decode_kv_fast_budget) {
        argv[a++] = "--kv-fast-budget";
        argv[a++] = (char *)p->decode_kv_fast_budget;
    }
    if (p->decode_kv_slow_tier) {
        argv[a++] = "--kv-slow-tier";
        argv[a++] = (char *)p->decode_kv_slow_tier;
    }
    argv[a] = NULL;
    return pdm__spawn_argv(argv, pr);
}

/* Reads one line from a rank before the deadline; *line is malloc'd. */
static int pdm__read_line(pdm__proc_t *pr, int rank, double deadline, char **line)
{
    for (;;) {
        char *nl = pr->len ? memchr(pr->buf, '\n', pr->len) : NULL;
        if (nl) {
            size_t n = (size_t)(nl - pr->buf);
            char *s = malloc(n + 1);
            if (!s) return pdm_error_set(PDM_ENOMEM, "out of memory");
            memcpy(s, pr->buf, n);
            s[n] = 0;
            memmove(pr->buf, nl + 1, pr->len - n - 1);
            pr->len -= n + 1;
            *line = s;
            return PDM_OK;
        }
        double left = deadline - pdm_now();
        char who[32];
        if (left <= 0)
            return pdm_error_set(PDM_ETIMEOUT, "%s did not answer in time",
                                 pdm__who(rank, who, sizeof(who)));
        struct pollfd pfd = {.fd = pr->out_fd, .events = POLLIN};
        int pr_st = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (pr_st < 0 && errno != EINTR) return pdm_error_set(-errno, "poll: %s", strerror(errno));
        if (pr_st <= 0) continue;
        if (pr->cap - pr->len < 65536) {
            size_t cap = pr->cap ? pr->cap * 2 : 1 << 16;
            if (cap > (256u << 20))
                return pdm_error_set(PDM_EOVERFLOW, "%s sent a line over 256 MiB",
                                     pdm__who(rank, who, sizeof(who)));
            char *b = realloc(pr->buf, cap);
            if (!b) return pdm_error_set(PDM_ENOMEM, "out of memory");
            pr->buf = b;
            pr->cap = cap;
        }
        ssize_t got = read(pr->out_fd, pr->buf + pr->len, pr->cap - pr->len);
        if (got == 0) return pdm_error_set(PDM_EPEER, "%s exited", pdm__who(rank, who, sizeof(who)));
        if (got < 0 && errno != EINTR && errno != EAGAIN)
            return pdm_error_set(-errno, "%s: %s", pdm__who(rank, who, sizeof(who)),
                                 strerror(errno));
        if (got > 0) pr->len += (size_t)got;
    }
}

static double pdm__num(const cJSON *o, const char *key);

#define PDM__ANY_TASK UINT64_MAX

/* Reads the next event of a rank as JSON and checks its name and "ok". With a task `id`
 * (not PDM__ANY_TASK), late answers to earlier tasks that the launcher gave up on (they
 * carry another id) are skipped. */
static int pdm__read_task_event(pdm__proc_t *pr, int rank, const char *event, uint64_t id,
                                double deadline, cJSON **out)
{
    for (;;) {
        char *line = NULL;
        int st = pdm__read_line(pr, rank, deadline, &line);
        if (st) return st;
        cJSON *o = cJSON_Parse(line);
        free(line);
        const cJSON *tid = o ? cJSON_GetObjectItem(o, "id") : NULL;
        if (id != PDM__ANY_TASK && cJSON_IsNumber(tid) && (uint64_t)tid->valuedouble != id) {
            cJSON_Delete(o); /* a stale answer */
            continue;
        }
        const cJSON *ev = o ? cJSON_GetObjectItem(o, "event") : NULL;
        const cJSON *ok = o ? cJSON_GetObjectItem(o, "ok") : NULL;
        const cJSON *err = o ? cJSON_GetObjectItem(o, "error") : NULL;
        char who[32];
        pdm__who(rank, who, sizeof(who));
        if (!cJSON_IsString(ev)) {
            cJSON_Delete(o);
            return pdm_error_set(PDM_EFORMAT, "%s sent a malformed line", who);
        }
        if (cJSON_IsFalse(ok) || strcmp(ev->valuestring, event)) {
            st = pdm_error_set(PDM_EPEER, "%s: %s", who,
                               cJSON_IsString(err) ? err->valuestring : "unexpected answer");
            cJSON_Delete(o);
            return st;
        }
        *out = o;
        return PDM_OK;
    }
}

static int pdm__read_event(pdm__proc_t *pr, int rank, const char *event, double deadline,
                           cJSON **out)
{
    return pdm__read_task_event(pr, rank, event, PDM__ANY_TASK, deadline, out);
}

/* A number field of a rank's event, 0 when missing (a rank's lines are checked, not
 * trusted). */
static double pdm__num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

static int pdm__write_all(pdm__proc_t *pr, int rank, const char *s)
{
    size_t len = strlen(s), off = 0;
    while (off < len) {
        ssize_t w = write(pr->in_fd, s + off, len - off);
        if (w < 0 && errno == EINTR) continue;
        char who[32];
        if (w <= 0)
            return pdm_error_set(PDM_EPEER, "%s does not take commands",
                                 pdm__who(rank, who, sizeof(who)));
        off += (size_t)w;
    }
    return PDM_OK;
}

static int pdm__send_json(pdm__proc_t *pr, int rank, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    if (!s) return pdm_error_set(PDM_ENOMEM, "out of memory");
    size_t n = strlen(s);
    char *line = malloc(n + 2);
    int st = PDM_ENOMEM;
    if (line) {
        memcpy(line, s, n);
        line[n] = '\n';
        line[n + 1] = 0;
        st = pdm__write_all(pr, rank, line);
    }
    free(line);
    free(s);
    return st;
}

int pdm_launch_finish(pdm_launch_t *l)
{
    if (!l) return PDM_OK;
    for (int i = 0; i < l->n_procs; i++) {
        pdm__write_all(&l->proc[i], i < l->n ? i : -1, "{\"cmd\":\"quit\"}\n");
        close(l->proc[i].in_fd);
    }
    double until = pdm_now() + 5.0;
    int bad = 0;
    char msg[256] = "";
    for (int i = 0; i < l->n_procs; i++) {
        int status = 0, killed = 0;
        while (waitpid(l->proc[i].pid, &status, WNOHANG) == 0) {
            if (pdm_now() > until) {
                kill(l->proc[i].pid, SIGKILL);
                waitpid(l->proc[i].pid, &status, 0);
                killed = 1;
                break;
            }
            usleep(2000);
        }
        /* A clean quit is exit status 0; anything else (a crash, LeakSanitizer's exit code,
         * a process that had to be killed) is reported. */
        if (killed || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            char who[32];
            if (!bad)
                snprintf(msg, sizeof(msg), "%s %s", pdm__who(i < l->n ? i : -1, who, sizeof(who)),
                         killed ? "did not quit" : WIFSIGNALED(status) ? "was killed by a signal"
                                                                     : "exited with an error");
            bad++;
        }
        close(l->proc[i].out_fd);
        free(l->proc[i].buf);
    }
    pdm_prefill_conv_free(&l->conv);
    free(l);
    if (bad) return pdm_error_set(PDM_EPEER, "%d process(es) did not end cleanly: %s", bad, msg);
    return PDM_OK;
}

void pdm_launch_stop(pdm_launch_t *l)
{
    pdm_launch_finish(l);
}

int pdm_launch_start(const pdm_launch_params_t *p, pdm_launch_t **out)
{
    if (p->ranks < 1 || p->ranks > PDM_KVT_MAX_RANKS)
        return pdm_error_set(PDM_EINVAL, "--ranks must be 1..%d", PDM_KVT_MAX_RANKS);
    signal(SIGPIPE, SIG_IGN); /* a dead rank must not kill us through its pipe */
    pdm_launch_t *l = calloc(1, sizeof(*l));
    if (!l) return pdm_error_set(PDM_ENOMEM, "out of memory");
    l->p = *p;
    l->next_task = 1;
    int st = PDM_OK;
    for (int i = 0; i < p->ranks && !st; i++) {
        st = pdm__spawn(p, i, &l->proc[i]);
        if (!st) l->n_procs = ++l->n;
    }
    double deadline = pdm_now() + p->timeout;
    char *decode_addr = NULL;
    if (!st && p->decode_bin) {
        st = pdm__spawn_decode(p, &l->proc[l->n]);
        if (!st) {
            l->n_procs++;
            l->has_decode = 1;
            cJSON *hello;
            st = pdm__read_event(&l->proc[l->n], -1, "hello", deadline, &hello);
            const cJSON *a = st ? NULL : cJSON_GetObjectItem(hello, "address");
            if (!st && !cJSON_IsString(a))
                st = pdm_error_set(PDM_EFORMAT, "the decode node sent no address");
            if (!st) decode_addr = strdup(a->valuestring);
            if (!st) cJSON_Delete(hello);
        }
    }
    cJSON *addrs = cJSON_CreateArray();
    for (int i = 0; i < l->n && !st; i++) {
        cJSON *hello;
        st = pdm__read_event(&l->proc[i], i, "hello", deadline, &hello);
        if (st) break;
        const cJSON *a = cJSON_GetObjectItem(hello, "address");
        if (!cJSON_IsString(a))
            st = pdm_error_set(PDM_EFORMAT, "rank %d sent no address", i);
        else
            cJSON_AddItemToArray(addrs, cJSON_CreateString(a->valuestring));
        cJSON_Delete(hello);
    }
    for (int i = 0; i < l->n && !st; i++) {
        cJSON *cmd = cJSON_CreateObject();
        cJSON_AddStringToObject(cmd, "cmd", "group");
        cJSON_AddNumberToObject(cmd, "rank", i);
        cJSON_AddNumberToObject(cmd, "size", l->n);
        cJSON_AddItemReferenceToObject(cmd, "addrs", addrs);
        if (decode_addr) cJSON_AddStringToObject(cmd, "decode_addr", decode_addr);
        st = pdm__send_json(&l->proc[i], i, cmd);
        cJSON_Delete(cmd);
    }
    for (int i = 0; i < l->n && !st; i++) {
        cJSON *ready;
        st = pdm__read_event(&l->proc[i], i, "ready", deadline, &ready);
        if (st) break;
        const cJSON *tl = cJSON_GetObjectItem(ready, "transports");
        if (i == 0 && cJSON_IsString(tl))
            snprintf(l->transports, sizeof(l->transports), "%s", tl->valuestring);
        cJSON_Delete(ready);
    }
    if (!st && l->has_decode) { /* the decode node connects to every rank */
        cJSON *cmd = cJSON_CreateObject();
        cJSON_AddStringToObject(cmd, "cmd", "connect");
        cJSON_AddItemReferenceToObject(cmd, "addrs", addrs);
        st = pdm__send_json(&l->proc[l->n], -1, cmd);
        cJSON_Delete(cmd);
        cJSON *ok;
        if (!st) st = pdm__read_event(&l->proc[l->n], -1, "connected", deadline, &ok);
        if (!st) cJSON_Delete(ok);
    }
    free(decode_addr);
    cJSON_Delete(addrs);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        pdm_launch_stop(l);
        return pdm_error_set(st, "starting the prefill group: %s", msg);
    }
    *out = l;
    return PDM_OK;
}

int pdm_launch_task(pdm_launch_t *l, const pdm_prefill_task_t *task, const char *kv_out,
                    const char *logits_out, pdm_launch_result_t *res)
{
    memset(res, 0, sizeof(*res));
    res->owner = -1;
    res->first_token = -1;
    if (kv_out) unlink(kv_out); /* the ranks create it afresh */
    cJSON *cmd = cJSON_CreateObject();
    cJSON_AddStringToObject(cmd, "cmd", "task");
    const uint32_t task_id = task->id ? task->id : l->next_task;
    cJSON_AddNumberToObject(cmd, "id", task_id);
    l->next_task = task_id + 1;
    cJSON_AddStringToObject(cmd, "method", pdm_prefill_method_name(task->method));
    cJSON_AddNumberToObject(cmd, "start", task->start);
    cJSON_AddItemToObject(cmd, "tokens", cJSON_CreateIntArray(task->tokens, task->n_tokens));
    if (task->prefix && task->start > 0)
        cJSON_AddItemToObject(cmd, "prefix", cJSON_CreateIntArray(task->prefix, task->start));
    if (task->chunks)
        cJSON_AddItemToObject(cmd, "chunks", cJSON_CreateIntArray(task->chunks, l->n));
    if (task->stream) {
        cJSON *so = cJSON_AddObjectToObject(cmd, "stream");
        cJSON_AddNumberToObject(so, "request", (double)task->stream->request_id);
        cJSON_AddNumberToObject(so, "attempt", task->stream->attempt);
        cJSON_AddNumberToObject(so, "window", task->stream->max_in_flight);
    }
    if (kv_out) cJSON_AddStringToObject(cmd, "kv_out", kv_out);
    if (logits_out) cJSON_AddStringToObject(cmd, "logits_out", logits_out);
    cJSON_AddNumberToObject(cmd, "top", 16);
    double t0 = pdm_now(), deadline = t0 + l->p.timeout;
    int st = PDM_OK;
    for (int i = 0; i < l->n && !st; i++) st = pdm__send_json(&l->proc[i], i, cmd);
    cJSON_Delete(cmd);
    if (st) return st;

    /* Collect results as they come (any order), so the owner's arrival time is its own. */
    int done[PDM_KVT_MAX_RANKS] = {0}, remaining = l->n, first_err = PDM_OK;
    char err_msg[512] = "";
    while (remaining > 0) {
        struct pollfd pfd[PDM_KVT_MAX_RANKS];
        int idx[PDM_KVT_MAX_RANKS], np = 0;
        for (int i = 0; i < l->n; i++)
            if (!done[i]) {
                /* A complete line may already be buffered. */
                if (l->proc[i].len && memchr(l->proc[i].buf, '\n', l->proc[i].len)) {
                    np = 0;
                    idx[np] = i;
                    pfd[np++] = (struct pollfd){.fd = -1};
                    break;
                }
                idx[np] = i;
                pfd[np++] = (struct pollfd){.fd = l->proc[i].out_fd, .events = POLLIN};
            }
        double left = deadline - pdm_now();
        if (left <= 0) {
            st = pdm_error_set(PDM_ETIMEOUT, "prefill task: ranks did not finish in %.0f s",
                               l->p.timeout);
            break;
        }
        if (!(np == 1 && pfd[0].fd == -1) && poll(pfd, (nfds_t)np, (int)(left * 1000) + 1) <= 0)
            continue;
        for (int k = 0; k < np; k++) {
            if (pfd[k].fd != -1 && !pfd[k].revents) continue;
            int i = idx[k];
            cJSON *o = NULL;
            int rst = pdm__read_task_event(&l->proc[i], i, "result", task_id, deadline, &o);
            double now = pdm_now();
            done[i] = 1;
            remaining--;
            if (rst) {
                if (!first_err) {
                    first_err = rst;
                    snprintf(err_msg, sizeof(err_msg), "%s", pdm_error_last());
                }
                continue;
            }
            res->rank[i].n_local = (int)pdm__num(o, "n_local");
            res->rank[i].t_total = pdm__num(o, "t_total");
            res->rank[i].t_compute = pdm__num(o, "t_compute");
            res->rank[i].t_wait = pdm__num(o, "t_wait");
            res->rank[i].bytes_sent = pdm__num(o, "bytes_sent");
            res->rank[i].bytes_received = pdm__num(o, "bytes_received");
            if (cJSON_IsTrue(cJSON_GetObjectItem(o, "owner"))) {
                res->owner = i;
                res->ttft = now - t0;
                res->first_token = (int)pdm__num(o, "first_token");
                const cJSON *top = cJSON_GetObjectItem(o, "top"), *e;
                cJSON_ArrayForEach(e, top)
                {
                    if (res->n_top == 16) break;
                    const cJSON *id = cJSON_GetArrayItem(e, 0), *lg = cJSON_GetArrayItem(e, 1);
                    if (!cJSON_IsNumber(id) || !cJSON_IsNumber(lg)) break;
                    res->top_ids[res->n_top] = id->valueint;
                    res->top_logits[res->n_top] = (float)lg->valuedouble;
                    res->n_top++;
                }
            }
            cJSON_Delete(o);
        }
    }
    if (!st && !first_err && kv_out) {
        for (int i = 0; i < l->n && !st; i++) {
            cJSON *o;
            st = pdm__read_task_event(&l->proc[i], i, "dumped", task_id, deadline, &o);
            if (!st) cJSON_Delete(o);
        }
    }
    if (!first_err && !st && res->owner < 0)
        st = pdm_error_set(PDM_EPEER, "prefill task: no rank reported the first token");
    if (!first_err && !st) { /* the mirror follows the ranks */
        pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
        int n_prefix, nr = pdm_prefill_conv_plan(&l->conv, task->method, l->n, task->start,
                                                 task->n_tokens, task->chunks, 0, plan,
                                                 &n_prefix);
        if (nr < 0 || pdm_prefill_conv_commit(&l->conv, task->method, l->n, task->start,
                                              task->tokens, task->n_tokens, plan, nr))
            pdm_prefill_conv_reset(&l->conv); /* out of step: a smaller view is always safe */
    }
    if (first_err || st) pdm_prefill_conv_reset(&l->conv);
    if (first_err) return pdm_error_set(first_err, "%s", err_msg);
    return st;
}

int pdm_launch_pingpong(pdm_launch_t *l, size_t bytes, int iters, double *seconds)
{
    if (l->n < 2) return pdm_error_set(PDM_EINVAL, "pingpong needs two ranks");
    cJSON *cmd = cJSON_CreateObject();
    cJSON_AddStringToObject(cmd, "cmd", "pingpong");
    cJSON_AddNumberToObject(cmd, "bytes", (double)bytes);
    cJSON_AddNumberToObject(cmd, "iters", iters);
    int st = PDM_OK;
    for (int i = 0; i < l->n && !st; i++) st = pdm__send_json(&l->proc[i], i, cmd);
    cJSON_Delete(cmd);
    double deadline = pdm_now() + l->p.timeout;
    for (int i = 0; i < l->n && !st; i++) {
        cJSON *o;
        st = pdm__read_event(&l->proc[i], i, "pingpong", deadline, &o);
        if (st) break;
        if (i == 0) *seconds = pdm__num(o, "seconds");
        cJSON_Delete(o);
    }
    return st;
}

/* ---- Disaggregated runs ------------------------------------------------------------------- */

void pdm_launch_response_free(pdm_launch_response_t *r)
{
    free(r->tokens);
    free(r->text);
    free(r->beam_json);
    free(r->offload_json);
    memset(r, 0, sizeof(*r));
}

typedef struct {
    pdm_launch_t *l;
    const pdm_launch_request_t *reqs;
    pdm_launch_response_t *out;
    int n;
    uint64_t first_id;
    int *state;     /* 0 not started, 1 generating, 2 finished */
    double *t0;     /* dispatch time of each request */
} pdm__gen_t;

/* Reads one event of the decode node and applies it; *event receives its name (static). */
static int pdm__decode_event(pdm__gen_t *g, double deadline, char *name, size_t name_size,
                             uint64_t *id_out)
{
    pdm_launch_t *l = g->l;
    char *line = NULL;
    int st = pdm__read_line(&l->proc[l->n], -1, deadline, &line);
    if (st) return st;
    cJSON *o = cJSON_Parse(line);
    free(line);
    const cJSON *ev = o ? cJSON_GetObjectItem(o, "event") : NULL;
    if (!cJSON_IsString(ev)) {
        cJSON_Delete(o);
        return pdm_error_set(PDM_EFORMAT, "the decode node sent a malformed line");
    }
    snprintf(name, name_size, "%s", ev->valuestring);
    double idd = pdm__num(o, "id");
    *id_out = (uint64_t)idd;
    int i = idd >= (double)g->first_id ? (int)((uint64_t)idd - g->first_id) : -1;
    pdm_launch_response_t *r = i >= 0 && i < g->n ? &g->out[i] : NULL;
    const cJSON *err = cJSON_GetObjectItem(o, "error");
    if (r && !strcmp(name, "done")) {
        const cJSON *toks = cJSON_GetObjectItem(o, "tokens"), *t;
        int k = cJSON_GetArraySize(toks);
        r->tokens = malloc(sizeof(int32_t) * (size_t)(k ? k : 1));
        r->n_tokens = 0;
        cJSON_ArrayForEach(t, toks)
        {
            if (r->tokens && cJSON_IsNumber(t)) r->tokens[r->n_tokens++] = t->valueint;
        }
        const cJSON *text = cJSON_GetObjectItem(o, "text"), *fin = cJSON_GetObjectItem(o, "finish");
        r->text = strdup(cJSON_IsString(text) ? text->valuestring : "");
        snprintf(r->finish, sizeof(r->finish), "%s", cJSON_IsString(fin) ? fin->valuestring : "?");
        r->total = pdm_now() - g->t0[i];
        r->step_seconds = pdm__num(o, "step_seconds");
        r->kv_seconds = pdm__num(o, "kv_seconds");
        r->kv_bytes = pdm__num(o, "kv_bytes");
        cJSON *nb = cJSON_DetachItemFromObject(o, "n_best"), *bm = cJSON_DetachItemFromObject(o, "beam");
        if (nb || bm) { /* beam search: keep its report for the caller */
            cJSON *j = cJSON_CreateObject();
            if (nb) cJSON_AddItemToObject(j, "n_best", nb);
            if (bm) cJSON_AddItemToObject(j, "beam", bm);
            r->beam_json = cJSON_PrintUnformatted(j);
            cJSON_Delete(j);
        }
        const cJSON *offl = cJSON_GetObjectItem(o, "offload");
        free(r->offload_json);
        r->offload_json = cJSON_IsObject(offl) ? cJSON_PrintUnformatted(offl) : NULL;
        r->ok = 1;
        g->state[i] = 2;
    } else if (r && !strcmp(name, "error") && g->state[i] != 2) {
        snprintf(r->error, sizeof(r->error), "decode node: %s",
                 cJSON_IsString(err) ? err->valuestring : "failed");
        r->ok = 0;
        g->state[i] = 2;
    } else if (!strcmp(name, "reserved") && cJSON_IsFalse(cJSON_GetObjectItem(o, "ok")) && r) {
        snprintf(r->error, sizeof(r->error), "decode node: %s",
                 cJSON_IsString(err) ? err->valuestring : "reservation refused");
        r->ok = 0;
        g->state[i] = 2;
    }
    cJSON_Delete(o);
    return PDM_OK;
}

int pdm_launch_generate(pdm_launch_t *l, const pdm_launch_request_t *reqs, int n,
                        pdm_launch_response_t *out)
{
    if (!l->has_decode) return pdm_error_set(PDM_ESTATE, "the mesh has no decode node");
    int state[n > 0 ? n : 1];
    double t0[n > 0 ? n : 1];
    memset(state, 0, sizeof(state));
    memset(out, 0, sizeof(*out) * (size_t)n);
    pdm__gen_t g = {.l = l, .reqs = reqs, .out = out, .n = n, .first_id = l->next_request + 1,
                    .state = state, .t0 = t0};
    l->next_request += (uint64_t)n;
    double deadline = pdm_now();
    for (int i = 0; i < n; i++)
        deadline += reqs[i].timeout > 0 ? reqs[i].timeout : l->p.timeout;
    int mesh_st = PDM_OK;
    char name[32];
    uint64_t ev_id;
    for (int i = 0; i < n && !mesh_st; i++) {
        const pdm_launch_request_t *q = &reqs[i];
        const uint64_t id = g.first_id + (uint64_t)i;
        /* Who computes which tokens: the decode node posts its receives accordingly. A
         * follow-up turn starts after the prefix the group still holds (at least one token
         * is computed: its logits give the first token). */
        int32_t start = 0;
        if (q->reuse_prefix && !q->chunks && q->method != PDM_PREFILL_TSP) {
            start = PDM_MIN(pdm_prefill_conv_common(&l->conv, q->tokens, q->n_tokens),
                            q->n_tokens - 1);
            if (pdm_prefill_method_is_kvr(q->method) &&
                (pdm_prefill_conv_chain_head(&l->conv, l->n, start) < 0 ||
                 q->n_tokens - start < l->n))
                start = 0;
        }
        pdm_prefill_range_t ranges[PDM_PREFILL_MAX_PLAN];
        int n_prefix, nr = pdm_prefill_conv_plan(&l->conv, q->method, l->n, start,
                                                 q->n_tokens - start, q->chunks, 1, ranges,
                                                 &n_prefix);
        if (nr < 0) {
            snprintf(out[i].error, sizeof(out[i].error), "prefill: %s", pdm_error_last());
            state[i] = 2;
            continue;
        }
        out[i].cached = start;
        cJSON *cmd = cJSON_CreateObject();
        cJSON_AddStringToObject(cmd, "cmd", "reserve");
        cJSON_AddNumberToObject(cmd, "id", (double)id);
        cJSON_AddNumberToObject(cmd, "attempt", 0);
        cJSON_AddNumberToObject(cmd, "n_prompt", q->n_tokens);
        cJSON_AddNumberToObject(cmd, "max_new", q->max_new);
        cJSON *arr = cJSON_AddArrayToObject(cmd, "ranges");
        for (int k = 0; k < nr; k++) {
            int v[4] = {ranges[k].start, ranges[k].len, ranges[k].rank, ranges[k].chunk};
            cJSON_AddItemToArray(arr, cJSON_CreateIntArray(v, 4));
        }
        if (q->beams > 0) cJSON_AddNumberToObject(cmd, "beams", q->beams);
        mesh_st = pdm__send_json(&l->proc[l->n], -1, cmd);
        cJSON_Delete(cmd);
        /* Wait for this reservation's answer; other requests' events are applied meanwhile. */
        while (!mesh_st) {
            mesh_st = pdm__decode_event(&g, deadline, name, sizeof(name), &ev_id);
            if (!mesh_st && !strcmp(name, "reserved") && ev_id == id) break;
        }
        if (mesh_st || state[i] == 2) continue; /* refused: out[i] says why */
        pdm_prefill_stream_t stream = {.peer = 0, .request_id = id, .attempt = 0,
                                       .max_in_flight = 64};
        pdm_prefill_task_t task = {.method = q->method, .start = start, .prefix = q->tokens,
                                   .tokens = q->tokens + start, .n_tokens = q->n_tokens - start,
                                   .chunks = q->chunks, .stream = &stream};
        pdm_launch_result_t res;
        t0[i] = pdm_now();
        int st = pdm_launch_task(l, &task, NULL, NULL, &res);
        if (st) {
            snprintf(out[i].error, sizeof(out[i].error), "prefill: %s", pdm_error_last());
            state[i] = 2;
            cmd = cJSON_CreateObject(); /* release the reservation at once */
            cJSON_AddStringToObject(cmd, "cmd", "cancel");
            cJSON_AddNumberToObject(cmd, "id", (double)id);
            mesh_st = pdm__send_json(&l->proc[l->n], -1, cmd);
            cJSON_Delete(cmd);
            continue;
        }
        out[i].ttft = res.ttft;
        for (int r = 0; r < l->n; r++)
            out[i].prefill_wait = fmax(out[i].prefill_wait, res.rank[r].t_wait);
        cmd = cJSON_CreateObject();
        cJSON_AddStringToObject(cmd, "cmd", "start");
        cJSON_AddNumberToObject(cmd, "id", (double)id);
        cJSON_AddNumberToObject(cmd, "first_token", res.first_token);
        cJSON_AddNumberToObject(cmd, "temp", q->sp.temperature);
        cJSON_AddNumberToObject(cmd, "top_k", q->sp.top_k);
        cJSON_AddNumberToObject(cmd, "top_p", q->sp.top_p);
        cJSON_AddNumberToObject(cmd, "min_p", q->sp.min_p);
        cJSON_AddNumberToObject(cmd, "repeat_penalty", q->sp.repeat_penalty);
        cJSON_AddNumberToObject(cmd, "seed", (double)q->sp.seed);
        if (q->timeout > 0) cJSON_AddNumberToObject(cmd, "timeout", q->timeout);
        if (q->beams > 0) { /* beam search picks the first token itself from the last one */
            cJSON_AddNumberToObject(cmd, "beams", q->beams);
            cJSON_AddNumberToObject(cmd, "length_penalty", q->length_penalty);
            cJSON_AddNumberToObject(cmd, "n_best", q->n_best > 0 ? q->n_best : 1);
            cJSON_AddStringToObject(cmd, "early_stopping",
                                    q->early_stopping ? q->early_stopping : "heuristic");
            cJSON_AddNumberToObject(cmd, "prompt_last", q->tokens[q->n_tokens - 1]);
        }
        cJSON *stops = cJSON_AddArrayToObject(cmd, "stop");
        for (int k = 0; k < q->n_stops; k++)
            cJSON_AddItemToArray(stops, cJSON_CreateString(q->stops[k]));
        mesh_st = pdm__send_json(&l->proc[l->n], -1, cmd);
        cJSON_Delete(cmd);
        state[i] = 1;
    }
    /* Collect until every request has ended. */
    for (;;) {
        int open_ = 0;
        for (int i = 0; i < n; i++) open_ += state[i] == 1;
        if (!open_ || mesh_st) break;
        mesh_st = pdm__decode_event(&g, deadline, name, sizeof(name), &ev_id);
    }
    if (mesh_st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        for (int i = 0; i < n; i++)
            if (state[i] != 2) snprintf(out[i].error, sizeof(out[i].error), "%s", msg);
        return pdm_error_set(mesh_st, "%s", msg);
    }
    return PDM_OK;
}

int pdm_launch_decode_usage(pdm_launch_t *l, int *held, long *kv_slots)
{
    if (!l->has_decode) return pdm_error_set(PDM_ESTATE, "the mesh has no decode node");
    int st = pdm__write_all(&l->proc[l->n], -1, "{\"cmd\":\"stats\"}\n");
    double deadline = pdm_now() + l->p.timeout;
    /* Events of finished requests may still be queued before the answer: skip them. */
    while (!st) {
        char *line = NULL;
        st = pdm__read_line(&l->proc[l->n], -1, deadline, &line);
        if (st) break;
        cJSON *o = cJSON_Parse(line);
        free(line);
        const cJSON *ev = o ? cJSON_GetObjectItem(o, "event") : NULL;
        if (cJSON_IsString(ev) && !strcmp(ev->valuestring, "stats")) {
            *held = (int)pdm__num(o, "held");
            *kv_slots = (long)pdm__num(o, "kv_slots");
            cJSON_Delete(o);
            return PDM_OK;
        }
        cJSON_Delete(o);
    }
    return st;
}
