/* Greedy sampling's argmax over rows of float32 logits, as torch.argmax gives it: the first index of the
 * largest value, a NaN counting as larger than every number (the first NaN wins); -0 and +0 are equal.
 *
 * A node of the CPU step graph (kernels/csrc/step_graph.c) after the LM head, so a greedy decode step's
 * tokens come out of the replay; built and loaded by kernels/native/argmax.py, whose reference is
 * torch.argmax (the tests compare the two on ties, NaN, infinities and signed zeros).
 */
#include <stdint.h>
#include "omp_team.h"

static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0;
    float m = x[0];
    if (m != m) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float v = x[i];
        if (v > m) {
            m = v;
            best = i;
        } else if (v != v) {
            return i;
        }
    }
    return best;
}

/* Thread t of nt's rows of out[r] = argmax of x[r, 0 .. n-1] (row stride ldx); n >= 1. */
void tandem_argmax_part(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out, int64_t t, int64_t nt) {
    for (int64_t r = rows * t / nt; r < rows * (t + 1) / nt; r++) out[r] = argmax_row(x + r * ldx, n);
}

void tandem_argmax(const float *x, int64_t rows, int64_t n, int64_t ldx, int64_t *out) {
    tandem_argmax_part(x, rows, n, ldx, out, 0, 1);
}
