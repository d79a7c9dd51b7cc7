/* Paged attention on CPU, float32 queries and sums, reading K/V where it lies in the pool: decodes,
 * draft-verify rows, prefills and prefill chunks, all alike. The pools hold float32, float16, bfloat16 or
 * q8_0 blocks (--kv-cache-dtype, kv_types.h); an element is widened to float32 as it is loaded (a q8_0 one
 * times its block's scale), which is exact, so such a pool gives the very bits of a float32 pool holding the
 * same values, for half the bytes read (q8_0: 34 per 32 elements).
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
 * The AVX2 passes are written once for the pool types (an always-inlined function of a constant type) and
 * instantiated per type, so the type is no branch in their inner loops; the portable loops widen each row
 * they read into float32 first (see widen). Their per-row pieces are attention_rows.h. The eager K/V write (tandem_kv_store) is here too: it stores
 * rows as the step graph's KV_WRITE node does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "omp_team.h"

#include "attention_rows.h" /* the row loaders and SIMD passes (with kv_types.h and simd_exp.h) */

/* How many slots ahead to prefetch: a request's slots may be scattered over the pool. */
#define PREFETCH_AHEAD 4
/* Keys per block: a score row is padded to a multiple of KB (padding scores are -inf), and the softmax
 * sums go in KB lanes by key index, a fixed order, so the same keys give the same sum. */
#define KB 8

static inline int64_t padded(int64_t len) { return (len + KB - 1) / KB * KB; }

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
    const int64_t bytes = kv_row_bytes(kt, D);
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
/* Keys per pass-2 chunk: their values stay in L1 while every query of the item sums them. */
#define VCHUNK 32

/* Pass 2 over keys [c0, c1) for every query of the item: key t's value row at v + sl[t - off] * rb, of type
 * kt; invs: each query's 1 / sum; width: a score row's (scores indexed from item_first). */
ALWAYS_INLINE void pass2_chunk(const Item *it, const int kt, int64_t c0, int64_t c1, const char *v, int64_t rb,
                               const int64_t *sl, int64_t off, const float *invs, int64_t width) {
    const int64_t D = it->D, k0 = item_first(it) - off; /* with s and t shifted by off: sl[t] */
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
                for (int h = 0; h < ng; h++) s[h] = it->work + (i0 + h) * width - k0; /* indexed by key - off */
                const float *inv = invs + i0;
                float *const *o = it->ob + i0;
                switch (ng) {
                case 4: pass2_group(4, kt, s, inv, t0 - off, t1 - off, v, rb, sl, D, o); break;
                case 3: pass2_group(3, kt, s, inv, t0 - off, t1 - off, v, rb, sl, D, o); break;
                case 2: pass2_group(2, kt, s, inv, t0 - off, t1 - off, v, rb, sl, D, o); break;
                default: pass2_group(1, kt, s, inv, t0 - off, t1 - off, v, rb, sl, D, o); break;
                }
            }
        }
        return;
    }
#endif
    FOR_QUERIES(it, i, j) {
        const int64_t last = it->len - it->q_len + j, t1 = (c1 < last + 1 ? c1 : last + 1) - off;
        const int64_t first = first_key(it, j), t0 = (c0 > first ? c0 : first) - off;
        if (t0 >= t1) continue;
        const float *s = it->work + i * width - k0; /* indexed by key - off */
        float *o = it->ob[i];
        int64_t d = 0;
        for (; d + 64 <= D; d += 64) pass2(8, kt, s, invs[i], t0, t1, v, rb, sl, d, o);
        for (; d + 32 <= D; d += 32) pass2(4, kt, s, invs[i], t0, t1, v, rb, sl, d, o);
        for (; d < D; d += 8) pass2(1, kt, s, invs[i], t0, t1, v, rb, sl, d, o);
    }
}

/* The same results as the portable loops but for the order of the score's sums (see score1), with
 * eight keys (pass 1) or eight head dims (pass 2) per instruction. D a multiple of 8. */
