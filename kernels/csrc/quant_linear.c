/* y = x @ W.T on CPU, float32 activations, W kept in GGUF's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
 * Q6_K): the weights of gguf's float32 dequantization, read as 4.5 to 8.5 bits each; or a float weight as
 * the checkpoint holds it (float32, bfloat16 or float16 rows: dense_rows.h).
 *
 * Built and loaded by kernels/native/quant_linear.py; kernels/native/quant_pack.py repacks GGUF's blocks
 * into the layout of quant_blocks.h and holds the plain-torch reference (dequantize, then x @ W.T).
 *
 * Layout: W [N, K] in panels of 16 output columns (N padded to a multiple of 16 with zero weights), each
 * panel a run of blocks along K (quant_blocks.h). Each weight is dequantized in registers as fma(D, q, M),
 * the very float gguf's dequantization computes (see there), so the product uses the same weights as the
 * float32 conversion of the file.
 *
 * Each output y[r, n] is one chain of FMAs over k = 0 .. K-1 in order, started from 0: its bits depend
 * on row r of x and column n of W only, not on how many rows the call has, which rows sit beside it or
 * how many threads run (a decode row and the same row in a verify step or a batch agree bit for bit).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "omp_team.h"

#include "quant_blocks.h"
#include "dense_rows.h"

/* Rows of x kept hot per pass over the panels (measured: capping them to fit L2 at large K was slower). */
#define ROW_BLOCK 128
/* From this many rows a panel is dequantized once into float32 scratch and shared by all of them (below,
 * re-dequantizing in registers per 4-row tile measured faster: 8 rows 1.7x, 16 rows even). */
#define SCRATCH_MIN_ROWS 16
/* Inputs per pass of the many-rows path: 256 x 16 weights (16 KB) and 6 rows' 256 inputs fit in L1. */
#define K_CHUNK 256
/* Bytes ahead of a panel's current 32-block fetched in software by the few-rows tile. The hardware
 * prefetcher alone left the K-quants' super-blocks (scales, then 8 x 256 bytes) 1.2-1.3x slower than Q4_1 a
 * weight at 1 row when streaming from L3, against 1.04x in L2; with it they are even (512 to 4096 measured
 * alike), and the other kinds unchanged. */
#define PF_DIST 1024

#ifdef QUANT_AVX2
/* MR rows x NP panels: MR * NP * 2 accumulators, independent chains so the FMA latency is hidden. `kind`
 * is a constant at every call (see BY_KIND), so each kind's decoding compiles to straight-line code. */
