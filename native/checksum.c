/* Block checksums: xxh3_64 over each row of one or more parts, GIL released.
 *
 * xxh3_rows(parts, nrows) -> bytes of nrows little-endian u64. Each part is a
 * C-contiguous buffer of nrows equal rows; row r's checksum is xxh3_64 over
 * part[0] row r, then part[1] row r, ... (docs/format.md §3.3). Hashing runs
 * without the GIL, so I/O threads keep the disk busy while a layer is verified;
 * python-xxhash holds the GIL for row-sized inputs. Every build has it: the
 * xxhash header is the system's (libxxhash-dev) or native/third_party's.
 */
#include "nkv.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NKV_MAX_PARTS 64

/* The most rows (times layers) one call takes. Each row gets an 8-byte digest
 * and, in pread_*_xxh3, an XXH3_state_t, so below this bound neither
 * nlayers * nrows * 8 nor nrows * sizeof(XXH3_state_t) can overflow: empty
 * parts pass the multiple-of-nrows check with any nrows. The twin checks the
 * same bound (_twin._MAX_ROWS). */
#define NKV_MAX_ROWS (PY_SSIZE_T_MAX / 1024)
_Static_assert(sizeof(XXH3_state_t) <= 1024, "NKV_MAX_ROWS assumes states <= 1 KiB");

#define NKV_HASH_ROWS_NAME nkv_hash_rows_baseline
#define NKV_HASH_RANGE_NAME nkv_hash_range_baseline
#include "hash_rows.h"

/* The row loop compiled for AVX2 (checksum_avx2.c), picked at import where
 * the CPU has it: xxh3 then hashes about twice as fast as with the SSE2
 * baseline (20 against 11 GB/s in L2 on the `vm` host, a 2-core x86-64 VM:
 * docs/RESULTS.md). An AVX-512 build hashed at 30 GB/s in L2 but read cached
 * chunks no faster (docs/decisions/0020), so it is not built: on some Xeons
 * its frequency drop slows the serving threads too. */
typedef void (*nkv_hash_rows_fn)(const Py_buffer *, Py_ssize_t, Py_ssize_t,
                                 unsigned char *);
typedef void (*nkv_hash_range_fn)(XXH3_state_t *, const char *, size_t, size_t,
                                  size_t);

#if defined(__x86_64__) && defined(__GNUC__)
void nkv_hash_rows_avx2(const Py_buffer *views, Py_ssize_t nparts,
                        Py_ssize_t nrows, unsigned char *out);
void nkv_hash_range_avx2(XXH3_state_t *states, const char *data, size_t row_bytes,
                         size_t pos, size_t end);
#define NKV_HAVE_AVX2_KERNEL 1
#endif

/* One kernel per instruction set; all give the same digests (xxh3 is defined
 * by its output, not its SIMD width) and the same bytes, which the tests check
 * on every kernel this CPU can run. `stream_copy`, where there is one, makes
 * pread_rows_xxh3 read large parts through a bounce buffer (see
 * nkv_pread_into); NULL reads them straight into the destination. */
static const struct nkv_hash_kernel {
    const char *name;
    const char *cpu_feature; /* NULL: any CPU */
    nkv_hash_rows_fn rows;
    nkv_hash_range_fn range;
    nkv_stream_copy_fn stream_copy;
} nkv_hash_kernels[] = {
#ifdef NKV_HAVE_AVX2_KERNEL
    {"avx2", "avx2", nkv_hash_rows_avx2, nkv_hash_range_avx2, nkv_stream_copy_avx2},
#endif
    {"baseline", NULL, nkv_hash_rows_baseline, nkv_hash_range_baseline, NULL},
};
#define NKV_HASH_KERNELS (sizeof(nkv_hash_kernels) / sizeof(nkv_hash_kernels[0]))

/* The kernel in use: set once at import (the widest this CPU runs), changed
 * only by _hash_kernel() in tests and benchmarks. */
static const struct nkv_hash_kernel *nkv_hash = NULL;

static int
nkv_kernel_runs(const struct nkv_hash_kernel *kernel)
{
#ifdef NKV_HAVE_AVX2_KERNEL
    /* __builtin_cpu_supports wants a string literal: avx2 is the only one */
    return kernel->cpu_feature == NULL || __builtin_cpu_supports("avx2");
#else
    return kernel->cpu_feature == NULL;
#endif
}

