/*
 * mesh.c - `pdmesh up` / `pdmesh down`: a whole mesh (router, prefill groups, decode nodes) on
 * this machine from a YAML file (libyaml), with a generated cluster secret and admin token in
 * a run directory that also holds the logs and pids. See docs/router.md.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml.h>

#include "cli/cli.h"
#include "common/curve.h"
#include "common/health.h"
#include "common/pdm.h"
#include "common/wire.h"
#include "sdk/pdmesh_admin.h"

/* ---- a small YAML tree (maps, sequences, scalars) --------------------------------------- */

typedef struct ynode {
    int kind; /* 0 scalar, 1 map, 2 seq */
    char *text;
    struct ynode **kids; /* map: key, value, key, value...; seq: items */
    int n;
} ynode_t;

static void y_free(ynode_t *y)
{
    if (!y) return;
    for (int i = 0; i < y->n; i++) y_free(y->kids[i]);
    free(y->kids);
    free(y->text);
    free(y);
}

static ynode_t *y_parse(yaml_parser_t *p, yaml_event_t *first, int depth)
{
    if (depth > 32) return NULL;
    ynode_t *y = calloc(1, sizeof(*y));
    if (!y) return NULL;
    if (first->type == YAML_SCALAR_EVENT) {
        y->text = strndup((const char *)first->data.scalar.value, first->data.scalar.length);
        return y;
    }
    if (first->type != YAML_MAPPING_START_EVENT && first->type != YAML_SEQUENCE_START_EVENT) {
        free(y);
        return NULL;
    }
    y->kind = first->type == YAML_MAPPING_START_EVENT ? 1 : 2;
    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(p, &ev)) goto fail;
        if (ev.type == YAML_MAPPING_END_EVENT || ev.type == YAML_SEQUENCE_END_EVENT) {
            yaml_event_delete(&ev);
            return y;
        }
        ynode_t *k = y_parse(p, &ev, depth + 1);
        yaml_event_delete(&ev);
        if (!k || y->n >= 4096) {
            y_free(k);
            goto fail;
        }
        ynode_t **kids = realloc(y->kids, sizeof(*kids) * (size_t)(y->n + 1));
        if (!kids) {
            y_free(k);
            goto fail;
        }
        y->kids = kids;
        y->kids[y->n++] = k;
    }
fail:
    y_free(y);
    return NULL;
}

static int y_load(const char *path, ynode_t **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return pdm_error_set(PDM_EIO, "%s: %s", path, strerror(errno));
    yaml_parser_t p;
    yaml_parser_initialize(&p);
    yaml_parser_set_input_file(&p, f);
    ynode_t *root = NULL;
    yaml_event_t ev;
    while (!root && yaml_parser_parse(&p, &ev)) {
        int t = ev.type;
        if (t == YAML_MAPPING_START_EVENT) root = y_parse(&p, &ev, 0);
        yaml_event_delete(&ev);
        if (t == YAML_STREAM_END_EVENT || (t == YAML_MAPPING_START_EVENT && !root)) break;
    }
    int st = PDM_OK;
    if (!root)
        st = pdm_error_set(PDM_EFORMAT, "%s: line %zu: %s", path, p.problem_mark.line + 1,
                           p.problem ? p.problem : "expected a YAML mapping");
    yaml_parser_delete(&p);
    fclose(f);
    *out = root;
    return st;
}

static const ynode_t *y_get(const ynode_t *m, const char *key)
{
    if (!m || m->kind != 1) return NULL;
    for (int i = 0; i + 1 < m->n; i += 2)
        if (m->kids[i]->kind == 0 && !strcmp(m->kids[i]->text, key)) return m->kids[i + 1];
    return NULL;
}

static const char *y_str(const ynode_t *m, const char *key, const char *def)
{
    const ynode_t *v = y_get(m, key);
    return v && v->kind == 0 ? v->text : def;
}

static int y_int(const ynode_t *m, const char *key, long def, long lo, long hi, long *out)
{
    const char *s = y_str(m, key, NULL);
    if (!s) {
        *out = def;
        return PDM_OK;
    }
    if (pdm_parse_long(s, lo, hi, out))
        return pdm_error_set(PDM_EINVAL, "config: %s must be an integer in [%ld, %ld]", key, lo, hi);
    return PDM_OK;
}

/* ---- processes -------------------------------------------------------------------------- */

/* One process of the mesh: how to (re)start it. */
typedef struct {
    char name[200];
    char *argv[40];             /* strdup'ed */
    const char *curve_key;      /* $PDMESH_CURVE_KEY_FILE in its environment, or NULL */
    const char *curve_server;   /* $PDMESH_CURVE_SERVER_KEY_FILE, or NULL */
    char health[1300];          /* its health file (nodes), or "" (router) */
    pid_t pid;
    int restarts;
    int last_status;            /* wait status of its last exit (-1: none yet) */
    double started, restart_at; /* restart_at > 0: waiting out its backoff */
} mesh_proc_t;

