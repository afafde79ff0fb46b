/* File I/O helpers the os module lacks.
 *
 * sync_file_range(fd, offset, nbytes, flags=SYNC_FILE_RANGE_WRITE): start (or
 * wait for) writeback of a byte range. The store calls it after writing each
 * layer of a chunk so the disk works while Python hashes the next layer; the
 * final fsync then has little left to do. The GIL is released around the call.
 *
 * page_residency(fd, offset, nbytes) -> bytes: one byte per page of the range
 * (from the page holding `offset`), 1 where the page cache holds it. The
 * reader sends ranges the cache does not hold to O_DIRECT reads (mincore on a
 * transient mapping; the os module has no mincore, and cachestat needs 6.5).
 */
#define _GNU_SOURCE
#include "nkv.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

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

static PyObject *
nkv_page_residency(PyObject *module, PyObject *args)
{
    int fd;
    long long offset;
    long long nbytes;
    int err = 0;
    PyObject *out;

    (void)module;
    if (!PyArg_ParseTuple(args, "iLL:page_residency", &fd, &offset, &nbytes)) {
        return NULL;
    }
    if (offset < 0 || nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "page_residency: found offset %lld and nbytes %lld, expected "
                     "both >= 0",
                     offset, nbytes);
        return NULL;
    }
    long long page = sysconf(_SC_PAGESIZE);
    long long start = offset - offset % page;
    long long span = offset + nbytes - start;
    Py_ssize_t pages = (Py_ssize_t)((span + page - 1) / page);
    out = PyBytes_FromStringAndSize(NULL, pages);
    if (out == NULL || pages == 0) {
        return out;
    }
    unsigned char *vec = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    void *map = mmap(NULL, (size_t)span, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (map == MAP_FAILED) {
        err = errno;
    } else {
        if (mincore(map, (size_t)span, vec) < 0) {
            err = errno;
        }
        munmap(map, (size_t)span);
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        Py_DECREF(out);
        return nkv_err_set("page_residency (mmap/mincore)", err);
    }
    for (Py_ssize_t i = 0; i < pages; i++) {
        vec[i] &= 1; /* the other bits are reserved */
    }
    return out;
}

static PyMethodDef nkv_fileio_methods[] = {
    {"page_residency", nkv_page_residency, METH_VARARGS,
     "page_residency(fd, offset, nbytes) -> bytes\n"
     "One byte per page of the range: 1 where the page cache holds it."},
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
