/* A GGUF tensor's blocks, read once at load: repacked into quant_blocks.h's panels for quant_linear.c, or
 * dequantized to float32 rows (an embedding table's lookup).
 *
 * Built and loaded by kernels/native/quant_repack.py. tandem_repack writes, byte for byte, what
 * kernels/native/quant_pack.py's pack_reference (numpy) writes; tandem_dequantize_rows gives, bit for bit,
 * the floats of the gguf package's dequantization (the same float operations in the same order). The tests
 * (tests/kernels/test_quant_repack.py) hold both to those references.
 *
 * Input: `n` rows of GGUF blocks, row r at raw + r * ld, each K / (weights per block) blocks. A GGUF block
 * ("unit" here: 32 weights, 256 for the K-quants, whose scales cover 256 inputs like a panel's super-block)
 * is decoded into q, its 32 or 256 quantized values (uint8; Q8_0's int8 bits), and its scales as the file
 * holds them.
 */
#include <stdint.h>
#include <string.h>
#include "omp_team.h"

#include "quant_blocks.h"
#ifdef __SSE2__
#include <emmintrin.h>
#endif

typedef struct {
    uint8_t q[256];
    uint8_t sc[16], mn[8]; /* K-quants' sub-block scales (Q6_K: 16 int8) and mins */
    uint16_t d, m;         /* float16 bits: d, and m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K) */
} unit_t;

/* Weights and bytes of a GGUF block of each kind (quant_pack.py's GGUF_BLOCKS). */
static int64_t unit_weights(int kind) { return super_k(kind) ? 256 : 32; }
static int64_t unit_bytes(int kind) {
    static const int64_t bytes[] = {[KIND_Q4_1] = 20, [KIND_Q8_0] = 34, [KIND_Q4_K] = 144, [KIND_Q4_0] = 18,
                                    [KIND_Q5_0] = 22, [KIND_Q5_1] = 24, [KIND_Q5_K] = 176, [KIND_Q6_K] = 210};
    return bytes[kind];
}
/* The kinds gguf dequantizes as D * (q - offset): an infinite or NaN d is refused by the repacking. */
static int offset_kind(int kind) { return kind == KIND_Q4_0 || kind == KIND_Q5_0 || kind == KIND_Q6_K; }

static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* 16 bytes' low nibbles to lo[16], high ones to hi[16] (written out for SSE2: GCC's own vectorization of
 * the loop assembled the bytes one by one, most of a Q4_0 repacking's time). */
static ALWAYS_INLINE void split16(const uint8_t *src, uint8_t *lo, uint8_t *hi) {
#ifdef __SSE2__
    const __m128i x = _mm_loadu_si128((const __m128i *)src), m = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)lo, _mm_and_si128(x, m));
    _mm_storeu_si128((__m128i *)hi, _mm_and_si128(_mm_srli_epi16(x, 4), m));
#else
    for (int i = 0; i < 16; i++) {
        lo[i] = src[i] & 15;
        hi[i] = src[i] >> 4;
    }
#endif
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins (gguf's Q4_K.get_scale_min). */
static inline void scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 2) & 0x30));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
    }
}

