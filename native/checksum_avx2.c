/* checksum.c's row loop compiled for AVX2; checksum.c calls it only when
 * __builtin_cpu_supports("avx2"). A separate unit because XXH_INLINE_ALL picks
 * its SIMD kernels at preprocessing time, from the unit's target. */
#include "nkv.h"

#if defined(NKV_HAVE_XXHASH) && defined(__x86_64__) && defined(__GNUC__)
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

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

void nkv_stream_copy_avx2(char *dst, const char *src, size_t n);

/* memcpy with non-temporal stores, then a store fence: the destination's
 * lines go to memory without being read first (no read-for-ownership), which
 * a cached read into a large buffer would otherwise pay for every line. glibc
 * streams only above a threshold of megabytes per call; pread_rows_xxh3 copies
 * 256 KiB pieces, so it streams here (docs/design.md §21). */
void
nkv_stream_copy_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 128; n -= 128, dst += 128, src += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    for (; n >= 32; n -= 32, dst += 32, src += 32) {
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
    }
    memcpy(dst, src, n);
    _mm_sfence(); /* the streamed stores are visible before the caller goes on */
}

#else
/* ISO C forbids an empty unit. */
typedef int nkv_checksum_avx2_unused;
#endif
