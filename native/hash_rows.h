/* The row-hashing loops of xxh3_rows and pread_rows_xxh3, included by
 * checksum.c (baseline SIMD) and checksum_avx2.c (the same loops compiled for
 * AVX2). The includer defines NKV_HASH_ROWS_NAME and NKV_HASH_RANGE_NAME and
 * includes xxhash.h with XXH_INLINE_ALL first, so each copy inlines the xxh3
 * kernels of its own instruction set. */
#if !defined(NKV_HASH_ROWS_NAME) || !defined(NKV_HASH_RANGE_NAME)
#error "define NKV_HASH_ROWS_NAME and NKV_HASH_RANGE_NAME before hash_rows.h"
#endif

#ifdef NKV_HASH_ROWS_EXTERN
void
#else
static void
#endif
NKV_HASH_ROWS_NAME(const Py_buffer *views, Py_ssize_t nparts, Py_ssize_t nrows,
                   unsigned char *out)
{
    XXH3_state_t state;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        XXH64_hash_t digest;
        if (nparts == 1) {
            Py_ssize_t row = views[0].len / nrows;
            digest = XXH3_64bits((const char *)views[0].buf + r * row, (size_t)row);
        } else {
            XXH3_64bits_reset(&state);
            for (Py_ssize_t p = 0; p < nparts; p++) {
                Py_ssize_t row = views[p].len / nrows;
                XXH3_64bits_update(&state, (const char *)views[p].buf + r * row,
                                   (size_t)row);
            }
            digest = XXH3_64bits_digest(&state);
        }
        for (int byte = 0; byte < 8; byte++) { /* little-endian on any host */
            out[r * 8 + byte] = (unsigned char)(digest >> (8 * byte));
        }
    }
}

/* Feed bytes [pos, end) of one part (rows of row_bytes, laid end to end),
 * found at `data` (the part's byte pos), into the running state of each row
 * they belong to: pread_rows_xxh3 calls it on each piece just read, while the
 * piece is still in cache. */
#ifdef NKV_HASH_ROWS_EXTERN
void
#else
static void
#endif
NKV_HASH_RANGE_NAME(XXH3_state_t *states, const char *data, size_t row_bytes,
                    size_t pos, size_t end)
{
    while (pos < end) {
        size_t r = pos / row_bytes;
        size_t take = (r + 1) * row_bytes - pos;
        if (take > end - pos) {
            take = end - pos;
        }
        XXH3_64bits_update(&states[r], data, take);
        data += take;
        pos += take;
    }
}
