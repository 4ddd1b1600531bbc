/* Row copies that take the XXH3-64 digest of each unit's bytes on the way (one pass).
 *
 * The same units and row walk as rows.c (unit u: rows of `row` bytes at byte strides from
 * src[u] to dst[u], outermost dim first). The digest of a unit is XXH3_64bits (seed 0, default
 * secret) of its rows' bytes in walk order: where the caller walks a contiguous source in
 * memory order (a host slab's page), that is the page's own xxh3, the digest the host and disk
 * tiers keep per page (python's xxhash.xxh3_64_intdigest of the same bytes). It is computed
 * from the registers the copy loads anyway, so a verified copy reads memory once.
 *
 * With `expect`, unit u's digest must equal expect[u]: at the first unit that differs, its
 * destination rows are overwritten with 0xFF bytes (NaN in float16, bfloat16 and float32:
 * never unverified bytes left behind), nothing after it is copied, and u is returned.
 *
 * With a finiteness check (`flags` bits 2-3: 1 float16, 2 bfloat16, 3 float32) every element
 * copied is also tested for NaN / Inf (all exponent bits set) in the same registers, as rows.c
 * does: a put written straight into the host tier takes its digests and its finiteness scan
 * in the one pass that moves it (`mmtier_copy_rows_xxh3_checked`).
 *
 * A copy without `expect` may be split over `threads` (contiguous runs of units, one per
 * thread, at least PART_MIN_BYTES each; this thread runs the first): the units are independent,
 * each digest is its own unit's, so the result is the same, only sooner where one core does not
 * saturate memory. With `expect` the copy runs on one thread (the first differing unit stops
 * it: nothing after it is touched).
 *
 * Only inputs longer than 240 bytes and rows a multiple of 64 bytes are taken (xxh3's long-
 * input path, whole 64-byte stripes); the caller hashes anything else itself. The hash is
 * written from the published XXH3 specification and checked against python's xxhash in
 * tests/native/test_digests.py. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "walk.h"

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8)   /* 16 */