#define MESH_MAX_PROCS 256

typedef struct {
    char run[1024];
    char bin[1024];
    mesh_proc_t procs[MESH_MAX_PROCS];
    int n;
    double health_timeout, health_stall; /* seconds; see mesh_check_health */
} mesh_t;

static int mesh_add(mesh_t *m, const char *name, char *const argv[], const char *curve_key,
                    const char *curve_server, const char *health)
{
    if (m->n == MESH_MAX_PROCS) return pdm_error_set(PDM_ERANGE, "at most %d processes",
                                                     MESH_MAX_PROCS);
    mesh_proc_t *p = &m->procs[m->n++];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    for (int i = 0; argv[i] && i < 39; i++)
        if (!(p->argv[i] = strdup(argv[i]))) return pdm_error_set(PDM_ENOMEM, "out of memory");
    p->curve_key = curve_key;
    p->curve_server = curve_server;
    snprintf(p->health, sizeof(p->health), "%s", health ? health : "");
    p->last_status = -1;
    return PDM_OK;
}

/* Starts one process: its log is run/NAME.log (appended: a restart keeps the history). */
static int mesh_start(mesh_t *m, mesh_proc_t *p)
{
    char log[1300];
    snprintf(log, sizeof(log), "%s/%s.log", m->run, p->name);
    for (char *c = log + strlen(m->run) + 1; *c; c++)
        if (*c == '/') *c = '_';
    pid_t pid = fork();
    if (pid < 0) return pdm_error_set(PDM_EIO, "fork: %s", strerror(errno));
    if (pid == 0) {
        setpgid(0, 0);
        signal(SIGTERM, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        int nul = open("/dev/null", O_RDONLY);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
        if (nul >= 0) dup2(nul, 0);
        if (p->curve_key) setenv("PDMESH_CURVE_KEY_FILE", p->curve_key, 1);
        if (p->curve_server) setenv("PDMESH_CURVE_SERVER_KEY_FILE", p->curve_server, 1);
        execv(p->argv[0], p->argv);
        fprintf(stderr, "exec %s: %s\n", p->argv[0], strerror(errno));
        _exit(127);
    }
    p->pid = pid;
    p->started = pdm_now();
    p->restart_at = 0;
    return PDM_OK;
}

/* run/pids ("NAME PID", what pdmesh down stops) and run/status ("NAME PID RESTARTS
 * LAST_EXIT"), each replaced whole (rename) so a reader never sees half a file. */
static void mesh_write_state(const mesh_t *m)
{
    static const char *const files[2] = {"pids", "status"};
    for (int k = 0; k < 2; k++) {
        char path[1100], tmp[1110];
        snprintf(path, sizeof(path), "%s/%s", m->run, files[k]);
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        FILE *f = fopen(tmp, "w");
        if (!f) continue;
        for (int i = 0; i < m->n; i++) {
            const mesh_proc_t *p = &m->procs[i];
            if (k == 0) {
                fprintf(f, "%s %d\n", p->name, (int)p->pid);
            } else {
                char last[32] = "-";
                if (p->last_status >= 0 && WIFEXITED(p->last_status))
                    snprintf(last, sizeof(last), "exit:%d", WEXITSTATUS(p->last_status));
                else if (p->last_status >= 0 && WIFSIGNALED(p->last_status))
                    snprintf(last, sizeof(last), "signal:%d", WTERMSIG(p->last_status));
                fprintf(f, "%s %d %d %s\n", p->name, (int)p->pid, p->restarts, last);
            }
        }
        if (fclose(f) == 0) rename(tmp, path);
    }
}

/* A node whose health file (common/health.h) shows it frozen or stalled is killed; the restart
 * path below brings it back, as a Kubernetes liveness probe would. Only a file this process
 * wrote counts: before its first report (model loading) the node is not judged. */
static void mesh_check_health(mesh_t *m)
{
    uint64_t now = pdm_health_now_ms();
    for (int i = 0; i < m->n; i++) {
        mesh_proc_t *p = &m->procs[i];
        pdm_health_t h;
        char why[512];
        if (!p->pid || !p->health[0] || pdm_health_read(p->health, &h) || h.pid != p->pid)
            continue;
        if (!pdm_health_judge(&h, now, (uint64_t)(m->health_timeout * 1000),
                              (uint64_t)(m->health_stall * 1000), 0, why, sizeof(why)))
            continue;
        fprintf(stderr, "supervisor: %s unhealthy: %s; killing it\n", p->name, why);
        kill(p->pid, SIGKILL);
        unlink(p->health); /* the next process writes its own */
    }
}

static volatile sig_atomic_t mesh_stopping;
static void mesh_on_term(int sig)
{
    (void)sig;
    mesh_stopping = 1;
}

/* The supervisor (its own process, started by pdmesh up): starts every process, restarts one
 * that exits with exponential backoff (0.5 s doubling to 30 s; back to 0.5 s once it ran a
 * minute), kills a node its health file shows frozen or stalled (then restarted the same
 * way), keeps run/pids and run/status current. SIGTERM (pdmesh down): stops the processes
 * (SIGTERM, SIGKILL after 10 s) in reverse order and exits. */
static void mesh_supervise(mesh_t *m)
{
    signal(SIGTERM, mesh_on_term);
    signal(SIGINT, mesh_on_term);
    for (int i = 0; i < m->n && !mesh_stopping; i++) {
        if (mesh_start(m, &m->procs[i])) fprintf(stderr, "supervisor: %s\n", pdm_error_last());
        if (i == 0) usleep(300000); /* the router binds first */
    }
    mesh_write_state(m);
    double next_health = pdm_now() + 1;
    while (!mesh_stopping) {
        int status;
        pid_t pid;
        int changed = 0;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            for (int i = 0; i < m->n; i++) {
                mesh_proc_t *p = &m->procs[i];
                if (p->pid != pid) continue;
                double ran = pdm_now() - p->started;
                double backoff = ran > 60 ? 0.5 : PDM_MIN(30.0, 0.5 * (double)(1 << PDM_MIN(p->restarts, 6)));
                if (ran > 60) p->restarts = 0;
                p->last_status = status;
                p->pid = 0;
                p->restart_at = pdm_now() + backoff;
                fprintf(stderr, "supervisor: %s (pid %d) ended after %.1f s; restart in %.1f s\n",
                        p->name, (int)pid, ran, backoff);
                changed = 1;
            }
        }
        for (int i = 0; i < m->n && !mesh_stopping; i++) {
            mesh_proc_t *p = &m->procs[i];
            if (p->pid || !p->restart_at || pdm_now() < p->restart_at) continue;
            if (mesh_start(m, p)) {
                fprintf(stderr, "supervisor: %s\n", pdm_error_last());
                p->restart_at = pdm_now() + 5;
                continue;
            }
            p->restarts++;
            changed = 1;
        }
        if (changed) mesh_write_state(m);
        if (pdm_now() >= next_health) {
            mesh_check_health(m);
            next_health = pdm_now() + 1;
        }
        usleep(50000);
    }
    for (int i = m->n - 1; i >= 0; i--)
        if (m->procs[i].pid) kill(m->procs[i].pid, SIGTERM);
    double end = pdm_now() + 10;
    for (;;) {
        int left = 0;
        for (int i = 0; i < m->n; i++) {
            mesh_proc_t *p = &m->procs[i];
            if (p->pid && waitpid(p->pid, NULL, WNOHANG) == p->pid) p->pid = 0;
            left += p->pid != 0;
        }
        if (!left) break;
        if (pdm_now() > end) {
            for (int i = 0; i < m->n; i++)
                if (m->procs[i].pid) kill(m->procs[i].pid, SIGKILL), waitpid(m->procs[i].pid, NULL, 0);
            break;
        }
        usleep(50000);
    }
    mesh_write_state(m);
    _exit(0);
}

