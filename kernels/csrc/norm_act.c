/* A decoder layer's elementwise steps on CPU, float32, each in one pass over its rows:
 *   - RMSNorm, optionally after adding a layer's output into the residual stream (x += delta in place),
 *     out = w * (x * 1/sqrt(mean(x^2) + eps)), HF's formula;
 *   - SiLU(gate) * up, from a [rows, 2 * n] gate/up product;
 *   - GELU(gate) * up (tanh approximation: Gemma's GeGLU), from the same.
 * torch runs each as four to seven ops with a Python call and a pass over memory each: at batch 1 that
 * dispatch is most of the time between a layer's matrix products.
 *
 * Built and loaded by kernels/cpu_norm_act.py (ctypes, compiled on first use); the plain-torch references
 * are in that file and the tests compare the two. A row's result depends on that row alone (the sum of
 * squares runs in 8 lanes in a fixed order), whatever the batch and the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "simd_exp.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows below this many elements in all run on one thread: waking another costs more than it saves. */
#define PARALLEL_MIN_ELEMS (1 << 15)

static void norm_row(float *restrict x, const float *restrict delta, const float *restrict w, int64_t n, float eps,
                     float *restrict out) {
    float acc[8] = {0};
    int64_t i = 0;
    if (delta) {
        for (int64_t k = 0; k < n; k++) x[k] += delta[k];
    }
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += x[i + l] * x[i + l];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += x[i] * x[i];
    const float r = 1.0f / sqrtf(s / (float)n + eps);
    for (int64_t k = 0; k < n; k++) out[k] = w[k] * (x[k] * r);
}

/* x [rows, n] (row stride ldx); delta (may be NULL) [rows, n] (ldd); w [n]; out [rows, n] (ldo). */
void tandem_add_rms_norm_f32(float *x, int64_t ldx, const float *delta, int64_t ldd, const float *w, int64_t rows,
                             int64_t n, float eps, float *out, int64_t ldo, int64_t threads) {
    const int64_t nt = rows * n < PARALLEL_MIN_ELEMS ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * ldx, delta ? delta + r * ldd : 0, w, n, eps, out + r * ldo);
}

/* The threads an entry below takes for rows x n elements (as its own parallel region would). */
int64_t tandem_elementwise_threads(int64_t rows, int64_t n, int64_t threads) {
    return rows * n < PARALLEL_MIN_ELEMS ? 1 : threads;
}

/* Thread t of nt's share of tandem_add_rms_norm_f32 (rows [rows t / nt, rows (t + 1) / nt)), for a caller
 * already inside a parallel region (kernels/csrc/step_graph.c): a row's bits do not depend on the split. */
void tandem_add_rms_norm_part(float *x, int64_t ldx, const float *delta, int64_t ldd, const float *w, int64_t rows,
                              int64_t n, float eps, float *out, int64_t ldo, int64_t t, int64_t nt) {
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)
        norm_row(x + r * ldx, delta ? delta + r * ldd : 0, w, n, eps, out + r * ldo);
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
    int64_t k = 0;
#ifdef TANDEM_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 x = _mm256_loadu_ps(g + k);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
    }
#endif
    for (; k < n; k++) o[k] = g[k] / (1.0f + exp_clamped(-g[k])) * u[k];
}

/* gate_up [rows, 2n] (row stride ldg): out [rows, n] (ldo) = silu(gate) * up, silu(g) = g / (1 + exp(-g)). */
void tandem_silu_mul_f32(const float *gate_up, int64_t ldg, int64_t rows, int64_t n, float *out, int64_t ldo,
                         int64_t threads) {
    const int64_t nt = rows * n < PARALLEL_MIN_ELEMS ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) silu_mul_row(gate_up + r * ldg, gate_up + r * ldg + n, out + r * ldo, n);
}

/* Thread t of nt's rows of tandem_silu_mul_f32 (see tandem_add_rms_norm_part). */
void tandem_silu_mul_part(const float *gate_up, int64_t ldg, int64_t rows, int64_t n, float *out, int64_t ldo,
                          int64_t t, int64_t nt) {
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)
        silu_mul_row(gate_up + r * ldg, gate_up + r * ldg + n, out + r * ldo, n);
}

/* GELU, tanh form: 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3); 1 + tanh(y) = 2 / (1 + exp(-2y)), so
 * gelu(g) = g / (1 + exp(-2y)): silu's shape at 2y, computed as silu is. */
#define GELU_2C 1.5957691216057308f /* 2 * sqrt(2 / pi) */
#define GELU_A 0.044715f

static void gelu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int64_t n) {
    int64_t k = 0;
#ifdef TANDEM_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 c2 = _mm256_set1_ps(GELU_2C), a = _mm256_set1_ps(GELU_A);
    for (; k + 8 <= n; k += 8) {
        const __m256 x = _mm256_loadu_ps(g + k);
        const __m256 y2 = _mm256_mul_ps(c2, _mm256_add_ps(x, _mm256_mul_ps(a, _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, y2))));
        _mm256_storeu_ps(o + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
    }
#endif
    for (; k < n; k++) {
        const float x = g[k], y2 = GELU_2C * (x + GELU_A * (x * (x * x)));
        o[k] = x / (1.0f + exp_clamped(-y2)) * u[k];
    }
}

/* gate_up [rows, 2n] (row stride ldg): out [rows, n] (ldo) = gelu_tanh(gate) * up. */
void tandem_gelu_mul_f32(const float *gate_up, int64_t ldg, int64_t rows, int64_t n, float *out, int64_t ldo,
                         int64_t threads) {
    const int64_t nt = rows * n < PARALLEL_MIN_ELEMS ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) gelu_mul_row(gate_up + r * ldg, gate_up + r * ldg + n, out + r * ldo, n);
}

/* Thread t of nt's rows of tandem_gelu_mul_f32 (see tandem_add_rms_norm_part). */
void tandem_gelu_mul_part(const float *gate_up, int64_t ldg, int64_t rows, int64_t n, float *out, int64_t ldo,
                          int64_t t, int64_t nt) {
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++)
        gelu_mul_row(gate_up + r * ldg, gate_up + r * ldg + n, out + r * ldo, n);
}
