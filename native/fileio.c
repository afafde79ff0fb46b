/* File I/O helpers the os module lacks.
 *
 * sync_file_range(fd, offset, nbytes, flags=SYNC_FILE_RANGE_WRITE): start (or
 * wait for) writeback of a byte range. The store calls it after writing each
 * layer of a chunk so the disk works while Python hashes the next layer; the
 * final fsync then has little left to do. The GIL is released around the call.
 *
 * page_residency(fd, offset, nbytes) -> bytes: one byte per page of the range
 * (from the page holding `offset`), 1 where the page cache holds it (mincore
 * on a transient mapping; the os module has no mincore).
 *
 * cached_pages(fd, ranges) -> bytes: per (offset, nbytes) range, how many of
 * its pages the page cache holds. The reader sends ranges the cache does not
 * hold to O_DIRECT reads and reads cached ones on its verifier threads. Asked
 * with cachestat(2) (Linux 6.5), which counts in the kernel's page-cache tree:
 * 66 against 727 us for mincore over a cached 64 MiB chunk on the `vm` host
 * (docs/decisions/0020). Where cachestat is missing or filtered (ENOSYS,
 * EPERM from a seccomp profile), the counts come from page_residency's
 * mincore, and cachestat is not tried again.
 */
#define _GNU_SOURCE
#include "nkv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef __NR_cachestat
#define __NR_cachestat 451 /* one number on every architecture */
#endif

/* The kernel's struct cachestat_range and struct cachestat (uapi/linux/mman.h),
 * spelled out: older headers lack them. */
struct nkv_cachestat_range {
    uint64_t off;
    uint64_t len;
};

struct nkv_cachestat {
    uint64_t nr_cache;
    uint64_t nr_dirty;
    uint64_t nr_writeback;
    uint64_t nr_evicted;
    uint64_t nr_recently_evicted;
};

/* Cleared the first time cachestat is missing or filtered (and by tests). */
static volatile int nkv_cachestat_usable = 1;

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

/* mincore of [start, start+span) (start page-aligned) into vec; 0 or errno.
 * No GIL needed. */
static int
nkv_mincore_span(int fd, long long start, long long span, unsigned char *vec)
{
    int err = 0;
    void *map = mmap(NULL, (size_t)span, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (map == MAP_FAILED) {
        return errno;
    }
    if (mincore(map, (size_t)span, vec) < 0) {
        err = errno;
    }
    munmap(map, (size_t)span);
    return err;
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
    if (offset < 0 || nbytes < 0 || offset > LLONG_MAX - nbytes) {
        PyErr_Format(PyExc_ValueError,
                     "page_residency: found offset %lld and nbytes %lld, expected "
                     "both >= 0 and offset + nbytes <= %lld",
                     offset, nbytes, LLONG_MAX);
        return NULL;
    }
    long long page = sysconf(_SC_PAGESIZE);
    long long start = offset - offset % page;
    long long span = offset + nbytes - start;
    /* rounded up without span + page - 1, which could overflow */
    Py_ssize_t pages = (Py_ssize_t)(span / page + (span % page != 0));
    out = PyBytes_FromStringAndSize(NULL, pages);
    if (out == NULL || pages == 0) {
        return out;
    }
    unsigned char *vec = (unsigned char *)PyBytes_AS_STRING(out);
    NKV_UNLOCKED(err = nkv_mincore_span(fd, start, span, vec));
    if (err != 0) {
        Py_DECREF(out);
        return nkv_err_set("page_residency (mmap/mincore)", err);
    }
    for (Py_ssize_t i = 0; i < pages; i++) {
        vec[i] &= 1; /* the other bits are reserved */
    }
    return out;
}

/* cached_pages without cachestat: one mincore over the span of all ranges,
 * counted per range. 0 or an errno. */
static int
nkv_cached_pages_mincore(int fd, const long long *ranges, Py_ssize_t n,
                         long long page, uint64_t *counts)
{
    long long first = -1;
    long long end = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long off = ranges[2 * i];
        long long len = ranges[2 * i + 1];
        if (len > 0) {
            first = (first < 0 || off < first) ? off : first;
            end = off + len > end ? off + len : end;
        }
    }
    if (first < 0) {
        return 0; /* every range is empty */
    }
    long long start = first - first % page;
    size_t pages = (size_t)((end - start) / page + ((end - start) % page != 0));
    unsigned char *vec = malloc(pages);
    if (vec == NULL) {
        return ENOMEM;
    }
    int err = nkv_mincore_span(fd, start, end - start, vec);
    for (Py_ssize_t i = 0; i < n && err == 0; i++) {
        long long off = ranges[2 * i];
        long long len = ranges[2 * i + 1];
        if (len <= 0) {
            continue;
        }
        for (long long p = (off - start) / page; p <= (off + len - 1 - start) / page; p++) {
            counts[i] += vec[p] & 1; /* the other bits are reserved */
        }
    }
    free(vec);
    return err;
}

