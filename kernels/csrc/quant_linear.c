/* y = x @ W.T on CPU, float32 activations, W kept in GGUF's 4- and 8-bit blocks (Q4_0, Q4_1, Q4_K, Q8_0).
 *
 * Built and loaded by kernels/cpu_quant_linear.py, which also repacks GGUF's blocks into the layout below;
 * the plain-torch reference (dequantize, then x @ W.T) is there too.
 *
 * Layout: W [N, K] in panels of 16 output columns (N padded to a multiple of 16 with zero weights), each
 * panel in blocks of 32 along K. A Q4 block is 320 bytes: for each of its 32 k, 8 bytes of nibbles
 * (byte j: column j in the low nibble, column j + 8 in the high one), then d[16] and m[16] as float16
 * (weight = d * q + m). A Q8 block is 544 bytes: 32 x 16 int8 (k-major), then d[16] (weight = d * q).
 * A Q4F block (Q4_K) is 384 bytes: the nibbles, then d[16] and m[16] as float32 (d = d_super * scale and
 * m = -dmin * min, each exact in float32 but not in float16).
 * Each weight is dequantized in registers as fma(d, q, m): d * q is exact in float32 (at most a 17-bit by
 * 4-bit or an 11-bit by 8-bit product), so this is the very float gguf's dequantization computes
 * ((d * q) + m), and the product uses the same weights as the float32 conversion of the file.
 *
 * Each output y[r, n] is one chain of FMAs over k = 0 .. K-1 in order, started from 0: its bits depend
 * on row r of x and column n of W only, not on how many rows the call has, which rows sit beside it or
 * how many threads run (a decode row and the same row in a verify step or a batch agree bit for bit).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define PANEL 16
#define KBLK 32
#define Q4_BYTES 320
#define Q8_BYTES 544
#define Q4F_BYTES 384
/* Rows of x kept hot per pass over the panels (measured: capping them to fit L2 at large K was slower). */
#define ROW_BLOCK 128
/* From this many rows a panel is dequantized once into float32 scratch and shared by all of them (below,
 * re-dequantizing in registers per 4-row tile measured faster: 8 rows 1.7x, 16 rows even). */
#define SCRATCH_MIN_ROWS 16
/* Inputs per pass of the many-rows path: 256 x 16 weights (16 KB) and 6 rows' 256 inputs fit in L1. */
#define K_CHUNK 256

/* qtype 0: 4-bit, float16 d and m; 1: 8-bit, float16 d; 2: 4-bit, float32 d and m (Q4_K's d * scale and
 * dmin * min, exact in float32 but not in float16). */
static inline int64_t block_bytes(int64_t qtype) { return qtype == 0 ? Q4_BYTES : qtype == 1 ? Q8_BYTES : Q4F_BYTES; }
static inline int64_t quant_bytes(int64_t qtype) { return qtype == 1 ? 512 : 256; }

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

#ifdef __AVX2__
/* The 16 weights of column pairs (0..7, 8..15) at k = kk of block blk. */
static inline void weights_at(int64_t qtype, const uint8_t *blk, int64_t kk, __m256 d0, __m256 d1, __m256 m0,
                              __m256 m1, __m256 *w0, __m256 *w1) {
    if (qtype != 1) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + kk * 8)));
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        *w0 = _mm256_fmadd_ps(d0, q0, m0);
        *w1 = _mm256_fmadd_ps(d1, q1, m1);
    } else {
        const uint8_t *p = blk + kk * 16;
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
        *w0 = _mm256_fmadd_ps(d0, q0, m0);
        *w1 = _mm256_fmadd_ps(d1, q1, m1);
    }
}