nkv_stream_copy_fn
nkv_stream_copy_kernel(void)
{
    return nkv_hash != NULL ? nkv_hash->stream_copy : NULL;
}

static void
nkv_hash_rows(const Py_buffer *views, Py_ssize_t nparts, Py_ssize_t nrows,
              unsigned char *out)
{
    nkv_hash->rows(views, nparts, nrows, out);
}

static void
nkv_hash_range(XXH3_state_t *states, const char *data, size_t row_bytes, size_t pos,
               size_t end)
{
    nkv_hash->range(states, data, row_bytes, pos, end);
}

/* `parts` as a tuple of 1..NKV_MAX_PARTS items, with 1..NKV_MAX_ROWS rows;
 * NULL with TypeError or ValueError naming `fn` otherwise. A tuple (a copy of
 * a list): converting an item may run Python code that changes the list. */
static PyObject *
nkv_parts_seq(const char *fn, PyObject *parts, Py_ssize_t nrows, const char *items)
{
    PyObject *seq = nkv_tuple_of(parts, "parts must be a sequence");
    if (seq == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError,
                         "%s: parts is %.100s, expected a sequence of %s", fn,
                         Py_TYPE(parts)->tp_name, items);
        }
        return NULL;
    }
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(seq);
    if (nparts < 1 || nparts > NKV_MAX_PARTS || nrows < 1 || nrows > NKV_MAX_ROWS) {
        PyErr_Format(PyExc_ValueError,
                     "%s: found %zd parts and %zd rows, expected 1..%d parts and "
                     "1..%zd rows",
                     fn, nparts, nrows, NKV_MAX_PARTS, (Py_ssize_t)NKV_MAX_ROWS);
        Py_DECREF(seq);
        return NULL;
    }
    return seq;
}

static PyObject *
nkv_xxh3_rows(PyObject *module, PyObject *args)
{
    PyObject *parts;
    Py_ssize_t nrows;
    Py_buffer views[NKV_MAX_PARTS];
    Py_ssize_t got = 0;
    Py_ssize_t total = 0;
    PyObject *seq = NULL;
    PyObject *out = NULL;

    (void)module;
    if (!PyArg_ParseTuple(args, "On:xxh3_rows", &parts, &nrows)) {
        return NULL;
    }
    seq = nkv_parts_seq("xxh3_rows", parts, nrows, "buffers");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(seq);
    for (; got < nparts; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got],
                               PyBUF_SIMPLE) < 0) {
            goto done;
        }
        if (views[got].len % nrows != 0) {
            PyErr_Format(PyExc_ValueError,
                         "xxh3_rows: part %zd has %zd bytes, expected a multiple "
                         "of %zd rows",
                         got, views[got].len, nrows);
            got++;
            goto done;
        }
        total += views[got].len;
    }
    out = PyBytes_FromStringAndSize(NULL, nrows * 8);
    if (out == NULL) {
        goto done;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    if (total >= NKV_GIL_MINSIZE) {
        NKV_UNLOCKED(nkv_hash_rows(views, nparts, nrows, dst));
    } else {
        nkv_hash_rows(views, nparts, nrows, dst);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&views[i]);
    }
    Py_DECREF(seq);
    return out;
}

/* pread_rows_xxh3 reads this much at a time and hashes it while it is in
 * the L2 cache: one pass over memory where a read then a hash take two. */
#define NKV_PREAD_PIECE_BYTES (256 * 1024)

/* From this many bytes in a part on, with a kernel that has a stream_copy,
 * each piece is read into an L2-sized bounce buffer, hashed there, and
 * streamed to its destination: the kernel's copy then writes into cache-hot
 * memory, and no destination line is read before it is written. 0.213 against
 * 0.25 CPU s per GB from the page cache on the `vm` host (docs/decisions/0021).
 * Smaller parts are read straight into place, where the caller may want them
 * in cache. */
#define NKV_STREAM_MIN_BYTES NKV_PREAD_PIECE_BYTES

/* Read `total` bytes at `file_off` into `dst` piece by piece, feeding each
 * piece to the running states of the rows (of `row_bytes`) it belongs to;
 * `bounce` (NKV_PREAD_PIECE_BYTES, or NULL) as above. 0, or an errno (EIO for
 * a short read: the file ends early). */
