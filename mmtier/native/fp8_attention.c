/* Attention straight over fp8 pages, every key visible to every query row (fp8_attention.py).
 *
 * The torch path widens fp8 pages to a float32 buffer (four times their bytes, out of cache
 * by the time it is read) and hands it to torch's flash kernel, whose GEMMs pack operands for
 * a handful of query rows. Here each page row is widened in registers where it is used: a
 * row of K once for all R query rows of its KV head (R FMAs per 8 keys' elements), a row of V
 * once into R accumulators, softmax online per block of tokens (exp vectorised across the
 * rows), nothing written but the state: one pass over the fp8 bytes.
 *
 * Pages: `pages[i]` is the byte address of page i's K in the layer ([P, Hkv, D] fp8,
 * contiguous), its V `v_off` bytes on. `q`: float32 [Hkv, R, D], already multiplied by the
 * softmax scale (and an fp8 cache's K scale: the caller's). Out: `out` [Hkv, R, D] float32,
 * sum_j p_j v_j / sum_j p_j, and `lse` [Hkv, R] (natural log of sum_j exp(q . k_j)): a partial
 * state that merges exactly with others by log-sum-exp. The values are as stored (an fp8
 * cache's V scale is the caller's). A NaN or infinity among the bytes gives a NaN state for
 * that KV head's rows, never a finite wrong one.
 *
 * Two paths: AVX2 + FMA (chosen at run time where the CPU has both and denormal inputs are not
 * flushed), and portable C; `threads` take the pages in chunks as they go (each thread a partial
 * state, merged by log-sum-exp at the end). Returns 0, or -2 on arguments it does not take (nothing written). */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8_bits.h"

#define MAX_ROWS 8          /* query rows per KV head (GQA group x queries) */
#define MAX_DIM 512
#define MAX_THREADS 16
#define TOKENS 32           /* tokens per online-softmax block */
#define CHUNK 16            /* pages a thread takes at a time */

typedef struct {
    const int64_t *pages;
    int64_t n_pages, v_off;
    int64_t *next;          /* the first page no thread has taken yet (shared) */
    int P, hkv, D, R, e5m2, vec;
    const float *q;
    float *acc, *m, *l;     /* this thread's state: [hkv, R, D], [hkv, R], [hkv, R] */
} job_t;

static inline float widen1(uint8_t x, int e5m2) {
    uint32_t b = e5m2 ? e5m2_bits(x) : e4m3_bits(x);
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* The portable path: one token block of one head at a time, as the vector one. */
static void head_block_scalar(const job_t *j, const uint8_t *k, const uint8_t *v, int n, int h) {
    const int D = j->D, R = j->R, stride = j->hkv * D;
    float s[TOKENS][MAX_ROWS], row[MAX_DIM];
    const unsigned special = j->e5m2 ? 0x7c : 0x7f;
    int seen = 0;
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < D; d++) {
            uint8_t kb = k[(int64_t)t * stride + d], vb = v[(int64_t)t * stride + d];
            seen |= (kb & special) == special || (vb & special) == special;
            row[d] = widen1(kb, j->e5m2);
        }
        for (int r = 0; r < R; r++) {
            const float *q = j->q + ((int64_t)h * R + r) * D;
            float a = 0.f;
            for (int d = 0; d < D; d++) a += q[d] * row[d];
            s[t][r] = seen ? NAN : a;     /* a special among the bytes: the head's state NaN */
        }
    }
    for (int r = 0; r < R; r++) {
        float *m = j->m + h * R + r, *l = j->l + h * R + r, *acc = j->acc + ((int64_t)h * R + r) * D;
        float mx = *m;
        for (int t = 0; t < n; t++) mx = fmaxf(mx, s[t][r]);
        float corr = expf(*m - mx);
        *l *= corr;
        for (int d = 0; d < D; d++) acc[d] *= corr;
        for (int t = 0; t < n; t++) {
            s[t][r] = expf(s[t][r] - mx);
            *l += s[t][r];
        }
        *m = mx;
    }
    for (int t = 0; t < n; t++) {
        for (int d = 0; d < D; d++) row[d] = widen1(v[(int64_t)t * stride + d], j->e5m2);
        for (int r = 0; r < R; r++) {
            float *acc = j->acc + ((int64_t)h * R + r) * D, p = s[t][r];
            for (int d = 0; d < D; d++) acc[d] += p * row[d];
        }
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2 1
#define VEC __attribute__((target("avx2,fma")))
#define VEC_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline

/* 8 fp8 bytes -> 8 floats: each byte shifted to the top of its lane, then an arithmetic shift
   puts the magnitude under the float32 exponent with the sign above it, a mask keeps sign and
   magnitude, and one multiply rebiases (normal and subnormal alike, exactly: no denormal input
   is flushed, see vector_ok()). The specials (e4m3fn's NaN, e5m2's infinities and NaNs) are not
   told apart here: special_bytes() finds them per row. */
VEC_INLINE __m256 widen8(const uint8_t *p, const int e5m2) {
    __m256i x = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 24);
    if (!e5m2)
        return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(x, 4),
                                                                  _mm256_set1_epi32((int)0x87F00000u))),
                             _mm256_set1_ps(0x1p120f));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_srai_epi32(x, 3),
                                                              _mm256_set1_epi32((int)0x8FE00000u))),
                         _mm256_set1_ps(0x1p112f));
}

