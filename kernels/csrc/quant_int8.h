/* Int8 activations (--cpu-int8-activations): y = x @ W.T with x quantized per row and per 32-block of
 * inputs to 8 bits (llama.cpp's Q8_0 activation format) and multiplied with the weights' integer q in
 * integer arithmetic, the float scales applied once per block. Included by quant_linear.c after its float32
 * path (it uses BY_KIND, store_partial, panel_bytes and ROW_BLOCK from there); kernels/reference/
 * quant_int8.py is the plain reference of exactly this arithmetic.
 *
 * Activations, per row and 32-block b (x's inputs b*32 .. b*32+31):
 *   d = max|x| / 127 (float32), q = round-half-even(clamp(x / d, -127, 127)), 0 where d = 0; a block with an
 *   infinite or NaN input gets d = NaN and q = 0, so its outputs are NaN;
 *   s0, s1 = the sums of q over each 16 inputs (Q6_K's scales cover 16), sd = d * (float)(s0 + s1).
 * Output (row r, column n), one float32 chain over the blocks in order, started from 0; per block b:
 *   for each scale group (2 of 16 inputs for Q6_K, else 1 of 32):
 *     i = sum over the group's k of (qw - off) * q   (exact, int32; off = 8, 16, 32 for Q4_0, Q5_0, Q6_K
 *         whose weights are D * (qw - off); Q8_0's qw is signed)
 *     acc = fma(D * d, (float)i, acc)        (D: the weight's scale as quant_blocks.h computes it)
 *   for the kinds with a minimum M (Q4_1, Q5_1, Q4_K, Q5_K: weights D * qw + M): acc = fma(M, sd, acc).
 * Integer sums are exact whatever the order, and every path (AVX2's maddubs, VNNI's dpbusd, the portable
 * loops) runs these float ops in this order, so all give the same bits, and a row's result does not depend
 * on the batch it is in or the thread count. (float)i is exact: |i| < 2^21.
 *
 * AVX2 path: a panel's 32-block is decoded 4 inputs at a time into two vectors of 8 dwords, one per column,
 * each holding that column's 4 consecutive q as bytes, so a broadcast of the row's 4 q bytes against it
 * sums 4 products per column: _mm256_maddubs_epi16 (u8 x s8; never saturates here: |2 * 63 * 127| and, for
 * Q8_0 as |w| x sign-moved x, 2 * 128 * 127 < 2^15), a run of those added in 16 bits (i16_run), then
 * _mm256_madd_epi16; or one dpbusd with VNNI (Q8_0's q stored + 128 as u8, taken off as 128 * (s0 + s1)).
 * Few rows decode in registers; from I8_SCRATCH_MIN_ROWS a panel is decoded once into scratch. */
#ifndef TANDEM_QUANT_INT8_H
#define TANDEM_QUANT_INT8_H
#include <float.h>
#include <math.h>

#include "quant_blocks.h"

/* From this many rows a panel's 32-blocks are decoded once into scratch (below, in registers per tile). */
#define I8_SCRATCH_MIN_ROWS 16
/* A decoded 32-block in scratch: 16 columns x 32 q bytes, then D for 2 scale groups and M (16 floats each). */
#define I8_SCRATCH_BLOCK (512 + 3 * PANEL * 4)

/* The quantized activations of one call, per row and 32-block (row r, block b at r * nb + b). */
typedef struct {
    const int8_t *q; /* [M, K] */
    const float *d, *sd;
    const int32_t *s; /* [M, nb, 2] */
    int64_t K, nb;
} QActs;

static inline int has_min(int kind) {
    return kind == KIND_Q4_1 || kind == KIND_Q5_1 || kind == KIND_Q4_K || kind == KIND_Q5_K;
}

#ifdef QUANT_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I8_VNNI 1
#define DPBUSD _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define I8_VNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
#endif
/* Rows a tile holds: its int32 sums and float accumulators stay in registers (32 of them with AVX-512VL). */
#ifdef __AVX512VL__
#define I8_MR 4
#else
#define I8_MR 3
#endif
#ifdef I8_VNNI
#define Q8_OFFSET 128 /* dpbusd takes the weight unsigned: Q8_0's q is stored + 128 */
#else
#define Q8_OFFSET 0 /* the sign moves onto x: |w| x sign(x, w) */
#endif
#else
#define Q8_OFFSET 0
#endif

static inline int int_offset(int kind) {
    return kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : kind == KIND_Q6_K ? 32 : kind == KIND_Q8_0 ? Q8_OFFSET : 0;
}

