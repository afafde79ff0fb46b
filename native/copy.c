/* Batched copies: many byte runs between buffers in one call, GIL released.
 *
 * copy_runs(srcs, dsts, runs, /, threads=0) -> int (total bytes copied)
 *   srcs     sequence of C-contiguous buffers (PyBUF_SIMPLE)
 *   dsts     sequence of writable C-contiguous buffers (PyBUF_WRITABLE)
 *   runs     C-contiguous native int64 buffer of shape [k, 5]; row i is
 *            (src_index, src_offset, dst_index, dst_offset, nbytes)
 *   threads  0: min(4, online CPUs); else 1..NKV_COPY_MAX_THREADS
 *
 * The worker half of the asynchronous data path: gather the rows of many
 * per-layer tensors into one staging-ring region, scatter a region back into
 * them, gather blocks from a paged buffer. One call per transfer replaces one
 * numpy.copyto per row, each a Python call made with the GIL held.
 *
 * Validation: every run is checked against its buffers before any byte moves,
 * so a bad run raises ValueError (naming the run, what was found and what was
 * expected) and every destination is left untouched. Exporters word their
 * refusals differently (bytes: BufferError, numpy: ValueError); both become one
 * ValueError naming the argument, with the exporter's as __cause__.
 *
 * Overlap: each run is copied as if by memmove, so its source and destination
 * may overlap (compacting within one buffer); a call holding such a run never
 * splits across threads. Single-threaded calls (threads=1, or fewer than
 * _COPY_THREAD_MINSIZE bytes in all) apply the runs in order, so a run sees
 * the writes of the runs before it. Across threads the order is unspecified:
 * there, no run's destination may overlap another run's source or destination.
 *
 * Threads: from NKV_GIL_MINSIZE bytes on the GIL is released; from
 * NKV_COPY_THREAD_MINSIZE on the threads share the bytes, 1 MiB granules
 * taken in turn, splitting big runs, since one core's memmove does not use all
 * of a socket's memory bandwidth; they copy with non-temporal stores where the
 * CPU has them (stream_avx2.c): destinations that large leave the cache
 * anyway, and streaming skips reading each line before writing it. Threads
 * are created per call and joined before it returns; a persistent pool was
 * rejected: it would not survive fork() and would need a shutdown path, to
 * save some tens of microseconds per 4 MiB. If a thread cannot be created the
 * others take its granules. The workers see only C structs (no Python object,
 * no GIL) and share one atomic counter.
 */
#include "nkv.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Below this many bytes in all, extra threads cost more than they save. */
#define NKV_COPY_THREAD_MINSIZE (4 * 1024 * 1024)
#define NKV_COPY_DEFAULT_THREADS 4
#define NKV_COPY_COLUMNS 5

/* Threads take the bytes GRANULE at a time from a shared counter: a thread
 * the scheduler sets aside (a busy core, a VM's stolen time) holds up the call
 * by one granule at most, where an equal share per thread held it up by the
 * whole share (docs/decisions/0021). */
#define NKV_COPY_GRANULE_BYTES (1024 * 1024)

/* The work of one parallel call, shared by its threads. */
typedef struct {
    const nkv_run *runs;
    const size_t *starts; /* starts[i]: offset of runs[i] in the call's bytes */
    Py_ssize_t k;
    size_t total;
    size_t next; /* the next granule's first byte (atomic) */
    nkv_stream_copy_fn stream; /* or NULL: memmove */
} nkv_copy_work;

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

