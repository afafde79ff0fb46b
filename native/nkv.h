/* Shared declarations of the npukv_store._native translation units.
 * Every symbol has the nkv_ prefix; everything else is static. */
#ifndef NKV_H
#define NKV_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Copies and syscalls below this many bytes keep the GIL: releasing and
 * re-taking it costs more than a small memcpy. */
#define NKV_GIL_MINSIZE (64 * 1024)

/* Release the GIL around a blocking syscall or a large copy. No Python object
 * may be touched between the two macros. */
#define NKV_UNLOCKED(stmt) \
    do {                   \
        Py_BEGIN_ALLOW_THREADS stmt; Py_END_ALLOW_THREADS \
    } while (0)

/* Set an OSError from errno `err` naming what failed; returns NULL. */
PyObject *nkv_err_set(const char *what, int err);

/* fileio.c */
PyObject *nkv_sync_file_range(PyObject *module, PyObject *args);
int nkv_fileio_exec(PyObject *module);

#endif
