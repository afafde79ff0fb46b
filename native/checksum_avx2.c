/* checksum.c's row loop compiled for AVX2; checksum.c calls it only when
 * __builtin_cpu_supports("avx2"). A separate unit because XXH_INLINE_ALL picks
 * its SIMD kernels at preprocessing time, from the unit's target. */
#include "nkv.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2")
#define XXH_VECTOR XXH_AVX2
#define XXH_INLINE_ALL
#include <xxhash.h>

void nkv_hash_rows_avx2(const Py_buffer *views, Py_ssize_t nparts,
                        Py_ssize_t nrows, unsigned char *out);
void nkv_hash_range_avx2(XXH3_state_t *states, const char *part, size_t row_bytes,
                         size_t pos, size_t end);

#define NKV_HASH_ROWS_NAME nkv_hash_rows_avx2
#define NKV_HASH_RANGE_NAME nkv_hash_range_avx2
#define NKV_HASH_ROWS_EXTERN
#include "hash_rows.h"

#else
/* ISO C forbids an empty unit. */
typedef int nkv_checksum_avx2_unused;
#endif