/* counts[i] = cached pages of range i, by cachestat; 0, ENOSYS when cachestat
 * cannot be used here (counts untouched then), or another errno. */
static int
nkv_cached_pages_cachestat(int fd, const long long *ranges, Py_ssize_t n,
                           uint64_t *counts)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        struct nkv_cachestat_range range = {(uint64_t)ranges[2 * i],
                                            (uint64_t)ranges[2 * i + 1]};
        struct nkv_cachestat stat = {0, 0, 0, 0, 0};
        if (range.len == 0) {
            continue; /* a length of 0 would mean "to the end of the file" */
        }
        if (syscall(__NR_cachestat, fd, &range, &stat, 0) < 0) {
            int err = errno;
            if (err == ENOSYS || err == EPERM || err == EOPNOTSUPP) {
                nkv_cachestat_usable = 0;
                return ENOSYS;
            }
            return err;
        }
        counts[i] = stat.nr_cache;
    }
    return 0;
}

static PyObject *
nkv_cached_pages(PyObject *module, PyObject *args)
{
    int fd;
    Py_buffer view;
    int err = 0;

    (void)module;
    if (!PyArg_ParseTuple(args, "iy*:cached_pages", &fd, &view)) {
        return NULL;
    }
    Py_ssize_t n = view.len / (Py_ssize_t)(2 * sizeof(long long));
    if (view.len % (Py_ssize_t)(2 * sizeof(long long)) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "cached_pages: ranges has %zd bytes, expected int64 "
                     "(offset, nbytes) pairs (a multiple of 16)",
                     view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    const long long *ranges = (const long long *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* offset + nbytes fits: the mincore path adds them */
        if (ranges[2 * i] < 0 || ranges[2 * i + 1] < 0 ||
            ranges[2 * i] > LLONG_MAX - ranges[2 * i + 1]) {
            PyErr_Format(PyExc_ValueError,
                         "cached_pages: range %zd has offset %lld and nbytes "
                         "%lld, expected both >= 0 and offset + nbytes <= %lld",
                         i, ranges[2 * i], ranges[2 * i + 1], LLONG_MAX);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t *counts = (uint64_t *)PyBytes_AS_STRING(out);
    memset(counts, 0, (size_t)n * sizeof(uint64_t));
    long long page = sysconf(_SC_PAGESIZE);
    Py_BEGIN_ALLOW_THREADS
    err = nkv_cachestat_usable ? nkv_cached_pages_cachestat(fd, ranges, n, counts)
                               : ENOSYS;
    if (err == ENOSYS) {
        memset(counts, 0, (size_t)n * sizeof(uint64_t));
        err = nkv_cached_pages_mincore(fd, ranges, n, page, counts);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (err != 0) {
        Py_DECREF(out);
        return nkv_err_set("cached_pages (cachestat/mincore)", err);
    }
    return out;
}

static PyObject *
nkv_use_cachestat(PyObject *module, PyObject *args)
{
    PyObject *use = Py_None;
    (void)module;
    if (!PyArg_ParseTuple(args, "|O:_use_cachestat", &use)) {
        return NULL;
    }
    if (use != Py_None) { /* None: only ask (a signature default can say it) */
        int on = PyObject_IsTrue(use);
        if (on < 0) {
            return NULL;
        }
        nkv_cachestat_usable = on; /* on again: the next call finds out */
    }
    return PyBool_FromLong(nkv_cachestat_usable);
}

static PyMethodDef nkv_fileio_methods[] = {
    {"cached_pages", nkv_cached_pages, METH_VARARGS,
     "cached_pages($module, fd, ranges, /)\n--\n\n"
     "Per int64 (offset, nbytes) pair of ranges, the number of pages of that\n"
     "range the page cache holds, as native-endian uint64 (cachestat, else\n"
     "mincore; GIL released)."},
    {"_use_cachestat", nkv_use_cachestat, METH_VARARGS,
     "_use_cachestat($module, use=None, /)\n--\n\n"
     "Whether cached_pages asks cachestat; with True or False, turn that on or off\n"
     "(tests: the mincore path on a kernel that has cachestat)."},
    {"page_residency", nkv_page_residency, METH_VARARGS,
     "page_residency($module, fd, offset, nbytes, /)\n--\n\n"
     "One byte per page of the range: 1 where the page cache holds it."},
    {"sync_file_range", nkv_sync_file_range, METH_VARARGS,
     "sync_file_range($module, fd, offset, nbytes,"
     " flags=SYNC_FILE_RANGE_WRITE, /)\n--\n\n"
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