static const unsigned char SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static inline uint64_t rd64(const void *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void acc_init(uint64_t acc[8]) {
    acc[0] = P32_3; acc[1] = P64_1; acc[2] = P64_2; acc[3] = P64_3;
    acc[4] = P64_4; acc[5] = P32_2; acc[6] = P64_5; acc[7] = P32_1;
}

/* One 64-byte stripe into the accumulators (scalar). */
static inline void stripe_scalar(uint64_t acc[8], const unsigned char *in, const unsigned char *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(in + 8 * i);
        uint64_t k = v ^ rd64(key + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static void scramble(uint64_t acc[8]) {
    const unsigned char *key = SECRET + SECRET_SIZE - STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(key + 8 * i);
        acc[i] = a * P32_1;
    }
}

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static uint64_t finish(const uint64_t acc[8], uint64_t len) {
    const unsigned char *key = SECRET + 11;
    uint64_t h = len * P64_1;
    for (int i = 0; i < 4; i++)
        h += fold128(acc[2 * i] ^ rd64(key + 16 * i), acc[2 * i + 1] ^ rd64(key + 16 * i + 8));
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    return h;
}

/* The secret a stripe takes: stripe s of a unit of S stripes (the last one its own). */
static inline const unsigned char *stripe_key(int64_t s, int64_t S) {
    return s == S - 1 ? SECRET + SECRET_SIZE - STRIPE - 7 : SECRET + (s % STRIPES_PER_BLOCK) * 8;
}

/* Copy one row of whole stripes, folding them into acc; `s` counts the unit's stripes. */
static void row_scalar(char *d, const char *src, int64_t row, uint64_t acc[8], int64_t *s, int64_t S) {
    memcpy(d, src, (size_t)row);
    for (int64_t k = 0; k < row; k += STRIPE, (*s)++) {
        stripe_scalar(acc, (const unsigned char *)src + k, stripe_key(*s, S));
        if (*s % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1 && *s < S - 1) scramble(acc);
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2 1
/* Bytes the source is read ahead of the stripe. A row starts the hardware prefetcher afresh:
   where the source's rows lie apart (a put's token-major K / V: 32 KiB rows at layer strides)
   the copy reads far ahead into L2; where they follow each other (a page read back from host
   memory, one sequential run) the hardware keeps up and the copy reads just ahead into L1.
   Measured on a 2-core AMD EPYC, one thread, 32 MiB groups of 32 KiB rows: the put's copy
   13.3-13.7 GB/s at 512 into L1, 14.5-15.1 at 4096 into L2 (the plain row copy's 14.9-15.5;
   6144 the same, 8192 14.3-14.5, 2048 11.8-12.3, none 13.2); a verified read out of host
   memory 16.0-17.7 GB/s at 512 into L1, 14.1-15.0 at 4096 into L2. The two loops live in
   functions of their own: inlined side by side in one, the far loop ran at 10.3 GB/s. */
#ifndef PREFETCH_FAR
#define PREFETCH_FAR 4096
#endif
#ifndef PREFETCH_NEAR
#define PREFETCH_NEAR 512
#endif
#define AVX2_INLINE __attribute__((target("avx2"), always_inline)) static inline

/* One stripe: copied (stream: non-temporal), tested (check: the lanes' exponent bits, kept as a
   running unsigned max that reaches the mask only where some element had all of them set) and
   folded into the accumulators a0, a1 with `key`. */
AVX2_INLINE void stripe_avx2(char *d, const char *src, const unsigned char *key, __m256i *a0, __m256i *a1,
                             __m256i *hi, __m256i m, const int stream, const int check) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)src);
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(src + 32));
    if (stream) {
        _mm256_stream_si256((__m256i *)d, x0);
        _mm256_stream_si256((__m256i *)(d + 32), x1);
    } else {
        _mm256_storeu_si256((__m256i *)d, x0);
        _mm256_storeu_si256((__m256i *)(d + 32), x1);
    }
    if (check == 3) {
        *hi = _mm256_max_epu32(*hi, _mm256_max_epu32(_mm256_and_si256(x0, m), _mm256_and_si256(x1, m)));
    } else if (check) {
        *hi = _mm256_max_epu16(*hi, _mm256_max_epu16(_mm256_and_si256(x0, m), _mm256_and_si256(x1, m)));
    }
    __m256i k0 = _mm256_xor_si256(x0, _mm256_loadu_si256((const __m256i *)key));
    __m256i k1 = _mm256_xor_si256(x1, _mm256_loadu_si256((const __m256i *)(key + 32)));
    /* acc[i] += lo32(k) * hi32(k); acc[i ^ 1] += x[i] */
    __m256i p0 = _mm256_mul_epu32(k0, _mm256_shuffle_epi32(k0, _MM_SHUFFLE(0, 3, 0, 1)));
    __m256i p1 = _mm256_mul_epu32(k1, _mm256_shuffle_epi32(k1, _MM_SHUFFLE(0, 3, 0, 1)));
    *a0 = _mm256_add_epi64(*a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(x0, _MM_SHUFFLE(1, 0, 3, 2))));
    *a1 = _mm256_add_epi64(*a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(x1, _MM_SHUFFLE(1, 0, 3, 2))));
}

