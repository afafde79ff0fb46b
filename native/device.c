/* CUDA and Ascend ACL runtime calls for npukv_store.device, resolved with
 * dlopen (nothing is linked against either runtime), GIL released.
 *
 * cuda_memcpy_batch(src_ptrs, dst_ptrs, sizes, kind, stream, batch_api=True, /)
 *   -> int: every run enqueued on `stream` (kind 1 H2D, 2 D2H), as one
 *   cuMemcpyBatchAsync where the driver has it (CUDA 12.8+) and `batch_api`,
 *   else one cudaMemcpyAsync(dst, src, n, kind, stream) per run. Why: a stream
 *   holds about 1,000 pending operations; behind a busy compute stream the
 *   1,000th cudaMemcpyAsync of a save blocks the host until the GPU catches up
 *   (measured on an H200: 1,024 runs of 32 KiB block 200 ms behind a 200 ms
 *   kernel, 512 do not), while one batch of 8,192 runs returns in 3.5 ms, and
 *   moves small runs 2-3x faster. A batch the driver refuses goes again as the
 *   loop, and later calls use the loop.
 * cuda_copy_api() -> str: the call the last cuda_memcpy_batch used
 * acl_memcpy_batch(src_ptrs, dst_ptrs, sizes, kind, stream, /) -> int
 *   one aclrtMemcpyAsync(dst, n, src, n, kind, stream) per run (1 H2D, 2 D2H)
 * acl_host_register(ptr, nbytes, flags, /) -> int (ACL error code, 0 = ok)
 *   aclrtHostRegisterV2(ptr, nbytes, flags), or where the CANN lacks it
 *   aclrtHostRegister(ptr, nbytes, ACL_HOST_REGISTER_MAPPED, &dev_ptr)
 * acl_host_unregister(ptr, /) -> int (ACL error code)
 * cuda_get_last_error() -> int: cudaGetLastError, clearing the runtime's
 *   last error (torch.cuda.cudart() does not bind it)
 *
 * The pointer arrays are checked as ptrs.c checks them, all before the first
 * run is enqueued; the caller keeps every run's memory alive until the stream
 * has run the copy.
 *
 * Libraries: the runtime already loaded into the process is preferred
 * (RTLD_NOLOAD: torch's libcudart, torch_npu's libascendcl), so the calls share
 * its state (last error, per-thread device). A library or symbol that cannot
 * be found raises OSError (ENOENT / ENOSYS) naming it; a failed call raises
 * RuntimeError naming the run and the error code, after the runs before it
 * have been enqueued. Handles are cached for the life of the process and never
 * closed: unloading a runtime that holds registrations would be unsafe. The
 * cache is guarded by nkv_dev_lock, a leaf lock held only around dlopen (with
 * the GIL held), never while taking the GIL or calling a runtime function.
 */
#define _GNU_SOURCE
#include "nkv.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*nkv_cuda_memcpy_fn)(void *, const void *, size_t, int, void *);
/* cuda.h 12.8+: CUmemLocation and CUmemcpyAttributes, declared here because
 * nothing is built against the CUDA headers. */
typedef struct {
    int type; /* CUmemLocationType; 0 (invalid): no hint */
    int id;
} nkv_cu_location;
typedef struct {
    int src_access_order; /* CUmemcpySrcAccessOrder */
    nkv_cu_location src_hint;
    nkv_cu_location dst_hint;
    unsigned int flags;
} nkv_cu_memcpy_attrs;
#define NKV_CU_SRC_ACCESS_ORDER_STREAM 1 /* sources read in stream order */
/* cuMemcpyBatchAsync_v2 (CUDA 13) and cuMemcpyBatchAsync (12.8: failIdx too) */
typedef int (*nkv_cu_batch2_fn)(uint64_t *, uint64_t *, size_t *, size_t,
                                nkv_cu_memcpy_attrs *, size_t *, size_t, void *);
typedef int (*nkv_cu_batch1_fn)(uint64_t *, uint64_t *, size_t *, size_t,
                                nkv_cu_memcpy_attrs *, size_t *, size_t, size_t *,
                                void *);
typedef int (*nkv_cuda_last_fn)(void);
typedef int (*nkv_acl_memcpy_fn)(void *, size_t, const void *, size_t, int, void *);
typedef int (*nkv_acl_reg2_fn)(void *, uint64_t, uint32_t);
typedef int (*nkv_acl_reg_fn)(void *, uint64_t, int, void **);
typedef int (*nkv_acl_unreg_fn)(void *);

/* ------------------------------------------------------------------------ */
/* Libraries                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct {
    const char *label;        /* for messages */
    const char *const *names; /* sonames, tried in order */
    void *handle;             /* cached; never closed */
} nkv_lib;

static const char *const nkv_cudart_names[] = {
    "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so", NULL};