/* Forks the supervisor, detached (its own session; log run/supervisor.log); writes its pid
 * to run/supervisor.pid. */
static int mesh_start_supervisor(mesh_t *m)
{
    char log[1100], pidf[1100];
    snprintf(log, sizeof(log), "%s/supervisor.log", m->run);
    snprintf(pidf, sizeof(pidf), "%s/supervisor.pid", m->run);
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return pdm_error_set(PDM_EIO, "fork: %s", strerror(errno));
    if (pid == 0) {
        setsid(); /* outlives `pdmesh up`; `pdmesh down` stops it */
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        int nul = open("/dev/null", O_RDWR);
        if (fd >= 0) dup2(fd, 2);
        if (nul >= 0) dup2(nul, 0), dup2(nul, 1);
        mesh_supervise(m);
    }
    FILE *f = fopen(pidf, "w");
    if (!f || fprintf(f, "%d\n", (int)pid) < 0 || fclose(f))
        return pdm_error_set(PDM_EIO, "%s: cannot write", pidf);
    /* pdmesh up reports readiness only once the pids file exists */
    char pids[1100];
    snprintf(pids, sizeof(pids), "%s/pids", m->run);
    for (int i = 0; i < 100 && access(pids, F_OK); i++) usleep(50000);
    return PDM_OK;
}

