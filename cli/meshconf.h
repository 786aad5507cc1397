/*
 * meshconf.h - endpoints of a mesh started by `pdmesh up --config FILE` (cli/meshconf.c).
 */
#ifndef PDM_CLI_MESHCONF_H
#define PDM_CLI_MESHCONF_H

#include <stddef.h>

#define CLI_MESH_DEFAULT_CONFIG "deploy/local/default.yaml"

typedef struct {
    char client[1024];  /* router.client (default tcp://127.0.0.1:7700), then each
                         * extra_routers[].client, comma-separated (the SDKs fail over) */
    char admin[1024];   /* router.admin (default tcp://127.0.0.1:7702), then each
                         * extra_routers[].admin (pdctl: the first that answers) */
    char run_dir[1024]; /* run_dir (default run/mesh): admin-token, pids, logs */
} cli_mesh_t;

/* Reads the configuration at path and checks that the mesh it describes is up (its run
 * directory has a pids file). 0 on success; -1 with a sentence in err otherwise. */
int cli_mesh_config(const char *path, cli_mesh_t *out, char *err, size_t err_len);

/* CURVE files of a mesh started with `curve: true` (run_dir/curve/server.pub and
 * client.key): 1 with both paths filled when they exist, else 0. */
int cli_mesh_curve_files(const cli_mesh_t *m, char *server_pub, size_t server_len, char *key,
                         size_t key_len);

#endif
