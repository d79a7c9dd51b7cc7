/* A mixture-of-experts layer on CPU, float32 activations, in one call: the router's product and top-k
 * choice, then each expert's SwiGLU over only the tokens routed to it, weighted and summed per token.
 *
 * Built and loaded by kernels/native/moe.py; the plain-torch reference is kernels/reference/moe.py. The
 * experts' weights are float32 in panels of 16 output columns (k-major in a panel: w[p][k][16], the
 * layout quant_linear.c's many-rows path dequantizes a panel into) or GGUF blocks in quant_blocks.h's
 * layout; the products are quant_linear.c's own tiles (included below), so a quantized expert computes with
 * the weights of gguf's dequantization exactly, as a dense quantized layer does.
 *
 * Per pass over at most MAX_TOKENS tokens, one OpenMP region, phases split by barriers:
 *   1. router logits [T, E] (threads split its panels), then each token's top-k by logit (the softmax is
 *      monotone), its softmax weights over all E experts, renormalised to sum 1 if asked;
 *   2. the (token, slot) pairs counted and sorted by expert (stable: token order within an expert), and each
 *      pair's input row gathered into one matrix, so an expert's rows are contiguous;
 *   3. per expert, its rows times [gate; up] (every thread a range of that expert's panels), SiLU(gate) * up,
 *      then times down; 4. each token's output: its k rows scaled by their weights, summed in slot order.
 * Each output is one FMA chain per product (quant_linear.c) and the sum's order is fixed, so a token's
 * result does not depend on the other tokens of the call nor on the thread count.
 */
#include <math.h>

#include "quant_linear.c"
#include "simd_exp.h"

/* Float32 weights in panels (not a GGUF kind: kernels/native/moe.py's F32_KIND). */
#define KIND_F32 100
/* Tokens per pass: bounds the scratch (the pairs' rows: k * (2 H + 3 I) floats a token). */
#define MAX_TOKENS 512
#define MAX_EXPERTS 1024
/* Below this many multiply-adds a pass runs on one thread (kernels/native/quant_linear.py's threshold). */
#define PARALLEL_MIN_MACS (1 << 16)

#ifdef __AVX512F__
/* MR rows x NP panels over k in [k0, k1), a panel's 16 columns in one 512-bit register: as tile_f32, one FMA
 * chain per output in k order (so the same bits), twice the columns an instruction. */
static ALWAYS_INLINE void tile512(const float *x, int64_t ldx, int64_t k0, int64_t k1, const float *w,
                                  int64_t pstride, float *out, int64_t ldo, const int MR, const int NP) {
    __m512 acc[8][2];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) acc[r][p] = k0 ? _mm512_loadu_ps(out + r * ldo + p * PANEL) : _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k++)
        for (int p = 0; p < NP; p++) {
            const __m512 wv = _mm512_loadu_ps(w + p * pstride + k * PANEL);
            for (int r = 0; r < MR; r++) acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, acc[r][p]);
        }
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) _mm512_storeu_ps(out + r * ldo + p * PANEL, acc[r][p]);
}

#define TILE512(MR, NP) tile512(xr, ldx, k0, k1, wp, K * PANEL, o + r * ldo, ldo, MR, NP)

/* Rows [r0, r0 + rows) of y = x @ W.T over panels [p0, p0 + np), W float32 in panels: pairs of panels (32 KB
 * of weights a K_CHUNK) held while every row passes in tiles of 8 (16 chains in flight), the scratch path's
 * order. 512-bit where the CPU has it, as oneDNN's dense product is there (benchmarks/results/moe); the same
 * bits as the AVX2 tiles. */
static void run_f32(const float *x, int64_t ldx, int64_t K, const float *w, int64_t N, float *y, int64_t ldy,
                    int64_t r0, int64_t rows, int64_t p0, int64_t np) {
    const int64_t full = N / PANEL;
    float tmp[ROW_BLOCK * PANEL];
    for (int64_t p = p0; p < p0 + np;) {
        const int NP = p + 2 <= p0 + np && p + 2 <= full ? 2 : 1;
        const int direct = p + NP <= full;
        const float *wp = w + p * K * PANEL;
        float *o = direct ? y + r0 * ldy + p * PANEL : tmp;
        const int64_t ldo = direct ? ldy : PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
            for (int64_t r = 0; r < rows;) {
                const int MR = rows - r >= 8 ? 8 : (int)(rows - r);
                const float *xr = x + (r0 + r) * ldx;
                switch (MR * 4 + NP) {
                case 8 * 4 + 2: TILE512(8, 2); break;
                case 8 * 4 + 1: TILE512(8, 1); break;
                case 7 * 4 + 2: TILE512(7, 2); break;
                case 7 * 4 + 1: TILE512(7, 1); break;
                case 6 * 4 + 2: TILE512(6, 2); break;
                case 6 * 4 + 1: TILE512(6, 1); break;
                case 5 * 4 + 2: TILE512(5, 2); break;
                case 5 * 4 + 1: TILE512(5, 1); break;
                case 4 * 4 + 2: TILE512(4, 2); break;
                case 4 * 4 + 1: TILE512(4, 1); break;
                case 3 * 4 + 2: TILE512(3, 2); break;
                case 3 * 4 + 1: TILE512(3, 1); break;
                case 2 * 4 + 2: TILE512(2, 2); break;
                case 2 * 4 + 1: TILE512(2, 1); break;
                case 1 * 4 + 2: TILE512(1, 2); break;
                default: TILE512(1, 1); break;
                }
                r += MR;
            }
        }
        if (!direct) store_partial(y + r0 * ldy, ldy, N, p * PANEL, tmp, PANEL, (int)rows, PANEL);
        p += NP;
    }
}
#else
/* Rows [r0, r0 + rows) of y = x @ W.T over panels [p0, p0 + np), W float32 in panels: run_scratch's tiles
 * on a panel that is already float32. */