ALWAYS_INLINE void attend_item_avx2_t(const Item *it, const int kt) {
    const int64_t len = item_keys(it), k0 = item_first(it), lp = padded(len), D = it->D, rb = it->row_bytes;
    const int64_t bytes = kv_row_bytes(kt, D), width = lp - k0;
    const __m256 scale = _mm256_set1_ps(it->scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t first0 = first_key(it, it->j0);
    /* q8_0 keys are dequantized once per block of eight into kbuf, and scored from there as float32 rows by
     * every query of the item (the same values: the dequantization is exact) */
    const int kt1 = kt == KV_Q8_0 ? KV_F32 : kt;
    float kbuf[kt == KV_Q8_0 ? KB * D : 1];
    /* pass 1: each block of eight keys, read once into L1, scored against every query of this KV head */
    for (int64_t t0 = k0; t0 < lp; t0 += KB) {
        const char *k[KB];
        for (int u = 0; u < KB; u++) {
            const int64_t t = t0 + u < len ? t0 + u : len - 1;
            k[u] = it->k + it->sl[t < first0 ? first0 : t] * rb; /* keys outside every window: one it reads */
            if (kt == KV_Q8_0) {
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kbuf + u * D + d, load8(k[u], d, kt));
                k[u] = (const char *)(kbuf + u * D);
            }
        }
        for (int64_t t = t0 + KB; t < t0 + 2 * KB && t < len; t++)
            prefetch_row(it->k + it->sl[t] * rb, bytes);
        const __m256 pos = _mm256_add_ps(_mm256_set1_ps((float)t0), lane);
        FOR_QUERIES(it, i, j) {
            const __m256 late = _mm256_cmp_ps(pos, _mm256_set1_ps((float)(it->len - it->q_len + j)), _CMP_GT_OQ);
            const __m256 early = _mm256_cmp_ps(pos, _mm256_set1_ps((float)first_key(it, j)), _CMP_LT_OQ);
            const __m256 sc = _mm256_mul_ps(score8(it->qb[i], k, D, kt1), scale);
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
    /* pass 2, VCHUNK keys at a time for all the queries; an item of several queries reads each chunk's q8_0
     * values dequantized once into vbuf (a decode's heads share one load already) */
    float vbuf[kt == KV_Q8_0 ? VCHUNK * D : 1];
    int64_t rel[VCHUNK];
    for (int64_t r = 0; r < VCHUNK; r++) rel[r] = r;
    const int buffer_v = kt == KV_Q8_0 && it->j1 - it->j0 > 1;
    for (int64_t c0 = k0; c0 < len; c0 += VCHUNK) {
        const int64_t c1 = c0 + VCHUNK < len ? c0 + VCHUNK : len;
        if (buffer_v) {
            for (int64_t t = c0 > first0 ? c0 : first0; t < c1; t++) /* keys some query of the item sees */
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(vbuf + (t - c0) * D + d, load8(it->v + it->sl[t] * rb, d, kt));
            pass2_chunk(it, KV_F32, c0, c1, (const char *)vbuf, D * (int64_t)sizeof(float), rel, c0, invs,
                        width);
        } else {
            pass2_chunk(it, kt, c0, c1, it->v, rb, it->sl, 0, invs, width);
        }
    }
}
static void attend_item_avx2_f32(const Item *it) { attend_item_avx2_t(it, KV_F32); }
static void attend_item_avx2_f16(const Item *it) { attend_item_avx2_t(it, KV_F16); }
static void attend_item_avx2_bf16(const Item *it) { attend_item_avx2_t(it, KV_BF16); }
static void attend_item_avx2_q8_0(const Item *it) { attend_item_avx2_t(it, KV_Q8_0); }
#endif

static void attend_item(const Item *it) {
#ifdef TANDEM_AVX2
    if (it->D % 8 == 0) {
        if (it->kt == KV_F16) attend_item_avx2_f16(it);
        else if (it->kt == KV_BF16) attend_item_avx2_bf16(it);
        else if (it->kt == KV_Q8_0) attend_item_avx2_q8_0(it);
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
 * KV_BF16, KV_Q8_0: kv_types.h); slot_stride counts the pool tensor's elements (bytes for q8_0); window: keys
 * a query sees (0: all before it). Returns 0, -1 if out of memory, -2 for an unknown kv_type, a q8_0 head
 * size not a multiple of 32 or a negative window. */
int tandem_paged_attention_win(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows, const int64_t *q_offsets,
    const void *k_pool, const void *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, int64_t query_block, float *work, int64_t work_stride, int64_t num_threads,
    int64_t kv_type, int64_t window) {
    if (!kv_type_known(kv_type) || window < 0 || (kv_type == KV_Q8_0 && head_dim % Q8_0_QK)) return -2;
    const int kt = (int)kv_type;
    const int64_t group = num_heads / num_kv_heads, esize = kv_elem_size(kt);
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
        const int64_t head_off = hk * kv_row_bytes(kt, head_dim);
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
 * tandem_paged_attention_win gives it, whatever the split. Returns -2 where tandem_paged_attention_win
 * does, else 0. */
int tandem_paged_decode_part(
    const float *q, int64_t q_row_stride, int64_t q_head_stride,
    const void *k_pool, const void *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, float *work, int64_t work_stride, int64_t kv_type, int64_t window, int64_t t,
    int64_t nt) {
    if (!kv_type_known(kv_type) || window < 0 || (kv_type == KV_Q8_0 && head_dim % Q8_0_QK)) return -2;
    const int kt = (int)kv_type;
    const int64_t group = num_heads / num_kv_heads, esize = kv_elem_size(kt);
    for (int64_t w = t; w < batch * num_kv_heads; w += nt) {
        const int64_t b = w / num_kv_heads, hk = w % num_kv_heads;
        const float *qb[group];
        float *ob[group];
        for (int64_t g = 0; g < group; g++) {
            qb[g] = q + b * q_row_stride + (hk * group + g) * q_head_stride;
            ob[g] = out + (b * num_heads + hk * group + g) * head_dim;
        }
        const int64_t head_off = hk * kv_row_bytes(kt, head_dim);
        const Item it = {
            qb, ob, (const char *)k_pool + head_off, (const char *)v_pool + head_off, slot_stride * esize, kt,
            slots + b * slots_stride, lens[b], 1, 0, 1, group, head_dim, window, scale, work + t * work_stride,
        };
        attend_item(&it);
    }
    return 0;
}

/* The eager K/V write: row r of src (width float32 elements, a slot's heads back to back; rows ld apart) into
 * slot slots[r] of a pool of kv_type, rounded or quantized as the step graph's KV_WRITE node stores it (the
 * same code, kv_types.h). Returns -2 for an unknown kv_type or a q8_0 width not a multiple of 32, else 0. */
int tandem_kv_store(const float *src, int64_t ld, int64_t rows, int64_t width, void *pool, const int64_t *slots,
                    int64_t kv_type, int64_t num_threads) {
    if (!kv_type_known(kv_type) || (kv_type == KV_Q8_0 && width % Q8_0_QK)) return -2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) kv_store_row(pool, slots[r], src + r * ld, width, (int)kv_type);
    return 0;
}