static int
nkv_pread_into(int fd, char *dst, size_t total, long long file_off,
               XXH3_state_t *states, size_t row_bytes, char *bounce)
{
    nkv_stream_copy_fn stream = nkv_hash->stream_copy; /* read once per part */
    if (total < NKV_STREAM_MIN_BYTES || stream == NULL) {
        bounce = NULL;
    }
    size_t done = 0;
    while (done < total) {
        size_t want = total - done;
        if (want > NKV_PREAD_PIECE_BYTES) {
            want = NKV_PREAD_PIECE_BYTES;
        }
        char *into = bounce != NULL ? bounce : dst + done;
        ssize_t got = pread(fd, into, want, (off_t)(file_off + (long long)done));
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            return errno;
        }
        if (got == 0) {
            return EIO;
        }
        nkv_hash_range(states, into, row_bytes, done, done + (size_t)got);
        if (bounce != NULL) {
            stream(dst + done, bounce, (size_t)got);
        }
        done += (size_t)got;
    }
    return 0;
}

/* Read each part's file range into its buffer, hashing as it goes; a reversed
 * part puts file row j in buffer row nrows-1-j (row j's state still gets it).
 * 0, or an errno. */
static int
nkv_pread_hash(int fd, const long long *offsets, const Py_buffer *views,
               const int *reversed, Py_ssize_t nparts, Py_ssize_t nrows,
               XXH3_state_t *states, char *bounce, unsigned char *out)
{
    for (Py_ssize_t r = 0; r < nrows; r++) {
        XXH3_64bits_reset(&states[r]);
    }
    for (Py_ssize_t p = 0; p < nparts; p++) {
        char *part = (char *)views[p].buf;
        size_t total = (size_t)views[p].len;
        size_t row_bytes = total / (size_t)nrows;
        int err = 0;
        if (!reversed[p]) {
            err = nkv_pread_into(fd, part, total, offsets[p], states, row_bytes,
                                 bounce);
        }
        for (Py_ssize_t j = 0; reversed[p] && j < nrows && err == 0; j++) {
            err = nkv_pread_into(fd, part + (size_t)(nrows - 1 - j) * row_bytes,
                                 row_bytes, offsets[p] + (long long)(j * row_bytes),
                                 &states[j], row_bytes, bounce);
        }
        if (err != 0) {
            return err;
        }
    }
    for (Py_ssize_t r = 0; r < nrows; r++) {
        XXH64_hash_t digest = XXH3_64bits_digest(&states[r]);
        for (int byte = 0; byte < 8; byte++) { /* little-endian on any host */
            out[r * 8 + byte] = (unsigned char)(digest >> (8 * byte));
        }
    }
    return 0;
}

/* One layer's parts, parsed: pread_layers_xxh3 keeps one per layer. */
typedef struct {
    Py_ssize_t nparts;
    Py_ssize_t first; /* index of its first part in the flat arrays */
} nkv_layer_parts;

/* Read each layer's parts from fd into their buffers, hashing as it goes;
 * bytes of the digests, layer l's at rows [l * nrows, (l + 1) * nrows).
 * Messages name `fn`. pread_layers_xxh3 is this; pread_rows_xxh3 is this for
 * one layer. Several layers in one call take the GIL back and parse the
 * arguments once: a verifier task's 4-8 layers made one call each before
 * (docs/decisions/0020). */