#ifdef QUANT_AVX2

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

static void quantize_block(const float *x, int8_t *q, float *d, float *sd, int32_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, v[i]);
        amax = _mm256_max_ps(amax, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* inf or NaN */
    }
    float m[8], mx = 0.0f;
    _mm256_storeu_ps(m, amax);
    for (int i = 0; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
    const float dd = _mm256_movemask_ps(bad) ? NAN : mx / 127.0f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) {
        const __m256 t = _mm256_div_ps(v[i], _mm256_set1_ps(dd));
        qi[i] = dd > 0 ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)),
                                                          _mm256_set1_ps(127.0f)))
                       : _mm256_setzero_si256();
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    s[0] = hsum_epi32(_mm256_add_epi32(qi[0], qi[1]));
    s[1] = hsum_epi32(_mm256_add_epi32(qi[2], qi[3]));
    *d = dd;
    *sd = dd * (float)(s[0] + s[1]);
}

/* Per 128-bit lane, 4 dwords of 4 columns' bytes at one k each (k0..k3) -> one dword a column (its k0..k3). */
static ALWAYS_INLINE __m256i cols_of(__m256i v) {
    const __m256i t = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13,
                                       2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(v, t);
}

/* q's bits above the nibble for k = 4g .. 4g+3, one dword a column (w0: columns 0..7, w1: 8..15), at bit 4
 * of each byte: the plane's bytes gathered per column, then each dword shifted by its column's bit. */
static ALWAYS_INLINE void high_group(int hb, const uint8_t *blk, int g, __m256i *w0, __m256i *w1) {
    __m256i p, m0, m1, shift, mask;
    if (hb == 1) { /* per k a 16-bit word: byte 2i holds columns 0..7 at k_i, byte 2i + 1 columns 8..15 */
        int64_t plane;
        memcpy(&plane, blk + 8 * g, 8);
        p = _mm256_set1_epi64x(plane);
        m0 = _mm256_set1_epi32(0x06040200);
        m1 = _mm256_set1_epi32(0x07050301);
        shift = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        mask = _mm256_set1_epi8(1);
    } else { /* per k a 32-bit word: column c's 2 bits in its byte c / 4, at bit 2 (c % 4) */
        p = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 16 * g)));
        m0 = _mm256_set_m128i(_mm_set1_epi32(0x0d090501), _mm_set1_epi32(0x0c080400)); /* lane 1: columns 4-7 */
        m1 = _mm256_set_m128i(_mm_set1_epi32(0x0f0b0703), _mm_set1_epi32(0x0e0a0602));
        shift = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        mask = _mm256_set1_epi8(3);
    }
    *w0 = _mm256_or_si256(*w0, _mm256_slli_epi32(
                                   _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(p, m0), shift), mask), 4));
    *w1 = _mm256_or_si256(*w1, _mm256_slli_epi32(
                                   _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(p, m1), shift), mask), 4));
}

/* The q of k = 4g .. 4g+3 of the 32-block at blk, one dword a column: w0 columns 0..7, w1 columns 8..15. */
static ALWAYS_INLINE void decode_group(const int kind, const uint8_t *blk, int g, __m256i *w0, __m256i *w1) {
    if (kind == KIND_Q8_0) { /* per k 16 bytes: dwords k0 c0-3 .. c12-15, k1 ... (two loads: k0-1, k2-3) */
        const __m256i perm = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
        const __m256i a = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(blk + 64 * g)), perm);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32)), perm);
        *w0 = cols_of(_mm256_unpacklo_epi64(a, b));
        *w1 = cols_of(_mm256_unpackhi_epi64(a, b));
#ifdef I8_VNNI
        *w0 = _mm256_xor_si256(*w0, _mm256_set1_epi8((char)0x80));
        *w1 = _mm256_xor_si256(*w1, _mm256_set1_epi8((char)0x80));
#endif
        return;
    }
    const int hb = high_bits(kind);
    /* per k 8 bytes (column j low nibble, j + 8 high): dwords k0 c0-3, k0 c4-7, k1 ... */
    const __m256i v = cols_of(_mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(blk + 64 * hb + 32 * g)),
                                                          _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
    *w0 = _mm256_and_si256(v, _mm256_set1_epi8(15));
    *w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
    if (hb) high_group(hb, blk, g, w0, w1);
}

