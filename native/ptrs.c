/* Runs given as three arrays of raw addresses and sizes, and copy_ptrs.
 *
 * copy_ptrs(src_ptrs, dst_ptrs, sizes, /, threads=0) -> int (bytes copied)
 *   memmove sizes[i] bytes from address src_ptrs[i] to dst_ptrs[i]: the CPU
 *   backend's copy_runs (npukv_store/device/cpu.py). Shares copy.c's copying
 *   half: the GIL released from _GIL_MINSIZE bytes, the bytes shared among
 *   threads from _COPY_THREAD_MINSIZE unless a run overlaps itself (then one
 *   thread, runs in order). Across threads no run may overlap another.
 *
 * The three arrays are 1-D native int64 buffers of one length (numpy arrays);
 * nkv_ptr_acquire checks every entry (at most NKV_MAX_RUNS runs, size >= 0,
 * non-zero addresses for a non-empty run, no run ending past INT64_MAX, sizes
 * adding up to at most PY_SSIZE_T_MAX) before anything is copied or enqueued,
 * for copy_ptrs and for device.c's batches alike. The
 * addresses themselves cannot be checked: the caller guarantees that each run
 * lies in memory it owns and that stays alive until the copy is done.
 */
#include "nkv.h"

#include <stdint.h>
#include <string.h>

static const char *const nkv_ptr_names[3] = {"src_ptrs", "dst_ptrs", "sizes"};

/* ------------------------------------------------------------------------ */
/* Arguments                                                                 */
/* ------------------------------------------------------------------------ */

int
nkv_ptr_addr(PyObject *obj, void *out)
{
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) {
        return 0;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return 0;
    }
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

void
nkv_ptr_release(nkv_ptr_args *a)
{
    for (int i = 0; i < a->got; i++) {
        PyBuffer_Release(&a->views[i]);
    }
    PyMem_Free(a->runs);
}

/* Array i must be native int64, 1-D, C-contiguous: the twin checks the same. */
static int
nkv_ptr_check_view(const char *fn, int i, const Py_buffer *view)
{
    const char *fmt = view->format != NULL ? view->format : "B";
    const char *code = fmt;
    if (*code == '@' || *code == '=' || *code == (PY_LITTLE_ENDIAN ? '<' : '>')) {
        code++;
    }
    if (view->itemsize != 8 || (strcmp(code, "q") != 0 && strcmp(code, "l") != 0) ||
        view->ndim != 1 || !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %s has format '%s', itemsize %zd and %d dimensions, "
                     "expected a 1-D C-contiguous native int64 array",
                     fn, nkv_ptr_names[i], fmt, view->itemsize, view->ndim);
        return -1;
    }
    return 0;
}

static int64_t
nkv_ptr_at(const Py_buffer *view, Py_ssize_t i)
{
    int64_t value;
    memcpy(&value, (const char *)view->buf + i * 8, sizeof(value)); /* unaligned ok */
    return value;
}

/* Check run i and resolve it into a->runs[i]. */
static int
nkv_ptr_check_run(const char *fn, nkv_ptr_args *a, Py_ssize_t i)
{
    int64_t src = nkv_ptr_at(&a->views[0], i);
    int64_t dst = nkv_ptr_at(&a->views[1], i);
    int64_t size = nkv_ptr_at(&a->views[2], i);
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "%s: run %zd has size %lld, expected >= 0", fn,
                     i, (long long)size);
        return -1;
    }
    if (size > 0 && (src <= 0 || dst <= 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: run %zd has src %lld and dst %lld, expected non-zero "
                     "addresses (> 0) for a run of %lld bytes",
                     fn, i, (long long)src, (long long)dst, (long long)size);
        return -1;
    }
    if (size > 0 && (src > INT64_MAX - size || dst > INT64_MAX - size)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: run %zd has src %lld and dst %lld + size %lld, expected "
                     "each to end at or below %lld",
                     fn, i, (long long)src, (long long)dst, (long long)size,
                     (long long)INT64_MAX);
        return -1;
    }
    if ((uint64_t)size > (uint64_t)PY_SSIZE_T_MAX - a->total) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the sizes add up to more than %zd, expected at most that",
                     fn, PY_SSIZE_T_MAX);
        return -1;
    }
    a->total += (size_t)size;
    a->runs[i] = (nkv_run){(char *)(uintptr_t)dst, (const char *)(uintptr_t)src,
                           (size_t)size};
    uint64_t s = (uint64_t)src, d = (uint64_t)dst, n = (uint64_t)size;
    if (n > 0 && s < d + n && d < s + n) {
        a->overlap = 1;
    }
    return 0;
}