/* A block's d and m for columns 0..7 and 8..15 (m = 0 for 8-bit blocks). */
static inline void scales_at(int64_t qtype, const uint8_t *blk, __m256 *d0, __m256 *d1, __m256 *m0, __m256 *m1) {
    const uint8_t *s = blk + quant_bytes(qtype);
    if (qtype == 2) {
        *d0 = _mm256_loadu_ps((const float *)s);
        *d1 = _mm256_loadu_ps((const float *)(s + 32));
        *m0 = _mm256_loadu_ps((const float *)(s + 64));
        *m1 = _mm256_loadu_ps((const float *)(s + 96));
        return;
    }
    *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    *d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
    *m0 = qtype == 0 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32))) : _mm256_setzero_ps();
    *m1 = qtype == 0 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 48))) : _mm256_setzero_ps();
}

/* MR rows x NP panels: MR * NP * 2 accumulators, independent chains so the FMA latency is hidden. */
static inline __attribute__((always_inline)) void tile(int64_t qtype, const float *x, int64_t ldx, int64_t K,
                                                       const uint8_t *w, int64_t panel_stride, float *out,
                                                       int64_t ldo, const int MR, const int NP) {
    __m256 acc[4][4][2];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < K / KBLK; b++) {
        __m256 d0[4], d1[4], m0[4], m1[4];
        for (int p = 0; p < NP; p++) scales_at(qtype, w + p * panel_stride + b * bb, &d0[p], &d1[p], &m0[p], &m1[p]);
        const float *xb = x + b * KBLK;
        for (int64_t kk = 0; kk < KBLK; kk++) {
            for (int p = 0; p < NP; p++) {
                __m256 w0, w1;
                weights_at(qtype, w + p * panel_stride + b * bb, kk, d0[p], d1[p], m0[p], m1[p], &w0, &w1);
                for (int r = 0; r < MR; r++) {
                    const __m256 xv = _mm256_broadcast_ss(xb + r * ldx + kk);
                    acc[r][p][0] = _mm256_fmadd_ps(xv, w0, acc[r][p][0]);
                    acc[r][p][1] = _mm256_fmadd_ps(xv, w1, acc[r][p][1]);
                }
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) {
            _mm256_storeu_ps(out + r * ldo + p * PANEL, acc[r][p][0]);
            _mm256_storeu_ps(out + r * ldo + p * PANEL + 8, acc[r][p][1]);
        }
}

/* Panel p's weights as float32, k-major: wf[k * 16 + c]. */
static void dequant_panel(int64_t qtype, const uint8_t *w, int64_t K, float *wf) {
    const int64_t bb = block_bytes(qtype);
    for (int64_t b = 0; b < K / KBLK; b++) {
        const uint8_t *blk = w + b * bb;
        __m256 d0, d1, m0, m1;
        scales_at(qtype, blk, &d0, &d1, &m0, &m1);
        for (int64_t kk = 0; kk < KBLK; kk++) {
            __m256 w0, w1;
            weights_at(qtype, blk, kk, d0, d1, m0, m1, &w0, &w1);
            _mm256_storeu_ps(wf + (b * KBLK + kk) * PANEL, w0);
            _mm256_storeu_ps(wf + (b * KBLK + kk) * PANEL + 8, w1);
        }
    }
}

/* MR (<= 6) rows x one panel from its float32 weights: the same FMA chain per output as tile(). */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, int64_t k0, int64_t k1,
                                                           const float *wf, float *out, int64_t ldo, const int MR) {
    __m256 acc[6][2];
    for (int r = 0; r < MR; r++) {
        /* k0 > 0: the chain goes on from the partial sums stored at the end of the previous range */
        acc[r][0] = k0 ? _mm256_loadu_ps(out + r * ldo) : _mm256_setzero_ps();
        acc[r][1] = k0 ? _mm256_loadu_ps(out + r * ldo + 8) : _mm256_setzero_ps();
    }
    for (int64_t k = k0; k < k1; k++) {
        const __m256 w0 = _mm256_loadu_ps(wf + k * PANEL), w1 = _mm256_loadu_ps(wf + k * PANEL + 8);
        for (int r = 0; r < MR; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out + r * ldo, acc[r][0]);
        _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    }
}
#else
/* Column c's weight at input kk of block blk, as the AVX2 path computes it. */
static inline float weight_at(int64_t qtype, const uint8_t *blk, int c, int64_t kk) {
    const uint8_t *s = blk + quant_bytes(qtype);
    float d, m = 0.0f;
    if (qtype == 2) {
        memcpy(&d, s + 4 * c, 4);
        memcpy(&m, s + 64 + 4 * c, 4);
    } else {
        uint16_t hd, hm = 0;
        memcpy(&hd, s + 2 * c, 2);
        if (qtype == 0) memcpy(&hm, s + 32 + 2 * c, 2);
        d = half_to_float(hd);
        m = half_to_float(hm);
    }
    float q;
    if (qtype != 1) {
        const uint8_t byte = blk[kk * 8 + (c & 7)];
        q = (float)(c < 8 ? byte & 15 : byte >> 4);
    } else {
        q = (float)(int8_t)blk[kk * 16 + c];
    }
    return __builtin_fmaf(d, q, m);
}

