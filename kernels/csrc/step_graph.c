/* A recorded CPU decode step, replayed with one call from Python.
 *
 * At batch 1 a small model's decode step on CPU is mostly dispatch: some eleven ops in each layer, each a
 * Python call with its checks, cost several times what the weights take to stream. worker/cpu_step_graph.py
 * records the step once as a flat list of nodes (kind + arguments bound: pointers into persistent input
 * buffers, the KV pools, the weights and scratch) and `tandem_step_graph_run` walks the list. Inputs change
 * by writing the persistent buffers; the row count is an argument of the run, so one recording serves every
 * decode batch up to the size it was recorded for, with no padding rows.
 *
 * Every node calls the very kernel the eager path calls (their entry points are passed in as function
 * pointers: kernels/csrc/quant_linear.c, norm_act.c, rotary.c, paged_attention.c) with the arguments the
 * eager path would give it, or copies bytes (embedding rows, K/V into the pool), so a replay gives the eager
 * forward's bits. All nodes share one calling shape: node(args, rows, threads).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NODE_ARGS 24

enum {
    EMBED = 0,     /* table, hidden, ids, out, ld_out, scale bits|0 (Gemma: rows times sqrt(hidden)) */
    NORM = 1,      /* fn, x, ldx, delta|0, ldd, w, n, eps bits, out, ldo */
    HEAD_NORM = 2, /* fn, x, ld_token, heads, w, D, eps bits, out, ld_out_token: heads of each token as rows */
    QLINEAR = 3,   /* fn, x, K, ldx, w, kind, N, y, ldy, bias|0, min_macs */
    ROTARY = 4,    /* fn, x, ldx, ldh, cos table, sin table, D, H, positions, out */
    KV_WRITE = 5,  /* k, ldk, v, ldv, k pool, v pool, elements per slot, slots, pool type */
    ATTENTION = 6, /* fn, q, ldq, ldqh, k pool, v pool, slot stride, req_to_token, ld_rtt, rows, lens, slot buf,
                      H, Hkv, D, scale bits, out, work, offsets, min_keys, pool type, window, slot map|0 */
    SILU_MUL = 7,  /* fn, gate_up, ldg, n, out, ldo */
    MOE = 8,       /* fn, x, H, ldx, router, E, k, renorm, ids, wts, w13, kind13, N13, w2, kind2, I, y, ldy */
    GELU_MUL = 9,  /* as SILU_MUL, GELU (tanh form) */
};

typedef void (*norm_fn)(float *, int64_t, const float *, int64_t, const float *, int64_t, int64_t, float, float *,
                        int64_t, int64_t);
typedef void (*qlinear_fn)(const float *, int64_t, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *,
                           int64_t, int64_t);
typedef void (*rotary_fn)(const float *, int64_t, int64_t, const float *, int64_t, const float *, int64_t, int64_t,
                          int64_t, int64_t, float *, int64_t);
typedef int (*attention_fn)(const float *, int64_t, int64_t, const int64_t *, const int64_t *, const void *,
                            const void *, int64_t, const int64_t *, int64_t, const int64_t *, int64_t, int64_t,
                            int64_t, float, float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t,
                            int64_t);

/* The KV pools' element (kernels/native/paged_attention.py's KV_TYPES). */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
typedef void (*act_fn)(const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t);
typedef int64_t (*moe_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, int64_t,
                          int64_t *, float *, const void *, int64_t, int64_t, const void *, int64_t, int64_t, float *,
                          int64_t, int64_t);

#define P(i, T) ((T)(intptr_t)a[i])

static inline float as_float(int64_t bits) {
    const uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void embed(const int64_t *a, int64_t rows) {
    const float *table = P(0, const float *);
    const int64_t hidden = a[1], *ids = P(2, const int64_t *), ld = a[4];
    float *out = P(3, float *);
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * ld, table + ids[r] * hidden, (size_t)hidden * sizeof(float));
    if (a[5]) { /* the product torch's mul_ by a float32 scalar computes */
        const float scale = as_float(a[5]);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hidden; i++) out[r * ld + i] *= scale;
    }
}

