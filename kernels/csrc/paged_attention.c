/* Paged attention on CPU, float32 queries and sums, reading K/V where it lies in the pool: decodes,
 * draft-verify rows, prefills and prefill chunks, all alike. The pools hold float32, float16 or bfloat16
 * (--kv-cache-dtype); a half-precision element is widened to float32 as it is loaded, which is exact, so a
 * half pool gives the very bits of a float32 pool holding the same values, for half the bytes read.
 *
 * Built and loaded by kernels/native/paged_attention.py (ctypes; no torch headers, so it compiles in about a
 * second). The plain-torch reference is kernels/reference/paged_attention.py; the tests compare the two.
 *
 * A call attends B requests: request b has the queries q_offsets[b] .. q_offsets[b+1]-1 (rows q_rows[e]
 * of q, or row e when q_rows is NULL; its outputs are rows e of out) over the keys in pool slots
 * slots[b*slots_stride + 0 .. lens[b]-1]; its query j sits at position lens[b] - q_len + j and sees keys
 * up to it (causal), and with a window W > 0 (a sliding-window layer) only the last W of those: a block of
 * queries never reads a key before its first query's window, so their KV may be gone (freed, or another
 * request's). The work is split by (request, KV head, block of queries): pass 1 reads each key of
 * that head once, eight keys at a time, for all the G * block queries that share it; then a softmax per
 * query; pass 2 sums the weighted values into accumulators held in registers.
 *
 * A query's result depends only on itself and its own keys: not on the rest of the batch, on padding, on
 * threads, on how the queries are blocked, nor on whether it is a decode, a verify row or a prompt token
 * (a prompt attended whole, in chunks, or one token at a time gives the same bits). With AVX2 and FMA
 * (and a head size that is a multiple of 8) the passes run eight lanes per instruction (with AVX-512 and a
 * head size that is a multiple of 16, pass 2 sixteen, a position's query heads together: the same sums);
 * the portable loops compute the same sums in the same order elsewhere (the exp's rounding may differ:
 * FMAs there).
 *
 * The AVX2 passes are written once for the three pool types (an always-inlined function of a constant type)
 * and instantiated per type, so the type is no branch in their inner loops; the portable loops widen each
 * row they read into float32 first (see widen).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "omp_team.h"

#include "simd_exp.h"

/* How many slots ahead to prefetch: a request's slots may be scattered over the pool. */
#define PREFETCH_AHEAD 4
/* Keys per block: a score row is padded to a multiple of KB (padding scores are -inf), and the softmax
 * sums go in KB lanes by key index, a fixed order, so the same keys give the same sum. */
#define KB 8

#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline int64_t padded(int64_t len) { return (len + KB - 1) / KB * KB; }

/* The pools' element type: the codes kernels/native/paged_attention.py passes. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline int64_t kv_size(int kt) { return kt == KV_F32 ? 4 : 2; }

/* IEEE half -> float, exactly (every half is a float): rebias the exponent, widen the mantissa. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: bias 15 -> 127 */
    } else {
        const float f = (float)man * 0x1p-24f; /* zero or subnormal: man * 2^-24, exact in float */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* bfloat16 is a float's upper half. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* A K/V row of D elements of type kt as float32: the row itself, or widened into buf. The portable loops
 * below read every row through this, so a half pool runs the float32 pool's very instructions (the
 * compiler fuses multiply-adds as it likes, differently in differently typed copies of a loop). */
static inline const float *widen(const char *row, int64_t D, int kt, float *buf) {
    if (kt == KV_F32) return (const float *)row;
    const uint16_t *h = (const uint16_t *)row;
    if (kt == KV_F16)
        for (int64_t d = 0; d < D; d++) buf[d] = f16_to_f32(h[d]);
    else
        for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_f32(h[d]);
    return buf;
}

/* One key's score: 8 lanes over d (lane l sums d = l, l+8, ... in order), added ((0+1)+(2+3))+((4+5)+(6+7)),
 * then the head sizes past a multiple of 8 in order. A score depends on its query and key alone. */
static inline float score1(const float *q, const float *k, int64_t D) {
    float a[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int l = 0; l < 8; l++) a[l] += q[d + l] * k[d + l];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; d < D; d++) s += q[d] * k[d];
    return s;
}

static inline void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
}