/* Portable twin of the AVX2 tile: the same weights and the same FMA chain per output. */
static void tile(int64_t qtype, const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t panel_stride,
                 float *out, int64_t ldo, const int MR, const int NP) {
    const int64_t bb = block_bytes(qtype);
    for (int p = 0; p < NP; p++)
        for (int c = 0; c < PANEL; c++)
            for (int r = 0; r < MR; r++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++)
                    acc = __builtin_fmaf(x[r * ldx + k], weight_at(qtype, w + p * panel_stride + k / KBLK * bb, c,
                                                                   k % KBLK), acc);
                out[r * ldo + p * PANEL + c] = acc;
            }
}

static void dequant_panel(int64_t qtype, const uint8_t *w, int64_t K, float *wf) {
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < PANEL; c++)
            wf[k * PANEL + c] = weight_at(qtype, w + k / KBLK * block_bytes(qtype), c, k % KBLK);
}

static void tile_f32(const float *x, int64_t ldx, int64_t k0, int64_t k1, const float *wf, float *out, int64_t ldo,
                     const int MR) {
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < PANEL; c++) {
            float acc = k0 ? out[r * ldo + c] : 0.0f;
            for (int64_t k = k0; k < k1; k++) acc = __builtin_fmaf(x[r * ldx + k], wf[k * PANEL + c], acc);
            out[r * ldo + c] = acc;
        }
}
#endif

/* Copies an MR-row tile of the last, partial panel's outputs (columns < N) from tmp into y. */
static void store_partial(float *y, int64_t ldy, int64_t N, int64_t col0, const float *tmp, int64_t ldt, int MR,
                          int64_t width) {
    for (int i = 0; i < MR; i++)
        for (int64_t c = col0; c < N && c < col0 + width; c++) y[i * ldy + c] = tmp[i * ldt + c - col0];
}

/* Few rows: each panel's weights dequantized in registers for up to 4 rows at a time. */
static void run_direct(int64_t qtype, const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                       float *y, int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np) {
    const int64_t panel_stride = (K / KBLK) * block_bytes(qtype), full = N / PANEL;
    float tmp[4 * 4 * PANEL];
    for (int64_t r = r0; r < r0 + rows;) {
        const int64_t left = r0 + rows - r;
        const int MR = left >= 4 ? 4 : (int)left;
        /* 8 to 12 accumulators: enough chains in flight to hide the FMA latency, all in registers */
        const int NPW = MR == 1 ? 4 : MR < 4 ? 2 : 1;
        const int NPH = NPW > 2 ? 2 : 1; /* a range's last panels, when fewer than NPW are left */
        const float *xr = x + r * ldx;
        for (int64_t p = p0; p < p0 + np;) {
            const int NP = (p + NPW <= p0 + np && p + NPW <= full) ? NPW
                           : (p + NPH <= p0 + np && p + NPH <= full) ? NPH
                                                                     : 1;
            const uint8_t *wp = w + p * panel_stride;
            const int direct = p + NP <= full;
            float *o = direct ? y + r * ldy + p * PANEL : tmp;
            const int64_t ldo = direct ? ldy : NP * PANEL;
            switch (MR * 8 + NP) {
            case 4 * 8 + 1: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 4, 1); break;
            case 3 * 8 + 2: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 3, 2); break;
            case 3 * 8 + 1: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 3, 1); break;
            case 2 * 8 + 2: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 2, 2); break;
            case 2 * 8 + 1: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 2, 1); break;
            case 1 * 8 + 4: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 1, 4); break;
            case 1 * 8 + 2: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 1, 2); break;
            default: tile(qtype, xr, ldx, K, wp, panel_stride, o, ldo, 1, 1); break;
            }
            if (!direct) store_partial(y + r * ldy, ldy, N, p * PANEL, tmp, ldo, MR, NP * PANEL);
            p += NP;
        }
        r += MR;
    }
}