static ALWAYS_INLINE void decode(const int kind, const uint8_t *b, unit_t *u) {
    switch (kind) {
    case KIND_Q4_0:
    case KIND_Q4_1:
    case KIND_Q5_0:
    case KIND_Q5_1: {
        const int with_m = kind == KIND_Q4_1 || kind == KIND_Q5_1, at = with_m ? 4 : 2;
        u->d = le16(b);
        u->m = with_m ? le16(b + 2) : 0;
        if (high_bits(kind)) { /* a little-endian word before the nibbles: bit i is weight i's fifth bit */
            const uint32_t qh = le32(b + at);
            split16(b + at + 4, u->q, u->q + 16); /* GGUF's nibbles: low ones weights 0..15 */
            for (int i = 0; i < 32; i++) u->q[i] |= (uint8_t)(((qh >> i) & 1) << 4);
        } else {
            split16(b + at, u->q, u->q + 16);
        }
        return;
    }
    case KIND_Q8_0:
        u->d = le16(b);
        memcpy(u->q, b + 2, 32);
        return;
    case KIND_Q4_K:
    case KIND_Q5_K: { /* d, dmin, 12 scale bytes, (Q5_K: 32 bytes of fifth bits), 128 bytes of nibbles */
        const uint8_t *qs = b + (kind == KIND_Q4_K ? 16 : 48);
        u->d = le16(b);
        u->m = le16(b + 2);
        scale_min(b + 4, u->sc, u->mn);
        for (int j = 0; j < 8; j++) /* each 32 bytes: sub-block 2j in the low nibbles, 2j + 1 the high */
            split16(qs + 16 * j, u->q + 64 * (j / 2) + 16 * (j % 2), u->q + 64 * (j / 2) + 32 + 16 * (j % 2));
        if (kind == KIND_Q5_K) /* bit s of byte i: sub-block s's weight i */
            for (int s = 0; s < 8; s++)
                for (int i = 0; i < 32; i++) u->q[32 * s + i] |= (uint8_t)(((b[16 + i] >> s) & 1) << 4);
        return;
    }
    case KIND_Q6_K: { /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d */
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++) /* per 128 weights: 64 bytes of nibbles, 32 of 4 two-bit fields */
            for (int i = 0; i < 32; i++) {
                const uint8_t l0 = ql[64 * h + i], l1 = ql[64 * h + 32 + i], hi = qh[32 * h + i];
                uint8_t *q = u->q + 128 * h + i;
                q[0] = (uint8_t)((l0 & 15) | (hi & 3) << 4);
                q[32] = (uint8_t)((l1 & 15) | ((hi >> 2) & 3) << 4);
                q[64] = (uint8_t)((l0 >> 4) | ((hi >> 4) & 3) << 4);
                q[96] = (uint8_t)((l1 >> 4) | ((hi >> 6) & 3) << 4);
            }
        memcpy(u->sc, b + 192, 16);
        u->d = le16(b + 208);
        u->m = 0;
        return;
    }
    }
}

static ALWAYS_INLINE void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* A panel's 16 decoded units (one a column; zero past the last row) as one super-block (K-quants) or
 * 32-block of the layout: the scales, then per 32-block the values. `kind` is a constant at every call
 * (BY_KIND below): fixed trip counts, loops over k that vectorize (measured: as fast as SSE2 transposes
 * written out, and simpler). */
static ALWAYS_INLINE void write_unit(const int kind, const unit_t *u, uint8_t *out) {
    for (int c = 0; c < PANEL; c++) {
        put16(out + 2 * c, u[c].d);
        if (kind == KIND_Q4_1 || kind == KIND_Q5_1 || kind == KIND_Q4_K || kind == KIND_Q5_K)
            put16(out + 32 + 2 * c, u[c].m);
        if (kind == KIND_Q4_K || kind == KIND_Q5_K)
            for (int s = 0; s < 8; s++) {
                out[64 + s * PANEL + c] = u[c].sc[s];
                out[64 + (8 + s) * PANEL + c] = u[c].mn[s];
            }
        if (kind == KIND_Q6_K)
            for (int g = 0; g < 16; g++) out[32 + g * PANEL + c] = u[c].sc[g];
    }
    const int hb = high_bits(kind);
    for (int64_t sub = 0; sub < sub_blocks(kind); sub++) {
        uint8_t *v = out + scale_bytes(kind) + sub * quant_bytes(kind);
        const int at = (int)sub * KBLK;
        if (kind == KIND_Q8_0) { /* [k][column] */
            for (int k = 0; k < KBLK; k++)
                for (int c = 0; c < PANEL; c++) v[k * PANEL + c] = u[c].q[at + k];
            continue;
        }
        if (hb) { /* per k a 16- or 32-bit word: column c's bits above the nibble at bit c * hb */
            uint32_t word[KBLK] = {0};
            for (int c = 0; c < PANEL; c++)
                for (int k = 0; k < KBLK; k++) word[k] |= (uint32_t)(u[c].q[at + k] >> 4) << (c * hb);
            for (int k = 0; k < KBLK; k++)
                for (int i = 0; i < 2 * hb; i++) v[k * 2 * hb + i] = (uint8_t)(word[k] >> (8 * i));
        }
        uint8_t pair[8][KBLK]; /* column j in the low nibble, j + 8 in the high one, then [k][j] */
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < KBLK; k++)
                pair[j][k] = (uint8_t)((u[j].q[at + k] & 15) | (u[j + 8].q[at + k] & 15) << 4);
        for (int k = 0; k < KBLK; k++)
            for (int j = 0; j < 8; j++) v[64 * hb + k * 8 + j] = pair[j][k];
    }
}