/* What one (request, KV head, query block) item reads and writes: for each query j in [j0, j1) of the
 * request, the G query heads of KV head hk; local row i = (j - j0) * G + g. Query j sits at position
 * len - q_len + j, so the block needs keys 0 .. kend - 1, kend = len - q_len + j1. */
typedef struct {
    const float *const *qb; /* [(j1 - j0) * G] query vectors */
    float *const *ob;       /* [(j1 - j0) * G] output vectors */
    const char *k, *v;      /* the pools, offset to KV head hk */
    int64_t row_bytes;      /* from one slot to the next */
    int kt;                 /* the pools' element type */
    const int64_t *sl; /* the request's slots */
    int64_t len, q_len, j0, j1, group, D;
    int64_t window; /* keys a query sees, its own included; 0: all before it */
    float scale;
    float *work; /* scores: row i at work + i * (padded(kend) - kbeg), key t at (t - kbeg) */
} Item;

static inline int64_t item_keys(const Item *it) { return it->len - it->q_len + it->j1; }

/* The first key query j sees. */
static inline int64_t first_key(const Item *it, int64_t j) {
    const int64_t f = it->len - it->q_len + j - it->window + 1;
    return it->window && f > 0 ? f : 0;
}

/* The first key the item reads: its first query's first key, down to a multiple of KB, so that a key's
 * softmax lane (its index mod KB) is the same in every block: the sums do not depend on the blocking. */
static inline int64_t item_first(const Item *it) { return first_key(it, it->j0) / KB * KB; }

#define FOR_QUERIES(it, i, j)                                   \
    for (int64_t j = (it)->j0; j < (it)->j1; j++)               \
        for (int64_t i = (j - (it)->j0) * (it)->group;          \
             i < (j - (it)->j0 + 1) * (it)->group; i++)

/* Portable loops: any CPU, any head size. */
static void attend_item_portable(const Item *it) {
    const int kt = it->kt;
    const int64_t kend = item_keys(it), k0 = item_first(it), lp = padded(kend), D = it->D, rb = it->row_bytes;
    const int64_t bytes = D * kv_size(kt);
    float buf[D];
    FOR_QUERIES(it, i, j) {
        float *s = it->work + i * (lp - k0) - k0; /* indexed by key: s[k0 .. lp) */
        const int64_t last = it->len - it->q_len + j; /* the query's own position: keys past it are masked */
        const int64_t first = first_key(it, j); /* and keys before its window */
        for (int64_t t = k0; t < lp; t++) {
            if (t >= first && t <= last) {
                if (t + PREFETCH_AHEAD <= last) prefetch_row(it->k + it->sl[t + PREFETCH_AHEAD] * rb, bytes);
                s[t] = score1(it->qb[i], widen(it->k + it->sl[t] * rb, D, kt, buf), D) * it->scale;
            } else {
                s[t] = -INFINITY;
            }
        }
        float m = -INFINITY, lanes[KB] = {0};
        for (int64_t t = first; t <= last; t++) m = fmaxf(m, s[t]);
        for (int64_t t0 = k0; t0 < lp; t0 += KB)
            for (int64_t u = 0; u < KB; u++) {
                const float x = s[t0 + u];
                s[t0 + u] = x == -INFINITY ? 0.0f : exp_clamped(x - m);
                lanes[u] += s[t0 + u];
            }
        const float inv = 1.0f / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
        float *o = it->ob[i];
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t t = first; t <= last; t++) {
            const float p = s[t] * inv;
            if (p == 0.0f) continue; /* a weight that underflowed */
            const float *vt = widen(it->v + it->sl[t] * rb, D, kt, buf);
            for (int64_t d = 0; d < D; d++) o[d] += p * vt[d];
        }
    }
}

#ifdef TANDEM_AVX2
/* Eight 8-lane sums -> one vector of their totals, lane j = ((a_j0+a_j1)+(a_j2+a_j3))+((a_j4+a_j5)+(a_j6+a_j7)):
 * score1's order. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Elements d .. d+7 of a K/V row of type kt, as float32: F16C's conversion for half, a 16-bit shift for
 * bfloat16 (its bits are a float's upper half). */