/* Many rows: each panel dequantized once into wf (K * 16 floats), then 6 rows at a time over K_CHUNK
 * inputs at a time, so the chunk of weights and of the 6 rows stays in L1 (a float stored and reloaded
 * between chunks is the same float: one chain per output still). */
static void run_scratch(int64_t qtype, const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t N,
                        float *y, int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np, float *wf) {
    const int64_t panel_stride = (K / KBLK) * block_bytes(qtype), full = N / PANEL;
    float tmp[ROW_BLOCK * PANEL];
    for (int64_t p = p0; p < p0 + np; p++) {
        dequant_panel(qtype, w + p * panel_stride, K, wf);
        const int direct = p < full;
        float *o = direct ? y + r0 * ldy + p * PANEL : tmp;
        const int64_t ldo = direct ? ldy : PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
            /* rows split evenly into tiles of at most 6: with 16 or more every tile has 4 or more, so 8+ FMA
             * chains are in flight (a 2-row tail would wait on the FMA latency) */
            const int64_t tiles = (rows + 5) / 6;
            for (int64_t r = 0, i = 0; r < rows; i++) {
                const int MR = (int)(rows / tiles + (i < rows % tiles));
                const float *xr = x + (r0 + r) * ldx;
                float *or = o + r * ldo;
                switch (MR) {
                case 6: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 6); break;
                case 5: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 5); break;
                case 4: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 4); break;
                case 3: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 3); break;
                case 2: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 2); break;
                default: tile_f32(xr, ldx, k0, k1, wf, or, ldo, 1); break;
                }
                r += MR;
            }
        }
        if (!direct) store_partial(y + r0 * ldy, ldy, N, p * PANEL, tmp, PANEL, (int)rows, PANEL);
    }
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W.T; qtype: see block_bytes. K is a
 * multiple of 32. Rows go in blocks of ROW_BLOCK; each thread of the OpenMP runtime torch runs on (see
 * cpu_paged_attention.c) takes a contiguous range of panels, so it streams its own share of the weights.
 * Both paths give every output the same bits (the same weights, one FMA chain over k in order). */
void tandem_quant_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t qtype,
                             int64_t N, float *y, int64_t ldy, int64_t num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        /* Few rows: pairs of panels (a 1-row tile takes 4 panels at once, or 2 at a range's end); many rows:
         * single panels. So two threads split 36 or 60 panels evenly (groups of 4 gave one thread 20 of 36:
         * measured 1.07x at 64 rows and 1.11x at 2,048 once split evenly; at 1-8 rows within the noise). */
        const int64_t gp = M >= SCRATCH_MIN_ROWS ? 1 : 2;
        const int64_t groups = (panels + gp - 1) / gp;
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        const int64_t p0 = g0 * gp, p1 = g1 * gp < panels ? g1 * gp : panels;
        float *wf = M >= SCRATCH_MIN_ROWS ? malloc((size_t)K * PANEL * sizeof(float)) : NULL;
        for (int64_t r0 = 0; r0 < M && p1 > p0; r0 += ROW_BLOCK) {
            const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
            if (wf && rows >= SCRATCH_MIN_ROWS)
                run_scratch(qtype, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0, wf);
            else
                run_direct(qtype, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0);
        }
        free(wf);
    }
}
