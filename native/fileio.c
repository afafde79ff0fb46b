/* File I/O helpers the os module lacks.
 *
 * sync_file_range(fd, offset, nbytes, flags=SYNC_FILE_RANGE_WRITE): start (or
 * wait for) writeback of a byte range. The store calls it after writing each
 * layer of a chunk so the disk works while Python hashes the next layer; the
 * final fsync then has little left to do. The GIL is released around the call.
 */
#define _GNU_SOURCE
#include "nkv.h"

#include <errno.h>
#include <fcntl.h>

static PyObject *
nkv_sync_file_range(PyObject *module, PyObject *args)
{
    int fd;
    long long offset;
    long long nbytes;
    unsigned int flags = SYNC_FILE_RANGE_WRITE;
    int rc;
    int err = 0;

    (void)module;
    if (!PyArg_ParseTuple(args, "iLL|I:sync_file_range", &fd, &offset, &nbytes,
                          &flags)) {
        return NULL;
    }
    if (offset < 0 || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "sync_file_range: offset and nbytes must be >= 0");
        return NULL;
    }
    NKV_UNLOCKED(rc = sync_file_range(fd, (off64_t)offset, (off64_t)nbytes, flags);
                 if (rc < 0) err = errno);
    if (rc < 0) {
        return nkv_err_set("sync_file_range", err);
    }
    Py_RETURN_NONE;
}

static PyMethodDef nkv_fileio_methods[] = {
    {"sync_file_range", nkv_sync_file_range, METH_VARARGS,
     "sync_file_range(fd, offset, nbytes, flags=SYNC_FILE_RANGE_WRITE)\n"
     "Start writeback of a file range (GIL released)."},
    {NULL, NULL, 0, NULL},
};

int
nkv_fileio_exec(PyObject *module)
{
    if (PyModule_AddFunctions(module, nkv_fileio_methods) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "SYNC_FILE_RANGE_WAIT_BEFORE",
                                SYNC_FILE_RANGE_WAIT_BEFORE) < 0 ||
        PyModule_AddIntConstant(module, "SYNC_FILE_RANGE_WRITE",
                                SYNC_FILE_RANGE_WRITE) < 0 ||
        PyModule_AddIntConstant(module, "SYNC_FILE_RANGE_WAIT_AFTER",
                                SYNC_FILE_RANGE_WAIT_AFTER) < 0) {
        return -1;
    }
    return 0;
}
