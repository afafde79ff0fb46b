/* memcpy with non-temporal stores (AVX2), for the copies whose destination
 * is large and not read again soon: pread_rows_xxh3's pieces streamed out of
 * the bounce buffer, and copy_runs' threaded copies (blocks staged into the
 * ring, which the disk reads next). The destination's lines go to memory
 * without being read first (no read-for-ownership): 7.5 against 11.4 ms per
 * 64 MiB on one core of the `vm` host (a 2-core x86-64 VM: docs/RESULTS.md).
 * glibc streams only above a threshold of tens of megabytes per call, and
 * these copies come in pieces of 256 KiB to 1 MiB, hence this loop
 * (docs/decisions/0021). Picked at run time with the xxh3 kernel
 * (checksum.c), only where the CPU has AVX2. */
#include "nkv.h"

#ifdef NKV_HAVE_STREAM_AVX2
#pragma GCC target("avx2")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
    _mm_sfence(); /* the streamed stores are ordered before whatever follows */
}

#else
/* ISO C forbids an empty unit. */
typedef int nkv_stream_avx2_unused;
#endif