/* Bytes of a row of `n` (a multiple of 8) that are specials, or'ed into `seen` (0xFF in a byte
   lane where one was): e4m3fn's S.1111.111 (NaN), e5m2's S.11111.xx (infinity or NaN). */
VEC_INLINE __m256i special_bytes(const uint8_t *p, int n, __m256i seen, const int e5m2) {
    const __m256i m = _mm256_set1_epi8(e5m2 ? 0x7c : 0x7f);
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(p + i));
        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi8(_mm256_and_si256(x, m), m));
    }
    for (; i < n; i += 8) {
        __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));
        __m256i m32 = _mm256_set1_epi32(e5m2 ? 0x7c : 0x7f);
        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi32(_mm256_and_si256(x, m32), m32));
    }
    return seen;
}

/* exp of 8 floats (Cephes' polynomial; relative error ~2e-7); a NaN stays NaN. */
VEC_INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* Lane r: the sum of a[r]'s 8 lanes. */
VEC_INLINE __m256 hsum8(const __m256 a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Independent accumulator chains: an FMA's result is ready 4-5 cycles after it starts, so
   R rows alone keep the two FMA units busy only for large R. Scores take T tokens at a time
   (T x R chains); the weighted V sum C column chunks at a time (C x R chains), within the
   16 vector registers. */
#define K_TOKENS(R) ((R) == 1 ? 6 : (R) == 2 ? 4 : (R) <= 4 ? 3 : (R) <= 7 ? 2 : 1)
#define V_CHUNKS(R) ((R) <= 2 ? 4 : (R) <= 5 ? 2 : 1)

/* Scores of T tokens (rows `stride` bytes apart from `k`): lane r of s[t] is q_r . k_t. */
VEC_INLINE void scores_avx2(const uint8_t *k, int64_t stride, const float *q, int D, __m256 *s,
                            const int R, const int T, const int e5m2) {
    __m256 a[6][8];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 8; r++) a[t][r] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        __m256 x[6];
        for (int t = 0; t < T; t++) x[t] = widen8(k + t * stride + d, e5m2);
        for (int r = 0; r < R; r++) {
            __m256 qr = _mm256_loadu_ps(q + r * D + d);
            for (int t = 0; t < T; t++) a[t][r] = _mm256_fmadd_ps(qr, x[t], a[t][r]);
        }
    }
    for (int t = 0; t < T; t++) s[t] = hsum8(a[t]);
}

/* acc[r][d0 : d0 + 8C] = corr[r] * acc + sum_t w[t][r] * v_t[d0 : d0 + 8C] over n tokens; the
   weights come broadcast already (w[t][r]: 8 copies), so each FMA reads its weight from memory
   in the instruction, with no broadcast per column chunk. */
VEC_INLINE void values_avx2(const uint8_t *v, int64_t stride, int n, int d0, int D, float *acc,
                            const float *corr, const __m256 (*w)[8], const int R, const int C, const int e5m2) {
    __m256 o[4][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            o[c][r] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d0 + 8 * c), _mm256_set1_ps(corr[r]));
    for (int t = 0; t < n; t++) {
        __m256 x[4];
        for (int c = 0; c < C; c++) x[c] = widen8(v + t * stride + d0 + 8 * c, e5m2);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) o[c][r] = _mm256_fmadd_ps(w[t][r], x[c], o[c][r]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + r * D + d0 + 8 * c, o[c][r]);
}

