/* LoRA deltas of a step mixing adapters (S-LoRA/Punica's segmented product) in one call per layer: for each
 * token row t whose request runs the adapter in slot s = slot[t] (-1: the base, skipped),
 *   y[t] += (a[s] x[t]) b[s]
 * a [slots, r, in] and b [slots, r, out] row-major (the adapter's scale folded into b; b as PEFT's lora_B
 * transposed, so the second product runs along y's row: no sum across lanes per output). A fused layer's
 * parts lie side by side in r (part p: a's and b's rows p*r/parts.., y's columns cols[p]..cols[p+1]; the rest
 * of b is zeros, not read), and only the first rank[s] rows of each part hold the adapter (the slots are as
 * wide as --max-lora-rank): the rest are never read.
 *
 * The rows are taken adapter by adapter, a block of rows at a time: each row of a and of b is read once per
 * block (then from L1 for the block's other rows) where row by row every row would read its adapter's whole
 * weights, a layer's worth per row from memory once the step's adapters outgrow the cache. Any thread count
 * gives the same bits: a row's delta is computed in the same order whichever thread and block take it.
 * The plain-torch twin: kernels/reference/lora.py. */
#include <stdint.h>

#include "omp_team.h"

/* GCC's default for these CPUs is 256-bit vectors; the products here are short loops over L1-resident
 * rows, where 512-bit ones run ~2x faster (measured on Sapphire Rapids). Clang has no such switch. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

#define BLOCK_ROWS 16

/* The rows of adapters (slot >= 0) in slot order, stable: order[0..n). */
static int64_t by_slot(const int64_t *slot, int64_t rows, int64_t *order) {
    int64_t n = 0, top = -1;
    for (int64_t i = 0; i < rows; i++) top = slot[i] > top ? slot[i] : top;
    for (int64_t s = 0; s <= top; s++)
        for (int64_t i = 0; i < rows; i++)
            if (slot[i] == s) order[n++] = i;
    return n;
}

/* tmp[j][k] = a_k . x_j for the part's rows k0..k1 of a and the block's rows j (4 at a time: each row of a
 * loaded once for the four; every row through this one loop, so its bits never depend on its block). */
static void shrink(const float *x, int64_t xs, const int64_t *order, int64_t m, const float *as, int64_t in,
                   int64_t k0, int64_t k1, float *tmp, int64_t r) {
    for (int64_t j = 0; j < m; j += 4) {
        const float *x0 = x + order[j] * xs;
        const float *x1 = x + order[j + 1 < m ? j + 1 : j] * xs; /* past the block: row j again, unused */
        const float *x2 = x + order[j + 2 < m ? j + 2 : j] * xs;
        const float *x3 = x + order[j + 3 < m ? j + 3 : j] * xs;
        for (int64_t k = k0; k < k1; k++) {
            const float *restrict ak = as + k * in;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; i++) {
                const float w = ak[i];
                s0 += w * x0[i];
                s1 += w * x1[i];
                s2 += w * x2[i];
                s3 += w * x3[i];
            }
            tmp[j * r + k] = s0;
            if (j + 1 < m) tmp[(j + 1) * r + k] = s1;
            if (j + 2 < m) tmp[(j + 2) * r + k] = s2;
            if (j + 3 < m) tmp[(j + 3) * r + k] = s3;
        }
    }
}

#define OUT_BLOCK 64

/* The columns [o, o + w) of the four rows (w <= OUT_BLOCK; a whole block's loops have constant bounds, so
 * its sums stay in registers). */