static ALWAYS_INLINE void tile(const int kind, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                               int64_t panel_stride, float *out, int64_t ldo, const int MR, const int NP) {
    __m256 acc[4][4][2];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    const int64_t subs = sub_blocks(kind), sbb = super_bytes(kind);
    const int gk = KBLK / groups(kind);
    for (int64_t b = 0; b < K / KBLK; b++) {
        const int64_t sub = b % subs;
        const uint8_t *sb = w + b / subs * sbb;
        const float *xb = x + b * KBLK;
        for (int p = 0; p < NP; p++) /* a 32-block's share of the bytes, and a line for the misalignment */
            for (int64_t off = 0; off < sbb / subs + 64; off += 64)
                _mm_prefetch((const char *)values_of(kind, sb + p * panel_stride, sub) + PF_DIST + off, _MM_HINT_T0);
        for (int g = 0; g < groups(kind); g++) {
            __m256 d0[4], d1[4], m0[4], m1[4];
            for (int p = 0; p < NP; p++)
                scales_at(kind, sb + p * panel_stride, sub, g, &d0[p], &d1[p], &m0[p], &m1[p]);
            for (int64_t kk = g * gk; kk < (g + 1) * gk; kk++) {
                for (int p = 0; p < NP; p++) {
                    const uint8_t *v = values_of(kind, sb + p * panel_stride, sub);
                    __m256 w0, w1;
                    weights_at(kind, v, kk, d0[p], d1[p], m0[p], m1[p], &w0, &w1);
                    for (int r = 0; r < MR; r++) {
                        const __m256 xv = _mm256_broadcast_ss(xb + r * ldx + kk);
                        acc[r][p][0] = _mm256_fmadd_ps(xv, w0, acc[r][p][0]);
                        acc[r][p][1] = _mm256_fmadd_ps(xv, w1, acc[r][p][1]);
                    }
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

/* A panel's weights as float32, k-major: wf[k * 16 + c]. */
static ALWAYS_INLINE void dequant_panel_kind(const int kind, const uint8_t *w, int64_t K, float *wf) {
    const int64_t subs = sub_blocks(kind), sbb = super_bytes(kind);
    const int gk = KBLK / groups(kind);
    for (int64_t b = 0; b < K / KBLK; b++) {
        const uint8_t *sb = w + b / subs * sbb, *blk = values_of(kind, sb, b % subs);
        for (int g = 0; g < groups(kind); g++) {
            __m256 d0, d1, m0, m1;
            scales_at(kind, sb, b % subs, g, &d0, &d1, &m0, &m1);
            for (int64_t kk = g * gk; kk < (g + 1) * gk; kk++) {
                __m256 w0, w1;
                weights_at(kind, blk, kk, d0, d1, m0, m1, &w0, &w1);
                _mm256_storeu_ps(wf + (b * KBLK + kk) * PANEL, w0);
                _mm256_storeu_ps(wf + (b * KBLK + kk) * PANEL + 8, w1);
            }
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
/* Portable twin of the AVX2 tile: the same weights and the same FMA chain per output. */
static ALWAYS_INLINE void tile(const int kind, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                               int64_t panel_stride, float *out, int64_t ldo, const int MR, const int NP) {
    for (int p = 0; p < NP; p++)
        for (int c = 0; c < PANEL; c++)
            for (int r = 0; r < MR; r++) {
                float acc = 0.0f;
                for (int64_t k = 0; k < K; k++)
                    acc = __builtin_fmaf(x[r * ldx + k], weight_at(kind, w + p * panel_stride, c, k), acc);
                out[r * ldo + p * PANEL + c] = acc;
            }
}

static ALWAYS_INLINE void dequant_panel_kind(const int kind, const uint8_t *w, int64_t K, float *wf) {
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < PANEL; c++) wf[k * PANEL + c] = weight_at(kind, w, c, k);
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

/* Calls fn with kind as a constant, so the always-inline code below it is compiled once per kind. */
#define BY_KIND(kind, fn, ...)                                                                                  \
    switch (kind) {                                                                                            \
    case KIND_Q4_1: fn(KIND_Q4_1, __VA_ARGS__); break;                                                         \
    case KIND_Q8_0: fn(KIND_Q8_0, __VA_ARGS__); break;                                                         \
    case KIND_Q4_K: fn(KIND_Q4_K, __VA_ARGS__); break;                                                         \
    case KIND_Q4_0: fn(KIND_Q4_0, __VA_ARGS__); break;                                                         \
    case KIND_Q5_0: fn(KIND_Q5_0, __VA_ARGS__); break;                                                         \
    case KIND_Q5_1: fn(KIND_Q5_1, __VA_ARGS__); break;                                                         \
    case KIND_Q5_K: fn(KIND_Q5_K, __VA_ARGS__); break;                                                         \
    case KIND_Q6_K: fn(KIND_Q6_K, __VA_ARGS__); break;                                                         \
    }

static void dequant_panel(int kind, const uint8_t *w, int64_t K, float *wf) {
    BY_KIND(kind, dequant_panel_kind, w, K, wf)
}

/* Copies an MR-row tile of the last, partial panel's outputs (columns < N) from tmp into y. */
static void store_partial(float *y, int64_t ldy, int64_t N, int64_t col0, const float *tmp, int64_t ldt, int MR,
                          int64_t width) {
    for (int i = 0; i < MR; i++)
        for (int64_t c = col0; c < N && c < col0 + width; c++) y[i * ldy + c] = tmp[i * ldt + c - col0];
}

static inline int64_t panel_bytes(int kind, int64_t K) { return K / (KBLK * sub_blocks(kind)) * super_bytes(kind); }

/* Few rows: each panel's weights dequantized in registers for up to 4 rows at a time. */
static ALWAYS_INLINE void direct_kind(const int kind, const float *x, int64_t ldx, int64_t K, const uint8_t *w,
                                      int64_t N, float *y, int64_t ldy, int64_t r0, int64_t rows, int64_t p0,
                                      int64_t np) {
    const int64_t panel_stride = panel_bytes(kind, K), full = N / PANEL;
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
            case 4 * 8 + 1: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 4, 1); break;
            case 3 * 8 + 2: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 3, 2); break;
            case 3 * 8 + 1: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 3, 1); break;
            case 2 * 8 + 2: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 2, 2); break;
            case 2 * 8 + 1: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 2, 1); break;
            case 1 * 8 + 4: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 1, 4); break;
            case 1 * 8 + 2: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 1, 2); break;
            default: tile(kind, xr, ldx, K, wp, panel_stride, o, ldo, 1, 1); break;
            }
            if (!direct) store_partial(y + r * ldy, ldy, N, p * PANEL, tmp, ldo, MR, NP * PANEL);
            p += NP;
        }
        r += MR;
    }
}

