/* Paged attention's arithmetic on single K/V rows of any pool type (kv_types.h): a row read as float32
 * (widened, or dequantized, exactly), one key's score, and the SIMD passes over rows: eight keys' scores
 * against a query (AVX2) and a query's weighted sum of value rows (AVX2, AVX-512). paged_attention.c splits
 * the work into items and runs these over them; the sums' orders are documented there. */
#ifndef TANDEM_ATTENTION_ROWS_H
#define TANDEM_ATTENTION_ROWS_H
#include <stdint.h>
#include <string.h>
#include "kv_types.h"
#include "simd_exp.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* A K/V row of D elements of type kt as float32: the row itself, or widened into buf. The portable loops
 * (paged_attention.c) read every row through this, so a half or q8_0 pool runs the float32 pool's very
 * instructions (the compiler fuses multiply-adds as it likes, differently in differently typed copies of a
 * loop). */
static inline const float *widen(const char *row, int64_t D, int kt, float *buf) {
    if (kt == KV_F32) return (const float *)row;
    if (kt == KV_Q8_0) {
        q8_0_dequantize(row, D, buf);
        return buf;
    }
    const uint16_t *h = (const uint16_t *)row;
    if (kt == KV_F16)
        for (int64_t d = 0; d < D; d++) buf[d] = f16_to_f32(h[d]);
    else
        for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(h[d]);
    return buf;
}

/* One key's score: 8 lanes over d (lane l sums d = l, l+8, ... in order), added ((0+1)+(2+3))+((4+5)+(6+7)),
 * then the head sizes past a multiple of 8 in order. A score depends on its query and key alone. */
static inline float score1(const float *q, const float *k, int64_t D) {
    float a[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) a[l] += q[d + l] * k[d + l];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; d < D; d++) s += q[d] * k[d];
    return s;
}

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
}

#ifdef TANDEM_AVX2
/* Eight 8-lane sums -> one vector of their totals, lane j = ((a_j0+a_j1)+(a_j2+a_j3))+((a_j4+a_j5)+(a_j6+a_j7)):
 * score1's order. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Elements d .. d+7 of a K/V row of type kt, as float32: F16C's conversion for half, a 16-bit shift for
 * bfloat16 (its bits are a float's upper half), q8_0's int8 widened and times its block's scale (exact). */
ALWAYS_INLINE __m256 load8(const char *row, int64_t d, int kt) {
    if (kt == KV_F32) return _mm256_loadu_ps((const float *)row + d);
    if (kt == KV_Q8_0) {
        const char *block = row + d / Q8_0_QK * Q8_0_BYTES;
        const __m128i q = _mm_loadl_epi64((const __m128i *)(block + 2 + d % Q8_0_QK));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(q8_0_scale(block)));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
    if (kt == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#ifdef __F16C__
    return _mm256_cvtph_ps(h);
#else /* a build told not to use F16C (every AVX2 CPU has it): one lane at a time */
    float f[8];
    for (int l = 0; l < 8; l++) f[l] = f16_to_f32(((const uint16_t *)row)[d + l]);
    return _mm256_loadu_ps(f);
#endif
}

/* The scores of eight keys against one query, D a multiple of 8: each lane as score1 computes it. */
ALWAYS_INLINE __m256 score8(const float *q, const char *const *k, int64_t D, int kt) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, load8(k[0], d, kt), a0);
        a1 = _mm256_fmadd_ps(x, load8(k[1], d, kt), a1);
        a2 = _mm256_fmadd_ps(x, load8(k[2], d, kt), a2);
        a3 = _mm256_fmadd_ps(x, load8(k[3], d, kt), a3);
        a4 = _mm256_fmadd_ps(x, load8(k[4], d, kt), a4);
        a5 = _mm256_fmadd_ps(x, load8(k[5], d, kt), a5);
        a6 = _mm256_fmadd_ps(x, load8(k[6], d, kt), a6);
        a7 = _mm256_fmadd_ps(x, load8(k[7], d, kt), a7);
    }
    return sum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* o[d .. d+8*nv) += sum over keys t0 .. t1-1 of p[t] * v_t[d .. d+8*nv), in key order, nv (a constant once
 * inlined) accumulators held in registers: o holds the running sums between chunks of keys (a float stored
 * and reloaded is the same float, so a query's sums run over its keys in order, however they are chunked). */
ALWAYS_INLINE void pass2(const int nv, const int kt, const float *s, float inv, int64_t t0, int64_t t1,
                         const char *v, int64_t row_bytes, const int64_t *sl, int64_t d, float *o) {
    __m256 acc[8];
    for (int c = 0; c < nv; c++) acc[c] = _mm256_loadu_ps(o + d + 8 * c);
    for (int64_t t = t0; t < t1; t++) {
        const float p = s[t] * inv;
        if (p == 0.0f) continue; /* a weight that underflowed */
        const char *vt = v + sl[t] * row_bytes;
        const __m256 pv = _mm256_set1_ps(p);
        for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(pv, load8(vt, d + 8 * c, kt), acc[c]);
    }
    for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + d + 8 * c, acc[c]);
}

