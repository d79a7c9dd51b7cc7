/* The block kinds of quant_linear.c: how each stores its weights' quantized values q and their scales, and
 * how a weight is rebuilt in registers as fma(D, q, M), the very float gguf's dequantization computes.
 * kernels/native/quant_pack.py writes these layouts and holds the plain reference of the same arithmetic.
 *
 * A panel is 16 output columns; along K it is a run of super-blocks, each the scales of SUB 32-blocks then
 * their quantized values (SUB = 8 for the K-quants, whose scales cover 256 inputs; 1 otherwise). A
 * 32-block's values, for each of its 32 k:
 *   4-bit:  8 bytes, byte j = column j in the low nibble, column j + 8 in the high one;
 *   5/6-bit: a plane of q's high bits, per k a 16- (5-bit) or 32-bit (6-bit) little-endian word, column c's
 *           1 or 2 bits at bit c or 2c, then the 4-bit layout's nibbles (q's low 4 bits) for all 32 k;
 *   8-bit:  16 int8 (k-major).
 * So a weight takes 4.5 (Q4_0) to 6.5625 (Q6_K) bits as in the file, 4.625 and 5.625 for Q4_K and Q5_K
 * (their 6-bit sub-block scales as bytes), and 8.5 for Q8_0.
 * Scales, per column (16 of each):
 *   Q4_0, Q5_0, Q8_0: d (float16); D = d, M = -8 d, -16 d, 0 (M computed in float32: exact, no overflow;
 *              an infinite or NaN d, where D * q + M is not gguf's float, is refused by the repacking);
 *   Q4_1, Q5_1: d, m (float16); D = d, M = m;
 *   Q4_K, Q5_K: d, dmin (float16), then per 32-block sc[16] and mn[16] (uint8, 6 bits): D = d * sc,
 *              M = -(dmin * mn), each exact in float32, as gguf computes them;
 *   Q6_K: d (float16), then per 16 inputs sc[16] (int8): D = d * sc, M = -32 D (d finite, as above).
 * Why fma(D, q, M) is gguf's float: D * q is exact in float32 (at most an 18-bit by 6-bit product), so the
 * FMA rounds what gguf rounds, D * q + M; where gguf computes D * (q - offset) (Q4_0, Q5_0, Q6_K) that
 * product is itself exact and equals D * q + M, so both are that number (a zero weight may be +0 where
 * gguf has -0: the same float to a sum, and to the tests' comparisons). */
#ifndef TANDEM_QUANT_BLOCKS_H
#define TANDEM_QUANT_BLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#define PANEL 16
#define KBLK 32
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Numbered as the kinds of kernels/native/quant_pack.py's GGUF_BLOCKS; then the float weights kept row-major
 * (dense_rows.h: not blocks, and not in panels). */
enum { KIND_Q4_1, KIND_Q8_0, KIND_Q4_K, KIND_Q4_0, KIND_Q5_0, KIND_Q5_1, KIND_Q5_K, KIND_Q6_K, KIND_F32_ROWS,
       KIND_BF16_ROWS, KIND_F16_ROWS };

static inline int super_k(int kind) { return kind == KIND_Q4_K || kind == KIND_Q5_K || kind == KIND_Q6_K; }
/* 32-blocks per super-block */
static inline int64_t sub_blocks(int kind) { return super_k(kind) ? 8 : 1; }
/* bits of q above its low nibble, kept in a plane before the nibbles */
static inline int high_bits(int kind) {
    return kind == KIND_Q5_0 || kind == KIND_Q5_1 || kind == KIND_Q5_K ? 1 : kind == KIND_Q6_K ? 2 : 0;
}
static inline int64_t quant_bytes(int kind) { return kind == KIND_Q8_0 ? 512 : 256 + 64 * high_bits(kind); }
static inline int64_t scale_bytes(int kind) {
    return kind == KIND_Q4_1 || kind == KIND_Q5_1 ? 64
           : kind == KIND_Q4_K || kind == KIND_Q5_K ? 64 + 2 * 8 * PANEL
           : kind == KIND_Q6_K                      ? 32 + 16 * PANEL
                                                    : 32;
}
static inline int64_t super_bytes(int kind) { return scale_bytes(kind) + sub_blocks(kind) * quant_bytes(kind); }
/* 32-block `sub`'s values in the super-block at sb: after the scales */
static inline const uint8_t *values_of(int kind, const uint8_t *sb, int64_t sub) {
    return sb + scale_bytes(kind) + sub * quant_bytes(kind);
}
/* scale groups per 32-block: Q6_K's scales cover 16 inputs */
static inline int groups(int kind) { return kind == KIND_Q6_K ? 2 : 1; }
/* M as a multiple of D where gguf computes D * (q - offset) (finite D only: quant_pack.py checks) */
static inline float offset_scale(int kind) { return kind == KIND_Q4_0 ? -8.0f : kind == KIND_Q5_0 ? -16.0f : -32.0f; }

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#ifdef QUANT_AVX2
static ALWAYS_INLINE __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static ALWAYS_INLINE __m256i bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static ALWAYS_INLINE __m256i broadcast32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* D and M of columns 0..7 and 8..15 for scale group g of 32-block `sub` of the super-block at s. */
static ALWAYS_INLINE void scales_at(int kind, const uint8_t *s, int64_t sub, int g, __m256 *d0, __m256 *d1,
                                    __m256 *m0, __m256 *m1) {
    if (kind == KIND_Q4_K || kind == KIND_Q5_K) {
        const uint8_t *sc = s + 64 + sub * PANEL, *mn = sc + 8 * PANEL;
        const __m256 neg = _mm256_set1_ps(-0.0f); /* M = -(dmin * mn): a true negation, as gguf subtracts */
        *d0 = _mm256_mul_ps(half8(s), _mm256_cvtepi32_ps(bytes8(sc)));
        *d1 = _mm256_mul_ps(half8(s + 16), _mm256_cvtepi32_ps(bytes8(sc + 8)));
        *m0 = _mm256_xor_ps(_mm256_mul_ps(half8(s + 32), _mm256_cvtepi32_ps(bytes8(mn))), neg);
        *m1 = _mm256_xor_ps(_mm256_mul_ps(half8(s + 48), _mm256_cvtepi32_ps(bytes8(mn + 8))), neg);
        return;
    }
    if (kind == KIND_Q6_K) {
        const uint8_t *sc = s + 32 + (sub * 2 + g) * PANEL;
        *d0 = _mm256_mul_ps(half8(s), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
        *d1 = _mm256_mul_ps(half8(s + 16),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)))));
    } else {
        *d0 = half8(s);
        *d1 = half8(s + 16);
    }
    if (kind == KIND_Q4_1 || kind == KIND_Q5_1) {
        *m0 = half8(s + 32);
        *m1 = half8(s + 48);
    } else if (kind == KIND_Q8_0) {
        *m0 = *m1 = _mm256_setzero_ps(); /* not 0 * d: an infinite d gives gguf's infinities, not NaN */
    } else {
        *m0 = _mm256_mul_ps(*d0, _mm256_set1_ps(offset_scale(kind)));
        *m1 = _mm256_mul_ps(*d1, _mm256_set1_ps(offset_scale(kind)));
    }
}