/* PyErr_Fetch is deprecated from 3.12 on (-Werror); its replacement is new. */
static PyObject *
nkv_copy_take_exc(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void
nkv_copy_give_exc(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef(Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* The exporter refused the buffer: raise one ValueError naming `what` (src or
 * dst) and `index`, the refusal as __cause__. TypeError (not a buffer at all)
 * and MemoryError pass through. */
static void
nkv_copy_refused(const char *what, Py_ssize_t index, const char *expected)
{
    if (!PyErr_ExceptionMatches(PyExc_BufferError) &&
        !PyErr_ExceptionMatches(PyExc_ValueError)) {
        return;
    }
    PyObject *cause = nkv_copy_take_exc();
    PyErr_Format(PyExc_ValueError, "copy_runs: %s %zd is not a %s buffer", what,
                 index, expected);
    PyObject *exc = nkv_copy_take_exc();
    PyException_SetCause(exc, cause); /* steals cause */
    nkv_copy_give_exc(exc);
}

/* ------------------------------------------------------------------------ */
/* Arguments                                                                 */
/* ------------------------------------------------------------------------ */

/* runs must be native int64 [k, 5], C-contiguous: the twin checks the same. */
static int
nkv_copy_check_runs(const Py_buffer *view)
{
    const char *fmt = view->format != NULL ? view->format : "B";
    const char *code = fmt;
    if (*code == '@' || *code == '=' || *code == (PY_LITTLE_ENDIAN ? '<' : '>')) {
        code++;
    }
    if (view->itemsize != 8 || (strcmp(code, "q") != 0 && strcmp(code, "l") != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: runs has format '%s' and itemsize %zd, "
                     "expected native int64 ('q' or 'l', itemsize 8)",
                     fmt, view->itemsize);
        return -1;
    }
    if (view->ndim != 2) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: runs has %d dimensions, expected shape [k, 5]",
                     view->ndim);
        return -1;
    }
    if (view->shape[1] != NKV_COPY_COLUMNS) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: runs has %zd columns, expected shape [k, 5]",
                     view->shape[1]);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_runs: runs is not C-contiguous, expected a "
                        "C-contiguous [k, 5] int64 array");
        return -1;
    }
    /* The shape is the exporter's word: bound it before sizing anything by it */
    if (view->shape[0] < 0 || view->shape[0] > NKV_MAX_RUNS) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: runs has %zd rows, expected 0..%zd",
                     view->shape[0], (Py_ssize_t)NKV_MAX_RUNS);
        return -1;
    }
    return 0;
}

/* Acquire views[0..n) from seq; *got counts the ones to release. */
static int
nkv_copy_get_views(PyObject *seq, Py_buffer *views, Py_ssize_t *got, int writable)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
    for (*got = 0; *got < n; (*got)++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, *got), &views[*got],
                               flags) < 0) {
            nkv_copy_refused(writable ? "dst" : "src", *got,
                             writable ? "writable C-contiguous" : "C-contiguous");
            return -1;
        }
    }
    return 0;
}

/* Check row i's numbers against the buffers; fill out. 0, or -1 with
 * ValueError. Offsets are compared, never added: no overflow. */
static int
nkv_copy_check_run(Py_ssize_t i, const int64_t row[NKV_COPY_COLUMNS],
                   const Py_buffer *srcs, Py_ssize_t nsrcs, const Py_buffer *dsts,
                   Py_ssize_t ndsts, nkv_run *out)
{
    static const char *const names[2] = {"src", "dst"};
    const Py_buffer *bufs[2] = {srcs, dsts};
    const Py_ssize_t counts[2] = {nsrcs, ndsts};
    const int64_t nbytes = row[4];

    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: run %zd has nbytes %lld, expected >= 0", i,
                     (long long)nbytes);
        return -1;
    }
    for (int side = 0; side < 2; side++) {
        int64_t index = row[2 * side];
        if (index < 0 || index >= counts[side]) {
            PyErr_Format(PyExc_ValueError,
                         "copy_runs: run %zd has %s_index %lld, expected 0 <= "
                         "%s_index < %zd",
                         i, names[side], (long long)index, names[side], counts[side]);
            return -1;
        }
    }
    for (int side = 0; side < 2; side++) {
        const Py_buffer *view = &bufs[side][row[2 * side]];
        int64_t offset = row[2 * side + 1];
        if (offset < 0 || offset > view->len || nbytes > view->len - offset) {
            PyErr_Format(PyExc_ValueError,
                         "copy_runs: run %zd has %s %lld offset %lld + nbytes "
                         "%lld, expected within that %s's %zd bytes",
                         i, names[side], (long long)row[2 * side], (long long)offset,
                         (long long)nbytes, names[side], view->len);
            return -1;
        }
    }
    /* An empty buffer may have buf == NULL, and NULL + 0 is undefined in C;
     * empty runs are never dereferenced, so they get no address at all. */
    out->src = nbytes > 0 ? (const char *)srcs[row[0]].buf + row[1] : NULL;
    out->dst = nbytes > 0 ? (char *)dsts[row[2]].buf + row[3] : NULL;
    out->nbytes = (size_t)nbytes;
    return 0;
}

/* Check every run and resolve it; *total gets the byte count and *overlap
 * whether any run's source and destination overlap. */
