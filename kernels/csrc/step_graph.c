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
    EMBED = 0,     /* table, hidden, ids, out, ld_out */
    NORM = 1,      /* fn, x, ldx, delta|0, ldd, w, n, eps bits, out, ldo */
    HEAD_NORM = 2, /* fn, x, ld_token, heads, w, D, eps bits, out, ld_out_token: heads of each token as rows */
    QLINEAR = 3,   /* fn, x, K, ldx, w, kind, N, y, ldy, bias|0, min_macs */
    ROTARY = 4,    /* fn, x, ldx, ldh, cos table, sin table, D, H, positions, out */
    KV_WRITE = 5,  /* k, ldk, v, ldv, k pool, v pool, floats per slot, slots */
    ATTENTION = 6, /* fn, q, ldq, ldqh, k pool, v pool, slot stride, req_to_token, ld_rtt, rows, lens, slot buf,
                      H, Hkv, D, scale bits, out, work, offsets, min_keys */
    SILU_MUL = 7,  /* fn, gate_up, ldg, n, out, ldo */
};

typedef void (*norm_fn)(float *, int64_t, const float *, int64_t, const float *, int64_t, int64_t, float, float *,
                        int64_t, int64_t);
typedef void (*qlinear_fn)(const float *, int64_t, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *,
                           int64_t, int64_t);
typedef void (*rotary_fn)(const float *, int64_t, int64_t, const float *, int64_t, const float *, int64_t, int64_t,
                          int64_t, int64_t, float *, int64_t);
typedef int (*attention_fn)(const float *, int64_t, int64_t, const int64_t *, const int64_t *, const float *,
                            const float *, int64_t, const int64_t *, int64_t, const int64_t *, int64_t, int64_t,
                            int64_t, float, float *, int64_t, int64_t, float *, int64_t, int64_t);
typedef void (*silu_fn)(const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t);

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

static void kv_write(const int64_t *a, int64_t rows) {
    const float *k = P(0, const float *), *v = P(2, const float *);
    float *kp = P(4, float *), *vp = P(5, float *);
    const int64_t width = a[6], *slots = P(7, const int64_t *);
    for (int64_t t = 0; t < rows; t++) {
        memcpy(kp + slots[t] * width, k + t * a[1], (size_t)width * sizeof(float));
        memcpy(vp + slots[t] * width, v + t * a[3], (size_t)width * sizeof(float));
    }
}

/* Decodes only: one query per request. The work split is what kernels/native/paged_attention.py's
 * _prepare works out for the same lengths (the output does not depend on it). */
static int attention(const int64_t *a, int64_t rows, int64_t threads) {
    const int64_t *rtt = P(7, const int64_t *), ld_rtt = a[8], *req_rows = P(9, const int64_t *);
    const int64_t *lens = P(10, const int64_t *), H = a[12], Hkv = a[13], min_keys = a[19];
    int64_t *slot_buf = P(11, int64_t *), *offsets = P(18, int64_t *);
    int64_t longest = 0, pairs = 0;
    for (int64_t b = 0; b < rows; b++) {
        memcpy(slot_buf + b * ld_rtt, rtt + req_rows[b] * ld_rtt, (size_t)lens[b] * sizeof(int64_t));
        offsets[b] = b;
        longest = lens[b] > longest ? lens[b] : longest;
        pairs += lens[b];
    }
    offsets[rows] = rows;
    const int64_t padded = (longest + 7) / 8 * 8, items = rows * Hkv;
    int64_t n = threads < items ? threads : items;
    if (pairs * Hkv / min_keys < n) n = pairs * Hkv / min_keys;
    if (n < 1) n = 1;
    return P(0, attention_fn)(P(1, const float *), a[2], a[3], NULL, offsets, P(4, const float *),
                              P(5, const float *), a[6], slot_buf, ld_rtt, lens, H, Hkv, a[14], as_float(a[15]),
                              P(16, float *), rows, 1, P(17, float *), (H / Hkv) * padded, n);
}

static void silu_mul(const int64_t *a, int64_t rows, int64_t threads) {
    P(0, silu_fn)(P(1, const float *), a[2], rows, a[3], P(4, float *), a[5], threads);
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
        case SILU_MUL: silu_mul(a, rows, threads); break;
        default: return i + 1;
        }
    }
    return 0;
}