/* The 16 weights of columns 0..7 (w0) and 8..15 (w1) at k = kk of the 32-block at blk. */
static ALWAYS_INLINE void weights_at(int kind, const uint8_t *blk, int64_t kk, __m256 d0, __m256 d1, __m256 m0,
                                     __m256 m1, __m256 *w0, __m256 *w1) {
    __m256i q0, q1;
    if (kind == KIND_Q8_0) {
        const uint8_t *p = blk + kk * 16;
        q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
        q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    } else {
        const int hb = high_bits(kind);
        const __m256i b = bytes8(blk + 64 * hb + kk * 8);
        q0 = _mm256_and_si256(b, _mm256_set1_epi32(15));
        q1 = _mm256_srli_epi32(b, 4);
        if (hb) {
            /* A 32-bit load starting one byte before a half's bits puts column j's at bit 8 + hb * j: the
             * same shifts for both halves bring them to bits 4.. (the byte before is the plane's previous
             * k, the scales or the previous 32-block's nibbles; the ones after, the plane's next k or this
             * 32-block's nibbles: never outside the weight). */
            const uint8_t *plane = blk + kk * 2 * hb;
            const __m256i shift = hb == 1 ? _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11)
                                          : _mm256_setr_epi32(4, 6, 8, 10, 12, 14, 16, 18);
            const __m256i mask = _mm256_set1_epi32(hb == 1 ? 0x10 : 0x30);
            q0 = _mm256_or_si256(q0, _mm256_and_si256(_mm256_srlv_epi32(broadcast32(plane - 1), shift), mask));
            q1 = _mm256_or_si256(q1, _mm256_and_si256(_mm256_srlv_epi32(broadcast32(plane + hb - 1), shift), mask));
        }
    }
    *w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(q0), m0);
    *w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(q1), m1);
}
#else
static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* D and M of column c at input k of the panel at w, as the AVX2 path's scales_at computes them. */
static inline void scales_scalar(int kind, const uint8_t *w, int c, int64_t k, float *d, float *m) {
    const int64_t b = k / KBLK, kk = k % KBLK, sub = b % sub_blocks(kind);
    const uint8_t *s = w + b / sub_blocks(kind) * super_bytes(kind);
    if (kind == KIND_Q4_K || kind == KIND_Q5_K) {
        *d = load_half(s + 2 * c) * (float)s[64 + sub * PANEL + c];
        *m = -(load_half(s + 32 + 2 * c) * (float)s[64 + (8 + sub) * PANEL + c]);
        return;
    }
    *d = load_half(s + 2 * c);
    if (kind == KIND_Q6_K) *d *= (float)(int8_t)s[32 + (sub * 2 + kk / 16) * PANEL + c];
    *m = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? load_half(s + 32 + 2 * c)
         : kind == KIND_Q8_0                  ? 0.0f
                                              : *d * offset_scale(kind);
}

/* Column c's quantized value q at input k of the panel at w (signed for Q8_0). */
static inline int quant_at(int kind, const uint8_t *w, int c, int64_t k) {
    const int64_t b = k / KBLK, kk = k % KBLK;
    const uint8_t *blk = values_of(kind, w + b / sub_blocks(kind) * super_bytes(kind), b % sub_blocks(kind));
    if (kind == KIND_Q8_0) return (int8_t)blk[kk * 16 + c];
    const int hb = high_bits(kind), bit = hb * c;
    const uint8_t byte = blk[64 * hb + kk * 8 + (c & 7)];
    int q = c < 8 ? byte & 15 : byte >> 4;
    if (hb) q |= ((blk[kk * 2 * hb + bit / 8] >> (bit % 8)) & ((1 << hb) - 1)) << 4;
    return q;
}

/* Column c's weight at input k of the panel at w, as the AVX2 path computes it (the same float ops). */
static inline float weight_at(int kind, const uint8_t *w, int c, int64_t k) {
    float d, m;
    scales_scalar(kind, w, c, k, &d, &m);
    return __builtin_fmaf(d, (float)quant_at(kind, w, c, k), m);
}
#endif
#endif
