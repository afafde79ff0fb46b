/* Block checksums: xxh3_64 over each row of one or more parts, GIL released.
 *
 * xxh3_rows(parts, nrows) -> bytes of nrows little-endian u64. Each part is a
 * C-contiguous buffer of nrows equal rows; row r's checksum is xxh3_64 over
 * part[0] row r, then part[1] row r, ... (docs/format.md §3.3). Hashing runs
 * without the GIL, so I/O threads keep the disk busy while a layer is verified;
 * python-xxhash holds the GIL for row-sized inputs. Built only where the xxhash
 * header is installed (libxxhash-dev); elsewhere npukv_store.native uses its
 * Python twin.
 */
#include "nkv.h"

#ifdef NKV_HAVE_XXHASH
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stdint.h>

#define NKV_MAX_PARTS 64

#define NKV_HASH_ROWS_NAME nkv_hash_rows_baseline
#include "hash_rows.h"

/* The row loop compiled for AVX2 (checksum_avx2.c), picked at run time:
 * xxh3 then hashes about twice as fast as with the SSE2 baseline. */
#if defined(__x86_64__) && defined(__GNUC__)
void nkv_hash_rows_avx2(const Py_buffer *views, Py_ssize_t nparts,
                        Py_ssize_t nrows, unsigned char *out);

static void
nkv_hash_rows(const Py_buffer *views, Py_ssize_t nparts, Py_ssize_t nrows,
              unsigned char *out)
{
    if (__builtin_cpu_supports("avx2")) {
        nkv_hash_rows_avx2(views, nparts, nrows, out);
    } else {
        nkv_hash_rows_baseline(views, nparts, nrows, out);
    }
}
#else
#define nkv_hash_rows nkv_hash_rows_baseline
#endif

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
    seq = PySequence_Fast(parts, "xxh3_rows: parts must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t nparts = PySequence_Fast_GET_SIZE(seq);
    if (nparts < 1 || nparts > NKV_MAX_PARTS || nrows < 1) {
        PyErr_Format(PyExc_ValueError,
                     "xxh3_rows: found %zd parts and %zd rows, expected 1..%d "
                     "parts and >= 1 row",
                     nparts, nrows, NKV_MAX_PARTS);
        goto done;
    }
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

static PyMethodDef nkv_checksum_methods[] = {
    {"xxh3_rows", nkv_xxh3_rows, METH_VARARGS,
     "xxh3_rows(parts, nrows) -> bytes\n"
     "Little-endian u64 xxh3_64 of each row over all parts (GIL released)."},
    {NULL, NULL, 0, NULL},
};

int
nkv_checksum_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, nkv_checksum_methods);
}

#else /* no xxhash header at build time: the Python twin serves */

int
nkv_checksum_exec(PyObject *module)
{
    (void)module;
    return 0;
}

#endif