static ALWAYS_INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#ifndef I8_VNNI
/* Groups of 4 inputs whose maddubs sums (2 products a 16-bit lane) add up in 16 bits before widening, one
 * madd_epi16 for the run: 8 x 2 * 15 * 127, 4 x 2 * 31 * 127 and 2 x 2 * 63 * 127 stay under 2^15; Q8_0's
 * 2 * 128 * 127 only alone. */
static inline int i16_run(int kind) { return kind == KIND_Q8_0 ? 1 : high_bits(kind) ? 4 / high_bits(kind) : 8; }

/* Per 16-bit lane the sum of 2 products w * x (Q8_0's signed w: |w| x x with w's sign). */
static ALWAYS_INLINE __m256i pairs(const int kind, __m256i w, __m256i x) {
    if (kind == KIND_Q8_0) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_maddubs_epi16(w, x);
}
#endif

/* MR rows x NP panels over all of K, from the panels' blocks at w (decoded in registers) or, with scr, from
 * one panel decoded into scratch. Integer sums per 16 inputs ([..][g >> 2]: Q6_K's scale groups; for the
 * others two dpbusd chains in flight, summed), then the block's float ops in the header comment's order. */
static ALWAYS_INLINE void tile8(const int kind, const QActs *a, int64_t r0, const uint8_t *w, int64_t panel_stride,
                                const uint8_t *scr, float *out, int64_t ldo, const int MR, const int NP) {
    const int KH = groups(kind), off = int_offset(kind);
    const int64_t subs = sub_blocks(kind), sbb = super_bytes(kind), nb = a->nb;
    __m256 acc[I8_MR][2][2];
    for (int r = 0; r < MR; r++)
        for (int p = 0; p < NP; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t sub = b % subs;
        const uint8_t *sb = scr ? NULL : w + b / subs * sbb, *sblk = scr ? scr + b * I8_SCRATCH_BLOCK : NULL;
        __m256i ia[I8_MR][2][2][2];
#ifndef I8_VNNI
        __m256i s16[I8_MR][2][2]; /* 16-bit sums of a run of groups */
#endif
        for (int r = 0; r < MR; r++)
            for (int p = 0; p < NP; p++)
                for (int h = 0; h < 2; h++) ia[r][p][h][0] = ia[r][p][h][1] = _mm256_setzero_si256();
        if (!scr)
            for (int p = 0; p < NP; p++)
                for (int64_t o = 0; o < sbb / subs + 64; o += 64)
                    _mm_prefetch((const char *)values_of(kind, sb + p * panel_stride, sub) + PF_DIST + o, _MM_HINT_T0);
        /* unrolled: ia's index g >> 2 must be a constant for the sums to stay in registers */
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++)
            for (int p = 0; p < NP; p++) {
                __m256i w0, w1;
                if (scr) {
                    w0 = _mm256_loadu_si256((const __m256i *)(sblk + 64 * g));
                    w1 = _mm256_loadu_si256((const __m256i *)(sblk + 64 * g + 32));
                } else {
                    decode_group(kind, values_of(kind, sb + p * panel_stride, sub), g, &w0, &w1);
                }
                for (int r = 0; r < MR; r++) {
                    const __m256i xv = bcast4(a->q + (r0 + r) * a->K + b * KBLK + 4 * g);
#ifdef I8_VNNI
                    ia[r][p][0][g >> 2] = DPBUSD(ia[r][p][0][g >> 2], w0, xv);
                    ia[r][p][1][g >> 2] = DPBUSD(ia[r][p][1][g >> 2], w1, xv);
#else
                    const int run = i16_run(kind), hk = KH == 2 ? g >> 2 : 0; /* one chain: runs are short */
                    const __m256i p0 = pairs(kind, w0, xv), p1 = pairs(kind, w1, xv);
                    s16[r][p][0] = g % run ? _mm256_add_epi16(s16[r][p][0], p0) : p0;
                    s16[r][p][1] = g % run ? _mm256_add_epi16(s16[r][p][1], p1) : p1;
                    if (g % run == run - 1)
                        for (int h = 0; h < 2; h++)
                            ia[r][p][h][hk] = _mm256_add_epi32(
                                ia[r][p][h][hk], _mm256_madd_epi16(s16[r][p][h], _mm256_set1_epi16(1)));
#endif
                }
            }
        for (int p = 0; p < NP; p++) {
            __m256 d[2][2], m[2];
            if (scr) {
                const float *f = (const float *)(sblk + 512);
                for (int gh = 0; gh < KH; gh++)
                    for (int h = 0; h < 2; h++) d[gh][h] = _mm256_loadu_ps(f + gh * PANEL + 8 * h);
                m[0] = _mm256_loadu_ps(f + 2 * PANEL);
                m[1] = _mm256_loadu_ps(f + 2 * PANEL + 8);
            } else {
                for (int gh = 0; gh < KH; gh++)
                    scales_at(kind, sb + p * panel_stride, sub, gh, &d[gh][0], &d[gh][1], &m[0], &m[1]);
            }
            for (int r = 0; r < MR; r++) {
                const int64_t at = (r0 + r) * nb + b;
                const __m256 dx = _mm256_set1_ps(a->d[at]);
                const int32_t *s = a->s + at * 2;
                for (int h = 0; h < 2; h++) {
                    for (int gh = 0; gh < KH; gh++) {
                        __m256i i = KH == 1 ? _mm256_add_epi32(ia[r][p][h][0], ia[r][p][h][1]) : ia[r][p][h][gh];
                        if (off) i = _mm256_sub_epi32(i, _mm256_set1_epi32(off * (KH == 1 ? s[0] + s[1] : s[gh])));
                        acc[r][p][h] = _mm256_fmadd_ps(_mm256_mul_ps(d[gh][h], dx), _mm256_cvtepi32_ps(i), acc[r][p][h]);
                    }
                    if (has_min(kind)) acc[r][p][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a->sd[at]), acc[r][p][h]);
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

/* A panel's 32-blocks decoded into scratch: per block the q bytes as decode_group gives them, D, M. */
static ALWAYS_INLINE void decode_panel8_kind(const int kind, const uint8_t *w, int64_t nb, uint8_t *scr) {
    const int64_t subs = sub_blocks(kind), sbb = super_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = w + b / subs * sbb;
        uint8_t *o = scr + b * I8_SCRATCH_BLOCK;
        for (int g = 0; g < 8; g++) {
            __m256i w0, w1;
            decode_group(kind, values_of(kind, sb, b % subs), g, &w0, &w1);
            _mm256_storeu_si256((__m256i *)(o + 64 * g), w0);
            _mm256_storeu_si256((__m256i *)(o + 64 * g + 32), w1);
        }
        float *f = (float *)(o + 512);
        __m256 d0, d1, m0, m1;
        for (int gh = 0; gh < groups(kind); gh++) {
            scales_at(kind, sb, b % subs, gh, &d0, &d1, &m0, &m1);
            _mm256_storeu_ps(f + gh * PANEL, d0);
            _mm256_storeu_ps(f + gh * PANEL + 8, d1);
        }
        _mm256_storeu_ps(f + 2 * PANEL, m0);
        _mm256_storeu_ps(f + 2 * PANEL + 8, m1);
    }
}

/* Rows r0 .. r0+rows over panels p0 .. p0+np: few rows decode each block in registers per tile (1 row: 2
 * panels at once, for chains in flight); many share a panel decoded once into scr. */
static ALWAYS_INLINE void panels8_kind(const int kind, const QActs *a, const uint8_t *w, int64_t N, float *y,
                                       int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np, uint8_t *scr) {
    const int64_t panel_stride = panel_bytes(kind, a->K), full = N / PANEL;
    float tmp[I8_MR * 2 * PANEL];
    if (scr) {
        const int64_t tiles = (rows + I8_MR - 1) / I8_MR;
        for (int64_t p = p0; p < p0 + np; p++) {
            decode_panel8_kind(kind, w + p * panel_stride, a->nb, scr);
            const int direct = p < full;
            for (int64_t r = 0, i = 0; r < rows; i++) { /* rows split evenly into tiles of at most I8_MR */
                const int MR = (int)(rows / tiles + (i < rows % tiles));
                float *o = direct ? y + (r0 + r) * ldy + p * PANEL : tmp;
                const int64_t ldo = direct ? ldy : PANEL;
                switch (MR) {
                case 4: tile8(kind, a, r0 + r, NULL, 0, scr, o, ldo, I8_MR >= 4 ? 4 : 1, 1); break;
                case 3: tile8(kind, a, r0 + r, NULL, 0, scr, o, ldo, I8_MR >= 3 ? 3 : 1, 1); break;
                case 2: tile8(kind, a, r0 + r, NULL, 0, scr, o, ldo, 2, 1); break;
                default: tile8(kind, a, r0 + r, NULL, 0, scr, o, ldo, 1, 1); break;
                }
                if (!direct) store_partial(y + (r0 + r) * ldy, ldy, N, p * PANEL, tmp, ldo, MR, PANEL);
                r += MR;
            }
        }
        return;
    }
    for (int64_t r = r0; r < r0 + rows;) {
        const int64_t left = r0 + rows - r;
        const int MR = left >= I8_MR ? I8_MR : (int)left;
        for (int64_t p = p0; p < p0 + np;) {
            const int NP = MR == 1 && p + 2 <= p0 + np && p + 2 <= full ? 2 : 1;
            const int direct = p + NP <= full;
            float *o = direct ? y + r * ldy + p * PANEL : tmp;
            const int64_t ldo = direct ? ldy : NP * PANEL;
            const uint8_t *wp = w + p * panel_stride;
            switch (MR * 8 + NP) {
            case 4 * 8 + 1: tile8(kind, a, r, wp, panel_stride, NULL, o, ldo, I8_MR >= 4 ? 4 : 1, 1); break;
            case 3 * 8 + 1: tile8(kind, a, r, wp, panel_stride, NULL, o, ldo, I8_MR >= 3 ? 3 : 1, 1); break;
            case 2 * 8 + 1: tile8(kind, a, r, wp, panel_stride, NULL, o, ldo, 2, 1); break;
            case 1 * 8 + 2: tile8(kind, a, r, wp, panel_stride, NULL, o, ldo, 1, 2); break;
            default: tile8(kind, a, r, wp, panel_stride, NULL, o, ldo, 1, 1); break;
            }
            if (!direct) store_partial(y + r * ldy, ldy, N, p * PANEL, tmp, ldo, MR, NP * PANEL);
            p += NP;
        }
        r += MR;
    }
}
#else
/* Portable twin: the same integers and the same float ops in the same order. */
static void quantize_block(const float *x, int8_t *q, float *d, float *sd, int32_t *s) {
    float mx = 0.0f;
    int bad = 0;
    for (int i = 0; i < KBLK; i++) {
        const float a = fabsf(x[i]);
        bad |= !(a <= FLT_MAX);
        mx = a > mx ? a : mx;
    }
    const float dd = bad ? NAN : mx / 127.0f;
    s[0] = s[1] = 0;
    for (int i = 0; i < KBLK; i++) {
        const int v = dd > 0 ? (int)rintf(fminf(fmaxf(x[i] / dd, -127.0f), 127.0f)) : 0;
        q[i] = (int8_t)v;
        s[i / 16] += v;
    }
    *d = dd;
    *sd = dd * (float)(s[0] + s[1]);
}

static ALWAYS_INLINE void panels8_kind(const int kind, const QActs *a, const uint8_t *w, int64_t N, float *y,
                                       int64_t ldy, int64_t r0, int64_t rows, int64_t p0, int64_t np, uint8_t *scr) {
    (void)scr;
    const int64_t panel_stride = panel_bytes(kind, a->K), gk = KBLK / groups(kind);
    const int off = int_offset(kind);
    for (int64_t p = p0; p < p0 + np; p++)
        for (int c = 0; c < PANEL && p * PANEL + c < N; c++)
            for (int64_t r = r0; r < r0 + rows; r++) {
                const uint8_t *wp = w + p * panel_stride;
                float acc = 0.0f, d, m;
                for (int64_t b = 0; b < a->nb; b++) {
                    const int64_t at = r * a->nb + b;
                    for (int gh = 0; gh < groups(kind); gh++) {
                        int32_t i = 0;
                        for (int64_t k = b * KBLK + gh * gk; k < b * KBLK + (gh + 1) * gk; k++)
                            i += (quant_at(kind, wp, c, k) - off) * a->q[r * a->K + k];
                        scales_scalar(kind, wp, c, b * KBLK + gh * gk, &d, &m);
                        acc = __builtin_fmaf(d * a->d[at], (float)i, acc);
                    }
                    if (has_min(kind)) acc = __builtin_fmaf(m, a->sd[at], acc);
                }
                y[r * ldy + p * PANEL + c] = acc;
            }
}
#endif

static void run_panels8(int kind, const QActs *a, const uint8_t *w, int64_t N, float *y, int64_t ldy, int64_t r0,
                        int64_t rows, int64_t p0, int64_t np, uint8_t *scr) {
    BY_KIND(kind, panels8_kind, a, w, N, y, ldy, r0, rows, p0, np, scr)
}
#endif
