/* LoRA deltas of a step mixing adapters (S-LoRA/Punica's segmented product), per target layer: for each
 * token row t whose request runs the adapter in slot s = slot[t] (-1: the base, skipped),
 *   y[t] += (a[s] x[t]) b[s]
 * a [slots, r, in] and b [slots, r, out] row-major (the adapter's scale folded into b; b as PEFT's lora_B
 * transposed, so the second product runs along y's row: no sum across lanes per output). A fused layer's
 * parts lie side by side in r (part p: a's and b's rows p*r/parts.., y's columns cols[p]..cols[p+1]; the rest
 * of b is zeros, not read), and only the first rank[s] rows of each part hold the adapter (the slots are as
 * wide as --max-lora-rank): the rest are never read.
 *
 * Two phases, x A^T into a [rows, r] scratch then that times B into y. The rows are taken adapter by
 * adapter, four at a time: each row of a and of b is read once per four rows (then from L1) where row by row
 * every row would read its adapter's whole weights, a layer's worth per row from memory once the step's
 * adapters outgrow the cache. Any thread count gives the same bits: a row's delta is computed in the same
 * order whichever thread and block take it.
 * The plain-torch twin: kernels/reference/lora.py. */
#include <stdint.h>

#include "omp_team.h"

/* GCC's default for these CPUs is 256-bit vectors; the products here are short loops over L1-resident
 * rows, where 512-bit ones ran 1.3-1.5x faster (Sapphire Rapids). Clang has no such switch. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

/* The rows of adapters (slot >= 0) in slot order, stable: order[0..n). */
static int64_t by_slot(const int64_t *slot, int64_t rows, int64_t *order) {
    int64_t n = 0, top = -1;
    for (int64_t i = 0; i < rows; i++) top = slot[i] > top ? slot[i] : top;
    for (int64_t s = 0; s <= top; s++)
        for (int64_t i = 0; i < rows; i++)
            if (slot[i] == s) order[n++] = i;
    return n;
}

/* tmp[row][k] = a_k . x_row for rows k0..k1 of a and a block's m <= 4 rows (each row of a loaded once for
 * the four; every row through this one loop, so its bits never depend on its block). */
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
            tmp[order[j] * r + k] = s0;
            if (j + 1 < m) tmp[order[j + 1] * r + k] = s1;
            if (j + 2 < m) tmp[order[j + 2] * r + k] = s2;
            if (j + 3 < m) tmp[order[j + 3] * r + k] = s3;
        }
    }
}

#define OUT_BLOCK 64

/* acc[q][0..w) += sum over k0..k1 of tq[q][k] bo[k * out + 0..w) (inlined with w a constant where it is one,
 * so a whole block's sums stay in registers). */
