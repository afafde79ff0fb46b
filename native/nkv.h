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

/* `obj`'s items as a new tuple (a tuple itself, with a new reference); NULL
 * with TypeError(`msg`) where obj is not iterable. PySequence_Fast would hand
 * back a list itself, which Python code run while its items are converted (an
 * __index__, a __buffer__) could shrink under the caller's indices. */
PyObject *nkv_tuple_of(PyObject *obj, const char *msg);

/* copy.c's copying half, shared with ptrs.c's copy_ptrs. */
#define NKV_COPY_MAX_THREADS 64

/* One checked run, resolved to addresses while the GIL is held. */
typedef struct {
    char *dst;
    const char *src;
    size_t nbytes;
} nkv_run;

/* The most runs one copy_runs or copy_ptrs call takes: (k + 1) runs of up to
 * 32 bytes each (and k offsets) then stay below PY_SSIZE_T_MAX, whatever
 * shape a buffer exporter claims (numpy's as_strided claims any). The twin
 * checks the same bound (_twin._MAX_RUNS). */
#define NKV_MAX_RUNS (PY_SSIZE_T_MAX / 64)
_Static_assert(sizeof(nkv_run) <= 32, "NKV_MAX_RUNS assumes runs of <= 32 bytes");

/* Copy runs[0..k) (memmove each), `total` bytes in all, on up to `nthreads`
 * threads from _COPY_THREAD_MINSIZE bytes on; no Python object is touched, so
 * it may run without the GIL. Threaded: no run may overlap another. */
void nkv_copy_all(const nkv_run *runs, Py_ssize_t k, size_t total, int nthreads);
/* min(4, online CPUs): the threads of `threads=0`. */
int nkv_copy_default_threads(void);

/* memcpy with non-temporal stores; NULL where the CPU or build has none. The
 * kernel in use is checksum.c's (its _hash_kernel picks both). Not for
 * overlapping runs. */
typedef void (*nkv_stream_copy_fn)(char *dst, const char *src, size_t n);
nkv_stream_copy_fn nkv_stream_copy_kernel(void);
#if defined(__x86_64__) && defined(__GNUC__)
#define NKV_HAVE_STREAM_AVX2 1
void nkv_stream_copy_avx2(char *dst, const char *src, size_t n); /* stream_avx2.c */
#endif

/* ptrs.c: runs given as three int64 arrays (src_ptrs, dst_ptrs, sizes), the
 * arguments of copy_ptrs and of device.c's batches. */
typedef struct {
    Py_buffer views[3];
    int got;        /* views to release */
    nkv_run *runs;  /* k resolved runs */
    Py_ssize_t k;
    size_t total;   /* sum of the sizes */
    int overlap;    /* some run's source and destination overlap */
} nkv_ptr_args;

/* Acquire and check the three arrays, resolve every run; 0, or -1 with
 * ValueError naming `fn`, the run and what was expected. Release either way. */
int nkv_ptr_acquire(const char *fn, PyObject *const objs[3], nkv_ptr_args *a);
void nkv_ptr_release(nkv_ptr_args *a);
/* "O&" converter: a non-negative int (or __index__) to a uintptr_t. */
int nkv_ptr_addr(PyObject *obj, void *out);

int nkv_fileio_exec(PyObject *module);   /* fileio.c: sync_file_range */
int nkv_checksum_exec(PyObject *module); /* checksum.c: xxh3 over block rows */
int nkv_copy_exec(PyObject *module);     /* copy.c: batched GIL-free copies */
int nkv_uring_exec(PyObject *module);    /* uring.c: io_uring engine */
int nkv_ptrs_exec(PyObject *module);     /* ptrs.c: copy_ptrs (raw addresses) */
int nkv_device_exec(PyObject *module);   /* device.c: CUDA/ACL calls via dlopen */

#endif