ALWAYS_INLINE __m256 load8(const char *row, int64_t d, int kt) {
    if (kt == KV_F32) return _mm256_loadu_ps((const float *)row + d);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
    if (kt == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#ifdef __F16C__
    return _mm256_cvtph_ps(h);
#else /* a build told not to use F16C (every AVX2 CPU has it): one lane at a time */
    float f[8];
    for (int l = 0; l < 8; l++) f[l] = f16_to_f32(((const uint16_t *)row)[d + l]);
    return _mm256_loadu_ps(f);
#endif
}

/* The scores of eight keys against one query, D a multiple of 8: each lane as score1 computes it. */
ALWAYS_INLINE __m256 score8(const float *q, const char *const *k, int64_t D, int kt) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, load8(k[0], d, kt), a0);
        a1 = _mm256_fmadd_ps(x, load8(k[1], d, kt), a1);
        a2 = _mm256_fmadd_ps(x, load8(k[2], d, kt), a2);
        a3 = _mm256_fmadd_ps(x, load8(k[3], d, kt), a3);
        a4 = _mm256_fmadd_ps(x, load8(k[4], d, kt), a4);
        a5 = _mm256_fmadd_ps(x, load8(k[5], d, kt), a5);
        a6 = _mm256_fmadd_ps(x, load8(k[6], d, kt), a6);
        a7 = _mm256_fmadd_ps(x, load8(k[7], d, kt), a7);
    }
    return sum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* o[d .. d+8*nv) += sum over keys t0 .. t1-1 of p[t] * v_t[d .. d+8*nv), in key order, nv (a constant once
 * inlined) accumulators held in registers: o holds the running sums between chunks of keys (a float stored
 * and reloaded is the same float, so a query's sums run over its keys in order, however they are chunked). */
ALWAYS_INLINE void pass2(const int nv, const int kt, const float *s, float inv, int64_t t0, int64_t t1,
                         const char *v, int64_t row_bytes, const int64_t *sl, int64_t d, float *o) {
    __m256 acc[8];
    for (int c = 0; c < nv; c++) acc[c] = _mm256_loadu_ps(o + d + 8 * c);
    for (int64_t t = t0; t < t1; t++) {
        const float p = s[t] * inv;
        if (p == 0.0f) continue; /* a weight that underflowed */
        const char *vt = v + sl[t] * row_bytes;
        const __m256 pv = _mm256_set1_ps(p);
        for (int c = 0; c < nv; c++) acc[c] = _mm256_fmadd_ps(pv, load8(vt, d + 8 * c, kt), acc[c]);
    }
    for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + d + 8 * c, acc[c]);
}

/* Keys per pass-2 chunk: their values stay in L1 while every query of the item sums them. */
#define VCHUNK 32