/* One token block of one head; R and e5m2 constants (specialised below). Scores and weights
   are kept token-major, a token's R rows in the lanes of one vector. */
VEC_INLINE void head_block_avx2(const job_t *j, const uint8_t *k, const uint8_t *v, int n, int h,
                                const int R, const int e5m2) {
    const int D = j->D;
    const int64_t stride = (int64_t)j->hkv * D;
    const float *q = j->q + (int64_t)h * R * D;
    float *acc = j->acc + (int64_t)h * R * D;
    __m256 s[TOKENS];
    __m256i seen = _mm256_setzero_si256();
    for (int t = 0; t < n; t++) {
        seen = special_bytes(k + t * stride, D, seen, e5m2);
        seen = special_bytes(v + t * stride, D, seen, e5m2);
    }
    const int T = K_TOKENS(R);
    int t = 0;
    for (; t + T <= n; t += T) scores_avx2(k + t * stride, stride, q, D, s + t, R, T, e5m2);
    for (; t < n; t++) scores_avx2(k + t * stride, stride, q, D, s + t, R, 1, e5m2);
    if (!_mm256_testz_si256(seen, seen))          /* a special among the bytes: the head's state NaN */
        for (t = 0; t < n; t++) s[t] = _mm256_set1_ps(NAN);
    float mv[8] = {0}, lv[8] = {0};
    for (int r = 0; r < R; r++) { mv[r] = j->m[h * R + r]; lv[r] = j->l[h * R + r]; }
    __m256 m_old = _mm256_loadu_ps(mv), mx = m_old;
    for (t = 0; t < n; t++) mx = _mm256_max_ps(s[t], mx);      /* a NaN score: exp gives NaN below */
    __m256 corr = exp8(_mm256_sub_ps(m_old, mx)), l = _mm256_mul_ps(_mm256_loadu_ps(lv), corr);
    for (t = 0; t < n; t++) {
        s[t] = exp8(_mm256_sub_ps(s[t], mx));
        l = _mm256_add_ps(l, s[t]);
    }
    float cv[8], wt[8];
    __m256 w[TOKENS][8];
    _mm256_storeu_ps(cv, corr);
    _mm256_storeu_ps(mv, mx);
    _mm256_storeu_ps(lv, l);
    for (t = 0; t < n; t++) {
        _mm256_storeu_ps(wt, s[t]);
        for (int r = 0; r < R; r++) w[t][r] = _mm256_set1_ps(wt[r]);
    }
    for (int r = 0; r < R; r++) { j->m[h * R + r] = mv[r]; j->l[h * R + r] = lv[r]; }
    const int C = V_CHUNKS(R);
    int d = 0;
    for (; d + 8 * C <= D; d += 8 * C) values_avx2(v, stride, n, d, D, acc, cv, (const __m256 (*)[8])w, R, C, e5m2);
    for (; d < D; d += 8) values_avx2(v, stride, n, d, D, acc, cv, (const __m256 (*)[8])w, R, 1, e5m2);
}

VEC static void head_block_vec(const job_t *j, const uint8_t *k, const uint8_t *v, int n, int h) {
#define MMT_R(rr) case rr: if (j->e5m2) head_block_avx2(j, k, v, n, h, rr, 1); \
                           else head_block_avx2(j, k, v, n, h, rr, 0); return;
    switch (j->R) { MMT_R(1) MMT_R(2) MMT_R(3) MMT_R(4) MMT_R(5) MMT_R(6) MMT_R(7) MMT_R(8) }
#undef MMT_R
}

static int vector_ok(void) {
    /* the widening's multiply takes subnormal float32 inputs: not where they are flushed (DAZ) */
    unsigned csr = _mm_getcsr();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !(csr & 0x40);
}
#endif

#ifndef PAGES_AHEAD
#define PAGES_AHEAD 2
#endif

/* Part `part` of `parts` of page i's K and V asked for ahead of use: a head reads its rows at
   a stride of Hkv * D bytes, which the hardware's prefetchers do not follow across pages; the
   requests are spread over the heads of the page before, so that few are in flight at once. */