static void norm(const int64_t *a, int64_t rows, int64_t threads) {
    P(0, norm_fn)(P(1, float *), a[2], P(3, const float *), a[4], P(5, const float *), rows, a[6], as_float(a[7]),
                  P(8, float *), a[9], threads);
}

static void head_norm(const int64_t *a, int64_t rows, int64_t threads) {
    for (int64_t t = 0; t < rows; t++)
        P(0, norm_fn)(P(1, float *) + t * a[2], a[5], NULL, 0, P(4, const float *), a[3], a[5], as_float(a[6]),
                      P(7, float *) + t * a[8], a[5], threads);
}

static void qlinear(const int64_t *a, int64_t rows, int64_t threads) {
    const int64_t K = a[2], N = a[6], ldy = a[8];
    float *y = P(7, float *);
    const int64_t n = rows * N * K < a[10] ? 1 : threads; /* as kernels/native/quant_linear.py picks */
    P(0, qlinear_fn)(P(1, const float *), rows, K, a[3], P(4, const uint8_t *), a[5], N, y, ldy, n);
    const float *bias = P(9, const float *);
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < N; c++) y[r * ldy + c] += bias[c];
}

static void rotary(const int64_t *a, int64_t rows, int64_t threads) {
    const int64_t D = a[6], H = a[7], *pos = P(8, const int64_t *);
    for (int64_t t = 0; t < rows; t++)
        P(0, rotary_fn)(P(1, const float *) + t * a[2], a[2], a[3], P(4, const float *) + pos[t] * D, D,
                        P(5, const float *) + pos[t] * D, D, 1, H, D, P(9, float *) + t * H * D, threads);
}