#ifdef __AVX512F__
/* Elements d .. d+15 of a K/V row of type kt, as float32 (load8's conversions, 16 lanes). */
ALWAYS_INLINE __m512 load16(const char *row, int64_t d, int kt) {
    if (kt == KV_F32) return _mm512_loadu_ps((const float *)row + d);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d));
    if (kt == KV_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* pass2 for ng query heads that share their keys (a position's heads of one KV head) at once, 16 lanes a
 * register: each value row is loaded once for all of them, and ng * nv independent FMA chains are in flight
 * (one query's nv chains alone wait on the FMA latency). Each lane is pass2's: o += p * v over the keys in
 * order, p = s[t] * inv, a zero p skipped; so the bits are pass2's. */
ALWAYS_INLINE void pass2_heads(const int ng, const int nv, const int kt, const float *const *s, const float *inv,
                               int64_t t0, int64_t t1, const char *v, int64_t row_bytes, const int64_t *sl,
                               int64_t d, float *const *o) {
    __m512 acc[4][4];
    for (int h = 0; h < ng; h++)
        for (int c = 0; c < nv; c++) acc[h][c] = _mm512_loadu_ps(o[h] + d + 16 * c);
    for (int64_t t = t0; t < t1; t++) {
        const char *vt = v + sl[t] * row_bytes;
        __m512 vv[4];
        for (int c = 0; c < nv; c++) vv[c] = load16(vt, d + 16 * c, kt);
        for (int h = 0; h < ng; h++) {
            const float p = s[h][t] * inv[h];
            if (p == 0.0f) continue; /* a weight that underflowed */
            const __m512 pv = _mm512_set1_ps(p);
            for (int c = 0; c < nv; c++) acc[h][c] = _mm512_fmadd_ps(pv, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < ng; h++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o[h] + d + 16 * c, acc[h][c]);
}

/* Query heads i0 .. i0+ng-1 (ng <= 4) over keys [t0, t1), their head dims 16 at a time, D a multiple of 16. */
ALWAYS_INLINE void pass2_group(const int ng, const int kt, const float *const *s, const float *inv, int64_t t0,
                               int64_t t1, const char *v, int64_t rb, const int64_t *sl, int64_t D,
                               float *const *o) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) pass2_heads(ng, 4, kt, s, inv, t0, t1, v, rb, sl, d, o);
    for (; d + 32 <= D; d += 32) pass2_heads(ng, 2, kt, s, inv, t0, t1, v, rb, sl, d, o);
    for (; d < D; d += 16) pass2_heads(ng, 1, kt, s, inv, t0, t1, v, rb, sl, d, o);
}
#endif

/* The same results as the portable loops but for the order of the score's sums (see score1), with
 * eight keys (pass 1) or eight head dims (pass 2) per instruction. D a multiple of 8. */
ALWAYS_INLINE void attend_item_avx2_t(const Item *it, const int kt) {
    const int64_t len = item_keys(it), k0 = item_first(it), lp = padded(len), D = it->D, rb = it->row_bytes;
    const int64_t bytes = D * kv_size(kt), width = lp - k0;
    const __m256 scale = _mm256_set1_ps(it->scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t first0 = first_key(it, it->j0);
    /* pass 1: each block of eight keys, read once into L1, scored against every query of this KV head */
    for (int64_t t0 = k0; t0 < lp; t0 += KB) {
        const char *k[KB];
        for (int u = 0; u < KB; u++) {
            const int64_t t = t0 + u < len ? t0 + u : len - 1;
            k[u] = it->k + it->sl[t < first0 ? first0 : t] * rb; /* keys outside every window: one it reads */
        }
        for (int64_t t = t0 + KB; t < t0 + 2 * KB && t < len; t++)
            prefetch_row(it->k + it->sl[t] * rb, bytes);
        const __m256 pos = _mm256_add_ps(_mm256_set1_ps((float)t0), lane);
        FOR_QUERIES(it, i, j) {
            const __m256 late = _mm256_cmp_ps(pos, _mm256_set1_ps((float)(it->len - it->q_len + j)), _CMP_GT_OQ);
            const __m256 early = _mm256_cmp_ps(pos, _mm256_set1_ps((float)first_key(it, j)), _CMP_LT_OQ);
            const __m256 sc = _mm256_mul_ps(score8(it->qb[i], k, D, kt), scale);
            _mm256_storeu_ps(it->work + i * width + (t0 - k0), _mm256_blendv_ps(sc, ninf, _mm256_or_ps(late, early)));
        }
    }
    float invs[(it->j1 - it->j0) * it->group];
    FOR_QUERIES(it, i, j) {
        float *s = it->work + i * width;
        __m256 mv = ninf;
        for (int64_t t0 = 0; t0 < width; t0 += KB) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t0));
        float mx[KB], lanes[KB];
        _mm256_storeu_ps(mx, mv);
        float m = mx[0];
        for (int u = 1; u < KB; u++) m = fmaxf(m, mx[u]);
        const __m256 mb = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < width; t0 += KB) {
            const __m256 x = _mm256_loadu_ps(s + t0);
            const __m256 e = _mm256_blendv_ps(exp8(_mm256_sub_ps(x, mb)), _mm256_setzero_ps(),
                                              _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
            _mm256_storeu_ps(s + t0, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(lanes, sum);
        invs[i] = 1.0f / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
        memset(it->ob[i], 0, (size_t)D * sizeof(float));
    }
    /* pass 2, VCHUNK keys at a time for all the queries */
    for (int64_t c0 = k0; c0 < len; c0 += VCHUNK) {
        const int64_t c1 = c0 + VCHUNK < len ? c0 + VCHUNK : len;
#ifdef __AVX512F__
        if (D % 16 == 0) { /* a position's heads together (they share their keys) */
            for (int64_t j = it->j0; j < it->j1; j++) {
                const int64_t last = it->len - it->q_len + j, t1 = c1 < last + 1 ? c1 : last + 1;
                const int64_t first = first_key(it, j), t0 = c0 > first ? c0 : first;
                if (t0 >= t1) continue;
                for (int64_t g = 0; g < it->group; g += 4) {
                    const int64_t i0 = (j - it->j0) * it->group + g;
                    const int ng = it->group - g >= 4 ? 4 : (int)(it->group - g);
                    const float *s[4];
                    for (int h = 0; h < ng; h++) s[h] = it->work + (i0 + h) * width - k0; /* indexed by key */
                    const float *inv = invs + i0;
                    float *const *o = it->ob + i0;
                    switch (ng) {
                    case 4: pass2_group(4, kt, s, inv, t0, t1, it->v, rb, it->sl, D, o); break;
                    case 3: pass2_group(3, kt, s, inv, t0, t1, it->v, rb, it->sl, D, o); break;
                    case 2: pass2_group(2, kt, s, inv, t0, t1, it->v, rb, it->sl, D, o); break;
                    default: pass2_group(1, kt, s, inv, t0, t1, it->v, rb, it->sl, D, o); break;
                    }
                }
            }
            continue;
        }
#endif
        FOR_QUERIES(it, i, j) {
            const int64_t last = it->len - it->q_len + j, t1 = c1 < last + 1 ? c1 : last + 1;
            const int64_t first = first_key(it, j), t0 = c0 > first ? c0 : first;
            if (t0 >= t1) continue;
            const float *s = it->work + i * width - k0; /* indexed by key */
            float *o = it->ob[i];
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) pass2(8, kt, s, invs[i], t0, t1, it->v, rb, it->sl, d, o);
            for (; d + 32 <= D; d += 32) pass2(4, kt, s, invs[i], t0, t1, it->v, rb, it->sl, d, o);
            for (; d < D; d += 8) pass2(1, kt, s, invs[i], t0, t1, it->v, rb, it->sl, d, o);
        }
    }
}
static void attend_item_avx2_f32(const Item *it) { attend_item_avx2_t(it, KV_F32); }
static void attend_item_avx2_f16(const Item *it) { attend_item_avx2_t(it, KV_F16); }
static void attend_item_avx2_bf16(const Item *it) { attend_item_avx2_t(it, KV_BF16); }
#endif

static void attend_item(const Item *it) {
#ifdef TANDEM_AVX2
    if (it->D % 8 == 0) {
        if (it->kt == KV_F16) attend_item_avx2_f16(it);
        else if (it->kt == KV_BF16) attend_item_avx2_bf16(it);
        else attend_item_avx2_f32(it);
        return;
    }
#endif
    attend_item_portable(it);
}

/* Every (request, KV head, block of up to query_block queries) item of the batch, spread over num_threads
 * threads of the OpenMP runtime torch itself runs on (the library names libgomp.so.1, which the loader
 * resolves to the copy torch already loaded), so the kernel and torch's ops share one pool of threads
 * instead of two pools fighting over the cores. work: num_threads * work_stride floats, work_stride >=
 * G * min(query_block, longest q_len) * padded(max(lens)). kv_type: the pools' element (KV_F32, KV_F16,
 * KV_BF16); slot_stride counts elements; window: keys a query sees (0: all before it). Returns 0, -1 if out of
 * memory, -2 for an unknown kv_type or a negative window. */
int tandem_paged_attention_win(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows, const int64_t *q_offsets,
    const void *k_pool, const void *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, int64_t query_block, float *work, int64_t work_stride, int64_t num_threads,
    int64_t kv_type, int64_t window) {
    if ((kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16) || window < 0) return -2;
    const int kt = (int)kv_type;
    const int64_t group = num_heads / num_kv_heads, esize = kv_size(kt);
    int64_t blocks = 0;
    for (int64_t b = 0; b < batch; b++) blocks += (q_offsets[b + 1] - q_offsets[b] + query_block - 1) / query_block;
    /* (request, first query) per block; a request's later blocks (more keys each) first, for balance */
    int64_t *blk = malloc((size_t)(2 * blocks + 1) * sizeof(int64_t));
    if (!blk) return -1;
    for (int64_t b = 0, n = 0; b < batch; b++) {
        const int64_t ql = q_offsets[b + 1] - q_offsets[b];
        for (int64_t j0 = (ql - 1) / query_block * query_block; j0 >= 0 && ql > 0; j0 -= query_block, n++) {
            blk[2 * n] = b;
            blk[2 * n + 1] = j0;
        }
    }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t w = 0; w < blocks * num_kv_heads; w++) {
        const int64_t b = blk[2 * (w / num_kv_heads)], j0 = blk[2 * (w / num_kv_heads) + 1], hk = w % num_kv_heads;
        const int64_t ql = q_offsets[b + 1] - q_offsets[b], j1 = j0 + query_block < ql ? j0 + query_block : ql;
        float *scratch = work + team_thread() * work_stride;
        const float *qb[(j1 - j0) * group];
        float *ob[(j1 - j0) * group];
        for (int64_t j = j0; j < j1; j++) {
            const int64_t e = q_offsets[b] + j, row = q_rows ? q_rows[e] : e;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = hk * group + g;
                qb[(j - j0) * group + g] = q + row * q_row_stride + h * q_head_stride;
                ob[(j - j0) * group + g] = out + (e * num_heads + h) * head_dim;
            }
        }
        const int64_t head_off = hk * head_dim * esize;
        const Item it = {
            qb, ob, (const char *)k_pool + head_off, (const char *)v_pool + head_off, slot_stride * esize, kt,
            slots + b * slots_stride, lens[b], ql, j0, j1, group, head_dim, window, scale, scratch,
        };
        attend_item(&it);
    }
    free(blk);
    return 0;
}

/* Every layer attending all keys before it, kept with its signature for callers that bind it by name. */
int tandem_paged_attention_kv(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows, const int64_t *q_offsets,
    const void *k_pool, const void *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, int64_t query_block, float *work, int64_t work_stride, int64_t num_threads,
    int64_t kv_type) {
    return tandem_paged_attention_win(q, q_row_stride, q_head_stride, q_rows, q_offsets, k_pool, v_pool,
                                      slot_stride, slots, slots_stride, lens, num_heads, num_kv_heads, head_dim,
                                      scale, out, batch, query_block, work, work_stride, num_threads, kv_type, 0);
}

/* The float32-pool entry, kept with its signature for callers that bind it by name. */
int tandem_paged_attention_f32(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows, const int64_t *q_offsets,
    const float *k_pool, const float *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, int64_t query_block, float *work, int64_t work_stride, int64_t num_threads) {
    return tandem_paged_attention_kv(q, q_row_stride, q_head_stride, q_rows, q_offsets, k_pool, v_pool,
                                     slot_stride, slots, slots_stride, lens, num_heads, num_kv_heads, head_dim,
                                     scale, out, batch, query_block, work, work_stride, num_threads, KV_F32);
}

/* Decodes only (one query per request, request b's query and output at row b), for a caller already inside a
 * parallel region (kernels/csrc/step_graph.c): thread t of nt attends items (request, KV head) t, t + nt, ...
 * of the batch, with scratch at work + t * work_stride. Each item's output is what
 * tandem_paged_attention_win gives it, whatever the split. Returns -2 for an unknown kv_type or a negative
 * window, else 0. */
int tandem_paged_decode_part(
    const float *q, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_pool, const void *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, float *work, int64_t work_stride, int64_t kv_type, int64_t window, int64_t t,
    int64_t nt) {
    if ((kv_type != KV_F32 && kv_type != KV_F16 && kv_type != KV_BF16) || window < 0) return -2;
    const int kt = (int)kv_type;
    const int64_t group = num_heads / num_kv_heads, esize = kv_size(kt);
    for (int64_t w = t; w < batch * num_kv_heads; w += nt) {
        const int64_t b = w / num_kv_heads, hk = w % num_kv_heads;
        const float *qb[group];
        float *ob[group];
        for (int64_t g = 0; g < group; g++) {
            qb[g] = q + b * q_row_stride + (hk * group + g) * q_head_stride;
            ob[g] = out + (b * num_heads + hk * group + g) * head_dim;
        }
        const int64_t head_off = hk * head_dim * esize;
        const Item it = {
            qb, ob, (const char *)k_pool + head_off, (const char *)v_pool + head_off, slot_stride * esize, kt,
            slots + b * slots_stride, lens[b], 1, 0, 1, group, head_dim, window, scale, work + t * work_stride,
        };
        attend_item(&it);
    }
    return 0;
}
