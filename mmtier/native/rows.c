/* Row copies for mmtier's CPU data path: units of rows between two layouts, one call for all.
 *
 * A copy is `n_units` units; unit u moves from address src[u] to dst[u]. Inside a unit the
 * same index space of up to MAX_DIMS dims (outermost first, the caller puts them in the
 * source's memory order) selects rows of `row` contiguous bytes at byte strides sstr / dstr.
 * Each row is copied whole. Where the CPU has AVX2 and every destination row is 32-byte
 * aligned, rows are written with non-temporal stores: a bulk copy between an engine's blocks
 * and the cache's pages is not read back soon, and a streaming store skips the read of the
 * destination line that an ordinary store makes first (about a third of the memory traffic).
 *
 * With `check` set (1: float16, 2: bfloat16, 3: float32) every element copied is also tested
 * for NaN / Inf on its way through (all exponent bits set), in the registers the copy loads
 * anyway: a put's finiteness scan without a pass of its own over the payload.
 *
 * The index walk is walk.h's, shared with digests.c. Built by mmtier/native/build.py with the
 * system C compiler; no Python API (ctypes). */
#include <stdint.h>
#include <string.h>

#include "walk.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_STREAM 1
/* One row with streaming stores; returns nonzero where `check` found a NaN / Inf in it. */
__attribute__((target("avx2")))
static int stream_row(char *d, const char *s, int64_t row, int check) {
    int64_t k = 0;
    __m256i acc = _mm256_setzero_si256();
    __m256i m = check == 3 ? _mm256_set1_epi32(0x7F800000)
              : _mm256_set1_epi16((short)(check == 2 ? 0x7F80 : 0x7C00));
#define MMT_TEST(x) (check == 3 ? _mm256_cmpeq_epi32(_mm256_and_si256((x), m), m) \
                                : _mm256_cmpeq_epi16(_mm256_and_si256((x), m), m))
    for (; k + 128 <= row; k += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + k));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + k + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + k + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + k + 96));
        _mm256_stream_si256((__m256i *)(d + k), a);
        _mm256_stream_si256((__m256i *)(d + k + 32), b);
        _mm256_stream_si256((__m256i *)(d + k + 64), c);
        _mm256_stream_si256((__m256i *)(d + k + 96), e);
        if (check)
            acc = _mm256_or_si256(acc, _mm256_or_si256(_mm256_or_si256(MMT_TEST(a), MMT_TEST(b)),
                                                       _mm256_or_si256(MMT_TEST(c), MMT_TEST(e))));
    }
    for (; k < row; k += 32) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + k));
        _mm256_stream_si256((__m256i *)(d + k), a);
        if (check) acc = _mm256_or_si256(acc, MMT_TEST(a));
    }
#undef MMT_TEST
    return !_mm256_testz_si256(acc, acc);
}
#endif

/* Whether a row (already copied, read again from the cache) holds a NaN / Inf. */
static int row_nonfinite(const char *p, int64_t row, int check) {
    unsigned bad = 0;
    if (check == 3) {
        const uint32_t *x = (const uint32_t *)p;
        for (int64_t i = 0; i < row / 4; i++) bad |= (x[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *x = (const uint16_t *)p;
        uint16_t m = check == 2 ? 0x7F80 : 0x7C00;
        for (int64_t i = 0; i < row / 2; i++) bad |= (x[i] & m) == m;
    }
    return bad != 0;
}

/* 1 where streaming stores are used for these arguments, else 0. */
static int can_stream(const int64_t *dst, int64_t n_units, int nd, const int64_t *dstr, int64_t row) {
#ifdef HAVE_STREAM
    return __builtin_cpu_supports("avx2") && dst_aligned(dst, n_units, nd, dstr, row, 32);
#else
    (void)dst; (void)n_units; (void)nd; (void)dstr; (void)row;
    return 0;
#endif
}

/* Returns a bit set: 1 when streaming stores were used, 2 when `check` found a NaN / Inf;
   -1 on bad arguments (nothing copied). */
int mmtier_copy_rows(const int64_t *dst, const int64_t *src, int64_t n_units, int nd,
                     const int64_t *shape, const int64_t *dstr, const int64_t *sstr,
                     int64_t row, int allow_stream, int check) {
    int64_t total = walk_rows(nd, shape);
    if (total < 0 || row <= 0 || n_units < 0 || check < 0 || check > 3) return -1;
    if (check && row % (check == 3 ? 4 : 2) != 0) return -1;
    int stream = allow_stream && can_stream(dst, n_units, nd, dstr, row);
    int bad = 0;
    for (int64_t u = 0; u < n_units; u++) {
        char *d = (char *)(intptr_t)dst[u];
        const char *s = (const char *)(intptr_t)src[u];
        walk_t w;
        walk_start(&w);
        for (int64_t n = 0; n < total; n++, walk_next(&w, nd, shape, dstr, sstr)) {
#ifdef HAVE_STREAM
            if (stream) {
                bad |= stream_row(d + w.doff, s + w.soff, row, check);
            } else
#endif
            {
                memcpy(d + w.doff, s + w.soff, (size_t)row);
                if (check) bad |= row_nonfinite(d + w.doff, row, check);
            }
        }
    }
#ifdef HAVE_STREAM
    if (stream) _mm_sfence();
#endif
    return stream | (bad ? 2 : 0);
}
