/*
 * ctl.c - control lines on stdio between a daemon (pdmesh-prefill, pdmesh-decode) and its
 * launcher (common/pdm.h). Node-only: linked into the daemons and the CLI, not into libpdmesh
 * (COMMON_NODE_SRC in the Makefile).
 */
#include "common/pdm.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cjson/cJSON.h>

static FILE *pdm__ctl;

int pdm_ctl_open(void)
{
    int fd = dup(1);
    if (fd < 0 || !(pdm__ctl = fdopen(fd, "w")) || dup2(2, 1) < 0) {
        if (fd >= 0 && !pdm__ctl) close(fd);
        return pdm_error_set(PDM_EIO, "cannot set up the protocol stream on stdout");
    }
    return PDM_OK;
}

void pdm_ctl_close(void)
{
    if (pdm__ctl) fclose(pdm__ctl);
    pdm__ctl = NULL;
}

void pdm_ctl_emit(cJSON *obj)
{
    char *s = cJSON_PrintUnformatted(obj);
    if (s && pdm__ctl) {
        fprintf(pdm__ctl, "%s\n", s);
        fflush(pdm__ctl);
    }
    free(s);
    cJSON_Delete(obj);
}

void pdm_ctl_hello(const void *address, size_t len)
{
    char *hex = pdm_hex_encode(address, len);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", "hello");
    cJSON_AddStringToObject(o, "address", hex ? hex : "");
    cJSON_AddNumberToObject(o, "pid", (double)getpid());
    pdm_ctl_emit(o);
    free(hex);
}