static int write_secret(const char *path, size_t bytes)
{
    uint8_t raw[64];
    if (bytes > sizeof(raw) || pdm_random_bytes(raw, bytes))
        return pdm_error_set(PDM_EIO, "no random bytes");
    char *hex = pdm_hex_encode(raw, bytes);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int st = fd >= 0 && hex && write(fd, hex, strlen(hex)) == (ssize_t)strlen(hex) ? PDM_OK : PDM_EIO;
    if (fd >= 0) close(fd);
    free(hex);
    return st ? pdm_error_set(st, "%s: cannot write", path) : PDM_OK;
}

/* Nodes alive according to the router's admin socket (the SDK's admin call, CURVE from the
 * environment), -1 when it does not answer. */
static int alive_nodes(const char *admin_ep, const char *token)
{
    Pdmesh__AdminRequest a = PDMESH__ADMIN_REQUEST__INIT;
    a.op = PDMESH__ADMIN_OP__ADMIN_NODES;
    a.token = (char *)token;
    pdm_admin_reply_t *reply;
    if (pdm_admin_call(admin_ep, &a, 1000, &reply)) return -1;
    const Pdmesh__AdminReply *r = pdm_admin_reply_get(reply);
    int n = 0;
    for (size_t i = 0; r->ok && i < r->n_nodes; i++) n += !strcmp(r->nodes[i]->state, "alive");
    pdm_admin_reply_free(reply);
    return n;
}

static int pid_alive(int pid)
{
    if (kill(pid, 0)) return 0;
    char path[64], *stat;
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    if (pdm_file_read(path, 4096, &stat, NULL)) return 0;
    char *p = strrchr(stat, ')');
    int zombie = p && p[1] == ' ' && p[2] == 'Z'; /* a zombie has exited */
    free(stat);
    return !zombie;
}

/* The supervisor's pid from run/supervisor.pid, 0 if none. */
static long mesh_supervisor_pid(const char *run)
{
    char path[1100], *txt;
    snprintf(path, sizeof(path), "%s/supervisor.pid", run);
    if (pdm_file_read(path, 64, &txt, NULL)) return 0;
    long pid = strtol(txt, NULL, 10);
    free(txt);
    return pid;
}

static int stop_all(const char *run, double grace)
{
    char path[1100];
    /* The supervisor first: it stops its processes itself, and must not restart them. */
    snprintf(path, sizeof(path), "%s/supervisor.pid", run);
    long sup = mesh_supervisor_pid(run);
    if (sup > 1 && pid_alive((int)sup)) {
        kill((pid_t)sup, SIGTERM);
        double end = pdm_now() + grace + 2;
        while (pid_alive((int)sup) && pdm_now() < end) usleep(100000);
        if (pid_alive((int)sup)) kill((pid_t)sup, SIGKILL);
    }
    unlink(path);
    snprintf(path, sizeof(path), "%s/pids", run);
    FILE *f = fopen(path, "r");
    if (!f) return pdm_error_set(PDM_ENOTFOUND, "%s: no mesh is running there", path);
    int pids[1024], n = 0;
    char name[256];
    int pid;
    while (n < 1024 && fscanf(f, "%255s %d", name, &pid) == 2)
        if (pid > 1) pids[n++] = pid;
    fclose(f);
    for (int i = n - 1; i >= 0; i--) kill(pids[i], SIGTERM);
    double end = pdm_now() + grace;
    for (;;) {
        int left = 0;
        for (int i = 0; i < n; i++) left += pid_alive(pids[i]);
        if (!left) break;
        if (pdm_now() > end) {
            for (int i = 0; i < n; i++)
                if (pid_alive(pids[i])) kill(pids[i], SIGKILL);
            fprintf(stderr, "pdmesh down: %d processes did not stop within %.0f s: killed\n", left,
                    grace);
            break;
        }
        usleep(100000);
    }
    unlink(path);
    snprintf(path, sizeof(path), "%s/status", run);
    unlink(path);
    return PDM_OK;
}

static void self_dir(char *out, size_t cap)
{
    ssize_t n = readlink("/proc/self/exe", out, cap - 1);
    if (n <= 0) {
        snprintf(out, cap, "build/bin");
        return;
    }
    out[n] = 0;
    char *slash = strrchr(out, '/');
    if (slash) *slash = 0;
}

static int mkdirs(const char *path)
{
    char tmp[1024];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(tmp, 0755);
            *p = '/';
        }
    if (mkdir(tmp, 0755) && errno != EEXIST)
        return pdm_error_set(PDM_EIO, "%s: %s", path, strerror(errno));
    return PDM_OK;
}