static int
nkv_copy_resolve(const Py_buffer *runs_view, const Py_buffer *srcs,
                 Py_ssize_t nsrcs, const Py_buffer *dsts, Py_ssize_t ndsts,
                 nkv_run *runs, size_t *total, int *overlap)
{
    const char *rows = (const char *)runs_view->buf;
    Py_ssize_t k = runs_view->shape[0];
    *total = 0;
    *overlap = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t row[NKV_COPY_COLUMNS];
        /* memcpy: a buffer exporter need not align its int64s */
        memcpy(row, rows + i * (Py_ssize_t)sizeof(row), sizeof(row));
        if (nkv_copy_check_run(i, row, srcs, nsrcs, dsts, ndsts, &runs[i]) < 0) {
            return -1;
        }
        if (runs[i].nbytes > (size_t)PY_SSIZE_T_MAX - *total) {
            PyErr_Format(PyExc_ValueError,
                         "copy_runs: the runs' nbytes add up to more than %zd, "
                         "expected at most that",
                         PY_SSIZE_T_MAX);
            return -1;
        }
        *total += runs[i].nbytes;
        uintptr_t s = (uintptr_t)runs[i].src, d = (uintptr_t)runs[i].dst;
        if (runs[i].nbytes > 0 && s < d + runs[i].nbytes && d < s + runs[i].nbytes) {
            *overlap = 1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Copying (no GIL from here to the method)                                  */
/* ------------------------------------------------------------------------ */

/* The run holding byte `offset` of the call: the last i with starts[i] <=
 * offset (runs of 0 bytes start where the next run does, so never chosen). */
static Py_ssize_t
nkv_copy_find_run(const nkv_copy_work *work, size_t offset)
{
    Py_ssize_t lo = 0, hi = work->k - 1;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo + 1) / 2;
        if (work->starts[mid] <= offset) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

static void *
nkv_copy_worker(void *arg)
{
    nkv_copy_work *work = arg;
    for (;;) {
        size_t begin =
            __atomic_fetch_add(&work->next, NKV_COPY_GRANULE_BYTES, __ATOMIC_RELAXED);
        if (begin >= work->total) {
            return NULL;
        }
        size_t end = work->total - begin < NKV_COPY_GRANULE_BYTES
                         ? work->total
                         : begin + NKV_COPY_GRANULE_BYTES;
        for (Py_ssize_t r = nkv_copy_find_run(work, begin); begin < end; r++) {
            const nkv_run *run = &work->runs[r];
            size_t skip = begin - work->starts[r];
            size_t n = run->nbytes - skip < end - begin ? run->nbytes - skip
                                                        : end - begin;
            if (n > 0 && work->stream != NULL) {
                work->stream(run->dst + skip, run->src + skip, n);
            } else if (n > 0) {
                memmove(run->dst + skip, run->src + skip, n);
            }
            begin += n;
        }
    }
}

/* 0, or -1 when the offsets table cannot be allocated (the caller copies on
 * its own thread). */
static int
nkv_copy_parallel(const nkv_run *runs, Py_ssize_t k, size_t total, int nthreads)
{
    pthread_t tids[NKV_COPY_MAX_THREADS];
    int started[NKV_COPY_MAX_THREADS] = {0};
    size_t *starts = malloc((size_t)k * sizeof(size_t));
    if (starts == NULL) {
        return -1;
    }
    size_t offset = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        starts[i] = offset;
        offset += runs[i].nbytes;
    }
    nkv_copy_work work = {runs, starts, k, total, 0, nkv_stream_copy_kernel()};
    for (int t = 1; t < nthreads; t++) {
        /* no thread to be had: the others take its granules */
        started[t] = pthread_create(&tids[t], NULL, nkv_copy_worker, &work) == 0;
    }
    nkv_copy_worker(&work);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) {
            pthread_join(tids[t], NULL);
        }
    }
    free(starts);
    return 0;
}