static PyObject *
nkv_pread_layers(const char *fn, int fd, PyObject *layers, Py_ssize_t nrows)
{
    PyObject *layer_seq = NULL;
    nkv_layer_parts *spans = NULL;
    Py_buffer *views = NULL;
    long long *offsets = NULL;
    int *reversed = NULL;
    Py_ssize_t nviews = 0; /* views held, to release */
    PyObject *out = NULL;
    XXH3_state_t *states = NULL;
    char *bounce = NULL;
    int err = 0;

    layer_seq = nkv_tuple_of(layers, "layers must be a sequence");
    if (layer_seq == NULL) {
        return NULL;
    }
    Py_ssize_t nlayers = PySequence_Fast_GET_SIZE(layer_seq);
    /* nlayers * nrows bounded: the digests and the row states below */
    if (nlayers < 1 || nrows < 1 || nrows > NKV_MAX_ROWS / nlayers) {
        PyErr_Format(PyExc_ValueError,
                     "%s: found %zd layers and %zd rows, expected >= 1 of each "
                     "and layers * rows <= %zd",
                     fn, nlayers, nrows, (Py_ssize_t)NKV_MAX_ROWS);
        goto done;
    }
    Py_ssize_t capacity = 0; /* parts in all layers, checked one by one below */
    for (Py_ssize_t l = 0; l < nlayers; l++) {
        Py_ssize_t size = PySequence_Size(PySequence_Fast_GET_ITEM(layer_seq, l));
        if (size < 0) {
            PyErr_Clear(); /* nkv_parts_seq below names the problem */
            size = 0;
        }
        capacity += size < NKV_MAX_PARTS ? size : NKV_MAX_PARTS;
    }
    spans = PyMem_Calloc((size_t)nlayers, sizeof(*spans));
    views = PyMem_Calloc((size_t)capacity + 1, sizeof(*views));
    offsets = PyMem_Calloc((size_t)capacity + 1, sizeof(*offsets));
    reversed = PyMem_Calloc((size_t)capacity + 1, sizeof(*reversed));
    if (spans == NULL || views == NULL || offsets == NULL || reversed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t l = 0; l < nlayers; l++) {
        PyObject *parts = nkv_parts_seq(fn, PySequence_Fast_GET_ITEM(layer_seq, l),
                                        nrows, "(offset, buffer) pairs");
        if (parts == NULL) {
            goto done;
        }
        spans[l].first = nviews;
        spans[l].nparts = PySequence_Fast_GET_SIZE(parts);
        if (nviews + spans[l].nparts > capacity) { /* it grew since it was counted */
            PyErr_Format(PyExc_RuntimeError, "%s: a layer's parts changed during the call",
                         fn);
            Py_DECREF(parts);
            goto done;
        }
        for (Py_ssize_t p = 0; p < spans[l].nparts; p++) {
            PyObject *buffer;
            Py_ssize_t i = nviews;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(parts, p),
                                  "LO|p:pread_*_xxh3 part", &offsets[i], &buffer,
                                  &reversed[i]) ||
                PyObject_GetBuffer(buffer, &views[i], PyBUF_WRITABLE) < 0) {
                Py_DECREF(parts);
                goto done;
            }
            nviews++;
            /* offset + bytes fits: the file offsets of every piece do too */
            if (offsets[i] < 0 || offsets[i] > LLONG_MAX - views[i].len ||
                views[i].len % nrows != 0) {
                PyErr_Format(PyExc_ValueError,
                             "%s: layer %zd part %zd has offset %lld and %zd bytes, "
                             "expected offset >= 0, offset + bytes <= %lld and a "
                             "multiple of %zd rows",
                             fn, l, p, offsets[i], views[i].len, LLONG_MAX, nrows);
                Py_DECREF(parts);
                goto done;
            }
        }
        Py_DECREF(parts);
    }
    states = aligned_alloc(64, (size_t)nrows * sizeof(XXH3_state_t));
    for (Py_ssize_t i = 0; i < nviews && nkv_hash->stream_copy != NULL; i++) {
        if (views[i].len >= NKV_STREAM_MIN_BYTES) { /* some part may stream */
            bounce = aligned_alloc(4096, NKV_PREAD_PIECE_BYTES);
            break;
        }
    }
    out = PyBytes_FromStringAndSize(NULL, nlayers * nrows * 8);
    if (states == NULL || out == NULL) {
        Py_CLEAR(out);
        if (states == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t l = 0; l < nlayers && err == 0; l++) {
        Py_ssize_t first = spans[l].first;
        err = nkv_pread_hash(fd, &offsets[first], &views[first], &reversed[first],
                             spans[l].nparts, nrows, states, bounce,
                             dst + l * nrows * 8);
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        Py_CLEAR(out);
        char what[96]; /* glibc's snprintf: checked (__snprintf_chk) with fortify */
        snprintf(what, sizeof(what), "%s%s", fn,
                 err == EIO ? " (short read or I/O error)" : "");
        nkv_err_set(what, err);
    }
done:
    free(states);
    free(bounce); /* NULL (no stream_copy, or no memory: parts read in place) */
    for (Py_ssize_t i = 0; i < nviews; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(spans);
    PyMem_Free(views);
    PyMem_Free(offsets);
    PyMem_Free(reversed);
    Py_DECREF(layer_seq);
    return out;
}

static PyObject *
nkv_pread_layers_xxh3(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *layers;
    Py_ssize_t nrows;
    (void)module;
    if (!PyArg_ParseTuple(args, "iOn:pread_layers_xxh3", &fd, &layers, &nrows)) {
        return NULL;
    }
    return nkv_pread_layers("pread_layers_xxh3", fd, layers, nrows);
}

static PyObject *
nkv_pread_rows_xxh3(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *parts;
    Py_ssize_t nrows;
    (void)module;
    if (!PyArg_ParseTuple(args, "iOn:pread_rows_xxh3", &fd, &parts, &nrows)) {
        return NULL;
    }
    PyObject *one_layer = PyTuple_Pack(1, parts);
    if (one_layer == NULL) {
        return NULL;
    }
    PyObject *out = nkv_pread_layers("pread_rows_xxh3", fd, one_layer, nrows);
    Py_DECREF(one_layer);
    return out;
}

static PyObject *
nkv_hash_kernel(PyObject *module, PyObject *args)
{
    const char *want = NULL;
    (void)module;
    if (!PyArg_ParseTuple(args, "|z:_hash_kernel", &want)) {
        return NULL;
    }
    if (want != NULL) {
        const struct nkv_hash_kernel *found = NULL;
        for (size_t k = 0; k < NKV_HASH_KERNELS; k++) {
            if (strcmp(nkv_hash_kernels[k].name, want) == 0 &&
                nkv_kernel_runs(&nkv_hash_kernels[k])) {
                found = &nkv_hash_kernels[k];
            }
        }
        if (found == NULL) {
            PyErr_Format(PyExc_ValueError,
                         "_hash_kernel: found %.50s, expected one of the kernels "
                         "this CPU runs (see _hash_kernels())",
                         want);
            return NULL;
        }
        nkv_hash = found;
    }
    return PyUnicode_FromString(nkv_hash->name);
}

static PyObject *
nkv_hash_kernel_names(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (size_t k = 0; names != NULL && k < NKV_HASH_KERNELS; k++) {
        if (!nkv_kernel_runs(&nkv_hash_kernels[k])) {
            continue;
        }
        PyObject *name = PyUnicode_FromString(nkv_hash_kernels[k].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_CLEAR(names);
        } else {
            Py_DECREF(name);
        }
    }
    return names;
}

static PyMethodDef nkv_checksum_methods[] = {
    {"_hash_kernel", nkv_hash_kernel, METH_VARARGS,
     "_hash_kernel($module, name=None, /)\n--\n\n"
     "The xxh3 kernel in use; with a name (one of _hash_kernels()), use that\n"
     "one instead (tests and benchmarks). Not thread-safe against hashing."},
    {"_hash_kernels", nkv_hash_kernel_names, METH_NOARGS,
     "_hash_kernels($module, /)\n--\n\n"
     "The xxh3 kernels this CPU runs, widest first."},
    {"pread_rows_xxh3", nkv_pread_rows_xxh3, METH_VARARGS,
     "pread_rows_xxh3($module, fd, parts, nrows, /)\n--\n\n"
     "Read each (offset, buffer[, reversed]) part from fd into its buffer and\n"
     "return the little-endian u64 xxh3_64 of each file row over all parts,\n"
     "hashing each piece while it is in cache (GIL released); a reversed part\n"
     "puts file row j in buffer row nrows-1-j. OSError on an error or short read."},
    {"pread_layers_xxh3", nkv_pread_layers_xxh3, METH_VARARGS,
     "pread_layers_xxh3($module, fd, layers, nrows, /)\n--\n\n"
     "pread_rows_xxh3 of each layer's parts in one call (GIL released once):\n"
     "layer l's nrows little-endian u64 digests at bytes [8*l*nrows, ...)."},
    {"xxh3_rows", nkv_xxh3_rows, METH_VARARGS,
     "xxh3_rows($module, parts, nrows, /)\n--\n\n"
     "Little-endian u64 xxh3_64 of each row over all parts (GIL released)."},
    {NULL, NULL, 0, NULL},
};

int
nkv_checksum_exec(PyObject *module)
{
    for (size_t k = 0; nkv_hash == NULL && k < NKV_HASH_KERNELS; k++) {
        if (nkv_kernel_runs(&nkv_hash_kernels[k])) {
            nkv_hash = &nkv_hash_kernels[k];
        }
    }
    /* exported so that the reader's ReadTuning table shows it */
    if (PyModule_AddIntConstant(module, "BOUNCE_ABOVE_BYTES", NKV_STREAM_MIN_BYTES) < 0) {
        return -1;
    }
    return PyModule_AddFunctions(module, nkv_checksum_methods);
}
