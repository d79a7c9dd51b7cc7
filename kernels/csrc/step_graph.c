/* A recorded CPU decode step, replayed with one call from Python.
 *
 * At batch 1 a small model's decode step on CPU is mostly dispatch: some eleven ops in each layer, each a
 * Python call with its checks, cost several times what the weights take to stream. worker/cpu_step_graph.py
 * records the step once as a flat list of nodes (kind + arguments bound: pointers into persistent input
 * buffers, the KV pools, the weights and scratch) and `tandem_step_graph_run` walks the list. Inputs change
 * by writing the persistent buffers; the row count is an argument of the run, so one recording serves every
 * decode batch up to the size it was recorded for, with no padding rows.
 *
 * The walk is one OpenMP parallel region for the whole step (llama.cpp's graph compute does the same with
 * its own pool): every thread walks the list, each node's work is split by the kernel's `_part` entry
 * (thread t of n takes its share), and a barrier separates a node from the next, instead of every kernel
 * opening and closing a region of its own (the eager path's calls). A node that wants fewer threads (a
 * one-row norm) leaves the rest idle until the barrier. Barriers are only ever here, executed by every
 * thread of the team, never inside a part. An MoE layer (kernels/csrc/moe.c, whose routing syncs threads
 * inside it) runs between regions as its eager call.
 *
 * Each node gives the bits the eager path's call gives: the parts are those kernels' own code over a share
 * of the rows, panels or (request, KV head) items, and no output depends on how the work was split
 * (kernels/csrc/quant_linear.c, norm_act.c, rotary.c, paged_attention.c say why). All nodes share one
 * calling shape: node(args, rows, t, nt).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_types.h"
#include "omp_team.h"

#define NODE_ARGS 24

enum {
    EMBED = 0,     /* table, hidden, ids, out, ld_out, scale bits|0 (Gemma: rows times sqrt(hidden)) */
    NORM = 1,      /* part, x, ldx, delta|0, ldd, w, n, eps bits, out, ldo */
    HEAD_NORM = 2, /* part, x, ld_token, heads, w, D, eps bits, out, ld_out_token: heads of each token as rows */
    QLINEAR = 3,   /* part, x, K, ldx, w, kind, N, y, ldy, bias|0, min_macs, quantize part|0, q8 part, q8 buffer
                      (int8 activations when the quantize part is given) */
    ROTARY = 4,    /* part, x, ldx, ldh, cos table, sin table, D, H, positions, out */
    KV_WRITE = 5,  /* k, ldk, v, ldv, k pool, v pool, elements per slot, slots, pool type */
    ATTENTION = 6, /* part, q, ldq, ldqh, k pool, v pool, slot stride, req_to_token, ld_rtt, rows, lens, slot buf,
                      H, Hkv, D, scale bits, out, work, work stride, min_keys, pool type, window, slot map|0 */
    SILU_MUL = 7,  /* part, gate_up, ldg, n, out, ldo */
    MOE = 8,       /* fn, x, H, ldx, router, E, k, renorm, ids, wts, w13, kind13, N13, w2, kind2, I, y, ldy */
    GELU_MUL = 9,  /* as SILU_MUL, GELU (tanh form) */
    ARGMAX = 10,   /* part, logits, ld, vocab, out (int64): greedy sampling's tokens (argmax.c) */
    ADD = 11,      /* x, ldx, delta, ldd, n: x += delta (a residual add no norm takes in; torch's add_ bits) */
    LORA = 12,     /* part, y, ldy, x, ldx, slots (int64, -1: none), a, b, r, k, n, cols, parts, ranks, tmp,
                      phase: each row's adapter's delta added to a linear layer's [rows, n] output from its
                      [rows, k] input, in two nodes (phase 0 fills tmp, phase 1 reads it: lora.c) */
};

/* Elementwise nodes under this many elements run on one thread (norm_act.c's and rotary.c's rule). */
#define PARALLEL_MIN_ELEMS (1 << 15)

typedef void (*norm_part)(float *, int64_t, const float *, int64_t, const float *, int64_t, int64_t, float, float *,
                          int64_t, int64_t, int64_t);
typedef void (*qlinear_part)(const float *, int64_t, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *,
                             int64_t, int64_t, int64_t);
typedef void (*quantize_part)(const float *, int64_t, int64_t, int64_t, int8_t *, int64_t, int64_t);
typedef void (*q8_part)(int8_t *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, float *, int64_t, int64_t,
                        int64_t);
typedef void (*rotary_part)(const float *, int64_t, int64_t, const float *, const float *, int64_t, int64_t,
                            const int64_t *, int64_t, float *, int64_t, int64_t);
typedef int (*attention_part)(const float *, int64_t, int64_t, const void *, const void *, int64_t, const int64_t *,
                              int64_t, const int64_t *, int64_t, int64_t, int64_t, float, float *, int64_t, float *,
                              int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*act_part)(const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t, int64_t);