/* scramble() on the accumulators in registers: a ^= a >> 47; a ^= key; a *= P32_1. */
AVX2_INLINE __m256i scramble_avx2(__m256i a, const unsigned char *key) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)), _mm256_loadu_si256((const __m256i *)key));
    __m256i lo = _mm256_mul_epu32(a, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

/* A row of whole stripes, `*sp` the unit's stripes before it (S in all): runs of stripes up to
   the next scramble, each stripe's key 8 bytes on from the last, so the loop does no division
   and keeps its counters in registers; the unit's last stripe takes its own key. */
AVX2_INLINE int row_avx2_body(char *d, const char *src, int64_t row, uint64_t acc[8], int64_t *sp, int64_t S,
                              const int stream, const int check, const int far) {
    const unsigned char *last_key = SECRET + SECRET_SIZE - STRIPE - 7;
    const unsigned char *scramble_key = SECRET + SECRET_SIZE - STRIPE;
    __m256i m = check == 3 ? _mm256_set1_epi32(0x7F800000)
              : _mm256_set1_epi16((short)(check == 2 ? 0x7F80 : 0x7C00));
    __m256i hi = _mm256_setzero_si256();
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    int64_t s = *sp, k = 0;
    while (k < row) {
        int64_t in_block = s % STRIPES_PER_BLOCK;
        int64_t run = STRIPES_PER_BLOCK - in_block, left = (row - k) / STRIPE;
        if (run > left) run = left;
        int last = s + run == S;                        /* the run ends on the unit's last stripe */
        const unsigned char *key = SECRET + in_block * 8;
        for (int64_t i = 0; i < run - last; i++, k += STRIPE, key += 8) {
            if (far) _mm_prefetch(src + k + PREFETCH_FAR, _MM_HINT_T1);
            else _mm_prefetch(src + k + PREFETCH_NEAR, _MM_HINT_T0);
            stripe_avx2(d + k, src + k, key, &a0, &a1, &hi, m, stream, check);
        }
        if (last) {
            stripe_avx2(d + k, src + k, last_key, &a0, &a1, &hi, m, stream, check);
            k += STRIPE;
        }
        s += run;
        if (s % STRIPES_PER_BLOCK == 0 && s < S) {     /* stripe s - 1 closed a block, not the last */
            a0 = scramble_avx2(a0, scramble_key);
            a1 = scramble_avx2(a1, scramble_key + 32);
        }
    }
    *sp = s;
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    if (!check) return 0;
    __m256i seen = check == 3 ? _mm256_cmpeq_epi32(hi, m) : _mm256_cmpeq_epi16(hi, m);
    return !_mm256_testz_si256(seen, seen);
}

/* row_avx2_body with stream, check and the read-ahead as constants (one specialised loop
   each; the far and near loops in functions of their own, as each was measured alone). */
#define MMT_ROW(st, ch, fa) return row_avx2_body(d, src, row, acc, s, S, st, ch, fa)
#define MMT_ROWS(fa) if (stream) { switch (check) { case 1: MMT_ROW(1, 1, fa); case 2: MMT_ROW(1, 2, fa); \
                                                    case 3: MMT_ROW(1, 3, fa); default: MMT_ROW(1, 0, fa); } } \
                     switch (check) { case 1: MMT_ROW(0, 1, fa); case 2: MMT_ROW(0, 2, fa); \
                                      case 3: MMT_ROW(0, 3, fa); default: MMT_ROW(0, 0, fa); }
__attribute__((target("avx2"), noinline))
static int row_avx2_far(char *d, const char *src, int64_t row, uint64_t acc[8], int64_t *s, int64_t S,
                        int stream, int check) {
    MMT_ROWS(1)
}

__attribute__((target("avx2"), noinline))
static int row_avx2_near(char *d, const char *src, int64_t row, uint64_t acc[8], int64_t *s, int64_t S,
                         int stream, int check) {
    MMT_ROWS(0)
}
#undef MMT_ROWS
#undef MMT_ROW

__attribute__((target("avx2")))
static inline int row_avx2(char *d, const char *src, int64_t row, uint64_t acc[8], int64_t *s, int64_t S,
                           int stream, int check, int far) {
    return far ? row_avx2_far(d, src, row, acc, s, S, stream, check)
               : row_avx2_near(d, src, row, acc, s, S, stream, check);
}
#endif

/* Whether a row (already copied, read again from the cache) holds a NaN / Inf (rows.c's test). */
static int row_nonfinite(const char *p, int64_t row, int check) {
    unsigned bad = 0;
    if (check == 3) {
        for (int64_t i = 0; i < row; i += 4) {
            uint32_t x; memcpy(&x, p + i, 4);
            bad |= (x & 0x7F800000u) == 0x7F800000u;
        }
    } else {
        uint16_t m = check == 2 ? 0x7F80 : 0x7C00;
        for (int64_t i = 0; i < row; i += 2) {
            uint16_t x; memcpy(&x, p + i, 2);
            bad |= (x & m) == m;
        }
    }
    return bad != 0;
}

