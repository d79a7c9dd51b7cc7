/* A packed GGUF weight (quant_blocks.h's panels) written out as bfloat16, for products of many rows that the
 * hardware's bf16 matmul (AMX, AVX512-BF16 through oneDNN) runs faster than the int8 kernel: a prefill chunk
 * reads each weight once per chunk, so widening it per call costs a small share of the chunk's products.
 *
 * Each weight is the float32 the kernel dequantizes (dequant_panel: gguf's dequantization), rounded to nearest
 * even (torch's rounding), written k-major. Built on quant_linear.c's panel decoders
 * (#included). */
#include "quant_linear.c"

/* float32 -> bfloat16 rounded to nearest even, NaN to 0xffff: torch's vectorized .to(bfloat16), as
 * kv_types.h's f32_to_bf16, written as a select so the loops below vectorize. */
static inline uint16_t bf16_rne(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t r = (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0xffff : r;
}

/* W [N, K] packed as `kind` -> out[k * ldo + n] bfloat16 bits for n < N (k-major: torch multiplies by its
 * [K, N] view transposed), on num_threads threads. Each thread takes pairs of panels: a k's 32 columns are
 * one 64-byte line of out, written whole (one panel's 16 halves would leave each line half written twice,
 * far apart). Returns 0, or -1 when out of memory. */
int64_t tandem_dequantize_bf16(const uint8_t *w, int64_t kind, int64_t N, int64_t K, uint16_t *out, int64_t ldo,
                               int64_t num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2, stride = panel_bytes((int)kind, K);
    int64_t failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *wf = malloc((size_t)K * 2 * PANEL * sizeof(float));
        const int64_t t = team_thread(), nt = team_size();
        if (!wf) failed = 1;
        for (int64_t q = pairs * t / nt; wf && q < pairs * (t + 1) / nt; q++) {
            const int64_t p = 2 * q, n0 = p * PANEL, cols = N - n0 < 2 * PANEL ? N - n0 : 2 * PANEL;
            dequant_panel((int)kind, w + p * stride, K, wf);
            if (p + 1 < panels) dequant_panel((int)kind, w + (p + 1) * stride, K, wf + K * PANEL);
            for (int64_t k = 0; k < K; k++) {
                uint16_t *dst = out + k * ldo + n0;
                const float *a = wf + k * PANEL, *b = wf + (K + k) * PANEL;
                if (cols == 2 * PANEL) {
                    for (int c = 0; c < PANEL; c++) dst[c] = bf16_rne(a[c]);
                    for (int c = 0; c < PANEL; c++) dst[PANEL + c] = bf16_rne(b[c]);
                } else {
                    for (int c = 0; c < cols; c++) dst[c] = bf16_rne(c < PANEL ? a[c] : b[c - PANEL]);
                }
            }
        }
        free(wf);
    }
    return failed ? -1 : 0;
}