typedef void (*argmax_part)(const float *, int64_t, int64_t, int64_t, int64_t *, int64_t, int64_t);
typedef void (*lora_part)(float *, int64_t, const float *, int64_t, int64_t, const int64_t *, const float *,
                          const float *, int64_t, int64_t, int64_t, const int64_t *, int64_t, const int64_t *,
                          float *, int64_t, int64_t, int64_t);
typedef int64_t (*moe_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, int64_t,
                          int64_t *, float *, const void *, int64_t, int64_t, const void *, int64_t, int64_t, float *,
                          int64_t, int64_t);

#define P(i, T) ((T)(intptr_t)a[i])
#define BARRIER _Pragma("omp barrier")

static inline float as_float(int64_t bits) {
    const uint32_t u = (uint32_t)bits;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline int64_t lo(int64_t n, int64_t t, int64_t nt) { return n * t / nt; }

static void embed(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const float *table = P(0, const float *);
    const int64_t hidden = a[1], *ids = P(2, const int64_t *), ld = a[4];
    float *out = P(3, float *);
    for (int64_t r = lo(rows, t, nt); r < lo(rows, t + 1, nt); r++) {
        memcpy(out + r * ld, table + ids[r] * hidden, (size_t)hidden * sizeof(float));
        if (a[5]) { /* the product torch's mul_ by a float32 scalar computes */
            const float scale = as_float(a[5]);
            for (int64_t i = 0; i < hidden; i++) out[r * ld + i] *= scale;
        }
    }
}

/* The threads an elementwise node of `elems` elements takes of the team's nt. */
static inline int64_t elementwise(int64_t elems, int64_t nt) { return elems < PARALLEL_MIN_ELEMS ? 1 : nt; }

static void norm(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t n = elementwise(rows * a[6], nt);
    if (t < n)
        P(0, norm_part)(P(1, float *), a[2], P(3, const float *), a[4], P(5, const float *), rows, a[6],
                        as_float(a[7]), P(8, float *), a[9], t, n);
}

static void head_norm(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    for (int64_t r = lo(rows, t, nt); r < lo(rows, t + 1, nt); r++)
        P(0, norm_part)(P(1, float *) + r * a[2], a[5], NULL, 0, P(4, const float *), a[3], a[5], as_float(a[6]),
                        P(7, float *) + r * a[8], a[5], 0, 1);
}

/* Barriers inside: every thread of the team calls it. */
static void qlinear(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t K = a[2], N = a[6], ldy = a[8];
    float *y = P(7, float *);
    const int64_t n = rows * N * K < a[10] ? 1 : nt; /* as kernels/native/quant_linear.py picks */
    if (a[11]) { /* int8 activations: x quantized (each thread its rows), then the product from them */
        int8_t *buf = P(13, int8_t *);
        if (t < n) P(11, quantize_part)(P(1, const float *), rows, K, a[3], buf, t, n);
        BARRIER
        if (t < n) P(12, q8_part)(buf, rows, K, P(4, const uint8_t *), a[5], N, y, ldy, t, n);
    } else if (t < n) {
        P(0, qlinear_part)(P(1, const float *), rows, K, a[3], P(4, const uint8_t *), a[5], N, y, ldy, t, n);
    }
    const float *bias = P(9, const float *);
    if (bias) { /* after the whole product, as the eager path adds it */
        BARRIER
        for (int64_t r = lo(rows, t, nt); r < lo(rows, t + 1, nt); r++)
            for (int64_t c = 0; c < N; c++) y[r * ldy + c] += bias[c];
    }
}

static void rotary(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t D = a[6], H = a[7], n = elementwise(rows * H * D, nt);
    if (t < n)
        P(0, rotary_part)(P(1, const float *), a[2], a[3], P(4, const float *), P(5, const float *), D, H,
                          P(8, const int64_t *), rows, P(9, float *), t, n);
}

static void act_mul(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t n = elementwise(rows * a[3], nt);
    if (t < n) P(0, act_part)(P(1, const float *), a[2], rows, a[3], P(4, float *), a[5], t, n);
}

static void add(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t n = a[4], team = elementwise(rows * n, nt);
    float *x = P(0, float *);
    const float *d = P(2, const float *);
    for (int64_t r = lo(rows, t, team); t < team && r < lo(rows, t + 1, team); r++)
        for (int64_t i = 0; i < n; i++) x[r * a[1] + i] += d[r * a[3] + i];
}

static void kv_write(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const float *k = P(0, const float *), *v = P(2, const float *);
    const int64_t width = a[6], *slots = P(7, const int64_t *), type = a[8];
    for (int64_t r = lo(rows, t, nt); r < lo(rows, t + 1, nt); r++) { /* as tandem_kv_store's eager write */
        kv_store_row(P(4, void *), slots[r], k + r * a[1], width, (int)type);
        kv_store_row(P(5, void *), slots[r], v + r * a[3], width, (int)type);
    }
}

/* Decodes only: one query per request. Each request's slots are gathered (by the thread its row falls to),
 * then, after a barrier, the (request, KV head) items are split over the threads the eager call would take
 * (kernels/native/paged_attention.py's rule; the output does not depend on it). A sliding-window layer
 * (window > 0) reads its last `window` keys, through the slot map of its own pool when it has one. Barriers
 * inside: every thread of the team calls it. */
static int attention(const int64_t *a, int64_t rows, int64_t t, int64_t nt) {
    const int64_t *rtt = P(7, const int64_t *), ld_rtt = a[8], *req_rows = P(9, const int64_t *);
    const int64_t *lens = P(10, const int64_t *), H = a[12], Hkv = a[13], min_keys = a[19], window = a[21];
    const int64_t *slot_map = P(22, const int64_t *);
    int64_t *slot_buf = P(11, int64_t *);
    int64_t pairs = 0;
    for (int64_t b = 0; b < rows; b++) {
        pairs += lens[b];
        if (b < lo(rows, t, nt) || b >= lo(rows, t + 1, nt)) continue;
        const int64_t first = window && lens[b] > window ? lens[b] - window : 0;
        const int64_t *src = rtt + req_rows[b] * ld_rtt;
        int64_t *dst = slot_buf + b * ld_rtt;
        if (slot_map)
            for (int64_t i = first; i < lens[b]; i++) dst[i] = slot_map[src[i]];
        else
            memcpy(dst + first, src + first, (size_t)(lens[b] - first) * sizeof(int64_t));
    }
    BARRIER
    const int64_t items = rows * Hkv;
    int64_t n = nt < items ? nt : items;
    if (pairs * Hkv / min_keys < n) n = pairs * Hkv / min_keys;
    if (n < 1) n = 1;
    if (t >= n) return 0;
    return P(0, attention_part)(P(1, const float *), a[2], a[3], P(4, const void *), P(5, const void *), a[6],
                                slot_buf, ld_rtt, lens, H, Hkv, a[14], as_float(a[15]), P(16, float *), rows,
                                P(17, float *), a[18], a[20], window, t, n);
}

/* A whole MoE layer (kernels/csrc/moe.c): router, top-k, the routed experts; nonzero if its scratch failed. */
static int64_t moe(const int64_t *a, int64_t rows, int64_t threads) {
    return P(0, moe_fn)(P(1, const float *), rows, a[2], a[3], P(4, const float *), a[5], a[6], a[7], P(8, int64_t *),
                        P(9, float *), P(10, const void *), a[11], a[12], P(13, const void *), a[14], a[15],
                        P(16, float *), a[17], threads);
}

/* Thread t of nt's part of one node; nonzero if it failed. */
static int64_t run_node(const int64_t *node, int64_t rows, int64_t t, int64_t nt) {
    const int64_t *a = node + 1;
    switch (node[0]) {
    case EMBED: embed(a, rows, t, nt); return 0;
    case NORM: norm(a, rows, t, nt); return 0;
    case HEAD_NORM: head_norm(a, rows, t, nt); return 0;
    case QLINEAR: qlinear(a, rows, t, nt); return 0;
    case ROTARY: rotary(a, rows, t, nt); return 0;
    case KV_WRITE: kv_write(a, rows, t, nt); return 0;
    case ATTENTION: return attention(a, rows, t, nt);
    case SILU_MUL:
    case GELU_MUL: act_mul(a, rows, t, nt); return 0; /* the part: the activation's */
    case ADD: add(a, rows, t, nt); return 0;
    case ARGMAX: P(0, argmax_part)(P(1, const float *), rows, a[3], a[2], P(4, int64_t *), t, nt); return 0;
    case LORA: /* the phase's items split over the team, however few the rows */
        P(0, lora_part)(P(1, float *), a[2], P(3, const float *), a[4], rows, P(5, const int64_t *),
                        P(6, const float *), P(7, const float *), a[8], a[9], a[10], P(11, const int64_t *), a[12],
                        P(13, const int64_t *), P(14, float *), a[15], t, nt);
        return 0;
    default: return 1;
    }
}

/* Runs nodes [n_nodes][NODE_ARGS + 1] (kind, then its arguments) over `rows` decode rows on `threads` threads.
 * Returns 0, or the index + 1 of a node that failed (an unknown kind, the attention's pool type, the MoE
 * kernel's scratch). */
int64_t tandem_step_graph_run(const int64_t *nodes, int64_t n_nodes, int64_t rows, int64_t threads) {
    int64_t failed = 0;
    for (int64_t i = 0; i < n_nodes && !failed;) {
        if (nodes[i * (NODE_ARGS + 1)] == MOE) {
            if (moe(nodes + i * (NODE_ARGS + 1) + 1, rows, threads)) failed = i + 1;
            i++;
            continue;
        }
        int64_t j = i;
        while (j < n_nodes && nodes[j * (NODE_ARGS + 1)] != MOE) j++;
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = team_thread(), nt = team_size();
            for (int64_t k = i; k < j; k++) {
                if (run_node(nodes + k * (NODE_ARGS + 1), rows, t, nt)) {
#pragma omp atomic write
                    failed = k + 1;
                }
                if (k + 1 < j) { /* the region's end is the last node's */
                    BARRIER
                }
            }
        }
        i = j;
    }
    return failed;
}
