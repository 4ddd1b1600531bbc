/* One fp8 byte's float32 bits, by branch-free bit arithmetic (fp8.c widens whole blocks with it,
 * fp8_attention.c its portable path): a normal number's exponent and mantissa shifted into place
 * and the exponent rebiased by an integer add, a subnormal's mantissa converted exactly (m * 2^-9
 * for e4m3, m * 2^-16 for e5m2), the specials (e4m3fn's NaN, e5m2's infinities and NaNs) chosen
 * by masks, the sign or'ed in: torch's own bits for all 256 bytes, NaN payloads included. */
#ifndef MMTIER_FP8_BITS_H
#define MMTIER_FP8_BITS_H
#include <stdint.h>
#include <string.h>

/* e4m3fn: bias 7, no infinities, S.1111.111 is NaN (torch: 0x7ff00000 with the sign). */
static inline uint32_t e4m3_bits(uint32_t x) {
    uint32_t mag = x & 0x7f;
    uint32_t normal = (mag << 20) + (120u << 23);
    float sub = (float)(int32_t)mag * 0x1p-9f;
    uint32_t subbits;
    memcpy(&subbits, &sub, 4);
    uint32_t is_sub = -(uint32_t)(mag < 8), is_nan = -(uint32_t)(mag == 0x7f);
    uint32_t r = (subbits & is_sub) | (normal & ~is_sub);
    r = (0x7ff00000u & is_nan) | (r & ~is_nan);
    return r | (x & 0x80) << 24;
}

/* e5m2: bias 15, S.11111.00 is infinity, S.11111.mm NaN (torch: quieted, the payload kept). */
static inline uint32_t e5m2_bits(uint32_t x) {
    uint32_t mag = x & 0x7f;
    uint32_t normal = (mag << 21) + (112u << 23);
    float sub = (float)(int32_t)mag * 0x1p-16f;
    uint32_t subbits;
    memcpy(&subbits, &sub, 4);
    uint32_t is_sub = -(uint32_t)(mag < 4), is_special = -(uint32_t)(mag >= 0x7c);
    uint32_t special = 0x7f800000u | ((mag & 3) << 21) | (mag > 0x7c ? 0x400000u : 0u);
    uint32_t r = (subbits & is_sub) | (normal & ~is_sub);
    r = (special & is_special) | (r & ~is_special);
    return r | (x & 0x80) << 24;
}
#endif
