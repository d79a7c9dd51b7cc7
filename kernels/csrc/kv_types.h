/* The KV pools' element types (--kv-cache-dtype): their codes (kernels/native/paged_attention.py's KV_TYPES),
 * float16 and bfloat16 both ways, and q8_0 blocks. Included by paged_attention.c, which reads every type,
 * step_graph.c, whose KV_WRITE node stores rows as the eager write does, and dense_rows.h, whose float16 and
 * bfloat16 weights widen as these do (kernels/native/build.py hashes the headers beside a source into its
 * build).
 *
 * q8_0 is llama.cpp's block_q8_0: a head's row of D elements (D a multiple of 32) is D / 32 blocks of a
 * float16 scale d and 32 int8 q, element j reading back as q[j] * d (exact in float32). The rounding is
 * kernels/reference/kv_quant.py's, which the tests hold this code to byte for byte. */
#ifndef TANDEM_KV_TYPES_H
#define TANDEM_KV_TYPES_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

#define Q8_0_QK 32
#define Q8_0_BYTES (2 + Q8_0_QK)
#define F16_NAN 0x7e00u
#define F16_MAX_BITS 0x7bffu /* 65504 */

static inline int kv_type_known(int64_t kt) { return kt >= KV_F32 && kt <= KV_Q8_0; }

/* Bytes of the pool tensor's element: a slot stride counts them. */
static inline int64_t kv_elem_size(int kt) { return kt == KV_F32 ? 4 : kt == KV_Q8_0 ? 1 : 2; }

/* Bytes n consecutive elements take (n a multiple of 32 for q8_0): a head's row, or a slot's. */
static inline int64_t kv_row_bytes(int kt, int64_t n) {
    return kt == KV_Q8_0 ? n / Q8_0_QK * Q8_0_BYTES : n * kv_elem_size(kt);
}

/* IEEE half -> float, exactly (every half is a float): one instruction with F16C (a q8_0 block's scale is
 * widened on every load of its values), else rebias the exponent and widen the mantissa. */
static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: bias 15 -> 127 */
    } else {
        const float f = (float)man * 0x1p-24f; /* zero or subnormal: man * 2^-24, exact in float */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* bfloat16 is a float's upper half. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* float32 -> float16, rounded to nearest even as torch's .to(float16) rounds (NaN: its quiet NaN). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | F16_NAN);
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and up round to inf */
    const int32_t e = (int32_t)(ax >> 23) - 127;
    uint32_t q, r, half;
    if (e >= -14) { /* a normal half: drop 13 mantissa bits (a carry may step the exponent, as it should) */
        q = ((uint32_t)(e + 15) << 10) | ((ax >> 13) & 0x3ff);
        r = ax & 0x1fff;
        half = 0x1000;
    } else { /* a subnormal half: the value in units of 2^-24 */
        const uint32_t m = (ax >> 23) ? (ax & 0x7fffff) | 0x800000 : 0;
        const int32_t s = -(e + 1); /* >= 14 */
        if (s > 25) return (uint16_t)sign;
        q = m >> s;
        r = m & ((1u << s) - 1);
        half = 1u << (s - 1);
    }
    if (r > half || (r == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

/* float32 -> bfloat16, rounded to nearest even as torch's vectorized .to(bfloat16) rounds (NaN: 0xffff). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffff) > 0x7f800000) return 0xffff;
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* A block's scale, read as float32 (its two bytes may sit at any even offset). */
static inline float q8_0_scale(const char *block) {
    uint16_t h;
    memcpy(&h, block, sizeof h);
    return f16_to_f32(h);
}

/* n elements (a multiple of 32) -> n / 32 blocks at out. Each step is one IEEE float32 operation, in the
 * reference's order (kernels/reference/kv_quant.py): the same bytes whatever the compiler vectorizes. */
static inline void q8_0_quantize(const float *x, int64_t n, uint8_t *out) {
    for (int64_t b = 0; b < n / Q8_0_QK; b++, x += Q8_0_QK, out += Q8_0_BYTES) {
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < Q8_0_QK; j++) {
            const float a = fabsf(x[j]);
            finite &= a <= FLT_MAX; /* false for NaN and inf */
            amax = a > amax ? a : amax;
        }
        int8_t *q = (int8_t *)(out + 2);
        if (!finite) { /* a NaN scale and zeros: the block reads back as NaN */
            const uint16_t nan = F16_NAN;
            memcpy(out, &nan, sizeof nan);
            memset(q, 0, Q8_0_QK);
            continue;
        }
        uint16_t h = f32_to_f16(amax / 127.0f);
        if (h > F16_MAX_BITS) h = F16_MAX_BITS; /* rounded past the largest half: saturate, not inf */
        memcpy(out, &h, sizeof h);
        const float d = f16_to_f32(h), inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < Q8_0_QK; j++) {
            const float y = x[j] * inv, t = truncf(y);
            float r = fabsf(y - t) >= 0.5f ? t + copysignf(1.0f, y) : t; /* roundf: half away from zero */
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[j] = (int8_t)r;
        }
    }
}

/* n / 32 blocks -> n float32 values, exactly. */
static inline void q8_0_dequantize(const char *row, int64_t n, float *out) {
    for (int64_t b = 0; b < n / Q8_0_QK; b++, row += Q8_0_BYTES, out += Q8_0_QK) {
        const float d = q8_0_scale(row);
        const int8_t *q = (const int8_t *)(row + 2);
        for (int j = 0; j < Q8_0_QK; j++) out[j] = (float)q[j] * d;
    }
}

/* Row src (n float32 elements: a slot's heads, back to back) into slot `slot` of a pool of type `type`:
 * rounded as torch's .to() rounds, or quantized. */
static inline void kv_store_row(void *pool, int64_t slot, const float *src, int64_t n, int type) {
    char *dst = (char *)pool + slot * kv_row_bytes(type, n);
    if (type == KV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (type == KV_Q8_0) {
        q8_0_quantize(src, n, (uint8_t *)dst);
    } else {
        uint16_t *h = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) h[i] = type == KV_F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
    }
}
#endif