/* Whether a unit's source rows follow each other in memory in walk order (one sequential run). */
static int rows_follow(int nd, const int64_t *shape, const int64_t *sstr, int64_t row) {
    int64_t next = row;
    for (int i = nd - 1; i >= 0; i--) {
        if (shape[i] > 1 && sstr[i] != next) return 0;
        next *= shape[i];
    }
    return 1;
}

/* Digest (and copy, with `dst`) every unit; see the top of this file. Returns -1 when every
   unit is done (and matched `expect`), the index of the first unit that did not match, or -2
   on arguments it does not take (nothing copied). `dst` NULL: digests only, nothing copied. */
static int64_t copy_rows_xxh3(const int64_t *dst, const int64_t *src, int64_t n_units, int nd,
                              const int64_t *shape, const int64_t *dstr, const int64_t *sstr,
                              int64_t row, int flags, uint64_t *digests,
                              const uint64_t *expect, int *nonfinite) {
    int allow_stream = flags & 1;       /* flags: 1 streaming stores allowed, 2 scalar code only, */
    int check = (flags >> 2) & 3;       /* bits 2-3: the finiteness check's dtype (0: none) */
    int found = 0;
    int64_t total = walk_rows(nd, shape);
    if (total <= 0 || row <= 0 || row % STRIPE != 0 || n_units < 0) return -2;
    int64_t len = total * row;
    if (len <= 240) return -2;
    int64_t S = len / STRIPE;
    int use_avx2 = 0, stream = 0, far = 0;
#ifdef HAVE_AVX2
    far = !rows_follow(nd, shape, sstr, row);
    use_avx2 = !(flags & 2) && __builtin_cpu_supports("avx2");
    stream = use_avx2 && allow_stream && dst != NULL && dst_aligned(dst, n_units, nd, dstr, row, 32);
#else
    (void)allow_stream;
#endif
    char sink[4096];                    /* rows land here when only digests are wanted */
    int64_t bad = -1;
    for (int64_t u = 0; u < n_units && bad < 0; u++) {
        char *d = dst != NULL ? (char *)(intptr_t)dst[u] : NULL;
        const char *s = (const char *)(intptr_t)src[u];
        uint64_t acc[8];
        acc_init(acc);
        int64_t stripe = 0;
        walk_t w;
        walk_start(&w);
        for (int64_t n = 0; n < total; n++, walk_next(&w, nd, shape, dstr, sstr)) {
            if (d == NULL) {            /* hash only: walk the row in sink-sized pieces */
                for (int64_t k = 0; k < row; k += (int64_t)sizeof(sink)) {
                    int64_t part = row - k < (int64_t)sizeof(sink) ? row - k : (int64_t)sizeof(sink);
#ifdef HAVE_AVX2
                    if (use_avx2) row_avx2(sink, s + w.soff + k, part, acc, &stripe, S, 0, 0, far); else
#endif
                    row_scalar(sink, s + w.soff + k, part, acc, &stripe, S);
                }
            } else {
#ifdef HAVE_AVX2
                if (use_avx2) found |= row_avx2(d + w.doff, s + w.soff, row, acc, &stripe, S, stream, check, far); else
#endif
                {
                    row_scalar(d + w.doff, s + w.soff, row, acc, &stripe, S);
                    if (check) found |= row_nonfinite(d + w.doff, row, check);
                }
            }
        }
        uint64_t h = finish(acc, (uint64_t)len);
        if (digests != NULL) digests[u] = h;
        if (expect != NULL && h != expect[u]) {
            bad = u;
            if (d != NULL) {            /* no unverified byte stays behind: poison the unit */
                walk_start(&w);
                for (int64_t n = 0; n < total; n++, walk_next(&w, nd, shape, dstr, dstr))
                    memset(d + w.doff, 0xFF, (size_t)row);
            }
        }
    }
#ifdef HAVE_AVX2
    if (stream) _mm_sfence();
#endif
    if (nonfinite != NULL) *nonfinite = found;
    return bad;
}

