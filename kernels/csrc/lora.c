/* LoRA deltas of a step mixing adapters (S-LoRA/Punica's segmented product) in one call per layer: for each
 * token row t whose request runs the adapter in slot s = slot[t] (-1: the base, skipped),
 *   y[t] += (a[s] x[t]) b[s]
 * a [slots, r, in] and b [slots, r, out] row-major (the adapter's scale folded into b; b as PEFT's lora_B
 * transposed, so the second product runs along y's row: no sum across lanes per output). A row's delta
 * depends on that row alone; the two products are a few dot products a row, so rows are split over the
 * threads only when there are many of them. The plain-torch twin: kernels/reference/lora.py. */
#include <stdint.h>

static void lora_row(float *restrict yt, const float *restrict xt, const float *restrict as,
                     const float *restrict bs, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                     int64_t part_rank) {
    float tmp[r];
    for (int64_t k = 0; k < r; k++) {
        const float *ak = as + k * in;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < in; i++) acc += ak[i] * xt[i];
        tmp[k] = acc;
    }
    for (int64_t k = 0; k < r; k++) {
        const float c = tmp[k];
        if (c == 0.0f) continue; /* past the adapter's rank, or a part it does not target: nothing to add */
        const float *bk = bs + k * out;
        const int64_t o0 = cols[k / part_rank], o1 = cols[k / part_rank + 1]; /* its part's columns only */
#pragma omp simd
        for (int64_t o = o0; o < o1; o++) yt[o] += c * bk[o];
    }
}

/* Thread t of nt's rows (the step graph's node: kernels/csrc/step_graph.c). */
void tandem_lora_add_part(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                          const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                          int64_t parts, int64_t t, int64_t nt) {
    for (int64_t i = rows * t / nt; i < rows * (t + 1) / nt; i++) {
        int64_t s = slot[i];
        if (s >= 0) lora_row(y + i * ys, x + i * xs, a + s * r * in, b + s * out * r, r, in, out, cols, r / parts);
    }
}

/* cols [parts + 1]: a fused layer's parts' column bounds in y (part p: b's rows p*r/parts.., y's columns
 * cols[p]..cols[p+1]; the rest of b is zeros, not read). */
void tandem_lora_add_f32(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                         const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                         int64_t parts) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t t = 0; t < rows; t++) {
        int64_t s = slot[t];
        if (s >= 0) lora_row(y + t * ys, x + t * xs, a + s * r * in, b + s * out * r, r, in, out, cols, r / parts);
    }
}