static void run_f32(const float *x, int64_t ldx, int64_t K, const float *w, int64_t N, float *y, int64_t ldy,
                    int64_t r0, int64_t rows, int64_t p0, int64_t np) {
    const int64_t full = N / PANEL, tiles = (rows + 5) / 6;
    float tmp[ROW_BLOCK * PANEL];
    for (int64_t p = p0; p < p0 + np; p++) {
        const float *wf = w + p * K * PANEL;
        const int direct = p < full;
        float *o = direct ? y + r0 * ldy + p * PANEL : tmp;
        const int64_t ldo = direct ? ldy : PANEL;
        for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
            const int64_t k1 = k0 + K_CHUNK < K ? k0 + K_CHUNK : K;
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
#endif

/* y [M, N] = x [M, K] @ W.T over W's panels [p0, p1), W of `kind`; wf: K * 16 floats of scratch. */
static void product(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                    float *y, int64_t ldy, int64_t p0, int64_t p1, float *wf) {
    for (int64_t r0 = 0; r0 < M && p1 > p0; r0 += ROW_BLOCK) {
        const int64_t rows = M - r0 < ROW_BLOCK ? M - r0 : ROW_BLOCK;
        if (kind == KIND_F32)
            run_f32(x, ldx, K, (const float *)w, N, y, ldy, r0, rows, p0, p1 - p0);
        else if (rows >= SCRATCH_MIN_ROWS)
            run_scratch(kind, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0, wf);
        else
            run_direct(kind, x, ldx, K, w, N, y, ldy, r0, rows, p0, p1 - p0);
    }
}

/* Thread t of nt's share of an [M, N] product's panels (quant_linear.c's split). */
static void share(int64_t M, int64_t N, int64_t t, int64_t nt, int64_t *p0, int64_t *p1) {
    panel_range((N + PANEL - 1) / PANEL, M >= SCRATCH_MIN_ROWS, t, nt, p0, p1);
}

/* Token l's top-k experts by logit (ties: the lower id), and their softmax weights over all E. */
static void route(const float *l, int64_t E, int64_t k, int64_t renorm, int64_t *ids, float *wts) {
    uint8_t taken[MAX_EXPERTS] = {0};
    float max = l[0], sum = 0.0f, picked = 0.0f;
    for (int64_t e = 1; e < E; e++) max = l[e] > max ? l[e] : max;
    for (int64_t e = 0; e < E; e++) sum += expf(l[e] - max);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
        taken[best] = 1;
        ids[j] = best;
        wts[j] = expf(l[best] - max) / sum;
        picked += wts[j];
    }
    if (renorm)
        for (int64_t j = 0; j < k; j++) wts[j] /= picked;
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
    int64_t c = 0;
#ifdef TANDEM_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        const __m256 v = _mm256_loadu_ps(g + c);
        const __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v))));
        _mm256_storeu_ps(o + c, _mm256_mul_ps(s, _mm256_loadu_ps(u + c)));
    }
#endif
    for (; c < n; c++) o[c] = g[c] / (1.0f + exp_clamped(-g[c])) * u[c];
}

typedef struct {
    const uint8_t *const *w13, *const *w2; /* each expert's [gate; up] (N13 x H) and down (H x I) */
    int64_t kind13, kind2, N13, I;
} Experts;

