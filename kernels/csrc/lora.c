/* LoRA deltas of a step mixing adapters (S-LoRA/Punica's segmented product) in one call per layer: for each
 * token row t whose request runs the adapter in slot s = slot[t] (-1: the base, skipped),
 *   y[t] += b[s] (a[s] x[t])
 * a [slots, r, in] and b [slots, out, r] row-major (the adapter's scale folded into b). A row's delta
 * depends on that row alone; the two products are a few dot products a row, so rows are split over the
 * threads only when there are many of them. The plain-torch twin: kernels/reference/lora.py. */
#include <stdint.h>

static void lora_row(float *restrict yt, const float *restrict xt, const float *restrict as,
                     const float *restrict bs, int64_t r, int64_t in, int64_t out) {
    float tmp[r];
    for (int64_t k = 0; k < r; k++) {
        const float *ak = as + k * in;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < in; i++) acc += ak[i] * xt[i];
        tmp[k] = acc;
    }
    for (int64_t o = 0; o < out; o++) {
        const float *bo = bs + o * r;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < r; k++) acc += bo[k] * tmp[k];
        yt[o] += acc;
    }
}

void tandem_lora_add_f32(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                         const float *a, const float *b, int64_t r, int64_t in, int64_t out) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        int64_t s = slot[t];
        if (s >= 0) lora_row(y + t * ys, x + t * xs, a + s * r * in, b + s * out * r, r, in, out);
    }
}