int cmd_up(int argc, char **argv)
{
    const char *config = "deploy/local/default.yaml";
    static const struct option opts[] = {{"config", required_argument, 0, 'c'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "c:", opts, NULL)) != -1) {
        if (c == 'c') config = optarg;
        else return cli_usage_error("up: unknown option%s", "");
    }
    ynode_t *y;
    if (y_load(config, &y)) return cli_runtime_error("up: config");
    static mesh_t m; /* the process table is large */
    memset(&m, 0, sizeof(m));
    const ynode_t *rt = y_get(y, "router");
    const char *model = y_str(y, "model", pdm_model_default_path());
    snprintf(m.run, sizeof(m.run), "%s", y_str(y, "run_dir", "run/mesh"));
    if (y_str(y, "bin_dir", NULL)) snprintf(m.bin, sizeof(m.bin), "%s", y_str(y, "bin_dir", NULL));
    else self_dir(m.bin, sizeof(m.bin));
    const char *client = y_str(rt, "client", "tcp://127.0.0.1:7700");
    const char *node = y_str(rt, "node", "tcp://127.0.0.1:7701");
    const char *admin = y_str(rt, "admin", "tcp://127.0.0.1:7702");
    long http_port = 8080, local_thr = 16, timeout = 120;
    int st = y_int(rt, "http_port", 8080, -1, 65535, &http_port);
    if (!st) st = y_int(rt, "local_threshold", 16, 0, 1 << 22, &local_thr);
    long group_pool = 0; /* router.group_pool_tokens: prefill groups' pools of conversations */
    if (!st) st = y_int(rt, "group_pool_tokens", 0, 0, 1 << 24, &group_pool);
    if (!st) st = y_int(y, "start_timeout", 120, 1, 3600, &timeout);
    long h_timeout = 10, h_stall = 120;
    if (!st) st = y_int(y, "health_timeout", 10, 2, 3600, &h_timeout);
    if (!st) st = y_int(y, "health_stall", 120, 2, 86400, &h_stall);
    m.health_timeout = (double)h_timeout;
    m.health_stall = (double)h_stall;
    const char *method = y_str(rt, "method", "auto");
    /* The nodes' KV plane: loopback for a mesh on this machine unless the file says where. */
    const char *kv_iface = y_str(y, "kv_interface", getenv("UCX_NET_DEVICES") ? NULL : "lo");
    const ynode_t *groups = y_get(y, "prefill_groups"), *decodes = y_get(y, "decode_nodes");
    if (!st && (!decodes || decodes->kind != 2 || decodes->n < 1))
        st = pdm_error_set(PDM_EINVAL, "config: decode_nodes must list at least one node");
    if (!st && groups && groups->kind != 2)
        st = pdm_error_set(PDM_EINVAL, "config: prefill_groups must be a list");
    char path[1200];
    snprintf(path, sizeof(path), "%s/pids", m.run);
    if (!st && access(path, F_OK) == 0)
        st = pdm_error_set(PDM_ESTATE, "a mesh is already running from %s (pdmesh down first)", m.run);
    if (!st) st = mkdirs(m.run);
    char secret[1100], token[1100];
    snprintf(secret, sizeof(secret), "%s/secret", m.run);
    snprintf(token, sizeof(token), "%s/admin-token", m.run);
    if (!st) st = write_secret(secret, 32);
    if (!st) st = write_secret(token, 16);
    /* curve: true - a server keypair and one client keypair per role (prefill, decode,
     * client: pdmesh generate / pdctl / Python) in run_dir/curve, and the allowlist of the
     * three client keys (docs/router.md, CURVE). */
    const char *curve_v = y_str(y, "curve", "false");
    int curve = !strcmp(curve_v, "true") || !strcmp(curve_v, "yes") || !strcmp(curve_v, "on");
    char cdir[1100], c_srv_key[1200], c_srv_pub[1200], c_allow[1200], c_pre[1200], c_dec[1200],
        c_cli[1200];
    snprintf(cdir, sizeof(cdir), "%s/curve", m.run);
    snprintf(c_srv_key, sizeof(c_srv_key), "%s/server.key", cdir);
    snprintf(c_srv_pub, sizeof(c_srv_pub), "%s/server.pub", cdir);
    snprintf(c_allow, sizeof(c_allow), "%s/allow", cdir);
    snprintf(c_pre, sizeof(c_pre), "%s/prefill.key", cdir);
    snprintf(c_dec, sizeof(c_dec), "%s/decode.key", cdir);
    snprintf(c_cli, sizeof(c_cli), "%s/client.key", cdir);
    if (!st && curve) {
        st = mkdirs(cdir);
        FILE *af = NULL;
        static const char *names[] = {"server", "prefill", "decode", "client"};
        for (int i = 0; !st && i < 4; i++) {
            char prefix[1200], f[1300], pub[PDM_CURVE_KEY_LEN + 1];
            snprintf(prefix, sizeof(prefix), "%s/%s", cdir, names[i]);
            snprintf(f, sizeof(f), "%s.key", prefix);
            unlink(f); /* fresh keys for every run */
            st = pdm_curve_keygen(prefix, pub);
            if (!st && i == 0 && !(af = fopen(c_allow, "w")))
                st = pdm_error_set(PDM_EIO, "%s: cannot write", c_allow);
            if (!st && i > 0) fprintf(af, "%s  # %s\n", pub, names[i]);
        }
        if (af && fclose(af) && !st) st = pdm_error_set(PDM_EIO, "%s: cannot write", c_allow);
    } else if (!st) {
        unlink(c_cli); /* no stale client key makes generate --mesh / pdctl --mesh use CURVE */
        unlink(c_srv_pub);
    }
    if (st) {
        y_free(y);
        return cli_runtime_error("up");
    }
    setenv("PDMESH_SECRET_FILE", secret, 1);
    unsetenv("PDMESH_SECRET");
    char b_router[1100], b_pre[1100], b_dec[1100], s_http[16], s_local[16], s_gpool[24];
    snprintf(b_router, sizeof(b_router), "%s/pdmesh-router", m.bin);
    snprintf(b_pre, sizeof(b_pre), "%s/pdmesh-prefill", m.bin);
    snprintf(b_dec, sizeof(b_dec), "%s/pdmesh-decode", m.bin);
    snprintf(s_http, sizeof(s_http), "%ld", http_port);
    snprintf(s_local, sizeof(s_local), "%ld", local_thr);
    char *ra[32] = {b_router, "--model", (char *)model, "--client", (char *)client, "--node",
                    (char *)node, "--admin", (char *)admin, "--http-port", s_http,
                    "--admin-token-file", token, "--local-threshold", s_local, "--method",
                    (char *)method};
    int n_ra = 17;
    snprintf(s_gpool, sizeof(s_gpool), "%ld", group_pool);
    ra[n_ra++] = "--group-pool-tokens";
    ra[n_ra++] = s_gpool;
    /* router.chat_template: a format name (model/chat.h) instead of the file's template */
    const char *chat_template = y_str(rt, "chat_template", NULL);
    if (chat_template) {
        ra[n_ra++] = "--chat-template";
        ra[n_ra++] = (char *)chat_template;
    }
    if (curve) {
        ra[n_ra++] = "--curve-secret-file";
        ra[n_ra++] = c_srv_key;
        ra[n_ra++] = "--curve-allow";
        ra[n_ra++] = c_allow;
    }
    ra[n_ra] = NULL;
    st = mesh_add(&m, "router", ra, NULL, NULL, NULL);
    /* extra_routers: more routers of the same mesh (active-active, docs/router.md "High
     * availability"), each with its own client/node/admin endpoints and http_port; every
     * node registers with all of them. */
    const ynode_t *extra = y_get(y, "extra_routers");
    static char node_list[4096];
    snprintf(node_list, sizeof(node_list), "%s", node);
    for (int ei = 0; !st && extra && extra->kind == 2 && ei < extra->n; ei++) {
        const ynode_t *e = extra->kids[ei];
        const char *e_client = y_str(e, "client", NULL), *e_node = y_str(e, "node", NULL),
                   *e_admin = y_str(e, "admin", NULL);
        long e_http = -1;
        st = y_int(e, "http_port", -1, -1, 65535, &e_http);
        if (!st && (!e_client || !e_node || !e_admin))
            st = pdm_error_set(PDM_EINVAL, "config: extra_routers[%d] needs client, node and "
                               "admin", ei);
        size_t used = strlen(node_list);
        if (!st && used + strlen(e_node) + 2 > sizeof(node_list))
            st = pdm_error_set(PDM_EINVAL, "config: extra_routers: too many endpoints");
        if (st) break;
        snprintf(node_list + used, sizeof(node_list) - used, ",%s", e_node);
        char name[32], e_port[16];
        snprintf(name, sizeof(name), "router-%d", ei + 1);
        snprintf(e_port, sizeof(e_port), "%ld", e_http);
        char *ea[32];
        memcpy(ea, ra, sizeof(ea));
        ea[4] = (char *)e_client;
        ea[6] = (char *)e_node;
        ea[8] = (char *)e_admin;
        ea[10] = e_port;
        st = mesh_add(&m, name, ea, NULL, NULL, NULL);
    }
    node = node_list;
    char hdir[1100], hf[1300];
    snprintf(hdir, sizeof(hdir), "%s/health", m.run);
    if (!st) st = mkdirs(hdir);
    /* the nodes take their keys from the environment (common/nodelink.c) */
    unsetenv("PDMESH_CURVE_SERVER_KEY_FILE");
    unsetenv("PDMESH_CURVE_KEY_FILE");
    int expected = 0;
    for (int gi = 0; !st && groups && gi < groups->n; gi++) {
        const ynode_t *g = groups->kids[gi];
        const char *gname = y_str(g, "name", "prefill");
        long ranks = 2, threads = 1, pool_cap = 16384;
        st = y_int(g, "ranks", 2, 1, 64, &ranks);
        if (!st) st = y_int(g, "threads", 1, 1, 256, &threads);
        /* pool_tokens: what each rank keeps at most of the router's group_pool_tokens */
        if (!st) st = y_int(g, "pool_tokens", 16384, 0, 1 << 24, &pool_cap);
        for (long k = 0; !st && k < ranks; k++) {
            char id[200], rk[16], sz[16], th[16], pc[24];
            snprintf(pc, sizeof(pc), "%ld", pool_cap);
            snprintf(id, sizeof(id), "%s/%ld", gname, k);
            snprintf(rk, sizeof(rk), "%ld", k);
            snprintf(sz, sizeof(sz), "%ld", ranks);
            snprintf(th, sizeof(th), "%ld", threads);
            snprintf(hf, sizeof(hf), "%s/%s-%ld", hdir, gname, k);
            char *pa[] = {b_pre, "--model", (char *)model, "--router", (char *)node, "--node-id", id,
                          "--group", (char *)gname, "--rank", rk, "--group-size", sz, "--threads",
                          th, "--health-file", hf, "--pool-tokens", pc,
                          kv_iface ? "--kv-interface" : NULL, (char *)kv_iface, NULL};
            st = mesh_add(&m, id, pa, curve ? c_pre : NULL, curve ? c_srv_pub : NULL, hf);
            expected++;
        }
    }
    for (int di = 0; !st && di < decodes->n; di++) {
        const ynode_t *d = decodes->kids[di];
        char id[200], th[16], kv[32], pool[32];
        long threads = 1, budget = 65536, pool_tokens = 0;
        snprintf(id, sizeof(id), "%s", y_str(d, "name", "decode"));
        st = y_int(d, "threads", 1, 1, 256, &threads);
        if (!st) st = y_int(d, "kv_budget", 65536, 1, 1L << 30, &budget);
        if (!st) st = y_int(d, "kv_pool", 0, 0, 1L << 30, &pool_tokens);
        /* windowed local layers (pdmesh-decode --kv-window: 0, or 1.5 to 8; default 2) */
        const char *win = y_str(d, "kv_window", "2");
        double r;
        if (!st && (pdm_parse_double(win, 0, 8, &r) || (r != 0 && r < 1.5)))
            st = pdm_error_set(PDM_EINVAL, "config: kv_window must be 0 or in [1.5, 8]");
        snprintf(th, sizeof(th), "%ld", threads);
        snprintf(kv, sizeof(kv), "%ld", budget);
        snprintf(pool, sizeof(pool), "%ld", pool_tokens);
        snprintf(hf, sizeof(hf), "%s/%s", hdir, id);
        for (char *q = hf + strlen(hdir) + 1; *q; q++)
            if (*q == '/') *q = '-';
        char *da[] = {b_dec, "--model", (char *)model, "--router", (char *)node, "--node-id", id,
                      "--threads", th, "--kv-budget", kv, "--kv-pool", pool,
                      "--kv-window", (char *)win, "--health-file", hf,
                      kv_iface ? "--kv-interface" : NULL, (char *)kv_iface, NULL};
        if (!st) st = mesh_add(&m, id, da, curve ? c_dec : NULL, curve ? c_srv_pub : NULL, hf);
        expected++;
    }
    if (!st) st = mesh_start_supervisor(&m);
    if (st) {
        fprintf(stderr, "pdmesh up: %s\n", pdm_error_last());
        y_free(y);
        stop_all(m.run, 5);
        return 1;
    }
    /* Ready when the router reports every node alive; pdmesh generate/pdctl's client key. */
    if (curve) {
        setenv("PDMESH_CURVE_SERVER_KEY_FILE", c_srv_pub, 1);
        setenv("PDMESH_CURVE_KEY_FILE", c_cli, 1);
    }
    char *tok = NULL;
    if (pdm_admin_load_token(token, &tok))
        fprintf(stderr, "pdmesh up: %s\n", pdm_client_last_error());
    double end = pdm_now() + (double)timeout;
    int alive = -1;
    while (tok && pdm_now() < end && (alive = alive_nodes(admin, tok)) < expected) usleep(300000);
    free(tok);
    if (alive < expected) {
        fprintf(stderr, "pdmesh up: only %d of %d nodes alive after %ld s; logs in %s; stopping\n",
                alive < 0 ? 0 : alive, expected, timeout, m.run);
        y_free(y);
        stop_all(m.run, 5);
        return 1;
    }
    printf("pdmesh: mesh up: %d nodes; client %s, admin %s", expected, client, admin);
    if (http_port >= 0) printf(", http port %ld", http_port);
    printf("\npdmesh: run directory %s (logs, pids, secret, admin-token); stop with: pdmesh down "
           "--config %s\n", m.run, config);
    y_free(y); /* the strings above point into it */
    return 0;
}