/* Panels p0..p1 of tandem_repack; returns whether an offset kind's d was infinite or NaN. */
static ALWAYS_INLINE int64_t repack_panels(const int kind, const uint8_t *raw, int64_t n, int64_t ld,
                                          int64_t units, uint8_t *out, int64_t p0, int64_t p1) {
    const int64_t ub = unit_bytes(kind), sbb = super_bytes(kind); /* a unit is a panel's super-block */
    int64_t bad = 0;
    unit_t u[PANEL];
    for (int64_t p = p0; p < p1; p++)
        for (int64_t b = 0; b < units; b++) {
            for (int c = 0; c < PANEL; c++) {
                const int64_t r = p * PANEL + c;
                if (r < n) {
                    decode(kind, raw + r * ld + b * ub, &u[c]);
                    bad |= offset_kind(kind) && (u[c].d & 0x7c00) == 0x7c00;
                } else {
                    memset(&u[c], 0, sizeof u[c]); /* padding: zero scales and values */
                }
            }
            write_unit(kind, u, out + (p * units + b) * sbb);
        }
    return bad;
}

/* Bytes of a row of K inputs' GGUF blocks; -1 when K is not whole blocks. */
int64_t tandem_repack_row_bytes(int64_t kind, int64_t K) {
    return K % unit_weights((int)kind) ? -1 : K / unit_weights((int)kind) * unit_bytes((int)kind);
}
/* Bytes of one super-block of a panel (a 32-block's for the kinds without super-blocks). */
int64_t tandem_repack_super_bytes(int64_t kind) { return super_bytes((int)kind); }
int64_t tandem_repack_sub_blocks(int64_t kind) { return sub_blocks((int)kind); }

/* Returns fn(kind, ...) with kind as a constant: the always-inline code under fn compiles once per kind. */
#define BY_KIND(kind, fn, ...)                                                                                  \
    switch (kind) {                                                                                            \
    case KIND_Q4_1: return fn(KIND_Q4_1, __VA_ARGS__);                                                         \
    case KIND_Q8_0: return fn(KIND_Q8_0, __VA_ARGS__);                                                         \
    case KIND_Q4_K: return fn(KIND_Q4_K, __VA_ARGS__);                                                         \
    case KIND_Q4_0: return fn(KIND_Q4_0, __VA_ARGS__);                                                         \
    case KIND_Q5_0: return fn(KIND_Q5_0, __VA_ARGS__);                                                         \
    case KIND_Q5_1: return fn(KIND_Q5_1, __VA_ARGS__);                                                         \
    case KIND_Q5_K: return fn(KIND_Q5_K, __VA_ARGS__);                                                         \
    case KIND_Q6_K: return fn(KIND_Q6_K, __VA_ARGS__);                                                         \
    }

static int64_t repack_range(int kind, const uint8_t *raw, int64_t n, int64_t ld, int64_t units, uint8_t *out,
                            int64_t p0, int64_t p1) {
    BY_KIND(kind, repack_panels, raw, n, ld, units, out, p0, p1)
    return 0;
}