static const char *const nkv_acl_names[] = {"libascendcl.so", NULL};
static const char *const nkv_cuda_names[] = {"libcuda.so.1", "libcuda.so", NULL};
static nkv_lib nkv_cudart = {"libcudart", nkv_cudart_names, NULL};
static nkv_lib nkv_cuda = {"libcuda", nkv_cuda_names, NULL};
static nkv_lib nkv_acl = {"libascendcl.so", nkv_acl_names, NULL};
static pthread_mutex_t nkv_dev_lock = PTHREAD_MUTEX_INITIALIZER;

/* The library's handle: one already loaded first, else a fresh load. */
static void *
nkv_dev_open(nkv_lib *lib)
{
    pthread_mutex_lock(&nkv_dev_lock);
    for (int pass = 0; lib->handle == NULL && pass < 2; pass++) {
        int flags = pass == 0 ? RTLD_NOW | RTLD_NOLOAD : RTLD_NOW | RTLD_GLOBAL;
        for (const char *const *name = lib->names; *name && !lib->handle; name++) {
            lib->handle = dlopen(*name, flags);
        }
    }
    void *handle = lib->handle;
    pthread_mutex_unlock(&nkv_dev_lock);
    if (handle == NULL) {
        const char *why = dlerror();
        PyObject *exc_args = Py_BuildValue(
            "(iN)", ENOENT,
            PyUnicode_FromFormat("cannot load %s (%s); expected the %s runtime in "
                                 "the process or on the library path",
                                 lib->label, why ? why : "not found",
                                 lib == &nkv_acl ? "Ascend CANN" : "CUDA"));
        if (exc_args != NULL) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
    }
    return handle;
}

/* Symbol `name` of `lib` copied into *fn (a function pointer); with `required`
 * a missing symbol raises OSError(ENOSYS), else *fn stays NULL silently. */
static int
nkv_dev_sym(nkv_lib *lib, const char *name, void *fn, size_t fn_size, int required)
{
    void *handle = nkv_dev_open(lib);
    if (handle == NULL) {
        return -1;
    }
    void *sym = dlsym(handle, name);
    if (sym == NULL && required) {
        PyObject *exc_args = Py_BuildValue(
            "(iN)", ENOSYS,
            PyUnicode_FromFormat("%s has no %s; expected a runtime that provides it",
                                 lib->label, name));
        if (exc_args != NULL) {
            PyErr_SetObject(PyExc_OSError, exc_args);
            Py_DECREF(exc_args);
        }
        return -1;
    }
    memcpy(fn, &sym, fn_size); /* ISO C has no void* -> function pointer cast */
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Device copies (no GIL inside the loops)                                    */
/* ------------------------------------------------------------------------ */

/* Which runtime a device batch goes to; the loop is the same. */
typedef struct {
    const char *fn;    /* Python name, for messages */
    const char *call;  /* runtime function, for messages */
    nkv_cuda_memcpy_fn cuda;
    nkv_acl_memcpy_fn acl;
    nkv_cu_batch2_fn cu_batch2; /* CUDA only, optional: one call for all runs */
    nkv_cu_batch1_fn cu_batch1;
} nkv_dev_memcpy;

/* Set once a batch was refused: later batches go straight to the loop. */
static int nkv_cu_batch_refused;
/* What the last CUDA batch used: 0 loop, 1 cuMemcpyBatchAsync(_v2). */
static int nkv_cu_last_api;

/* All non-empty runs as one cuMemcpyBatchAsync; 0 on success, else the
 * driver's code (nothing may have run: the caller enqueues the loop). */
static int
nkv_cu_batch(const nkv_dev_memcpy *m, const nkv_run *runs, Py_ssize_t k, void *stream)
{
    uint64_t *dsts = malloc((size_t)k * 2 * sizeof(uint64_t));
    size_t *sizes = malloc((size_t)k * sizeof(size_t));
    size_t n = 0, attr_index = 0, fail_index = 0;
    nkv_cu_memcpy_attrs attrs = {NKV_CU_SRC_ACCESS_ORDER_STREAM, {0, 0}, {0, 0}, 0};
    int rc = -1;
    if (dsts != NULL && sizes != NULL) {
        uint64_t *srcs = dsts + k;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (runs[i].nbytes != 0) {
                dsts[n] = (uint64_t)(uintptr_t)runs[i].dst;
                srcs[n] = (uint64_t)(uintptr_t)runs[i].src;
                sizes[n++] = runs[i].nbytes;
            }
        }
        if (n == 0) {
            rc = 0;
        } else if (m->cu_batch2 != NULL) {
            rc = m->cu_batch2(dsts, srcs, sizes, n, &attrs, &attr_index, 1, stream);
        } else {
            rc = m->cu_batch1(dsts, srcs, sizes, n, &attrs, &attr_index, 1,
                              &fail_index, stream);
        }
    }
    free(dsts);
    free(sizes);
    return rc;
}