void
nkv_copy_all(const nkv_run *runs, Py_ssize_t k, size_t total, int nthreads)
{
    if (nthreads > 1 && total >= NKV_COPY_THREAD_MINSIZE &&
        nkv_copy_parallel(runs, k, total, nthreads) == 0) {
        return;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (runs[i].nbytes > 0) {
            memmove(runs[i].dst, runs[i].src, runs[i].nbytes);
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Method                                                                    */
/* ------------------------------------------------------------------------ */

int
nkv_copy_default_threads(void)
{
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1) {
        return 1;
    }
    return cpus < NKV_COPY_DEFAULT_THREADS ? (int)cpus : NKV_COPY_DEFAULT_THREADS;
}

/* Everything the method acquires, released in one place. */
typedef struct {
    PyObject *srcs_seq, *dsts_seq;
    Py_buffer runs_view;
    int have_runs;
    Py_buffer *views; /* nsrcs source views, then ndsts destination views */
    Py_ssize_t nsrcs, ndsts, got_srcs, got_dsts;
    nkv_run *runs;
} nkv_copy_args;

static void
nkv_copy_release(nkv_copy_args *a)
{
    for (Py_ssize_t i = 0; i < a->got_srcs; i++) {
        PyBuffer_Release(&a->views[i]);
    }
    for (Py_ssize_t i = 0; i < a->got_dsts; i++) {
        PyBuffer_Release(&a->views[a->nsrcs + i]);
    }
    if (a->have_runs) {
        PyBuffer_Release(&a->runs_view);
    }
    PyMem_Free(a->views);
    PyMem_Free(a->runs);
    Py_XDECREF(a->srcs_seq);
    Py_XDECREF(a->dsts_seq);
}

/* Acquire all of the arguments' buffers, in the order the twin checks them. */
static int
nkv_copy_acquire(nkv_copy_args *a, PyObject *srcs, PyObject *dsts, PyObject *runs)
{
    if (PyObject_GetBuffer(runs, &a->runs_view, PyBUF_RECORDS_RO) < 0) {
        return -1;
    }
    a->have_runs = 1;
    if (nkv_copy_check_runs(&a->runs_view) < 0) {
        return -1;
    }
    /* tuples: a __buffer__ run while the views are taken cannot resize them */
    a->srcs_seq = nkv_tuple_of(srcs, "copy_runs: srcs must be a sequence");
    a->dsts_seq = a->srcs_seq == NULL ? NULL
                  : nkv_tuple_of(dsts, "copy_runs: dsts must be a sequence");
    if (a->dsts_seq == NULL) {
        return -1;
    }
    a->nsrcs = PySequence_Fast_GET_SIZE(a->srcs_seq);
    a->ndsts = PySequence_Fast_GET_SIZE(a->dsts_seq);
    a->views = PyMem_Calloc((size_t)(a->nsrcs + a->ndsts) + 1, sizeof(Py_buffer));
    a->runs = PyMem_Malloc(((size_t)a->runs_view.shape[0] + 1) * sizeof(nkv_run));
    if (a->views == NULL || a->runs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (nkv_copy_get_views(a->srcs_seq, a->views, &a->got_srcs, 0) < 0) {
        return -1;
    }
    return nkv_copy_get_views(a->dsts_seq, a->views + a->nsrcs, &a->got_dsts, 1);
}

static PyObject *
nkv_copy_runs(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"", "", "", "threads", NULL};
    PyObject *srcs, *dsts, *runs;
    int nthreads = 0;
    nkv_copy_args a = {0};
    size_t total = 0;
    int overlap = 0;
    PyObject *result = NULL;

    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|i:copy_runs", kwlist, &srcs,
                                     &dsts, &runs, &nthreads)) {
        return NULL;
    }
    if (nthreads < 0 || nthreads > NKV_COPY_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: threads is %d, expected 0 (default) to %d",
                     nthreads, NKV_COPY_MAX_THREADS);
        return NULL;
    }
    if (nkv_copy_acquire(&a, srcs, dsts, runs) < 0 ||
        nkv_copy_resolve(&a.runs_view, a.views, a.nsrcs, a.views + a.nsrcs, a.ndsts,
                         a.runs, &total, &overlap) < 0) {
        goto done;
    }
    nthreads = overlap ? 1 : nthreads > 0 ? nthreads : nkv_copy_default_threads();
    Py_ssize_t k = a.runs_view.shape[0];
    if (total >= NKV_GIL_MINSIZE) {
        NKV_UNLOCKED(nkv_copy_all(a.runs, k, total, nthreads));
    } else {
        nkv_copy_all(a.runs, k, total, 1);
    }
    result = PyLong_FromSize_t(total);
done:
    nkv_copy_release(&a);
    return result;
}

static PyMethodDef nkv_copy_methods[] = {
    {"copy_runs", (PyCFunction)(void (*)(void))nkv_copy_runs,
     METH_VARARGS | METH_KEYWORDS,
     "copy_runs($module, srcs, dsts, runs, /, threads=0)\n--\n\n"
     "Copy each run (src_index, src_offset, dst_index, dst_offset, nbytes) of an\n"
     "int64 [k, 5] buffer from srcs to dsts, as if by memmove; all runs are\n"
     "checked first. GIL released from _GIL_MINSIZE bytes, threads from\n"
     "_COPY_THREAD_MINSIZE. Returns the bytes copied."},
    {NULL, NULL, 0, NULL},
};

int
nkv_copy_exec(PyObject *module)
{
    if (PyModule_AddFunctions(module, nkv_copy_methods) < 0) {
        return -1;
    }
    return PyModule_AddIntConstant(module, "_COPY_THREAD_MINSIZE",
                                   NKV_COPY_THREAD_MINSIZE);
}
