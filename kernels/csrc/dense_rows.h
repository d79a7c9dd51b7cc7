/* y = x @ W.T on CPU for a float weight kept as the checkpoint lays it out: W [N, K] row-major, float32,
 * bfloat16 or float16 (a half widened to float32 exactly as it is loaded), float32 activations. Included by
 * quant_linear.c, whose entry points take these as three more kinds (KIND_F32_ROWS, KIND_BF16_ROWS,
 * KIND_F16_ROWS): one calling shape for every linear product of a decode step, so a float model's layers are
 * step-graph nodes as a GGUF's are.
 *
 * Why row-major and not the quantized kinds' 16-column panels: the same tensor serves torch (oneDNN's AMX
 * product for many rows of a bfloat16 weight) and this kernel, so a weight is held once.
 *
 * Each output y[r, n] is the dot product of row r of x and row n of W in one fixed order: 16 lanes, lane j
 * an FMA chain over k = j, j + 16, ... (k < K rounded down to 16), the lanes folded pairwise (j with j + 8,
 * then + 4, + 2, + 1), then the last K % 16 terms FMA'd on in order. The 512-bit path holds a lane set in
 * one register, the AVX2 path in two, the portable one in an array: the same sums in the same order, so the
 * bits depend on row r of x and row n of W only: not on the ISA path, the rows beside it, or the threads.
 */
#ifndef TANDEM_DENSE_ROWS_H
#define TANDEM_DENSE_ROWS_H
#include <stdint.h>
#include <string.h>
#include "kv_types.h" /* the half conversions, shared with the KV pools' */
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

#define LANES 16
/* Output columns a tile holds (each thread takes whole groups of them). */
#define DENSE_NC 4
/* Rows of x a pass over a group of columns holds (their K floats stay in L2 while W's rows stream once). */
#define DENSE_ROW_BLOCK 256
/* Bytes ahead of each weight row fetched in software (measured at one row: bf16 1.2x, float32 even) */
#define DENSE_PF 512
/* The weight's element (`wt` below). */
enum { WT_F32 = 0, WT_BF16 = 1, WT_F16 = 2 };

