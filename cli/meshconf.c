/*
 * meshconf.c - where a mesh started by `pdmesh up --config FILE` listens, read from the same
 * YAML file (libyaml): router.client, router.admin and run_dir (which holds admin-token and
 * pids). Used by `pdmesh generate --mesh/--config` and `pdctl --mesh/--config`.
 */
#include "cli/meshconf.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <yaml.h>

/* The scalar value of `key` in mapping node `map`, or NULL. */
static const char *yaml_map_get(yaml_document_t *doc, yaml_node_t *map, const char *key,
                                yaml_node_t **node_out)
{
    if (!map || map->type != YAML_MAPPING_NODE) return NULL;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *k = yaml_document_get_node(doc, p->key);
        yaml_node_t *v = yaml_document_get_node(doc, p->value);
        if (!k || k->type != YAML_SCALAR_NODE || strcmp((const char *)k->data.scalar.value, key))
            continue;
        if (node_out) *node_out = v;
        return v && v->type == YAML_SCALAR_NODE ? (const char *)v->data.scalar.value : NULL;
    }
    return NULL;
}

int cli_mesh_config(const char *path, cli_mesh_t *out, char *err, size_t err_len)
{
    snprintf(out->client, sizeof(out->client), "tcp://127.0.0.1:7700");
    snprintf(out->admin, sizeof(out->admin), "tcp://127.0.0.1:7702");
    snprintf(out->run_dir, sizeof(out->run_dir), "run/mesh");
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_len, "cannot open mesh config %s: %s", path, strerror(errno));
        return -1;
    }
    yaml_parser_t parser;
    yaml_document_t doc;
    int rc = -1;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_file(&parser, f);
    if (!yaml_parser_load(&parser, &doc)) {
        snprintf(err, err_len, "%s: YAML error at line %zu: %s", path,
                 parser.problem_mark.line + 1, parser.problem ? parser.problem : "?");
        goto out_parser;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root || root->type != YAML_MAPPING_NODE) {
        snprintf(err, err_len, "%s: not a mesh configuration (no top-level mapping)", path);
        goto out_doc;
    }
    const char *s;
    if ((s = yaml_map_get(&doc, root, "run_dir", NULL)))
        snprintf(out->run_dir, sizeof(out->run_dir), "%s", s);
    yaml_node_t *router = NULL;
    yaml_map_get(&doc, root, "router", &router);
    if ((s = yaml_map_get(&doc, router, "client", NULL)))
        snprintf(out->client, sizeof(out->client), "%s", s);
    if ((s = yaml_map_get(&doc, router, "admin", NULL)))
        snprintf(out->admin, sizeof(out->admin), "%s", s);
    /* extra_routers (several routers): the clients' and pdctl's endpoint lists */
    yaml_node_t *extra = NULL;
    yaml_map_get(&doc, root, "extra_routers", &extra);
    for (yaml_node_item_t *it = extra && extra->type == YAML_SEQUENCE_NODE
                                    ? extra->data.sequence.items.start : NULL;
         it && it < extra->data.sequence.items.top; it++) {
        yaml_node_t *e = yaml_document_get_node(&doc, *it);
        const char *c = yaml_map_get(&doc, e, "client", NULL), *a = yaml_map_get(&doc, e, "admin", NULL);
        size_t lc = strlen(out->client), la = strlen(out->admin);
        if (c && lc + strlen(c) + 2 <= sizeof(out->client))
            snprintf(out->client + lc, sizeof(out->client) - lc, ",%s", c);
        if (a && la + strlen(a) + 2 <= sizeof(out->admin))
            snprintf(out->admin + la, sizeof(out->admin) - la, ",%s", a);
    }
    char pids[1100];
    struct stat st;
    snprintf(pids, sizeof(pids), "%s/pids", out->run_dir);
    if (stat(pids, &st)) {
        snprintf(err, err_len, "no mesh running from %s (no %s): start one with "
                 "'pdmesh up --config %s'", path, pids, path);
        goto out_doc;
    }
    rc = 0;
out_doc:
    yaml_document_delete(&doc);
out_parser:
    yaml_parser_delete(&parser);
    fclose(f);
    return rc;
}

int cli_mesh_curve_files(const cli_mesh_t *m, char *server_pub, size_t server_len, char *key,
                         size_t key_len)
{
    struct stat st;
    snprintf(server_pub, server_len, "%s/curve/server.pub", m->run_dir);
    snprintf(key, key_len, "%s/curve/client.key", m->run_dir);
    return !stat(server_pub, &st) && !stat(key, &st);
}