static void run_direct(int kind, const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t N, float *y,
                       int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np) {
    BY_KIND(kind, direct_kind, x, ldx, K, w, N, y, ldy, r0, rows, p0, np)
}

/* Many rows: each panel dequantized once into wf (K * 16 floats), then 6 rows at a time over K_CHUNK
 * inputs at a time, so the chunk of weights and of the 6 rows stays in L1 (a float stored and reloaded
 * between chunks is the same float: one chain per output still). */
static void run_scratch(int kind, const float *x, int64_t ldx, int64_t K, const uint8_t *w, int64_t N, float *y,
                        int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np, float *wf) {
    const int64_t panel_stride = panel_bytes(kind, K), full = N / PANEL;
    float tmp[ROW_BLOCK * PANEL];
    for (int64_t p = p0; p < p0 + np; p++) {
        dequant_panel(kind, w + p * panel_stride, K, wf);
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

/* Thread t of nt's panels [p0, p1). Few rows: pairs of panels (a 1-row tile takes 4 panels at once, or 2 at a
 * range's end); many rows (`single`): single panels. So two threads split 36 or 60 panels evenly (groups of 4
 * gave one thread 20 of 36: measured 1.07x at 64 rows and 1.11x at 2,048 once split evenly; at 1-8 rows
 * within the noise). */
static void panel_range(int64_t panels, int single, int64_t t, int64_t nt, int64_t *p0, int64_t *p1) {
    const int64_t gp = single ? 1 : 2, groups = (panels + gp - 1) / gp;
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    *p0 = g0 * gp;
    *p1 = g1 * gp < panels ? g1 * gp : panels;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W.T; qtype: the block kind (quant_blocks.h, checked
 * by the caller). K is a multiple of the kind's super-block (32 inputs, 256 for the K-quants). Rows go in
 * blocks of ROW_BLOCK; each thread of the OpenMP runtime torch runs on (see paged_attention.c) takes a
 * contiguous range of panels, so it streams its own share of the weights.
 * Both paths give every output the same bits (the same weights, one FMA chain over k in order). */
void tandem_quant_linear_part(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t qtype,
                              int64_t N, float *y, int64_t ldy, int64_t t, int64_t nt);

void tandem_quant_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t qtype,
                             int64_t N, float *y, int64_t ldy, int64_t num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        tandem_quant_linear_part(x, M, K, ldx, w, qtype, N, y, ldy, team_thread(), team_size());
    }
}

/* Thread t of nt's panels of tandem_quant_linear_f32, for a caller already inside a parallel region
 * (kernels/csrc/step_graph.c): the threads' shares together are the whole product, each output's bits as
 * any split gives them. */
void tandem_quant_linear_part(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t qtype,
                              int64_t N, float *y, int64_t ldy, int64_t t, int64_t nt) {
    if (qtype == KIND_F32_ROWS || qtype == KIND_BF16_ROWS || qtype == KIND_F16_ROWS) {
        dense_rows_part(x, M, K, ldx, w, qtype == KIND_BF16_ROWS ? WT_BF16 : qtype == KIND_F16_ROWS ? WT_F16 : WT_F32,
                        N, y, ldy, t, nt);
        return;
    }
    int64_t p0, p1;
    panel_range((N + PANEL - 1) / PANEL, M >= SCRATCH_MIN_ROWS, t, nt, &p0, &p1);
    float *wf = M >= SCRATCH_MIN_ROWS && p1 > p0 ? malloc((size_t)K * PANEL * sizeof(float)) : NULL;
    for (int64_t r0 = 0; r0 < M && p1 > p0; r0 += ROW_BLOCK) {
        const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
        if (wf && rows >= SCRATCH_MIN_ROWS)
            run_scratch((int)qtype, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0, wf);
        else
            run_direct((int)qtype, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0);
    }
    free(wf);
}

#include "quant_int8.h"

/* Rows r0 .. r1-1 of x [M, K] as int8 activations (quant_int8.h's format): q [M, K], d and sd [M, K / 32],
 * s [M, K / 32, 2]. Also an entry of its own, for the tests. */
void tandem_quantize_q8(const float *x, int64_t r0, int64_t r1, int64_t K, int64_t ldx, int8_t *q, float *d,
                        float *sd, int32_t *s) {
    const int64_t nb = K / KBLK;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = r * nb + b;
            quantize_block(x + r * ldx + b * KBLK, q + r * K + b * KBLK, d + at, sd + at, s + 2 * at);
        }
}

