/* Paged attention for decode and draft-verify rows on CPU, float32, reading K/V where it lies in the pool.
 *
 * Built and loaded by kernels/cpu_paged_decode.py (ctypes; no torch headers, so it compiles in about a
 * second). The plain-torch reference is kernels/paged_attention.py; the tests compare the two.
 *
 * A call attends requests [b0, b1) of a group: request b has q_len queries (rows q_rows[b*q_len + j] of q,
 * or b*q_len + j when q_rows is NULL) over the keys in pool slots slots[b*slots_stride + 0 .. lens[b]-1];
 * query j sits at position lens[b] - q_len + j and sees keys up to it (causal). Each pool row (all KV
 * heads of one slot) is read once per pass for all H * q_len queries: pass 1 scores every key, then a
 * softmax per query, pass 2 sums the weighted values. A query's result depends only on its own keys,
 * not on the rest of the batch or on padding.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* How many slots ahead to prefetch: a request's slots may be scattered over the pool. */
#define PREFETCH_AHEAD 4
/* Softmax sums go in KB lanes by key index: a fixed order, so the same keys give the same sum. */
#define KB 8

/* 16 independent lanes: the compiler turns this into SIMD FMAs without reassociating a reduction, and a
 * score is the same whichever other queries run beside it. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int u = 0; u < 16; u++) acc[u] += a[d + u] * b[d + u];
    float s = 0.0f;
    for (; d < n; d++) s += a[d] * b[d];
    for (int u = 0; u < 16; u++) s += acc[u];
    return s;
}

/* exp(x) for x <= 0 (scores minus their max), within ~2 ulp; plain arithmetic so the loop vectorizes
 * (libm's expf is a scalar call per element here). exp(x) = 2^n * exp(r), r = x - n ln2, |r| <= ln2/2. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) ~ 1.6e-38: the smallest normal float's neighbourhood */
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f; /* ln2 in two parts (Cody-Waite) */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n as a float's exponent field */
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t off = 0; off < floats; off += 16) __builtin_prefetch(row + off);
}

/* Request b's queries; work: H * q_len * lens[b] floats of scratch. */
static void attend_request(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows,
    const float *k_pool, const float *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t q_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t b, float *work) {
    const int64_t group = num_heads / num_kv_heads, D = head_dim, row_floats = num_kv_heads * D;
    const int64_t nq = num_heads * q_len; /* query i = j * num_heads + h: query j, head h */
    const int64_t len = lens[b];
    const int64_t *sl = slots + b * slots_stride;
    const float *qb[nq];
    for (int64_t j = 0; j < q_len; j++) {
        const int64_t row = q_rows ? q_rows[b * q_len + j] : b * q_len + j;
        for (int64_t h = 0; h < num_heads; h++) qb[j * num_heads + h] = q + row * q_row_stride + h * q_head_stride;
    }
    /* pass 1: work[i * len + t] = scaled score of query i against key t (-inf past its position) */
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_AHEAD < len) prefetch_row(k_pool + sl[t + PREFETCH_AHEAD] * slot_stride, row_floats);
        const float *kt = k_pool + sl[t] * slot_stride;
        for (int64_t j = 0; j < q_len; j++) {
            const int visible = t <= len - q_len + j;
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t i = j * num_heads + h;
                work[i * len + t] = visible ? dot(qb[i], kt + (h / group) * D, D) * scale : -INFINITY;
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        float *s = work + i * len;
        float m = -INFINITY, lanes[KB] = {0};
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) m = fmaxf(m, s[t]);
        /* Lane t % KB: the same keys give the same sum whatever the padding or later keys. Masked
         * (-inf) scores weigh exactly 0. */
        int64_t t0 = 0;
        for (; t0 + KB <= len; t0 += KB) /* whole blocks: a fixed trip count, so one SIMD step */
#pragma omp simd
            for (int64_t u = 0; u < KB; u++) {
                const float x = s[t0 + u];
                const float e = exp_nonpositive(x - m);
                s[t0 + u] = x == -INFINITY ? 0.0f : e;
                lanes[u] += s[t0 + u];
            }
        for (int64_t u = 0; t0 + u < len; u++) {
            const float x = s[t0 + u];
            const float e = exp_nonpositive(x - m);
            s[t0 + u] = x == -INFINITY ? 0.0f : e;
            lanes[u] += s[t0 + u];
        }
        float sum = 0.0f;
        for (int64_t u = 0; u < KB; u++) sum += lanes[u];
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    float *ob = out + b * q_len * num_heads * D; /* this request's rows, [q_len, H, D] */
    memset(ob, 0, (size_t)(nq * D) * sizeof(float));
    /* pass 2: out[i] = sum_t p[i, t] * v[t] */
    for (int64_t t = 0; t < len; t++) {
        if (t + PREFETCH_AHEAD < len) prefetch_row(v_pool + sl[t + PREFETCH_AHEAD] * slot_stride, row_floats);
        const float *vt = v_pool + sl[t] * slot_stride;
        for (int64_t i = 0; i < nq; i++) {
            const float p = work[i * len + t];
            if (p == 0.0f) continue; /* a later query's key, or a weight that underflowed */
            const float *vh = vt + ((i % num_heads) / group) * D;
            float *o = ob + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += p * vh[d];
        }
    }
}

/* Requests 0 .. batch-1, spread over num_threads threads of the OpenMP runtime torch itself runs on (the
 * library names libgomp.so.1, which the loader resolves to the copy torch already loaded), so the kernel
 * and torch's ops share one pool of threads instead of two pools fighting over the cores.
 * work: num_threads * work_stride floats, work_stride >= H * q_len * max(lens). */
void tandem_paged_decode_f32(
    const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows,
    const float *k_pool, const float *v_pool, int64_t slot_stride,
    const int64_t *slots, int64_t slots_stride, const int64_t *lens,
    int64_t q_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    float *out, int64_t batch, float *work, int64_t work_stride, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; b++) {
#ifdef _OPENMP
        float *w = work + omp_get_thread_num() * work_stride;
#else
        float *w = work;
#endif
        attend_request(q, q_row_stride, q_head_stride, q_rows, k_pool, v_pool, slot_stride, slots, slots_stride,
                       lens, q_len, num_heads, num_kv_heads, head_dim, scale, out, b, w);
    }
}
