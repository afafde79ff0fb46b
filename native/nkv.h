/* Shared declarations of the npukv_store._native translation units.
 * Every exported symbol has the nkv_ prefix; everything else is static.
 * Each unit adds its entry points to the module in its own *_exec function,
 * so units can change without touching module.c's table. */
#ifndef NKV_H
#define NKV_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Copies and syscalls below this many bytes keep the GIL: releasing and
 * re-taking it costs more than a small memcpy. */
#define NKV_GIL_MINSIZE (64 * 1024)

/* Release the GIL around a blocking syscall or a large copy. No Python object
 * may be touched inside. */
#define NKV_UNLOCKED(stmt)     \
    do {                       \
        Py_BEGIN_ALLOW_THREADS \
        stmt;                  \
        Py_END_ALLOW_THREADS   \
    } while (0)

/* Set an OSError from errno `err` naming what failed; returns NULL. */
PyObject *nkv_err_set(const char *what, int err);

int nkv_fileio_exec(PyObject *module);   /* fileio.c: sync_file_range */
int nkv_checksum_exec(PyObject *module); /* checksum.c: xxh3 over block rows */
int nkv_copy_exec(PyObject *module);     /* copy.c: batched GIL-free copies */
int nkv_uring_exec(PyObject *module);    /* uring.c: io_uring engine */

#endif