/* One pass over T <= MAX_TOKENS tokens; s: the scratch (see tandem_moe_f32). */
static void moe_pass(const float *x, int64_t T, int64_t H, int64_t ldx, const float *router, int64_t E, int64_t k,
                     int64_t renorm, int64_t *ids, float *wts, const Experts *ex, float *y, int64_t ldy,
                     int64_t threads, float *s) {
    const int64_t P = T * k, N13 = ex->N13, I = ex->I;
    float *logits = s, *xs = logits + T * E, *h = xs + P * H, *act = h + P * N13, *o = act + P * I;
    int64_t *pos = (int64_t *)(o + P * H), *start = pos + P; /* start: E + 1 group offsets */
    /* tiny layers on one thread: waking the other costs more than the work */
    const int64_t nt = P * (N13 + I) * H < PARALLEL_MIN_MACS ? 1 : threads;
#pragma omp parallel num_threads(nt)
    {
        const int64_t t = team_thread(), n = team_size();
        float *wf = malloc((size_t)(H > I ? H : I) * PANEL * sizeof(float));
        int64_t p0, p1;
        if (router) {
            share(T, E, t, n, &p0, &p1);
            product(KIND_F32, x, ldx, T, H, (const uint8_t *)router, E, logits, E, p0, p1, wf);
#pragma omp barrier
            for (int64_t i = T * t / n; i < T * (t + 1) / n; i++) route(logits + i * E, E, k, renorm, ids + i * k, wts + i * k);
#pragma omp barrier
        }
#pragma omp single
        {
            for (int64_t e = 0; e <= E; e++) start[e] = 0;
            for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
            for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
            int64_t fill[MAX_EXPERTS];
            for (int64_t e = 0; e < E; e++) fill[e] = start[e];
            for (int64_t p = 0; p < P; p++) pos[p] = fill[ids[p]]++;
        } /* implied barrier */
        for (int64_t p = P * t / n; p < P * (t + 1) / n; p++)
            memcpy(xs + pos[p] * H, x + p / k * ldx, (size_t)H * sizeof(float));
#pragma omp barrier
        for (int64_t e = 0; e < E; e++) {
            const int64_t m = start[e + 1] - start[e];
            if (!m) continue;
            share(m, N13, t, n, &p0, &p1);
            product((int)ex->kind13, xs + start[e] * H, H, m, H, ex->w13[e], N13, h + start[e] * N13, N13, p0, p1, wf);
        }
#pragma omp barrier
        for (int64_t r = P * t / n; r < P * (t + 1) / n; r++) silu_mul_row(h + r * N13, h + r * N13 + I, act + r * I, I);
#pragma omp barrier
        for (int64_t e = 0; e < E; e++) {
            const int64_t m = start[e + 1] - start[e];
            if (!m) continue;
            share(m, H, t, n, &p0, &p1);
            product((int)ex->kind2, act + start[e] * I, I, m, I, ex->w2[e], H, o + start[e] * H, H, p0, p1, wf);
        }
#pragma omp barrier
        for (int64_t i = T * t / n; i < T * (t + 1) / n; i++) {
            float *yi = y + i * ldy;
            for (int64_t j = 0; j < k; j++) {
                const float wj = wts[i * k + j], *oj = o + pos[i * k + j] * H;
                for (int64_t c = 0; c < H; c++) yi[c] = j ? yi[c] + wj * oj[c] : wj * oj[c];
            }
        }
        free(wf);
    }
}

/* y [T, H] (row stride ldy) = the MoE layer of x [T, H] (ldx). router: E x H float32 panels, or NULL when
 * ids / wts [T, k] come routed (then read; else written). w13, w2: E pointers each, to an expert's
 * [gate; up] (N13 = 2 I rows, H inputs) and down (H rows, I inputs) in kind13 / kind2 (KIND_F32 or a GGUF
 * kind). Returns 0, or 1 when the scratch could not be allocated (y is then not written). */
int64_t tandem_moe_f32(const float *x, int64_t T, int64_t H, int64_t ldx, const float *router, int64_t E,
                       int64_t k, int64_t renorm, int64_t *ids, float *wts, const uint8_t *const *w13,
                       int64_t kind13, int64_t N13, const uint8_t *const *w2, int64_t kind2, int64_t I, float *y,
                       int64_t ldy, int64_t threads) {
    if (E > MAX_EXPERTS || k > E || N13 != 2 * I) return 2;
    const Experts ex = {w13, w2, kind13, kind2, N13, I};
    const int64_t chunk = T < MAX_TOKENS ? T : MAX_TOKENS, P = chunk * k;
    float *s = malloc((size_t)(chunk * E + P * (2 * H + N13 + I)) * sizeof(float) + (size_t)(P + E + 1) * 8);
    if (!s) return 1;
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t m = T - t0 < chunk ? T - t0 : chunk;
        moe_pass(x + t0 * ldx, m, H, ldx, router, E, k, renorm, ids + t0 * k, wts + t0 * k, &ex, y + t0 * ldy, ldy,
                 threads, s);
    }
    free(s);
    return 0;
}