/* The run directory of `pdmesh down|status [--config FILE | --run-dir DIR]`. */
static int mesh_run_dir(int argc, char **argv, const char *what, char *dir, size_t cap)
{
    const char *config = "deploy/local/default.yaml", *run = NULL;
    static const struct option opts[] = {{"config", required_argument, 0, 'c'},
                                         {"run-dir", required_argument, 0, 'r'}, {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "c:r:", opts, NULL)) != -1) {
        if (c == 'c') config = optarg;
        else if (c == 'r') run = optarg;
        else return cli_usage_error("%s: unknown option", what);
    }
    if (run) {
        snprintf(dir, cap, "%s", run);
        return 0;
    }
    ynode_t *y = NULL;
    if (y_load(config, &y)) return cli_runtime_error(what);
    snprintf(dir, cap, "%s", y_str(y, "run_dir", "run/mesh"));
    y_free(y);
    return 0;
}

int cmd_down(int argc, char **argv)
{
    char dir[1024];
    int rc = mesh_run_dir(argc, argv, "down", dir, sizeof(dir));
    if (rc) return rc;
    if (stop_all(dir, 10)) return cli_runtime_error("down");
    printf("pdmesh: mesh in %s stopped\n", dir);
    return 0;
}

int cmd_status(int argc, char **argv)
{
    char dir[1024], path[1100];
    int rc = mesh_run_dir(argc, argv, "status", dir, sizeof(dir));
    if (rc) return rc;
    snprintf(path, sizeof(path), "%s/status", dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "%s: no mesh is running from %s\n", cli_prog, dir);
        return 1;
    }
    long sup = mesh_supervisor_pid(dir);
    printf("supervisor %ld %s\n", sup, sup > 1 && pid_alive((int)sup) ? "alive" : "gone");
    printf("%-24s %8s %6s %9s %s\n", "process", "pid", "state", "restarts", "last exit");
    char name[256], last[64];
    int pid, restarts;
    while (fscanf(f, "%255s %d %d %63s", name, &pid, &restarts, last) == 4)
        printf("%-24s %8d %6s %9d %s\n", name, pid, pid > 1 && pid_alive(pid) ? "up" : "down",
               restarts, last);
    fclose(f);
    return 0;
}