/* Enqueue every run; the index of the first failed run (its code in *rc) or -1. */
static Py_ssize_t
nkv_dev_loop(const nkv_dev_memcpy *m, const nkv_run *runs, Py_ssize_t k, int kind,
             void *stream, int *rc)
{
    for (Py_ssize_t i = 0; i < k; i++) {
        size_t n = runs[i].nbytes;
        if (n == 0) {
            continue;
        }
        *rc = m->cuda != NULL ? m->cuda(runs[i].dst, runs[i].src, n, kind, stream)
                              : m->acl(runs[i].dst, n, runs[i].src, n, kind, stream);
        if (*rc != 0) {
            return i;
        }
    }
    return -1;
}

static PyObject *
nkv_dev_batch(nkv_dev_memcpy *m, PyObject *args)
{
    PyObject *objs[3];
    int kind;
    uintptr_t stream;
    nkv_ptr_args a = {0};
    PyObject *result = NULL;
    int rc = 0;
    Py_ssize_t failed;

    int batch_api = 1;

    if (!PyArg_ParseTuple(args, "OOOiO&|p", &objs[0], &objs[1], &objs[2], &kind,
                          nkv_ptr_addr, &stream, &batch_api)) {
        return NULL;
    }
    if (!batch_api) {
        m->cu_batch2 = NULL;
        m->cu_batch1 = NULL;
    }
    if (kind < 0 || kind > 4) {
        PyErr_Format(PyExc_ValueError,
                     "%s: kind is %d, expected 0..4 (1 host to device, 2 device "
                     "to host)",
                     m->fn, kind);
        return NULL;
    }
    if (nkv_ptr_acquire(m->fn, objs, &a) < 0) {
        goto done;
    }
    /* Runtime calls may block (an unregistered host range makes the copy
     * synchronous), so the GIL is always released. The batch API refuses the
     * legacy NULL stream (0). */
    int batch = (m->cu_batch2 != NULL || m->cu_batch1 != NULL) && stream != 0 &&
                !__atomic_load_n(&nkv_cu_batch_refused, __ATOMIC_RELAXED);
    NKV_UNLOCKED({
        if (batch && nkv_cu_batch(m, a.runs, a.k, (void *)stream) != 0) {
            __atomic_store_n(&nkv_cu_batch_refused, 1, __ATOMIC_RELAXED);
            batch = 0;
        }
        failed = batch ? -1 : nkv_dev_loop(m, a.runs, a.k, kind, (void *)stream, &rc);
    });
    if (m->cuda != NULL) {
        __atomic_store_n(&nkv_cu_last_api, batch, __ATOMIC_RELAXED);
    }
    if (failed >= 0) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: %s of run %zd (%zu bytes) returned error %d, expected 0; "
                     "the runs before it are enqueued",
                     m->fn, m->call, failed, a.runs[failed].nbytes, rc);
        goto done;
    }
    result = PyLong_FromSize_t(a.total);
done:
    nkv_ptr_release(&a);
    return result;
}

static PyObject *
nkv_cuda_get_last_error(PyObject *module, PyObject *noargs)
{
    nkv_cuda_last_fn last = NULL;
    (void)module;
    (void)noargs;
    if (nkv_dev_sym(&nkv_cudart, "cudaGetLastError", &last, sizeof(last), 1) < 0) {
        return NULL;
    }
    return PyLong_FromLong(last());
}

static PyObject *
nkv_cuda_memcpy_batch(PyObject *module, PyObject *args)
{
    nkv_dev_memcpy m = {"cuda_memcpy_batch", "cudaMemcpyAsync", NULL, NULL, NULL, NULL};
    nkv_cuda_last_fn last = NULL;
    (void)module;
    if (nkv_dev_sym(&nkv_cudart, "cudaMemcpyAsync", &m.cuda, sizeof(m.cuda), 1) < 0 ||
        nkv_dev_sym(&nkv_cudart, "cudaGetLastError", &last, sizeof(last), 0) < 0) {
        return NULL;
    }
    /* The driver comes with any working runtime; without it, or without the
     * batch call (before CUDA 12.8), the loop does the work. */
    if (nkv_dev_sym(&nkv_cuda, "cuMemcpyBatchAsync_v2", &m.cu_batch2,
                    sizeof(m.cu_batch2), 0) < 0 ||
        (m.cu_batch2 == NULL &&
         nkv_dev_sym(&nkv_cuda, "cuMemcpyBatchAsync", &m.cu_batch1,
                     sizeof(m.cu_batch1), 0) < 0)) {
        PyErr_Clear();
        m.cu_batch2 = NULL;
        m.cu_batch1 = NULL;
    }
    PyObject *result = nkv_dev_batch(&m, args);
    if (result == NULL && last != NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        (void)last(); /* clear it, or torch's next launch check reports it */
    }
    return result;
}