#ifdef __AVX512F__
/* Elements d .. d+15 of a K/V row of type kt, as float32 (load8's conversions, 16 lanes). */
ALWAYS_INLINE __m512 load16(const char *row, int64_t d, int kt) {
    if (kt == KV_F32) return _mm512_loadu_ps((const float *)row + d);
    if (kt == KV_Q8_0) {
        const char *block = row + d / Q8_0_QK * Q8_0_BYTES;
        const __m128i q = _mm_loadu_si128((const __m128i *)(block + 2 + d % Q8_0_QK));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(q8_0_scale(block)));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    if (kt == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* pass2 for ng query heads that share their keys (a position's heads of one KV head) at once, 16 lanes a
 * register: each value row is loaded once for all of them, and ng * nv independent FMA chains are in flight
 * (one query's nv chains alone wait on the FMA latency). Each lane is pass2's: o += p * v over the keys in
 * order, p = s[t] * inv, a zero p skipped; so the bits are pass2's. */
ALWAYS_INLINE void pass2_heads(const int ng, const int nv, const int kt, const float *const *s, const float *inv,
                               int64_t t0, int64_t t1, const char *v, int64_t row_bytes, const int64_t *sl,
                               int64_t d, float *const *o) {
    __m512 acc[4][4];
    for (int h = 0; h < ng; h++)
        for (int c = 0; c < nv; c++) acc[h][c] = _mm512_loadu_ps(o[h] + d + 16 * c);
    for (int64_t t = t0; t < t1; t++) {
        const char *vt = v + sl[t] * row_bytes;
        __m512 vv[4];
        for (int c = 0; c < nv; c++) vv[c] = load16(vt, d + 16 * c, kt);
        for (int h = 0; h < ng; h++) {
            const float p = s[h][t] * inv[h];
            if (p == 0.0f) continue; /* a weight that underflowed */
            const __m512 pv = _mm512_set1_ps(p);
            for (int c = 0; c < nv; c++) acc[h][c] = _mm512_fmadd_ps(pv, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < ng; h++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o[h] + d + 16 * c, acc[h][c]);
}

/* Query heads i0 .. i0+ng-1 (ng <= 4) over keys [t0, t1), their head dims 16 at a time, D a multiple of 16. */
ALWAYS_INLINE void pass2_group(const int ng, const int kt, const float *const *s, const float *inv, int64_t t0,
                               int64_t t1, const char *v, int64_t rb, const int64_t *sl, int64_t D,
                               float *const *o) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) pass2_heads(ng, 4, kt, s, inv, t0, t1, v, rb, sl, d, o);
    for (; d + 32 <= D; d += 32) pass2_heads(ng, 2, kt, s, inv, t0, t1, v, rb, sl, d, o);
    for (; d < D; d += 16) pass2_heads(ng, 1, kt, s, inv, t0, t1, v, rb, sl, d, o);
}
#endif
#endif /* TANDEM_AVX2 */
#endif
