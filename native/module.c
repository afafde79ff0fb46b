/* npukv_store._native: module init for the C half of npukv_store.
 *
 * This file holds the method table and module init only; the logic lives in
 * copy.c (GIL-free batched copies) and uring.c (io_uring), which arrive with the
 * asynchronous data path. Until then the module exports its ABI version and the
 * size above which native calls release the GIL, so the build and import rails
 * (-Wall -Wextra -Werror, multi-phase init) are exercised from the first commit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Bumped whenever a native entry point changes meaning; npukv_store checks it
 * at import so a stale build is refused instead of misbehaving. */
#define NKV_ABI_VERSION 1

/* Copies and syscalls below this many bytes keep the GIL: releasing and
 * re-taking it costs more than a small memcpy. */
#define NKV_GIL_MINSIZE (64 * 1024)

static int
nkv_exec(PyObject *module)
{
    if (PyModule_AddIntConstant(module, "ABI_VERSION", NKV_ABI_VERSION) < 0) {
        return -1;
    }
    if (PyModule_AddIntConstant(module, "_GIL_MINSIZE", NKV_GIL_MINSIZE) < 0) {
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
