/* copy.c: placeholder until the asynchronous data path fills it in; adds no
 * entry points yet. */
#include "nkv.h"

int
nkv_copy_exec(PyObject *module)
{
    (void)module;
    return 0;
}