static inline __attribute__((always_inline)) void expand_block(float *yq[4], const float *tq[4], const float *bo,
                                                               int64_t out, int64_t o, int64_t k0, int64_t k1,
                                                               int64_t w) {
    float acc[4][OUT_BLOCK] = {{0.0f}};
    if (w == OUT_BLOCK) {
        for (int64_t k = k0; k < k1; k++) {
            const float *restrict bk = bo + k * out;
            const float c0 = tq[0][k], c1 = tq[1][k], c2 = tq[2][k], c3 = tq[3][k];
#pragma omp simd
            for (int64_t i = 0; i < OUT_BLOCK; i++) {
                const float v = bk[i];
                acc[0][i] += c0 * v;
                acc[1][i] += c1 * v;
                acc[2][i] += c2 * v;
                acc[3][i] += c3 * v;
            }
        }
    } else {
        for (int64_t k = k0; k < k1; k++) {
            const float *restrict bk = bo + k * out;
            const float c0 = tq[0][k], c1 = tq[1][k], c2 = tq[2][k], c3 = tq[3][k];
#pragma omp simd
            for (int64_t i = 0; i < w; i++) {
                const float v = bk[i];
                acc[0][i] += c0 * v;
                acc[1][i] += c1 * v;
                acc[2][i] += c2 * v;
                acc[3][i] += c3 * v;
            }
        }
    }
    for (int64_t q = 0; q < 4; q++) {
        float *restrict yo = yq[q] + o;
#pragma omp simd
        for (int64_t i = 0; i < w; i++) yo[i] += acc[q][i];
    }
}

/* y_j[o0..o1) += sum over the part's rows k of tmp[j][k] b_k, 4 rows j at a time and OUT_BLOCK columns: each
 * piece of b loaded once for the four, the sums held apart from y until the last k (the same order for
 * every row and column, whichever block). */
static void expand(float *y, int64_t ys, const int64_t *order, int64_t m, const float *bs, int64_t out,
                   int64_t o0, int64_t o1, int64_t k0, int64_t k1, const float *tmp, int64_t r, float *spare) {
    for (int64_t j = 0; j < m; j += 4) {
        float *yq[4];
        const float *tq[4];
        for (int64_t q = 0; q < 4; q++) {
            yq[q] = j + q < m ? y + order[j + q] * ys : spare; /* past the block: written to spare */
            tq[q] = tmp + (j + q < m ? j + q : j) * r;
        }
        int64_t o = o0;
        for (; o + OUT_BLOCK <= o1; o += OUT_BLOCK) expand_block(yq, tq, bs + o, out, o, k0, k1, OUT_BLOCK);
        if (o < o1) expand_block(yq, tq, bs + o, out, o, k0, k1, o1 - o);
    }
}

/* The rows order[0..m) (all of slot s) of y gain their deltas. */
static void lora_block(float *y, int64_t ys, const float *x, int64_t xs, const int64_t *order, int64_t m,
                       const float *as, const float *bs, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                       int64_t parts, int64_t rank) {
    const int64_t part_rank = r / parts;
    float tmp[BLOCK_ROWS * r];
    float spare[out];
    for (int64_t p = 0; p < parts; p++) {
        const int64_t k0 = p * part_rank;
        shrink(x, xs, order, m, as, in, k0, k0 + rank, tmp, r);
        expand(y, ys, order, m, bs, out, cols[p], cols[p + 1], k0, k0 + rank, tmp, r, spare);
    }
}

/* Thread t of nt's share: the adapters' rows in slot order, split in nt contiguous runs, each taken in blocks
 * of one slot's rows (the step graph's node: kernels/csrc/step_graph.c). */
void tandem_lora_add_part(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                          const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                          int64_t parts, const int64_t *ranks, int64_t t, int64_t nt) {
    int64_t order[rows > 0 ? rows : 1];
    const int64_t n = by_slot(slot, rows, order);
    const int64_t end = n * (t + 1) / nt;
    for (int64_t i = n * t / nt; i < end;) {
        const int64_t s = slot[order[i]];
        int64_t m = 1;
        while (m < BLOCK_ROWS && i + m < end && slot[order[i + m]] == s) m++;
        const int64_t rank = ranks[s] < r / parts ? ranks[s] : r / parts;
        lora_block(y, ys, x, xs, order + i, m, a + s * r * in, b + s * r * out, r, in, out, cols, parts, rank);
        i += m;
    }
}

void tandem_lora_add_f32(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                         const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                         int64_t parts, const int64_t *ranks) {
#pragma omp parallel if (rows >= 8)
    tandem_lora_add_part(y, ys, x, xs, rows, slot, a, b, r, in, out, cols, parts, ranks, team_thread(),
                         team_size());
}