static PyObject *
nkv_cuda_copy_api(PyObject *module, PyObject *noargs)
{
    (void)module;
    (void)noargs;
    return PyUnicode_FromString(__atomic_load_n(&nkv_cu_last_api, __ATOMIC_RELAXED)
                                    ? "cuMemcpyBatchAsync"
                                    : "cudaMemcpyAsync");
}

static PyObject *
nkv_acl_memcpy_batch(PyObject *module, PyObject *args)
{
    nkv_dev_memcpy m = {"acl_memcpy_batch", "aclrtMemcpyAsync", NULL, NULL, NULL, NULL};
    (void)module;
    if (nkv_dev_sym(&nkv_acl, "aclrtMemcpyAsync", &m.acl, sizeof(m.acl), 1) < 0) {
        return NULL;
    }
    return nkv_dev_batch(&m, args);
}

/* ------------------------------------------------------------------------ */
/* Host registration (Ascend)                                                */
/* ------------------------------------------------------------------------ */

#define NKV_ACL_HOST_REGISTER_MAPPED 0 /* aclrtHostRegisterType, acl_rt.h */

static PyObject *
nkv_acl_host_register(PyObject *module, PyObject *args)
{
    uintptr_t ptr;
    unsigned long long nbytes;
    unsigned int flags;
    nkv_acl_reg2_fn reg2 = NULL;
    nkv_acl_reg_fn reg = NULL;
    void *dev_ptr = NULL;
    int rc;

    (void)module;
    if (!PyArg_ParseTuple(args, "O&KI:acl_host_register", nkv_ptr_addr, &ptr, &nbytes,
                          &flags)) {
        return NULL;
    }
    if (nkv_dev_sym(&nkv_acl, "aclrtHostRegisterV2", &reg2, sizeof(reg2), 0) < 0 ||
        (reg2 == NULL &&
         nkv_dev_sym(&nkv_acl, "aclrtHostRegister", &reg, sizeof(reg), 1) < 0)) {
        return NULL;
    }
    /* The older call has no PINNED flag: MAPPED page-locks and maps the range. */
    NKV_UNLOCKED(rc = reg2 != NULL ? reg2((void *)ptr, nbytes, flags)
                                   : reg((void *)ptr, nbytes,
                                         NKV_ACL_HOST_REGISTER_MAPPED, &dev_ptr));
    return PyLong_FromLong(rc);
}

static PyObject *
nkv_acl_host_unregister(PyObject *module, PyObject *arg)
{
    uintptr_t ptr;
    nkv_acl_unreg_fn unreg = NULL;
    int rc;

    (void)module;
    if (!nkv_ptr_addr(arg, &ptr) ||
        nkv_dev_sym(&nkv_acl, "aclrtHostUnregister", &unreg, sizeof(unreg), 1) < 0) {
        return NULL;
    }
    NKV_UNLOCKED(rc = unreg((void *)ptr));
    return PyLong_FromLong(rc);
}

static PyMethodDef nkv_device_methods[] = {
    {"cuda_memcpy_batch", nkv_cuda_memcpy_batch, METH_VARARGS,
     "cuda_memcpy_batch($module, src_ptrs, dst_ptrs, sizes, kind, stream,"
     " batch_api=True, /)\n--\n\n"
     "Every run on the raw stream: one cuMemcpyBatchAsync where the driver has\n"
     "it, else cudaMemcpyAsync per run. Returns the bytes enqueued."},
    {"cuda_copy_api", nkv_cuda_copy_api, METH_NOARGS,
     "cuda_copy_api($module, /)\n--\n\n"
     "The call the last cuda_memcpy_batch used (str)."},
    {"acl_memcpy_batch", nkv_acl_memcpy_batch, METH_VARARGS,
     "acl_memcpy_batch($module, src_ptrs, dst_ptrs, sizes, kind, stream, /)\n--\n\n"
     "aclrtMemcpyAsync per run on the raw stream. Returns the bytes enqueued."},
    {"acl_host_register", nkv_acl_host_register, METH_VARARGS,
     "acl_host_register($module, ptr, nbytes, flags, /)\n--\n\n"
     "aclrtHostRegisterV2 (or aclrtHostRegister MAPPED); the ACL error code."},
    {"acl_host_unregister", nkv_acl_host_unregister, METH_O,
     "acl_host_unregister($module, ptr, /)\n--\n\n"
     "aclrtHostUnregister; the ACL error code."},
    {"cuda_get_last_error", nkv_cuda_get_last_error, METH_NOARGS,
     "cuda_get_last_error($module, /)\n--\n\n"
     "cudaGetLastError (clears the last error)."},
    {NULL, NULL, 0, NULL},
};

int
nkv_device_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, nkv_device_methods);
}
