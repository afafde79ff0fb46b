/* npukv_store._native: method table, module init and the one errno mapper.
 *
 * No logic lives here: fileio.c (sync_file_range), checksum.c (xxh3 over
 * block rows), copy.c (GIL-free batched copies), uring.c (io_uring), ptrs.c
 * (copies between raw addresses) and device.c (CUDA/ACL calls via dlopen) each
 * add their entry points in their own *_exec function. Every entry point but
 * device.c's has a pure-Python twin in npukv_store/_twin.py, which
 * npukv_store/native.py binds instead only with NPUKV_NATIVE=0, and the same
 * tests run against both; device.c's runtime calls have none
 * (npukv_store.device falls back to other paths).
 */
#include "nkv.h"

#include <errno.h>
#include <string.h>

/* Bumped whenever a native entry point changes meaning; npukv_store checks it
 * at import so a stale build is refused instead of misbehaving. */
#define NKV_ABI_VERSION 9

PyObject *
nkv_err_set(const char *what, int err)
{
    /* OSError(errno, "what: strerror") picks the errno's subclass itself. */
    PyObject *exc_args = Py_BuildValue("(iN)", err,
                                       PyUnicode_FromFormat("%s: %s", what, strerror(err)));
    if (exc_args != NULL) {
        PyErr_SetObject(PyExc_OSError, exc_args);
        Py_DECREF(exc_args);
    }
    return NULL;
}

PyObject *
nkv_tuple_of(PyObject *obj, const char *msg)
{
    if (PyTuple_Check(obj)) {
        return Py_NewRef(obj);
    }
    PyObject *iter = PyObject_GetIter(obj);
    if (iter == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_SetString(PyExc_TypeError, msg);
        }
        return NULL;
    }
    PyObject *items = PySequence_Tuple(iter);
    Py_DECREF(iter);
    return items;
}

static int
nkv_exec(PyObject *module)
{
    if (PyModule_AddIntConstant(module, "ABI_VERSION", NKV_ABI_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "_GIL_MINSIZE", NKV_GIL_MINSIZE) < 0) {
        return -1;
    }
    if (nkv_fileio_exec(module) < 0 || nkv_checksum_exec(module) < 0 ||
        nkv_copy_exec(module) < 0 || nkv_uring_exec(module) < 0 ||
        nkv_ptrs_exec(module) < 0 || nkv_device_exec(module) < 0) {
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot nkv_slots[] = {
    {Py_mod_exec, (void *)nkv_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef nkv_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "npukv_store._native",
    .m_doc = "Native half of npukv_store (see native/module.c).",
    .m_size = 0,
    .m_slots = nkv_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&nkv_module);
}
