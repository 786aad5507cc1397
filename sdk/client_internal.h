/* Internal helpers shared by the files of libpdmesh (not installed). */
#ifndef PDMESH_CLIENT_INTERNAL_H
#define PDMESH_CLIENT_INTERNAL_H

/* Records a message as the calling thread's pdm_client_last_error() and returns status. */
__attribute__((visibility("hidden"))) int pdm_client__fail(int status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