static inline __attribute__((always_inline)) void accumulate(float acc[4][OUT_BLOCK], const float *tq[4],
                                                             const float *bo, int64_t out, int64_t k0, int64_t k1,
                                                             int64_t w) {
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

/* The columns [o, o + w) of the block's m rows (w <= OUT_BLOCK). */
static void expand_block(float *yq[4], const float *tq[4], const float *bo, int64_t out, int64_t o, int64_t k0,
                         int64_t k1, int64_t w, int64_t m) {
    float acc[4][OUT_BLOCK] = {{0.0f}};
    if (w == OUT_BLOCK) accumulate(acc, tq, bo, out, k0, k1, OUT_BLOCK);
    else accumulate(acc, tq, bo, out, k0, k1, w);
    for (int64_t q = 0; q < m; q++) { /* the rows past the block's m were sums of a copy, dropped */
        float *restrict yo = yq[q] + o;
#pragma omp simd
        for (int64_t i = 0; i < w; i++) yo[i] += acc[q][i];
    }
}

/* y_j[o0..o1) += sum over the part's rows k of tmp[j][k] b_k for a block's m <= 4 rows j, OUT_BLOCK columns
 * at a time (o0 on a block's edge): each piece of b loaded once for the four, the sums held apart from y
 * until the last k (the same order for every row and column, whichever block and thread). */
static void expand(float *y, int64_t ys, const int64_t *order, int64_t m, const float *bs, int64_t out,
                   int64_t o0, int64_t o1, int64_t k0, int64_t k1, const float *tmp, int64_t r) {
    float *yq[4];
    const float *tq[4];
    for (int64_t q = 0; q < 4; q++) {
        yq[q] = y + order[q < m ? q : 0] * ys;
        tq[q] = tmp + order[q < m ? q : 0] * r;
    }
    int64_t o = o0;
    for (; o + OUT_BLOCK <= o1; o += OUT_BLOCK) expand_block(yq, tq, bs + o, out, o, k0, k1, OUT_BLOCK, m);
    if (o < o1) expand_block(yq, tq, bs + o, out, o, k0, k1, o1 - o, m);
}

/* The step's blocks: the adapters' rows in slot order (stable), cut into runs of at most four rows of one
 * slot; block i is order[start[i]..start[i + 1]). Returns the block count. */
static int64_t blocks_of(const int64_t *slot, int64_t rows, int64_t *order, int64_t *start) {
    const int64_t n = by_slot(slot, rows, order);
    int64_t nb = 0;
    for (int64_t i = 0; i < n;) {
        int64_t m = 1;
        while (m < 4 && i + m < n && slot[order[i + m]] == slot[order[i]]) m++;
        start[nb++] = i;
        i += m;
    }
    start[nb] = n;
    return nb;
}

static inline int64_t rank_of(const int64_t *ranks, int64_t s, int64_t part_rank) {
    return ranks[s] < part_rank ? ranks[s] : part_rank;
}

/* The two phases of a step's LoRA deltas, as thread t of nt's share: phase 0 fills tmp [rows, r] with each
 * adapter row's x A^T (items: a block's rows times one row of a), phase 1 adds tmp B to y (items: a block's
 * rows times OUT_BLOCK columns of one part). Each phase splits its items evenly over the threads, so one row
 * keeps both threads busy as 32 do; every item's arithmetic is the same whichever thread takes it. The step
 * graph records one node per phase (kernels/csrc/step_graph.c): phase 1 reads what every thread wrote in
 * phase 0. */
void tandem_lora_add_part(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                          const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                          int64_t parts, const int64_t *ranks, float *tmp, int64_t phase, int64_t t, int64_t nt) {
    if (rows <= 0) return;
    int64_t order[rows], start[rows + 1];
    const int64_t nb = blocks_of(slot, rows, order, start), part_rank = r / parts;
    int64_t total = 0; /* items of the phase, over all blocks */
    for (int64_t i = 0; i < nb; i++) {
        const int64_t rank = rank_of(ranks, slot[order[start[i]]], part_rank);
        if (phase == 0) total += parts * rank;
        else if (rank > 0)
            for (int64_t p = 0; p < parts; p++) total += (cols[p + 1] - cols[p] + OUT_BLOCK - 1) / OUT_BLOCK;
    }
    const int64_t first = total * t / nt, last = total * (t + 1) / nt;
    int64_t at = 0; /* items before block i */
    for (int64_t i = 0; i < nb && at < last; i++) {
        const int64_t s = slot[order[start[i]]], m = start[i + 1] - start[i];
        const int64_t rank = rank_of(ranks, s, part_rank);
        const int64_t *rows_of = order + start[i];
        for (int64_t p = 0; p < parts && at < last; p++) {
            const int64_t k0 = p * part_rank;
            if (phase == 0) {
                const int64_t lo = first > at ? first - at : 0, hi = last - at < rank ? last - at : rank;
                if (lo < hi) shrink(x, xs, rows_of, m, a + s * r * in, in, k0 + lo, k0 + hi, tmp, r);
                at += rank;
            } else if (rank > 0) {
                const int64_t chunks = (cols[p + 1] - cols[p] + OUT_BLOCK - 1) / OUT_BLOCK;
                const int64_t lo = first > at ? first - at : 0, hi = last - at < chunks ? last - at : chunks;
                if (lo < hi) {
                    const int64_t o0 = cols[p] + lo * OUT_BLOCK;
                    const int64_t o1 = cols[p] + hi * OUT_BLOCK < cols[p + 1] ? cols[p] + hi * OUT_BLOCK : cols[p + 1];
                    expand(y, ys, rows_of, m, b + s * r * out, out, o0, o1, k0, k0 + rank, tmp, r);
                }
                at += chunks;
            }
        }
    }
}

/* The eager call: both phases in one parallel region (when there are rows enough to share). */
void tandem_lora_add_f32(float *y, int64_t ys, const float *x, int64_t xs, int64_t rows, const int64_t *slot,
                         const float *a, const float *b, int64_t r, int64_t in, int64_t out, const int64_t *cols,
                         int64_t parts, const int64_t *ranks, float *tmp) {
#pragma omp parallel if (rows >= 4)
    {
        const int64_t t = team_thread(), nt = team_size();
        tandem_lora_add_part(y, ys, x, xs, rows, slot, a, b, r, in, out, cols, parts, ranks, tmp, 0, t, nt);
#pragma omp barrier
        tandem_lora_add_part(y, ys, x, xs, rows, slot, a, b, r, in, out, cols, parts, ranks, tmp, 1, t, nt);
    }
}