static void prefetch_part(const job_t *j, int64_t i, int part, int parts) {
    if (i >= j->n_pages) return;
    const char *page = (const char *)(intptr_t)j->pages[i];
    int64_t bytes = (int64_t)j->P * j->hkv * j->D, lo = bytes * part / parts, hi = bytes * (part + 1) / parts;
    for (int64_t o = lo & ~(int64_t)63; o < hi; o += 64) {
        __builtin_prefetch(page + o);
        __builtin_prefetch(page + j->v_off + o);
    }
}

/* Chunks of CHUNK pages taken in turn from the shared counter until none are left: a thread
   that is slowed (a core shared with the disk readers) takes fewer, none waits on another. */
static void *run_job(void *arg) {
    job_t *j = arg;
    for (;;) {
        int64_t a = __atomic_fetch_add(j->next, CHUNK, __ATOMIC_RELAXED);
        if (a >= j->n_pages) break;
        int64_t b = a + CHUNK < j->n_pages ? a + CHUNK : j->n_pages;
        for (int64_t i = a; i < a + PAGES_AHEAD && i < b; i++) prefetch_part(j, i, 0, 1);
        for (int64_t i = a; i < b; i++) {
            const uint8_t *page = (const uint8_t *)(intptr_t)j->pages[i];
            for (int h = 0; h < j->hkv; h++) {
                if (i + PAGES_AHEAD < b) prefetch_part(j, i + PAGES_AHEAD, h, j->hkv);
                for (int t0 = 0; t0 < j->P; t0 += TOKENS) {
                    int n = j->P - t0 < TOKENS ? j->P - t0 : TOKENS;
                    const uint8_t *k = page + ((int64_t)t0 * j->hkv + h) * j->D;
#ifdef HAVE_AVX2
                    if (j->vec) { head_block_vec(j, k, k + j->v_off, n, h); continue; }
#endif
                    head_block_scalar(j, k, k + j->v_off, n, h);
                }
            }
        }
    }
    return NULL;
}

int mmtier_fp8_attend(const int64_t *pages, int64_t n_pages, int64_t v_off, int P, int hkv, int D, int R,
                      int e5m2, const float *q, float *out, float *lse, int threads, int scalar) {
    if (n_pages <= 0 || P <= 0 || hkv <= 0 || D <= 0 || D > MAX_DIM || D % 8 || R <= 0 || R > MAX_ROWS)
        return -2;
    int vec = 0;
#ifdef HAVE_AVX2
    vec = !scalar && vector_ok();
#else
    (void)scalar;
#endif
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > (n_pages + CHUNK - 1) / CHUNK) threads = (int)((n_pages + CHUNK - 1) / CHUNK);
    int64_t state = (int64_t)hkv * R;
    float *mem = malloc(sizeof(float) * (size_t)(threads * state * (D + 2)));
    if (mem == NULL) return -2;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t next = 0;
    for (int t = 0; t < threads; t++) {
        float *acc = mem + t * state * (D + 2);
        job_t j = {pages, n_pages, v_off, &next, P, hkv, D, R, e5m2, vec, q, acc, acc + state * D,
                   acc + state * D + state};
        jobs[t] = j;
        memset(acc, 0, sizeof(float) * (size_t)(state * D));
        for (int64_t i = 0; i < state; i++) { jobs[t].m[i] = -INFINITY; jobs[t].l[i] = 0.f; }
    }
    for (int t = 1; t < threads; t++)          /* this thread works too; a failed start costs only speed */
        started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);   /* a thread never started took no page */
    }
    for (int64_t i = 0; i < state; i++) {      /* the threads' states merged by log-sum-exp */
        float top = -INFINITY;
        for (int t = 0; t < threads; t++) top = fmaxf(top, jobs[t].m[i]);
        float total = 0.f;
        float *o = out + i * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        int nan = 0;
        for (int t = 0; t < threads; t++) {
            float w = jobs[t].l[i] > 0.f ? expf(jobs[t].m[i] - top) : 0.f;
            nan |= isnan(jobs[t].m[i]) || isnan(jobs[t].l[i]);
            total += w * jobs[t].l[i];
            for (int d = 0; d < D; d++) o[d] += w * jobs[t].acc[i * D + d];
        }
        for (int d = 0; d < D; d++) o[d] = nan ? NAN : o[d] / total;
        lse[i] = nan ? NAN : top + logf(total);
    }
    free(mem);
    return 0;
}