int
nkv_ptr_acquire(const char *fn, PyObject *const objs[3], nkv_ptr_args *a)
{
    for (a->got = 0; a->got < 3; a->got++) {
        if (PyObject_GetBuffer(objs[a->got], &a->views[a->got], PyBUF_RECORDS_RO) < 0) {
            return -1;
        }
        if (nkv_ptr_check_view(fn, a->got, &a->views[a->got]) < 0) {
            a->got++;
            return -1;
        }
    }
    a->k = a->views[0].shape[0];
    for (int i = 1; i < 3; i++) {
        if (a->views[i].shape[0] != a->k) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s has %zd entries and src_ptrs %zd, expected equal "
                         "lengths",
                         fn, nkv_ptr_names[i], a->views[i].shape[0], a->k);
            return -1;
        }
    }
    /* The shape is the exporter's word (as_strided claims any): bound it before
     * sizing the runs by it. */
    if (a->k > NKV_MAX_RUNS) {
        PyErr_Format(PyExc_ValueError, "%s: found %zd runs, expected at most %zd", fn,
                     a->k, (Py_ssize_t)NKV_MAX_RUNS);
        return -1;
    }
    a->runs = PyMem_Malloc(((size_t)a->k + 1) * sizeof(nkv_run));
    if (a->runs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < a->k; i++) {
        if (nkv_ptr_check_run(fn, a, i) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Host copies                                                               */
/* ------------------------------------------------------------------------ */

static PyObject *
nkv_copy_ptrs(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", "", "threads", NULL};
    PyObject *objs[3];
    int nthreads = 0;
    nkv_ptr_args a = {0};
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|i:copy_ptrs", kwlist, &objs[0],
                                     &objs[1], &objs[2], &nthreads)) {
        return NULL;
    }
    if (nthreads < 0 || nthreads > NKV_COPY_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError,
                     "copy_ptrs: threads is %d, expected 0 (default) to %d", nthreads,
                     NKV_COPY_MAX_THREADS);
        return NULL;
    }
    if (nkv_ptr_acquire("copy_ptrs", objs, &a) == 0) {
        nthreads = a.overlap ? 1 : nthreads > 0 ? nthreads : nkv_copy_default_threads();
        if (a.total >= NKV_GIL_MINSIZE) {
            NKV_UNLOCKED(nkv_copy_all(a.runs, a.k, a.total, nthreads));
        } else {
            nkv_copy_all(a.runs, a.k, a.total, 1);
        }
        result = PyLong_FromSize_t(a.total);
    }
    nkv_ptr_release(&a);
    return result;
}

static PyMethodDef nkv_ptrs_methods[] = {
    {"copy_ptrs", (PyCFunction)(void (*)(void))nkv_copy_ptrs,
     METH_VARARGS | METH_KEYWORDS,
     "copy_ptrs($module, src_ptrs, dst_ptrs, sizes, /, threads=0)\n--\n\n"
     "memmove sizes[i] bytes from address src_ptrs[i] to dst_ptrs[i] (int64\n"
     "arrays); all runs are checked first. Returns the bytes copied."},
    {NULL, NULL, 0, NULL},
};

int
nkv_ptrs_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, nkv_ptrs_methods);
}