/* pdmesh health --file F [--max-age S] [--stall S] [--ready]: a node's health file judged
 * (common/health.h); the exec probe of deploy/k8s. Exit 0 healthy, 1 not, 2 usage. */
int cmd_health(int argc, char **argv)
{
    const char *file = NULL;
    double max_age = 10, stall = 120;
    int ready = 0, c;
    static const struct option opts[] = {{"file", required_argument, 0, 'f'},
                                         {"max-age", required_argument, 0, 'a'},
                                         {"stall", required_argument, 0, 's'},
                                         {"ready", no_argument, 0, 'r'},
                                         {0, 0, 0, 0}};
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'f') file = optarg;
        else if (c == 'a' && !pdm_parse_double(optarg, 0.1, 86400, &max_age)) continue;
        else if (c == 's' && !pdm_parse_double(optarg, 0.1, 86400, &stall)) continue;
        else if (c == 'r') ready = 1;
        else return cli_usage_error("health: bad option or value%s", "");
    }
    if (!file || optind < argc) return cli_usage_error("%s", "health needs --file F");
    pdm_health_t h;
    if (pdm_health_read(file, &h)) {
        printf("unhealthy: %s\n", pdm_error_last());
        return 1;
    }
    char why[512];
    int bad = pdm_health_judge(&h, pdm_health_now_ms(), (uint64_t)(max_age * 1000),
                               (uint64_t)(stall * 1000), ready, why, sizeof(why));
    printf("%s: %s\n", bad ? "unhealthy" : "ok", why);
    return bad;
}
