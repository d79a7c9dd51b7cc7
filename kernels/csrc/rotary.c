/* Rotary position embedding on CPU, float32, HF's rotate_half layout, in one pass over the rows:
 *   out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, (i + D/2) % D] * sin[t, i]
 * with the tables of worker/layers/rotary.py (cos = [c, c], sin = [-s, s]). torch runs it as four ops
 * (a multiply, a roll, a multiply, an add), each a Python call: ~30 us a layer at batch 1, most of it
 * dispatch. Each element is the very float torch's ops give (two products rounded, then their sum rounded:
 * no fused multiply-add), so the result equals HF's bit for bit.
 *
 * Built and loaded by kernels/cpu_rotary.py (ctypes, compiled on first use); the reference is
 * worker/layers/rotary.py's apply_rotary_ref, and the tests compare the two bit for bit.
 */
#include <stdint.h>

#include "simd_exp.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* A product and a sum must each be rounded, as torch rounds them: no contraction into an FMA. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* Rows below this many elements in all run on one thread: waking another costs more than it saves. */
#define PARALLEL_MIN_ELEMS (1 << 15)

static void rotate_row(const float *restrict x, const float *restrict c, const float *restrict s, int64_t D,
                       float *restrict o) {
    const int64_t half = D / 2;
    int64_t i = 0;
#ifdef TANDEM_AVX2
    if (half % 8 == 0) {
        for (; i < half; i += 8) { /* first half pairs with the second, and the second with the first */
            const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
            _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                  _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
            _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                         _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
        }
        return;
    }
#endif
    for (; i < D; i++) {
        const float p = x[i] * c[i], q = x[(i + half) % D] * s[i];
        o[i] = p + q;
    }
}

/* x [T, H, D] (row stride ldx, head stride ldh, each head's D floats contiguous); cos, sin [T, D] (row
 * strides ldc, lds); out [T, H, D] contiguous. D even. */
void tandem_rotary_f32(const float *x, int64_t ldx, int64_t ldh, const float *cos_t, int64_t ldc, const float *sin_t,
                       int64_t lds, int64_t T, int64_t H, int64_t D, float *out, int64_t threads) {
    const int64_t nt = T * H * D < PARALLEL_MIN_ELEMS ? 1 : threads;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++)
            rotate_row(x + t * ldx + h * ldh, cos_t + t * ldc, sin_t + t * lds, D, out + (t * H + h) * D);
}

/* The decode form, for a caller already inside a parallel region (kernels/csrc/step_graph.c): thread t of nt
 * rotates tokens [T t / nt, T (t + 1) / nt) of x [T, H, D], token i at table row positions[i] of cos_t and
 * sin_t ([*, D], contiguous rows). The same floats as tandem_rotary_f32 over those rows. */
void tandem_rotary_positions_part(const float *x, int64_t ldx, int64_t ldh, const float *cos_t, const float *sin_t,
                                  int64_t D, int64_t H, const int64_t *positions, int64_t T, float *out, int64_t t,
                                  int64_t nt) {
    for (int64_t i = T * t / nt; i < T * (t + 1) / nt; i++)
        for (int64_t h = 0; h < H; h++)
            rotate_row(x + i * ldx + h * ldh, cos_t + positions[i] * D, sin_t + positions[i] * D, D,
                       out + (i * H + h) * D);
}