/* raw: n rows of K inputs' GGUF blocks (row stride ld bytes) -> out [ceil(n / 16) panels, K / (32 * sub
 * blocks), super_bytes] in quant_blocks.h's layout, the columns past n zero. Returns 1 (out then not to
 * be used) when a kind gguf dequantizes as d * (q - offset) has an infinite or NaN d, else 0. */
int64_t tandem_repack(const uint8_t *raw, int64_t n, int64_t ld, int64_t kind, int64_t K, uint8_t *out,
                      int64_t num_threads) {
    const int64_t units = K / unit_weights((int)kind), panels = (n + PANEL - 1) / PANEL;
    int64_t bad = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
    {
        const int64_t t = team_thread(), nt = team_size();
        bad |= repack_range((int)kind, raw, n, ld, units, out, panels * t / nt, panels * (t + 1) / nt);
    }
    return bad;
}

/* One GGUF block as gguf's numpy dequantizes it: the same float32 operations in the same order. */
static ALWAYS_INLINE void dequantize_unit(const int kind, const unit_t *u, float *y) {
    const float d = half_to_float(u->d);
    switch (kind) {
    case KIND_Q4_0:
    case KIND_Q5_0: {
        const int offset = kind == KIND_Q4_0 ? 8 : 16;
        for (int i = 0; i < 32; i++) y[i] = d * (float)(u->q[i] - offset);
        return;
    }
    case KIND_Q4_1:
    case KIND_Q5_1: { /* d * q is exact: a contraction to an FMA rounds the same sum */
        const float m = half_to_float(u->m);
        for (int i = 0; i < 32; i++) y[i] = d * (float)u->q[i] + m;
        return;
    }
    case KIND_Q8_0:
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)u->q[i] * d;
        return;
    case KIND_Q4_K:
    case KIND_Q5_K: {
        const float dmin = half_to_float(u->m);
        for (int s = 0; s < 8; s++) { /* d * sc, and its product with q, exact (at most 11 + 6 + 5 bits) */
            const float ds = d * (float)u->sc[s], dm = dmin * (float)u->mn[s];
            for (int i = 0; i < 32; i++) y[32 * s + i] = ds * (float)u->q[32 * s + i] - dm;
        }
        return;
    }
    case KIND_Q6_K:
        for (int g = 0; g < 16; g++) { /* (d * sc) * (q - 32), rounded in that order as gguf's */
            const float ds = d * (float)(int8_t)u->sc[g];
            for (int i = 0; i < 16; i++) y[16 * g + i] = ds * (float)(u->q[16 * g + i] - 32);
        }
        return;
    }
}

/* Rows r0..r1 of tandem_dequantize_rows. */
static ALWAYS_INLINE int dequantize_part(const int kind, const uint8_t *raw, int64_t ld, int64_t units, float *y,
                                         int64_t ldy, int64_t r0, int64_t r1) {
    unit_t u;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < units; b++) {
            decode(kind, raw + r * ld + b * unit_bytes(kind), &u);
            dequantize_unit(kind, &u, y + r * ldy + b * unit_weights(kind));
        }
    return 0;
}

static int dequantize_range(int kind, const uint8_t *raw, int64_t ld, int64_t units, float *y, int64_t ldy,
                            int64_t r0, int64_t r1) {
    BY_KIND(kind, dequantize_part, raw, ld, units, y, ldy, r0, r1)
    return 0;
}

/* raw as tandem_repack's -> y [n, K] float32 (row stride ldy floats): gguf's dequantization. */
void tandem_dequantize_rows(const uint8_t *raw, int64_t n, int64_t ld, int64_t kind, int64_t K, float *y,
                            int64_t ldy, int64_t num_threads) {
    const int64_t units = K / unit_weights((int)kind);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = team_thread(), nt = team_size();
        dequantize_range((int)kind, raw, ld, units, y, ldy, n * t / nt, n * (t + 1) / nt);
    }
}