/* float32 -> float16, rounded to nearest even as torch's .to(float16) rounds (NaN: its quiet NaN). */
static uint16_t to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and up round to inf */
    const int32_t e = (int32_t)(ax >> 23) - 127;
    uint32_t q, r, half;
    if (e >= -14) { /* a normal half: drop 13 mantissa bits (a carry may step the exponent, as it should) */
        q = ((uint32_t)(e + 15) << 10) | ((ax >> 13) & 0x3ff);
        r = ax & 0x1fff;
        half = 0x1000;
    } else { /* a subnormal half: the value in units of 2^-24 */
        const uint32_t m = (ax >> 23) ? (ax & 0x7fffff) | 0x800000 : 0;
        const int32_t s = -(e + 1); /* >= 14 */
        if (s > 25) return (uint16_t)sign;
        q = m >> s;
        r = m & ((1u << s) - 1);
        half = 1u << (s - 1);
    }
    if (r > half || (r == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

/* float32 -> bfloat16, rounded to nearest even as torch's vectorized .to(bfloat16) rounds (NaN: 0xffff). */
static uint16_t to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffff) > 0x7f800000) return 0xffff;
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static void store_row(void *pool, int64_t slot, const float *src, int64_t n, int64_t type) {
    if (type == KV_F32) {
        memcpy((float *)pool + slot * n, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *dst = (uint16_t *)pool + slot * n;
    for (int64_t i = 0; i < n; i++) dst[i] = type == KV_F16 ? to_f16(src[i]) : to_bf16(src[i]);
}

static void kv_write(const int64_t *a, int64_t rows) {
    const float *k = P(0, const float *), *v = P(2, const float *);
    const int64_t width = a[6], *slots = P(7, const int64_t *), type = a[8];
    for (int64_t t = 0; t < rows; t++) {
        store_row(P(4, void *), slots[t], k + t * a[1], width, type);
        store_row(P(5, void *), slots[t], v + t * a[3], width, type);
    }
}

/* Decodes only: one query per request. The work split is what kernels/native/paged_attention.py's
 * _prepare works out for the same lengths (the output does not depend on it). A sliding-window layer
 * (window > 0) reads its last `window` keys, through the slot map of its own pool when it has one. */
static int attention(const int64_t *a, int64_t rows, int64_t threads) {
    const int64_t *rtt = P(7, const int64_t *), ld_rtt = a[8], *req_rows = P(9, const int64_t *);
    const int64_t *lens = P(10, const int64_t *), H = a[12], Hkv = a[13], min_keys = a[19], window = a[21];
    const int64_t *slot_map = P(22, const int64_t *);
    int64_t *slot_buf = P(11, int64_t *), *offsets = P(18, int64_t *);
    int64_t longest = 0, pairs = 0;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t first = window && lens[b] > window ? lens[b] - window : 0;
        const int64_t *src = rtt + req_rows[b] * ld_rtt;
        int64_t *dst = slot_buf + b * ld_rtt;
        if (slot_map)
            for (int64_t t = first; t < lens[b]; t++) dst[t] = slot_map[src[t]];
        else
            memcpy(dst + first, src + first, (size_t)(lens[b] - first) * sizeof(int64_t));
        offsets[b] = b;
        longest = lens[b] > longest ? lens[b] : longest;
        pairs += lens[b];
    }
    offsets[rows] = rows;
    const int64_t padded = (longest + 7) / 8 * 8, items = rows * Hkv;
    int64_t n = threads < items ? threads : items;
    if (pairs * Hkv / min_keys < n) n = pairs * Hkv / min_keys;
    if (n < 1) n = 1;
    return P(0, attention_fn)(P(1, const float *), a[2], a[3], NULL, offsets, P(4, const void *),
                              P(5, const void *), a[6], slot_buf, ld_rtt, lens, H, Hkv, a[14], as_float(a[15]),
                              P(16, float *), rows, 1, P(17, float *), (H / Hkv) * padded, n, a[20], window);
}

static void act_mul(const int64_t *a, int64_t rows, int64_t threads) {
    P(0, act_fn)(P(1, const float *), a[2], rows, a[3], P(4, float *), a[5], threads);
}

/* A whole MoE layer (kernels/csrc/moe.c): router, top-k, the routed experts; nonzero if its scratch failed. */
static int64_t moe(const int64_t *a, int64_t rows, int64_t threads) {
    return P(0, moe_fn)(P(1, const float *), rows, a[2], a[3], P(4, const float *), a[5], a[6], a[7], P(8, int64_t *),
                        P(9, float *), P(10, const void *), a[11], a[12], P(13, const void *), a[14], a[15],
                        P(16, float *), a[17], threads);
}

/* Runs nodes [n_nodes][NODE_ARGS + 1] (kind, then its arguments) over `rows` decode rows. Returns 0, or the
 * index + 1 of a node that failed (the attention kernel's allocation). */
int64_t tandem_step_graph_run(const int64_t *nodes, int64_t n_nodes, int64_t rows, int64_t threads) {
    for (int64_t i = 0; i < n_nodes; i++) {
        const int64_t *node = nodes + i * (NODE_ARGS + 1), *a = node + 1;
        switch (node[0]) {
        case EMBED: embed(a, rows); break;
        case NORM: norm(a, rows, threads); break;
        case HEAD_NORM: head_norm(a, rows, threads); break;
        case QLINEAR: qlinear(a, rows, threads); break;
        case ROTARY: rotary(a, rows, threads); break;
        case KV_WRITE: kv_write(a, rows); break;
        case ATTENTION:
            if (attention(a, rows, threads)) return i + 1;
            break;
        case SILU_MUL:
        case GELU_MUL: act_mul(a, rows, threads); break; /* fn: the activation's entry */
        case MOE:
            if (moe(a, rows, threads)) return i + 1;
            break;
        default: return i + 1;
        }
    }
    return 0;
}