static ALWAYS_INLINE float weight_of(const void *w, int64_t i, const int wt) {
    if (wt == WT_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    if (wt == WT_F16) return f16_to_f32(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

/* Fold 16 lane sums in the fixed order of the header comment. */
static inline float fold16(const float *a) {
    float b[8], c[4];
    for (int j = 0; j < 8; j++) b[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; j++) c[j] = b[j] + b[j + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

#if defined(__AVX512F__)
typedef __m512 lanes_t;
static ALWAYS_INLINE lanes_t lanes_zero(void) { return _mm512_setzero_ps(); }
static ALWAYS_INLINE lanes_t lanes_x(const float *p) { return _mm512_loadu_ps(p); }
static ALWAYS_INLINE lanes_t lanes_w(const void *w, int64_t k, const int wt) {
    if (wt == WT_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k))), 16));
    if (wt == WT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
    return _mm512_loadu_ps((const float *)w + k);
}
static ALWAYS_INLINE lanes_t lanes_fma(lanes_t x, lanes_t w, lanes_t acc) { return _mm512_fmadd_ps(x, w, acc); }
static ALWAYS_INLINE void lanes_store(float *out, lanes_t a) { _mm512_storeu_ps(out, a); }
/* 512-bit registers: 4 rows x 4 columns, 16 chains in flight */
#define DENSE_MR 4
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct {
    __m256 lo, hi;
} lanes_t;
static ALWAYS_INLINE lanes_t lanes_zero(void) { return (lanes_t){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static ALWAYS_INLINE lanes_t lanes_x(const float *p) { return (lanes_t){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static ALWAYS_INLINE __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static ALWAYS_INLINE __m256 widen8_f16(const uint16_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int l = 0; l < 8; l++) f[l] = f16_to_f32(p[l]);
    return _mm256_loadu_ps(f);
#endif
}
static ALWAYS_INLINE lanes_t lanes_w(const void *w, int64_t k, const int wt) {
    if (wt == WT_BF16) return (lanes_t){widen8((const uint16_t *)w + k), widen8((const uint16_t *)w + k + 8)};
    if (wt == WT_F16)
        return (lanes_t){widen8_f16((const uint16_t *)w + k), widen8_f16((const uint16_t *)w + k + 8)};
    return lanes_x((const float *)w + k);
}
static ALWAYS_INLINE lanes_t lanes_fma(lanes_t x, lanes_t w, lanes_t acc) {
    return (lanes_t){_mm256_fmadd_ps(x.lo, w.lo, acc.lo), _mm256_fmadd_ps(x.hi, w.hi, acc.hi)};
}
static ALWAYS_INLINE void lanes_store(float *out, lanes_t a) {
    _mm256_storeu_ps(out, a.lo);
    _mm256_storeu_ps(out + 8, a.hi);
}
/* 16 registers: 1 row x 4 columns, 8 chains */
#define DENSE_MR 1
#else
typedef struct {
    float v[LANES];
} lanes_t;
static inline lanes_t lanes_zero(void) {
    lanes_t a;
    memset(&a, 0, sizeof a);
    return a;
}
static inline lanes_t lanes_x(const float *p) {
    lanes_t a;
    memcpy(a.v, p, sizeof a.v);
    return a;
}
static inline lanes_t lanes_w(const void *w, int64_t k, const int wt) {
    lanes_t a;
    for (int j = 0; j < LANES; j++) a.v[j] = weight_of(w, k + j, wt);
    return a;
}
static inline lanes_t lanes_fma(lanes_t x, lanes_t w, lanes_t acc) {
    for (int j = 0; j < LANES; j++) acc.v[j] = __builtin_fmaf(x.v[j], w.v[j], acc.v[j]);
    return acc;
}
static inline void lanes_store(float *out, lanes_t a) { memcpy(out, a.v, sizeof a.v); }
#define DENSE_MR 1
#endif

/* MR rows of x (stride ldx) times NC rows of W (element stride ldw, starting at w) -> out (stride ldo). */
static ALWAYS_INLINE void dense_tile(const float *x, int64_t ldx, int64_t K, const void *w, int64_t ldw, const int wt,
                                     float *out, int64_t ldo, const int MR, const int NC) {
    lanes_t acc[DENSE_MR][DENSE_NC];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = lanes_zero();
    const int64_t kv = K / LANES * LANES;
    const int64_t esz = wt != WT_F32 ? 2 : 4;
    for (int64_t k = 0; k < kv; k += LANES) {
        lanes_t wv[DENSE_NC];
        for (int c = 0; c < NC; c++) {
#if defined(__AVX2__)
            _mm_prefetch((const char *)w + (c * ldw + k) * esz + DENSE_PF, _MM_HINT_T0);
#endif
            wv[c] = lanes_w((const char *)w + c * ldw * esz, k, wt);
        }
        for (int r = 0; r < MR; r++) {
            const lanes_t xv = lanes_x(x + r * ldx + k);
            for (int c = 0; c < NC; c++) acc[r][c] = lanes_fma(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NC; c++) {
            float a[LANES];
            lanes_store(a, acc[r][c]);
            float s = fold16(a);
            const void *wc = (const char *)w + c * ldw * esz;
            for (int64_t k = kv; k < K; k++) s = __builtin_fmaf(x[r * ldx + k], weight_of(wc, k, wt), s);
            out[r * ldo + c] = s;
        }
}

/* Rows [r0, r0 + rows) against W's rows [n0, n1): groups of DENSE_NC columns, each group's weights read
 * once from memory while every row passes in tiles of DENSE_MR (the last group may be narrower). */
static ALWAYS_INLINE void dense_block(const float *x, int64_t ldx, int64_t K, const void *w, const int wt,
                                      float *y, int64_t ldy, int64_t r0, int64_t rows, int64_t n0, int64_t n1) {
    const int64_t esz = wt != WT_F32 ? 2 : 4;
    for (int64_t n = n0; n < n1; n += DENSE_NC) {
        const int NC = n1 - n >= DENSE_NC ? DENSE_NC : (int)(n1 - n);
        const void *wn = (const char *)w + n * K * esz;
        for (int64_t r = r0; r < r0 + rows;) {
            const int MR = r0 + rows - r >= DENSE_MR ? DENSE_MR : (int)(r0 + rows - r);
            const float *xr = x + r * ldx;
            float *o = y + r * ldy + n;
            /* constant MR and NC at each call: the tile's loops unroll into registers */
            switch (MR * 8 + NC) {
            case 4 * 8 + 4: dense_tile(xr, ldx, K, wn, K, wt, o, ldy, DENSE_MR >= 4 ? 4 : 1, 4); break;
            case 3 * 8 + 4: dense_tile(xr, ldx, K, wn, K, wt, o, ldy, DENSE_MR >= 3 ? 3 : 1, 4); break;
            case 2 * 8 + 4: dense_tile(xr, ldx, K, wn, K, wt, o, ldy, DENSE_MR >= 2 ? 2 : 1, 4); break;
            case 1 * 8 + 4: dense_tile(xr, ldx, K, wn, K, wt, o, ldy, 1, 4); break;
            default: /* a narrow last group: a column at a time */
                for (int c = 0; c < NC; c++)
                    for (int i = 0; i < MR; i++)
                        dense_tile(xr + i * ldx, ldx, K, (const char *)wn + c * K * esz, K, wt, o + i * ldy + c,
                                   ldy, 1, 1);
            }
            r += MR;
        }
    }
}

/* Thread t of nt's share of y [M, N] = x [M, K] @ W.T, W [N, K] row-major (bf16, f16: uint16 bit patterns):
 * whole groups of DENSE_NC output columns, split evenly. */
static void dense_rows_part(const float *x, int64_t M, int64_t K, int64_t ldx, const void *w, const int wt,
                            int64_t N, float *y, int64_t ldy, int64_t t, int64_t nt) {
    const int64_t groups = (N + DENSE_NC - 1) / DENSE_NC;
    const int64_t n0 = groups * t / nt * DENSE_NC, n1e = groups * (t + 1) / nt * DENSE_NC;
    const int64_t n1 = n1e < N ? n1e : N;
    for (int64_t r0 = 0; r0 < M && n1 > n0; r0 += DENSE_ROW_BLOCK) {
        const int64_t rows = M - r0 < DENSE_ROW_BLOCK ? M - r0 : DENSE_ROW_BLOCK;
        /* a constant element type at each call: the tile's loads specialise */
        if (wt == WT_BF16)
            dense_block(x, ldx, K, w, WT_BF16, y, ldy, r0, rows, n0, n1);
        else if (wt == WT_F16)
            dense_block(x, ldx, K, w, WT_F16, y, ldy, r0, rows, n0, n1);
        else
            dense_block(x, ldx, K, w, WT_F32, y, ldy, r0, rows, n0, n1);
    }
}
#endif
