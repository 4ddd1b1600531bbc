/* fp8 -> float32 widening by bit arithmetic, vectorised (fp8.py).
 *
 * torch's CPU conversion of float8_e4m3fn runs element by element (about 0.3-0.4 GB/s of fp8
 * on one core here). Each byte's float32 bits are built directly: a normal number's exponent
 * and mantissa shifted into place and the exponent rebiased by an integer add, a subnormal's
 * mantissa converted exactly (m * 2^-9 for e4m3, m * 2^-16 for e5m2), the specials (e4m3fn's
 * NaN, e5m2's infinities and NaNs) chosen by masks, the sign or'ed in. No branch, no table:
 * the compiler vectorises the loop (on x86 with GCC, an AVX2 clone and a baseline one, chosen
 * at load time for the CPU it runs on). Every one of the 256 bytes gives torch's own float32
 * bits, NaN payloads included (tests/test_fp8_pages.py checks all of them). Measured on one
 * core of the 2-core EPYC: 4.5 GB/s of e4m3 into 64 MiB of float32, the 256-entry table it
 * replaces 1.8 GB/s.
 *
 * n_blocks blocks of `block` contiguous bytes, `src_stride` bytes apart, into `dst`
 * (contiguous, n_blocks * block floats); e5m2: 0 for float8_e4m3fn, 1 for float8_e5m2.
 */
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDEN_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define WIDEN_CLONES
#endif

/* e4m3fn: bias 7, no infinities, S.1111.111 is NaN (torch: 0x7ff00000 with the sign). */
WIDEN_CLONES
static void e4m3_block(const uint8_t *s, float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = s[i];
        uint32_t mag = x & 0x7f;
        uint32_t normal = (mag << 20) + (120u << 23);
        float sub = (float)(int32_t)mag * 0x1p-9f;
        uint32_t subbits;
        memcpy(&subbits, &sub, 4);
        uint32_t is_sub = -(uint32_t)(mag < 8), is_nan = -(uint32_t)(mag == 0x7f);
        uint32_t r = (subbits & is_sub) | (normal & ~is_sub);
        r = (0x7ff00000u & is_nan) | (r & ~is_nan);
        r |= (x & 0x80) << 24;
        memcpy(d + i, &r, 4);
    }
}

/* e5m2: bias 15, S.11111.00 is infinity, S.11111.mm NaN (torch: quieted, the payload kept). */
WIDEN_CLONES
static void e5m2_block(const uint8_t *s, float *d, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = s[i];
        uint32_t mag = x & 0x7f;
        uint32_t normal = (mag << 21) + (112u << 23);
        float sub = (float)(int32_t)mag * 0x1p-16f;
        uint32_t subbits;
        memcpy(&subbits, &sub, 4);
        uint32_t is_sub = -(uint32_t)(mag < 4), is_special = -(uint32_t)(mag >= 0x7c);
        uint32_t special = 0x7f800000u | ((mag & 3) << 21) | (mag > 0x7c ? 0x400000u : 0u);
        uint32_t r = (subbits & is_sub) | (normal & ~is_sub);
        r = (special & is_special) | (r & ~is_special);
        r |= (x & 0x80) << 24;
        memcpy(d + i, &r, 4);
    }
}

void fp8_widen_blocks(const uint8_t *src, int64_t src_stride, int64_t block, int64_t n_blocks,
                      float *dst, int32_t e5m2) {
    for (int64_t b = 0; b < n_blocks; b++) {
        if (e5m2)
            e5m2_block(src + b * src_stride, dst + b * block, block);
        else
            e4m3_block(src + b * src_stride, dst + b * block, block);
    }
}