#define MAX_THREADS 16
#define PART_MIN_BYTES (4 << 20)

typedef struct {
    const int64_t *dst, *src;
    int64_t n_units;
    int nd;
    const int64_t *shape, *dstr, *sstr;
    int64_t row;
    int flags;
    uint64_t *digests;
    int nonfinite;
    int64_t ret;
} part_t;

static void *run_part(void *arg) {
    part_t *p = arg;
    p->ret = copy_rows_xxh3(p->dst, p->src, p->n_units, p->nd, p->shape, p->dstr, p->sstr, p->row,
                            p->flags, p->digests, NULL, &p->nonfinite);
    return NULL;
}

/* copy_rows_xxh3 without `expect`, its units split over up to `threads` threads. */
static int64_t copy_rows_split(const int64_t *dst, const int64_t *src, int64_t n_units, int nd,
                               const int64_t *shape, const int64_t *dstr, const int64_t *sstr,
                               int64_t row, int flags, uint64_t *digests, int threads, int *nonfinite) {
    int64_t total = walk_rows(nd, shape);
    int64_t unit_bytes = total > 0 && row > 0 ? total * row : 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (unit_bytes > 0 && threads > 1) {
        int64_t most = n_units * unit_bytes / PART_MIN_BYTES;
        if (most < threads) threads = most < 1 ? 1 : (int)most;
    }
    if (threads <= 1 || dst == NULL || digests == NULL) {
        int found = 0;
        int64_t r = copy_rows_xxh3(dst, src, n_units, nd, shape, dstr, sstr, row, flags, digests, NULL, &found);
        if (nonfinite != NULL) *nonfinite = found;
        return r;
    }
    part_t parts[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t at = 0;
    for (int t = 0; t < threads; t++) {
        int64_t n = n_units / threads + (t < n_units % threads);
        part_t p = {dst + at, src + at, n, nd, shape, dstr, sstr, row, flags, digests + at, 0, -1};
        parts[t] = p;
        at += n;
    }
    for (int t = 1; t < threads; t++)          /* a thread that does not start: its part runs here */
        started[t] = pthread_create(&tid[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    int64_t ret = parts[0].ret;
    int found = parts[0].nonfinite;
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL); else run_part(&parts[t]);
        if (parts[t].ret == -2) ret = -2;
        found |= parts[t].nonfinite;
    }
    if (nonfinite != NULL) *nonfinite = found;
    return ret;
}

int64_t mmtier_copy_rows_xxh3(const int64_t *dst, const int64_t *src, int64_t n_units, int nd,
                              const int64_t *shape, const int64_t *dstr, const int64_t *sstr,
                              int64_t row, int flags, uint64_t *digests,
                              const uint64_t *expect, int threads) {
    if (expect != NULL)
        return copy_rows_xxh3(dst, src, n_units, nd, shape, dstr, sstr, row, flags & 3, digests, expect, NULL);
    return copy_rows_split(dst, src, n_units, nd, shape, dstr, sstr, row, flags & 3, digests, threads, NULL);
}

/* The same copy, each element also tested for NaN / Inf (`check`: 1 float16, 2 bfloat16,
   3 float32); *nonfinite is set to 1 where one was found (every unit is still copied). */
int64_t mmtier_copy_rows_xxh3_checked(const int64_t *dst, const int64_t *src, int64_t n_units, int nd,
                                      const int64_t *shape, const int64_t *dstr, const int64_t *sstr,
                                      int64_t row, int flags, uint64_t *digests, int check,
                                      int *nonfinite, int threads) {
    if (check < 1 || check > 3 || dst == NULL || nonfinite == NULL) return -2;
    return copy_rows_split(dst, src, n_units, nd, shape, dstr, sstr, row, (flags & 3) | (check << 2),
                           digests, threads, nonfinite);
}