/* Bytes of the int8 activations of M rows of K (q, then d, sd and s as tandem_quantize_q8 writes them). */
int64_t tandem_q8_bytes(int64_t M, int64_t K) { return M * K + M * (K / KBLK) * 4 * 4; }

static QActs q8_acts(int8_t *buf, int64_t M, int64_t K) {
    const int64_t nb = K / KBLK;
    float *d = (float *)(buf + M * K), *sd = d + M * nb;
    const QActs a = {buf, d, sd, (int32_t *)(sd + M * nb), K, nb};
    return a;
}

/* Thread t of nt's rows of x quantized into buf (tandem_q8_bytes(M, K) bytes). */
void tandem_quantize_q8_part(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *buf, int64_t t, int64_t nt) {
    const QActs a = q8_acts(buf, M, K);
    tandem_quantize_q8(x, M * t / nt, M * (t + 1) / nt, K, ldx, buf, (float *)a.d, (float *)a.sd, (int32_t *)a.s);
}

/* Thread t of nt's panels of the int8-activation product, buf holding all M rows quantized (every thread's
 * tandem_quantize_q8_part done first: the caller's barrier). */
void tandem_quant_linear_q8_part(int8_t *buf, int64_t M, int64_t K, const uint8_t *w, int64_t qtype, int64_t N,
                                 float *y, int64_t ldy, int64_t t, int64_t nt) {
    const QActs a = q8_acts(buf, M, K);
    int64_t p0, p1;
    panel_range((N + PANEL - 1) / PANEL, M >= I8_SCRATCH_MIN_ROWS, t, nt, &p0, &p1);
#ifdef QUANT_AVX2
    uint8_t *scr = M >= I8_SCRATCH_MIN_ROWS && p1 > p0 ? malloc((size_t)(a.nb * I8_SCRATCH_BLOCK)) : NULL;
#else
    uint8_t *scr = NULL;
#endif
    for (int64_t r0 = 0; r0 < M && p1 > p0; r0 += ROW_BLOCK) {
        const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
        run_panels8((int)qtype, &a, w, N, y, ldy, r0, rows, p0, p1 - p0, rows >= I8_SCRATCH_MIN_ROWS ? scr : NULL);
    }
    free(scr);
}

/* tandem_quant_linear_f32's product with int8 activations (quant_int8.h: the format, the arithmetic and why
 * every path gives the same bits). x is quantized once, each thread its share of the rows, then the threads
 * split the panels as above. Should the activations' buffer not be allocated, the float32 product runs. */
void tandem_quant_linear_q8(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int64_t qtype,
                            int64_t N, float *y, int64_t ldy, int64_t num_threads) {
    int8_t *buf = malloc((size_t)tandem_q8_bytes(M, K));
    if (!buf) {
        tandem_quant_linear_f32(x, M, K, ldx, w, qtype, N, y, ldy, num_threads);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = team_thread(), nt = team_size();
        tandem_quantize_q8_part(x, M, K, ldx, buf, t, nt);
#pragma omp barrier
        tandem_quant_linear_q8_part(buf, M, K, w, qtype, N, y, ldy, t, nt);
    }
    free(buf);
}
