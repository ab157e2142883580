/* A decoder layer's two sublayers for a few rows (decode, verify and draft steps on a CPU), fp32,
   each in one call and one parallel region on torch's OpenMP threads, and a step's whole layer
   stack in one call and one region (decoder_layers). See specdec_runtime/cpu_kernel.py.

   torch runs a sublayer as some twenty small ops, each dispatched, allocated and forked over the
   threads; at one to a few rows their overhead was a third of a decode step. Here the norm, the
   products (skinny.c), rope, the cache write, attention and the gated activation run back to back
   with a barrier between them.

   Every value is computed in one fixed order that depends only on its own row: a row of a verify
   step is bitwise the same row of a decode step (attention sums over the slots in slot order, the
   masked ones skipped). Rope and the gated activation round each product before adding, as torch
   and transformers do. The compiler fuses no product into an add (FP_CONTRACT off): GCC fuses
   some copies of an inlined loop and not others, and a row's sums must not depend on which copy
   ran. Attention's dot products and weighted sums fuse them explicitly (fma8, fmaw, fmaf): the
   same in every copy. */
#pragma STDC FP_CONTRACT OFF       /* the C standard's way (clang) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y);
void skinny_panel_rows(const float *x, long M, long K, const void *w, int is_bf16, long N, long j, const float *bias,
                       const float *res, float *y);
int skinny_panel(void);
int64_t argmax_row(const float *x, long V); /* argmax.c */

/* A growing scratch buffer per calling thread (decode steps reuse it: no allocation per call). */
static float *scratch(size_t n) {
    static __thread float *buf;
    static __thread size_t size;
    if (n > size) {
        free(buf);
        size = (n + 1023) & ~(size_t)1023;
        buf = aligned_alloc(64, size * sizeof(float));
        if (!buf) {
            size = 0;
            return NULL;
        }
    }
    return buf;
}

/* a . b over n: one 8-lane sum over the chunks of n (each product rounded, then added), its lanes
   summed by hsum(), then the tail of n. */
static float dot(const float *a, const float *b, long n) {
    v8 s = {0};
    long k = 0;
    for (; k + 8 <= n; k += 8) s += load8(a + k) * load8(b + k);
    float t = hsum(s);
    for (; k < n; k++) t += a[k] * b[k];
    return t;
}

/* out = w * (x / sqrt(mean(x^2) + eps)), as transformers' RMSNorm. */
static void norm_row(const float *x, long n, const float *w, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (long k = 0; k < n; k++) out[k] = w[k] * (x[k] * r);
}

/* out [H] = token t's embedding from a table in panels of ep tokens (model.Decoder.embedding_panels):
   element k at embed[t / ep * es0 + k * es1 + t % ep * es2]. */
static void gather_row(const float *embed, long ep, long es0, long es1, long es2, int64_t t, long H, float *out) {
    const float *column = embed + t / ep * es0 + t % ep * es2;
    for (long k = 0; k < H; k++) out[k] = column[k * es1];
}

/* Rotate the adjacent pairs of a head v [D] (model.apply_rope_): (a, b) -> (a c - b s, b c + a s),
   cos holding c twice per pair and sin (-s, s); each product rounded before the sum. */
static void rope(float *v, const float *cos, const float *sin, long D) {
    for (long i = 0; i < D; i += 2) {
        float a = v[i], b = v[i + 1];
        v[i] = a * cos[i] + b * sin[i];
        v[i + 1] = b * cos[i + 1] + a * sin[i + 1];
    }
}

/* Lanes summed as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the order of every attention score,
   computed alone (score) or eight keys at a time (scores8). */
static inline float tree8(v8 s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

/* The lanes of a and b summed in pairs: (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7). */
static inline v8 pairs(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
#if defined(__AVX512F__)
/* pairs() of the low halves of a and b, and of their high halves, in one 512-bit vector. */
static inline __m512 pairs16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
#endif

/* q . k over D, each product fused into its sum, the lanes in tree8's order. */
static float score(const float *q, const float *k, long D) {
    v8 s = {0};
    long d = 0;
    for (; d + 8 <= D; d += 8) s = fma8(load8(q + d), load8(k + d), s);
    float t = tree8(s);
    for (; d < D; d++) t = fmaf(q[d], k[d], t);
    return t;
}

/* Queries of one key/value head attended together, their scores a chunk of up to QMAX at a time
   (attend; the values QV at a time, below): each key loaded once for the chunk (GQA's heads of a
   group, and a verify step's rows, share one head's cache). QMAX queries keep up to 24 accumulators
   in registers (32 with AVX-512; AVX2's 16 hold one query's). Every query's sums are those it has
   alone: its chunk-mates change nothing. */
#if defined(__AVX512VL__)
#define QMAX 3
#else
#define QMAX 1
#endif

/* score() of the 8 keys k [8, D] into p[i] [8] for each of the Q queries q[i]: eight independent
   sums a query, their lanes reduced together in three rounds of pairs (tree8's order for each key),
   where one key at a time spent more on its lanes' sum than on its products. */
static inline __attribute__((always_inline)) void scores8(int Q, const float *const *q, const float *k, long D,
                                                          float *const *p) {
    long d = 0;
#if defined(__AVX512DQ__)
    /* keys 2c and 2c + 1 side by side in a 512-bit register, the query's 8 floats in both halves:
       every lane sums what the 8-lane loop's does, in the same order, in half the instructions */
    __m512 w[QMAX][4];
    for (int i = 0; i < Q; i++)
        for (int c = 0; c < 4; c++) w[i][c] = _mm512_setzero_ps();
    for (; d + 8 <= D; d += 8) {
        __m512 qd[QMAX];
        for (int i = 0; i < Q; i++) qd[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i] + d));
        for (int c = 0; c < 4; c++) {
            __m512 kc = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(k + 2 * c * D + d)),
                                           _mm256_loadu_ps(k + (2 * c + 1) * D + d), 1);
            for (int i = 0; i < Q; i++) w[i][c] = _mm512_fmadd_ps(qd[i], kc, w[i][c]);
        }
    }
    /* The rounds of pairs on both halves at once (vshufps works within 128-bit lanes: pairs16), each
       key's lanes summed as tree8 sums them; the keys come out in the order 0 2 4 6 1 3 5 7. */
    const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 7, 3, 6, 2, 5, 1, 4, 0);
    for (int i = 0; i < Q; i++) {
        __m512 a = pairs16(w[i][0], w[i][1]), b = pairs16(w[i][2], w[i][3]); /* lanes (0+1), (2+3), ... */
        __m512 r = pairs16(a, b); /* 128-bit lanes: keys 0 2 4 6's (0+1)+(2+3), their (4+5)+(6+7); keys 1 3 5 7's */
        r = _mm512_shuffle_f32x4(r, r, _MM_SHUFFLE(3, 1, 2, 0));
        __m256 t = _mm256_add_ps(_mm512_castps512_ps256(r), _mm512_extractf32x8_ps(r, 1));
        _mm256_storeu_ps(p[i], _mm512_castps512_ps256(_mm512_permutexvar_ps(order, _mm512_castps256_ps512(t))));
    }
#else
    v8 s[QMAX][8];
    for (int i = 0; i < Q; i++)
        for (int c = 0; c < 8; c++) s[i][c] = (v8){0};
    for (; d + 8 <= D; d += 8) {
        v8 qd[QMAX];
        for (int i = 0; i < Q; i++) qd[i] = load8(q[i] + d);
        for (int c = 0; c < 8; c++) {
            v8 kc = load8(k + c * D + d);
            for (int i = 0; i < Q; i++) s[i][c] = fma8(qd[i], kc, s[i][c]);
        }
    }
    for (int i = 0; i < Q; i++) {
        v8 lo = pairs(pairs(s[i][0], s[i][1]), pairs(s[i][2], s[i][3])); /* keys 0-3: (0+1)+(2+3), then (4+5)+(6+7) */
        v8 hi = pairs(pairs(s[i][4], s[i][5]), pairs(s[i][6], s[i][7])); /* keys 4-7 */
        store8(p[i], __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
                         __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15));
    }
#endif
    for (int i = 0; i < Q; i++)
        for (int c = 0; c < 8; c++)
            for (long e = d; e < D; e++) p[i][c] = fmaf(q[i][e], k[c * D + e], p[i][c]);
}

#if LANES == 16
typedef unsigned char vwb __attribute__((vector_size(16)));
#else
typedef unsigned char vwb __attribute__((vector_size(8)));
#endif

/* All bits set in the lanes of the slots j.. that are attended to: < bound, and allowed by mask
   (bool bytes: 0 or 1) where there is one. */
static inline vwi kept(const uint8_t *mask, long j, long bound) {
    vwb b;
    if (mask && j + LANES <= bound)
        __builtin_memcpy(&b, mask + j, sizeof b);
    else
        for (int i = 0; i < LANES; i++) b[i] = j + i < bound && (!mask || mask[j + i]);
    return -__builtin_convertvector(b, vwi);
}

/* p [bound] (a query's scores) -> its weights softmax needs before the division: e^(p_j * scale -
   top) at the slots < bound that mask allows, 0 at the others and up to bound rounded up to LANES
   (p holds that many). Returns their sum, over LANES lanes of slots (so the sum does not depend on
   bound past the last slot attended to: a row of a verify step sees more, masked, slots than the
   same row decoded). A slot not attended to is scaled to -inf first, which expw takes to 0. */
static float weigh(float *p, const uint8_t *mask, long bound, float scale) {
    long padded = (bound + LANES - 1) & -(long)LANES;
    const vw none = (vw){0} - INFINITY;
    vw tops = none;
    for (long j = 0; j < padded; j += LANES) { /* the scaled scores, and the largest one attended to */
        vw x = loadw(p + j) * scale;
        if (mask || j + LANES > bound) x = blendw(kept(mask, j, bound), x, none);
        __builtin_memcpy(p + j, &x, sizeof x);
        tops = maxw(tops, x);
    }
    float top = -INFINITY;
    for (int i = 0; i < LANES; i++) top = tops[i] > top ? tops[i] : top;
    vw sums = {0};
    for (long j = 0; j < padded; j += LANES) {
        vw e = expw(loadw(p + j) - top);
        __builtin_memcpy(p + j, &e, sizeof e);
        sums += e;
    }
    return hsumw(sums);
}

/* Weighted values: a chunk of up to QV queries at a time (attend), each slot's values loaded once
   for the chunk. QV queries keep QV x 4 512-bit accumulators (AVX-512: 24 for 6; 5 or 6 queries a
   chunk took 0.78x the time of 3 on the 2-core EPYC, a C harness); AVX2's 16 registers hold one
   query's 64 dims. */
#if defined(__AVX512F__)
#define QV 6
#else
#define QV 1
#endif

/* Blocks of a head's dims, C registers of W lanes a query: 64 dims in 4 16-lane ones where the CPU
   has 512-bit registers, else in 8 8-lane ones, then 32 in 4 8-lane ones. Lane by lane the same
   sums whatever the block. */
typedef float v16 __attribute__((vector_size(64)));
#define VALUE_BLOCK(V, W, C, FMA)                                                                                 \
    /* acc[i] += p[i][j] x vj [C W] for each of the Q queries; with check set, nothing where no query            \
       attends to slot j (p 0: the sums are bitwise what adding 0 x vj gives) */                                  \
    static inline __attribute__((always_inline)) void value_row_##W##_##C(int Q, float *const *p, long j,         \
                                                                          const float *vj, int check,             \
                                                                          V(*acc)[C]) {                           \
        if (check) {                                                                                              \
            int any = 0;                                                                                          \
            for (int i = 0; i < Q; i++) any |= p[i][j] != 0.0f;                                                   \
            if (!any) return;                                                                                     \
        }                                                                                                         \
        V w[QV];                                                                                                  \
        for (int i = 0; i < Q; i++) w[i] = (V){0} + p[i][j];                                                      \
        for (int c = 0; c < C; c++) {                                                                             \
            V vc;                                                                                                 \
            __builtin_memcpy(&vc, vj + W * c, sizeof vc);                                                         \
            for (int i = 0; i < Q; i++) acc[i][c] = FMA(w[i], vc, acc[i][c]);                                     \
        }                                                                                                         \
    }                                                                                                             \
    /* The slots [j0, j1) of out[i] [d0, d0 + C W) for the Q queries, each summed in slot order, the sums       \
       carried from one block of slots to the next in part[i] (C W floats); at the last slot divided by sum[i]   \
       into out[i]. From slot `open` on, some query may not attend (see value_row's check). */                   \
    static inline __attribute__((always_inline)) void value_block_##W##_##C(                                      \
        int Q, float *const *p, const float *sum, const float *v, long D, long d0, long j0, long j1, long open,   \
        long bound, float *const *part, float *const *out) {                                                      \
        V acc[QV][C];                                                                                             \
        for (int i = 0; i < Q; i++)                                                                               \
            for (int c = 0; c < C; c++) {                                                                         \
                acc[i][c] = (V){0};                                                                               \
                if (j0) __builtin_memcpy(&acc[i][c], part[i] + W * c, sizeof(V));                                 \
            }                                                                                                     \
        long j = j0, dense = open < j0 ? j0 : open < j1 ? open : j1;                                              \
        for (; j < dense; j++) value_row_##W##_##C(Q, p, j, v + j * D + d0, 0, acc);                              \
        for (; j < j1; j++) value_row_##W##_##C(Q, p, j, v + j * D + d0, 1, acc);                                \
        for (int i = 0; i < Q; i++)                                                                               \
            for (int c = 0; c < C; c++) {                                                                         \
                if (j1 < bound) {                                                                                 \
                    __builtin_memcpy(part[i] + W * c, &acc[i][c], sizeof(V));                                     \
                    continue;                                                                                     \
                }                                                                                                 \
                V o = acc[i][c] / sum[i];                                                                         \
                __builtin_memcpy(out[i] + d0 + W * c, &o, sizeof o);                                              \
            }                                                                                                     \
    }
VALUE_BLOCK(v8, 8, 4, fma8)
#if defined(__AVX512F__)
VALUE_BLOCK(v16, 16, 4, fmaw)
#define value_block_64 value_block_16_4
#else
VALUE_BLOCK(v8, 8, 8, fma8)
#define value_block_64 value_block_8_8
#endif

/* A chunk of Q (<= QMAX) queries' scores against the keys [j0, j1) (whole blocks of 8); a chunk of Q
   (<= QV) queries' weighted values over the slots [j0, j1) (see value_block; part: D floats a query). */
static inline __attribute__((always_inline)) void chunk_scores(int Q, const float *const *q, const float *k, long D,
                                                               long j0, long j1, float *const *pq) {
    float *pj[QMAX];
    for (long j = j0; j < j1; j += 8) {
        for (int i = 0; i < Q; i++) pj[i] = pq[i] + j;
        scores8(Q, q, k + j * D, D, pj);
    }
}
static inline __attribute__((always_inline)) void chunk_values(int Q, float *const *pq, const float *sum,
                                                               const float *v, long D, long j0, long j1, long open,
                                                               long bound, float *const *part, float *const *out) {
    float *pd[QV];
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        for (int i = 0; i < Q; i++) pd[i] = part[i] + d0;
        value_block_64(Q, pq, sum, v, D, d0, j0, j1, open, bound, pd, out);
    }
    for (; d0 + 32 <= D; d0 += 32) {
        for (int i = 0; i < Q; i++) pd[i] = part[i] + d0;
        value_block_8_4(Q, pq, sum, v, D, d0, j0, j1, open, bound, pd, out);
    }
}
/* The two for Q a constant: the loops over queries unrolled, the accumulators in registers. */
static void scores_of(int Q, const float *const *q, const float *k, long D, long j0, long j1, float *const *pq) {
    switch (Q) {
#if QMAX >= 3
    case 3: chunk_scores(3, q, k, D, j0, j1, pq); break;
    case 2: chunk_scores(2, q, k, D, j0, j1, pq); break;
#endif
    default: chunk_scores(1, q, k, D, j0, j1, pq);
    }
}
static void values_of(int Q, float *const *pq, const float *sum, const float *v, long D, long j0, long j1, long open,
                      long bound, float *const *part, float *const *out) {
    switch (Q) {
#if QV >= 6
    case 6: chunk_values(6, pq, sum, v, D, j0, j1, open, bound, part, out); break;
    case 5: chunk_values(5, pq, sum, v, D, j0, j1, open, bound, part, out); break;
    case 4: chunk_values(4, pq, sum, v, D, j0, j1, open, bound, part, out); break;
    case 3: chunk_values(3, pq, sum, v, D, j0, j1, open, bound, part, out); break;
    case 2: chunk_values(2, pq, sum, v, D, j0, j1, open, bound, part, out); break;
#endif
    default: chunk_values(1, pq, sum, v, D, j0, j1, open, bound, part, out);
    }
}

/* Keys (and values) a block: KEY_BYTES of each, so that while the queries of a segment take their
   turns at a block (QMAX at a time), it stays in L1 instead of being read from L2 again for each
   chunk of queries (a 9-row verify step's attention, 27 queries a head, in ~0.9x the time at 900
   cached slots on the 2-core EPYC; 32 KiB blocks against 16: 9-row verify steps in 0.98-0.99x the
   time at 300-1500 slots, 8 KiB and 64 KiB no faster). A segment holds a 12-row step's queries of
   a head (36 with 3 heads a group), so a head's keys and values are read once a thread: against
   segments of 24, 9- and 12-row steps in 0.975 / 0.982x the time at 3000 cached slots, the same at
   200-1000 (segments of 32 had been 2-4% slower than 24 at 1500, before the values went 5-6
   queries at a time). */
#define KEY_BYTES 32768
#define SEGMENT 36 /* queries at most a pass over a head's keys */

/* out[i] [D] = softmax(q[i] . k_j * scale over the slots j < bound that mask[i] allows) @ v for n
   queries of one key/value head (k, v [S, D]). p: scratch of n x (bound rounded up to LANES) floats,
   part: of n x D. Each score is score()'s, whichever keys share its block of 8, and each output
   sums its slots in one order, whichever queries share its chunk and segment and however the slots
   are blocked: a query's result is the same whatever else is attended to with it. A slot no query
   of a chunk attends to is skipped (one that only some attend to adds 0 x v to the others: their
   sums stay bitwise what skipping gives). */
static void attend(long n, const float *const *q, const float *k, const float *v, long D, const uint8_t *const *mask,
                   long bound, float scale, float *p, float *part, float *const *out) {
    long padded = (bound + LANES - 1) & -(long)LANES, whole = bound & ~7L;
    long kb = KEY_BYTES / (D * (long)sizeof(float)) & ~7L;
    if (kb < 8) kb = 8;
    float *pq[n], sum[n], *parts[n];
    long open = bound; /* the first slot some query does not attend to */
    for (long i = 0; i < n; i++) {
        pq[i] = p + i * padded, parts[i] = part + i * D;
        const uint8_t *zero = mask[i] ? memchr(mask[i], 0, open) : 0;
        if (zero) open = zero - mask[i];
    }
    for (long j0 = 0; j0 < whole; j0 += kb) {
        long j1 = j0 + kb < whole ? j0 + kb : whole;
        for (long c = 0; c < n; c += QMAX) scores_of(n - c < QMAX ? n - c : QMAX, q + c, k, D, j0, j1, pq + c);
    }
    for (long j = whole; j < bound; j++)
        for (long i = 0; i < n; i++) pq[i][j] = score(q[i], k + j * D, D);
    for (long i = 0; i < n; i++) sum[i] = weigh(pq[i], mask[i], bound, scale);
    long chunk = (n + (n + QV - 1) / QV - 1) / ((n + QV - 1) / QV); /* equal chunks of at most QV */
    for (long j0 = 0; j0 < bound; j0 += kb) {
        long j1 = j0 + kb < bound ? j0 + kb : bound;
        for (long c = 0; c < n; c += chunk)
            values_of(n - c < chunk ? n - c : chunk, pq + c, sum + c, v, D, j0, j1, open, bound, parts + c, out + c);
    }
    long d0 = D & ~31L;
    for (long i = 0; i < n; i++)
        for (long d = d0; d < D; d++) { /* head dims past a multiple of 32 */
            float t = 0.0f;
            for (long j = 0; j < bound; j++) t = fmaf(pq[i][j], v[j * D + d], t);
            out[i][d] = t / sum[i];
        }
}

/* Rows of x [M, K] normalized (norm_row) for this thread's share of the product that reads them.
   Up to OWN_ROWS rows, every thread normalizes all of them into its own copy (buf + its number x M
   K) and goes straight on to its product: no barrier, where the threads waited on one thread's norm
   of a decode step's row. More rows are split over the threads into buf, then a barrier. */
#define OWN_ROWS 4
static const float *normed(const float *x, long M, long K, const float *w, float eps, float *buf) {
    if (M <= OWN_ROWS) {
        float *h = buf + (long)omp_get_thread_num() * M * K;
        for (long m = 0; m < M; m++) norm_row(x + m * K, K, w, eps, h + m * K);
        return h;
    }
#pragma omp for schedule(static)
    for (long m = 0; m < M; m++) norm_row(x + m * K, K, w, eps, buf + m * K);
    return buf;
}

/* a [n] = silu(g) * u, 16 lanes at a time where the CPU has them (the lanes of exp8), then 8, then
   one (expf) for the last n % 8: a column's result depends on where it falls, so callers split the
   columns only at multiples of 16. */
static void silu_mul(const float *g, const float *u, float *a, long n) {
    long i = 0;
    for (; i + LANES <= n; i += LANES) {
        vw gi = loadw(g + i), o = gi / (1.0f + expw(-gi)) * loadw(u + i);
        __builtin_memcpy(a + i, &o, sizeof o);
    }
    for (; i + 8 <= n; i += 8) {
        v8 gi = load8(g + i);
        store8(a + i, gi / (1.0f + exp8(-gi)) * load8(u + i));
    }
    for (; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Scratch floats for attention_part and mlp_part. */
static size_t attention_floats(long M, long Kin, long H, long Hkv, long D, long bound, int threads) {
    long padded = (bound + LANES - 1) & -(long)LANES;
    return (size_t)threads * M * Kin + M * (H + 2 * Hkv) * D + M * H * D + (size_t)threads * SEGMENT * (padded + D);
}
static size_t mlp_floats(long M, long Hd, long I, int threads) {
    return (size_t)threads * M * Hd + M * 2 * I + M * I;
}

/* attention_block's work, run by every thread of an enclosing parallel region; buf: scratch of
   attention_floats(). Ends on a barrier (skinny_part's): out is written when it returns. */
static void attention_part(const float *x, long M, long Kin, const float *norm, float eps, const float *residual,
                           const void *wqkv, int is_bf16, const float *bqkv, long H, long Hkv, long D, const void *wo,
                           const float *bo, long Hd, const float *cos, const float *sin, long rope_stride, float *kv,
                           long S, const int64_t *slots, const uint8_t *mask, long mask_stride, long bound, float *out,
                           float *buf) {
    long nqkv = (H + 2 * Hkv) * D, heads = H + 2 * Hkv, group = H / Hkv, padded = (bound + LANES - 1) & -(long)LANES;
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    float *qkv = buf + (size_t)nt * M * Kin, *att = qkv + M * nqkv, *p = att + M * H * D;
    const float *h = norm ? normed(x, M, Kin, norm, eps, buf) : x;
    skinny_part(h, M, Kin, wqkv, is_bf16, nqkv, bqkv, 0, qkv);
#pragma omp for schedule(static)
    for (long i = 0; i < M * heads; i++) {
        long m = i / heads, head = i % heads;
        float *v = qkv + m * nqkv + head * D;
        if (head < H + Hkv) rope(v, cos + m * rope_stride, sin + m * rope_stride, D);
        if (head >= H) memcpy(kv + ((head - H) * S + slots[m]) * D, v, D * sizeof(float));
    }
    /* queries in order of key/value head, then (row, head of its group) row-major; each thread
       attends to an equal run of them, SEGMENT of one head at a time at most */
    long per_head = group * M, total = Hkv * per_head, lo = total * t / nt, hi = total * (t + 1) / nt;
    float *mine = p + (long)t * SEGMENT * (padded + D), scale = 1.0f / sqrtf((float)D);
    /* Odd threads take their heads last to first: a head two threads share is read by both at about
       the same time, where the second reader found it in L3 after the first had read it from memory
       (at 1500 cached slots the thread reading two heads cold took ~1.2-1.4x as long). */
    for (long g = (t & 1 ? hi - 1 : lo) / per_head, first = lo / per_head, last = (hi - 1) / per_head;
         lo < hi && g >= first && g <= last; g += t & 1 ? -1 : 1) {
        long a = g * per_head > lo ? g * per_head : lo, b = (g + 1) * per_head < hi ? (g + 1) * per_head : hi;
        long pieces = (b - a + SEGMENT - 1) / SEGMENT;
        for (long at = a; at < b;) {
            long n = (b - a + pieces - 1) / pieces < b - at ? (b - a + pieces - 1) / pieces : b - at;
            const float *q[SEGMENT];
            const uint8_t *rows[SEGMENT];
            float *o[SEGMENT];
            for (long i = 0; i < n; i++) {
                long r = at + i - g * per_head, m = r / group, head = g * group + r % group;
                q[i] = qkv + m * nqkv + head * D;
                rows[i] = mask ? mask + m * mask_stride : 0;
                o[i] = att + m * H * D + head * D;
            }
            attend(n, q, kv + g * S * D, kv + (Hkv + g) * S * D, D, rows, bound, scale, mine, mine + SEGMENT * padded, o);
            at += n;
        }
    }
#pragma omp barrier
    skinny_part(att, M, H * D, wo, is_bf16, Hd, bo, residual, out); /* (its loop ends on a barrier) */
}

/* mlp_block's work, as attention_part; buf: scratch of mlp_floats(). Ends on a barrier. */
static void mlp_part(const float *x, long M, long Hd, const float *norm, float eps, const void *wgu, int is_bf16,
                     const float *bgu, long I, const void *wd, const float *bd, float *out, float *buf) {
    float *gu = buf + (size_t)omp_get_num_threads() * M * Hd, *act = gu + M * 2 * I;
    skinny_part(normed(x, M, Hd, norm, eps, buf), M, Hd, wgu, is_bf16, 2 * I, bgu, 0, gu);
    long blocks = (I + 63) / 64; /* the activation in blocks of 64 columns: one row's is split too */
#pragma omp for schedule(static)
    for (long i = 0; i < M * blocks; i++) {
        long m = i / blocks, c = i % blocks * 64, n = I - c < 64 ? I - c : 64;
        silu_mul(gu + m * 2 * I + c, gu + m * 2 * I + I + c, act + m * I + c, n);
    }
    skinny_part(act, M, I, wd, is_bf16, Hd, bd, x, out);
}

/* out [M, Hd] = residual + o(attention(h)), h = norm(x) (x [M, Kin]; h = x when norm is NULL); the
   weights packed (skinny.c), in bf16 where is_bf16 is set.
   Writes the rows' keys and values into kv [2 Hkv, S, D] (keys, then values) at slots [M]; row m
   attends to the slots < bound that mask row m allows (mask [M, bound] with row stride
   mask_stride; NULL: all of them). cos / sin: row m at m * rope_stride. Returns 0, or -1 when
   out of memory. */
int attention_block(const float *x, long M, long Kin, const float *norm, float eps, const float *residual,
                    const void *wqkv, int is_bf16, const float *bqkv, long H, long Hkv, long D, const void *wo,
                    const float *bo, long Hd, const float *cos, const float *sin, long rope_stride, float *kv,
                    long S, const int64_t *slots, const uint8_t *mask, long mask_stride, long bound, float *out,
                    int threads) {
    float *buf = scratch(attention_floats(M, Kin, H, Hkv, D, bound, threads));
    if (!buf) return -1;
#pragma omp parallel num_threads(threads)
    attention_part(x, M, Kin, norm, eps, residual, wqkv, is_bf16, bqkv, H, Hkv, D, wo, bo, Hd, cos, sin, rope_stride,
                   kv, S, slots, mask, mask_stride, bound, out, buf);
    return 0;
}

/* out [M, Hd] = x + down(silu(gate(norm(x))) * up(norm(x))), gate and up the halves of one
   product [M, 2I]; the weights packed (skinny.c), in bf16 where is_bf16 is set. Returns 0, or -1 when
   out of memory. */
int mlp_block(const float *x, long M, long Hd, const float *norm, float eps, const void *wgu, int is_bf16,
              const float *bgu, long I, const void *wd, const float *bd, float *out, int threads) {
    float *buf = scratch(mlp_floats(M, Hd, I, threads));
    if (!buf) return -1;
#pragma omp parallel num_threads(threads)
    mlp_part(x, M, Hd, norm, eps, wgu, is_bf16, bgu, I, wd, bd, out, buf);
    return 0;
}

/* A layer's weights in decoder_layers' pointer array, in this order (biases may be NULL). */
enum { ATTN_NORM, QKV, QKV_BIAS, O, O_BIAS, MLP_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, PER_LAYER };

/* How far a screened logit can be from the exact one: screen_c(K, pairs) ||h|| ||w_v|| + screen_tiny
   for a row h of K floats. The exact logit sums h_k w_vk in skinny.c's order (runs of 64 fused
   multiply-adds, the runs' sums added): at most n = K + 2 roundings on any path, so within gamma_n
   sum |h_k w_vk| of the real sum (gamma_n = n u / (1 - n u), u = 2^-24). The screen rounds each
   w_vk to the nearest bf16 (within uw = 2^-8 of it, relatively), and where it multiplies pairs
   each h_k too (uh = 2^-8, else 0): each product within (uw + uh + uw uh) |h_k w_vk| of the exact
   one. Its sums (at most K roundings, in whatever order) add gamma_n (1 + uw)(1 + uh) sum |h_k
   w_vk|. Cauchy-Schwarz bounds sum |h_k w_vk| by ||h|| ||w_v||. 2^-20 of slack covers the
   rounding of the bound itself (in double) and of the comparisons; screen_tiny what subnormal
   values could add (flushed to zero by the pairs' instruction). No sum overflows: a row whose
   ||h|| times the largest ||w_v|| is not below 2^125 is computed exactly in full. */
static double screen_c(long K, int pairs) {
    double n = (double)K + 2, u = 0x1p-24, g = n * u / (1 - n * u), uw = 0x1p-8, uh = pairs ? 0x1p-8 : 0;
    return (uw + uh + uw * uh + g * (1 + (1 + uw) * (1 + uh))) * (1 + 0x1p-20);
}
static double screen_tiny(long K, double h_norm, double w_norm) { return (K + 4) * 0x1p-118 * (1 + h_norm + w_norm); }

/* Whether index i (after best in the row's order) is the argmax instead of best (-1: none yet), as
   torch.argmax chooses: the first NaN, else the first of equal maxima. */
static inline int replaces(const float *row, int64_t best, int64_t i) {
    return best < 0 || (row[best] == row[best] && (row[i] != row[i] || row[i] > row[best]));
}

/* decoder_layers' head, run by every thread of its region: logits [R, V] = head(h) of the normed
   rows h [R, K] and their argmax best [R] (torch.argmax's: the first of equal maxima, the first
   NaN); at: threads x R slots, lo: threads x R doubles of scratch.

   screen (NULL: none), for greedy decoding, which reads only the argmax: the head again in bf16 (half
   its bytes; packed in pairs where pairs is set, multiplied by the rows rounded to bf16: skinny.c)
   and norms [V + 1], the 2-norm of each output's fp32 weights (rounded up), then the largest. The
   whole head is read in bf16, and of the fp32 head only the panels that can hold a row's largest
   logit. Every screened logit is within its
   bound (screen_c) of the exact one, so the largest exact logit is at least the floor: the
   largest screened logit less its bound. No output whose screened logit plus its bound is below
   the floor can be the argmax or tie it. The panels that hold any other output (the candidates)
   are computed exactly, bitwise as without the screen, and the argmax is taken over them. Where
   a bound could overflow (or h holds a NaN), every panel is computed. The logits outside the
   computed panels are the screen's, not exact: the caller reads only best. */
static void head_part(const float *h, long R, long K, const void *head, int head_bf16, const void *screen,
                      int pairs, const float *norms, long V, float *logits, int64_t *best, int64_t *at, double *lo) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    long NR = skinny_panel(), count = (V + NR - 1) / NR, p0 = count * t / nt, p1 = count * (t + 1) / nt;
    if (!screen) {
        skinny_part(h, R, K, head, head_bf16, V, 0, 0, logits);
        long a = V * t / nt, b = V * (t + 1) / nt; /* each thread's span of every row, then in order */
        for (long r = 0; r < R; r++) at[r * nt + t] = b > a ? a + argmax_row(logits + r * V + a, b - a) : -1;
    } else {
        skinny_part(h, R, K, screen, pairs ? 2 : 1, V, 0, 0, logits); /* the screen's logits (ends on a barrier) */
        double c = screen_c(K, pairs), tiny[R], scale[R];
        float up[R], at_least[R];
        long a = p0 * NR < V ? p0 * NR : V, b = p1 * NR < V ? p1 * NR : V;
        int all = 0;
        for (long r = 0; r < R; r++) { /* a lower bound on the row's largest exact logit, from this thread's panels */
            double hh = 0;
            for (long k = 0; k < K; k++) hh += (double)h[r * K + k] * h[r * K + k];
            scale[r] = c * sqrt(hh), tiny[r] = screen_tiny(K, sqrt(hh), norms[V]);
            all |= !(sqrt(hh) * norms[V] < 0x1p125); /* (NaN too) */
            long v = b > a ? a + argmax_row(logits + r * V + a, b - a) : -1;
            lo[r * nt + t] = v < 0 ? -INFINITY : logits[r * V + v] - (scale[r] * norms[v] + tiny[r]);
        }
#pragma omp barrier
        for (long r = 0; r < R; r++) { /* the floor: the largest lower bound of all the threads' */
            double floor = -INFINITY;
            for (int s = 0; s < nt; s++) floor = lo[r * nt + s] > floor ? lo[r * nt + s] : floor;
            /* An output is a candidate where its screened logit plus its bound reaches the floor; tested
               in float as fmaf(up, norm, logit) >= at_least, with up >= the scale by 2^-12 (more than
               fmaf's one rounding: a screened logit is at most ~257 times its bound, as c >= 2^-8)
               and at_least <= floor - tiny. */
            up[r] = (float)(scale[r] * (1 + 0x1p-12));
            if (up[r] < scale[r] * (1 + 0x1p-12)) up[r] = nextafterf(up[r], INFINITY);
            at_least[r] = (float)(floor - tiny[r]);
            if (at_least[r] > floor - tiny[r]) at_least[r] = nextafterf(at_least[r], -INFINITY);
            at[r * nt + t] = -1;
        }
        for (long j = p0; j < p1; j++) {
            long v0 = j * NR, v1 = v0 + NR < V ? v0 + NR : V;
            int need = all;
            for (long r = 0; r < R && !need; r++) {
                const float *l = logits + r * V;
                float u = up[r], f = at_least[r];
                for (long v = v0; v < v1; v++) need |= fmaf(u, norms[v], l[v]) >= f;
            }
            if (!need) continue;
            skinny_panel_rows(h, R, K, head, head_bf16, V, j, 0, 0, logits); /* exact, bitwise the unscreened */
            for (long r = 0; r < R; r++) { /* the panels in order: the first maximum, the first NaN */
                const float *row = logits + r * V;
                int64_t i = v0 + argmax_row(row + v0, v1 - v0);
                if (replaces(row, at[r * nt + t], i)) at[r * nt + t] = i;
            }
        }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long r = 0; r < R; r++) { /* the threads' bests in order: the first NaN, else the first maximum */
        const float *row = logits + r * V;
        int64_t choice = -1;
        for (int s = 0; s < nt; s++) {
            int64_t i = at[r * nt + s];
            if (i >= 0 && replaces(row, choice, i)) choice = i;
        }
        best[r] = choice;
    }
}

/* Layers [first, last) of a decoder for M rows of one sequence, x [M, Hd] updated in place (where
   tokens [M] is given, x is first their embedding rows, gathered as eagle3_rows does): each
   layer's attention_block, then its mlp_block, as model.Decoder._forward calls them one by one,
   without a trip through Python between them. w: PER_LAYER pointers a layer (the enum above), the
   weights packed (in bf16 where is_bf16 is set); kv: layer 0's cache [2 Hkv, S, D], the next
   layer's kv_stride floats further. flags[i - first]: 1 skips layer i's attention, 2 its MLP.
   tap_at[i - first], i in [first, last]: which of the ntaps blocks of taps [M, ntaps * Hd] gets x
   as it enters layer i (as it leaves the last layer at i = last), or -1.
   head (packed, in bf16 where head_bf16 is set; NULL: none): then the last R rows' logits
   [R, V] = head(norm(x)) (R = keep, or M where keep is 0), and their argmax best [R] as
   torch.argmax gives it (argmax.c), in the same call: the Python and torch ops of a separate norm,
   product and argmax ran cold after the layers' stream (~0.1 ms a decode step, ~0.4 ms a verify
   step of 9 rows on the 2-core EPYC). Returns 0, or -1 when out of memory. */
int decoder_layers(float *x, const int64_t *tokens, const float *embed, long ep, long es0, long es1, long es2,
                   long M, long Hd, long first, long last, const void *const *w, int is_bf16,
                   const int *flags, float eps, long H, long Hkv, long D, long I, float *kv, long kv_stride,
                   const float *cos, const float *sin, long rope_stride, long S, const int64_t *slots,
                   const uint8_t *mask, long mask_stride, long bound, const long *tap_at, float *taps, long ntaps,
                   const float *norm, const void *head, int head_bf16, const void *screen, int screen_pairs,
                   const float *screen_norms, long V, long keep, float *logits, int64_t *best, int threads) {
    size_t a = attention_floats(M, Hd, H, Hkv, D, bound, threads), b = mlp_floats(M, Hd, I, threads);
    size_t floats = ((a > b ? a : b) + 1) & ~(size_t)1; /* then the head's argmax: each thread's best of each row */
    float *buf = scratch(floats + 4 * (size_t)threads * M); /* and its screen's bounds */
    if (!buf) return -1;
    int64_t *at = (int64_t *)(buf + floats);
    double *lo = (double *)(at + (size_t)threads * M);
#pragma omp parallel num_threads(threads) /* one region for all the layers: no fork and join a sublayer */
    {
        if (tokens) {
#pragma omp for schedule(static)
            for (long m = 0; m < M; m++) gather_row(embed, ep, es0, es1, es2, tokens[m], Hd, x + m * Hd);
        }
        for (long i = first; i <= last; i++) {
            long t = tap_at[i - first];
            if (t >= 0) {
#pragma omp for schedule(static)
                for (long m = 0; m < M; m++) memcpy(taps + (m * ntaps + t) * Hd, x + m * Hd, Hd * sizeof(float));
            }
            if (i == last) break;
            const void *const *l = w + i * PER_LAYER;
            if (!(flags[i - first] & 1))
                attention_part(x, M, Hd, l[ATTN_NORM], eps, x, l[QKV], is_bf16, l[QKV_BIAS], H, Hkv, D, l[O],
                               l[O_BIAS], Hd, cos, sin, rope_stride, kv + i * kv_stride, S, slots, mask, mask_stride,
                               bound, x, buf);
            if (!(flags[i - first] & 2))
                mlp_part(x, M, Hd, l[MLP_NORM], eps, l[GATE_UP], is_bf16, l[GATE_UP_BIAS], I, l[DOWN], l[DOWN_BIAS], x,
                         buf);
        }
        if (head) { /* x is final: no thread writes it after the layers' last barrier */
            long R = keep ? keep : M;
            head_part(normed(x + (M - R) * Hd, R, Hd, norm, eps, buf), R, Hd, head, head_bf16, screen, screen_pairs,
                      screen_norms, V, logits, best, at, lo);
        }
    }
    return 0;
}

/* logits [M, V] = head(norm(x)) for rows x [M, Hd], as decoder_layers' head computes them (the rows
   of a forward whose layers ran apart from it: a batch's, a prompt's past the kernel's rows). */
int head_rows(const float *x, long M, long Hd, const float *norm, float eps, const void *head, int head_bf16, long V,
              float *logits, int threads) {
    float *buf = scratch((size_t)(threads + 1) * M * Hd); /* normed's copies, or its rows */
    if (!buf) return -1;
#pragma omp parallel num_threads(threads)
    skinny_part(normed(x, M, Hd, norm, eps, buf), M, Hd, head, head_bf16, V, 0, 0, logits);
    return 0;
}

/* An EAGLE-3 drafter's weights in eagle3_rows' pointer array, in this order (biases may be NULL;
   norms doubled as the model keeps them: their first half is read). */
enum { E3_FC, E3_INPUT_NORM, E3_HIDDEN_NORM, E3_QKV, E3_QKV_BIAS, E3_O, E3_O_BIAS, E3_POST_NORM, E3_GATE_UP,
       E3_GATE_UP_BIAS, E3_DOWN, E3_DOWN_BIAS, E3_NORM, E3_HEAD, E3_WEIGHTS };

/* M rows of an EAGLE-3 drafter (specdec_runtime/eagle3.py: Eagle3Drafter._run), the whole draft step
   in one call and one parallel region, where the drafter's Python ran some twenty torch ops and three
   kernel calls a step (~0.45 ms a step of 1-3 rows on the 2-core EPYC, against ~0.25 ms of kernel):
     feature = fc(taps) where taps [M, Kt] is given (the target's features of accepted rows), else
               the previous step's prenorm, feature [M, H]
     x       = [input_norm(embedding of tokens[m]) ; hidden_norm(feature)]       [M, 2H]
     prenorm = mlp_part(attention_part(x, residual = feature, or hidden_norm(feature) where
               norm_before_residual is set))                                      [M, H]
     logits  = head(norm(prenorm)) of rows head_from..M-1                          [M - head_from, N]
   embed: the target's embedding in panels of ep tokens (model.Decoder.embedding_panels: a tied
   one is the lm_head's packed copy), token t's element k at embed[t / ep * es0 + k * es1 + t % ep *
   es2]. The weights packed (skinny.c), all in bf16 where is_bf16 is set; the rest as
   attention_block. Returns 0, or -1 when out of memory. */
int eagle3_rows(const int64_t *tokens, long M, const float *embed, long ep, long es0, long es1, long es2,
                const float *taps, long Kt,
                const float *feature, const void *const *w, int is_bf16, int norm_before_residual, float eps, long H,
                long Hq, long Hkv, long D, long I, long N, long head_from, const float *cos, const float *sin,
                long rope_stride, float *kv, long S, const int64_t *slots, const uint8_t *mask, long mask_stride,
                long bound, float *prenorm, float *logits, int threads) {
    size_t a = attention_floats(M, 2 * H, Hq, Hkv, D, bound, threads), b = mlp_floats(M, H, I, threads);
    size_t own = ((size_t)M * 5 * H + 15) & ~(size_t)15; /* fc's out, x [M, 2H], the residual, attention's out */
    size_t c = (size_t)threads * M * H; /* the head's normalized rows (normed) */
    float *base = scratch(own + (a > b ? (a > c ? a : c) : (b > c ? b : c)));
    if (!base) return -1;
    float *feat = base, *x = feat + M * H, *res = x + M * 2 * H, *att = res + M * H, *buf = base + own;
#pragma omp parallel num_threads(threads)
    {
        if (taps) skinny_part(taps, M, Kt, w[E3_FC], is_bf16, H, 0, 0, feat); /* ends on a barrier */
        const float *f = taps ? feat : feature;
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            float *row = x + m * 2 * H, *e = row + H; /* the embedding, gathered into place, then normed */
            gather_row(embed, ep, es0, es1, es2, tokens[m], H, e);
            norm_row(e, H, w[E3_INPUT_NORM], eps, row);
            norm_row(f + m * H, H, w[E3_HIDDEN_NORM], eps, e);
            memcpy(res + m * H, norm_before_residual ? e : f + m * H, H * sizeof(float));
        }
        attention_part(x, M, 2 * H, 0, 0.0f, res, w[E3_QKV], is_bf16, w[E3_QKV_BIAS], Hq, Hkv, D, w[E3_O], w[E3_O_BIAS],
                       H, cos, sin, rope_stride, kv, S, slots, mask, mask_stride, bound, att, buf);
        mlp_part(att, M, H, w[E3_POST_NORM], eps, w[E3_GATE_UP], is_bf16, w[E3_GATE_UP_BIAS], I, w[E3_DOWN],
                 w[E3_DOWN_BIAS], prenorm, buf);
        long R = M - head_from;
        if (R > 0)
            skinny_part(normed(prenorm + head_from * H, R, H, w[E3_NORM], eps, buf), R, H, w[E3_HEAD], is_bf16, N, 0, 0,
                        logits);
    }
    return 0;
}

/* The K largest of x [n] (K <= n), largest first, the lower index first among equal values: their
   indices into top [K] (torch.topk's order where the values differ). */
static void top_k(const float *x, long n, int K, long *top) {
    int have = 0;
    for (long i = 0; i < n; i++) {
        if (have == K && !(x[i] > x[top[K - 1]])) continue;
        int at = have < K ? have++ : K - 1; /* insert i, keeping the order */
        while (at > 0 && x[i] > x[top[at - 1]]) top[at] = top[at - 1], at--;
        top[at] = i;
    }
}

/* row [n] -> its log-softmax's K largest: values [K] and draft ids [K] (max + log of the sum of
   exp(x - max), LANES at a time). */
static void top_logp(const float *row, long n, int K, float *values, int64_t *ids, long *scratch_top) {
    float top = row[argmax_row(row, n)];
    vw sums = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES) sums += expw(loadw(row + i) - top);
    float sum = hsumw(sums);
    for (; i < n; i++) sum += expf(row[i] - top);
    float lse = top + logf(sum);
    top_k(row, n, K, scratch_top);
    for (int k = 0; k < K; k++) values[k] = row[scratch_top[k]] - lse, ids[k] = scratch_top[k];
}

/* An EAGLE-2 tree's levels (specdec_runtime/eagle3.py: Eagle3Drafter._tree, whose torch ops this
   is on a CPU; eagle3_draft runs it after the catch-up rows): from the newest row's
   prenorm0 [H] and draft logits0 [N], the top K children of each expanded node, level by level;
   the K best by path log-probability are expanded next (a row each, at rope position L - 2 + depth,
   attending to the prefix's L - 1 slots, its ancestors' rows and its own, its row slot L - 1 + the
   rows run before it). levels: the depth the tree may reach. Writes the nodes in the order the
   torch ops make them: score (the path's log-probability), tok (draft id), parent (node index or
   -1), rank (among its siblings) [K + (levels - 1) K K]; returns their count, or -1 when out of
   memory. draft_ids [N]: each draft id's target id; cos / sin: rope row 0, rows rope_stride apart;
   the rest as eagle3_rows. */
static long eagle3_tree(const float *prenorm0, const float *logits0, const int64_t *draft_ids, long L, int levels,
                        int K, const float *embed, long ep, long es0, long es1, long es2, const void *const *w,
                        int is_bf16, int norm_before_residual, float eps, long H, long Hq, long Hkv, long D, long I,
                        long N, const float *cos, const float *sin, long rope_stride, float *kv, long S, float *score,
                        int64_t *tok, int64_t *parent, int64_t *rank, int threads) {
    long most = K + (long)(levels - 1) * K * K, bound_most = L - 1 + (long)(levels - 1) * K;
    size_t floats = ((size_t)K * H * 2 + (size_t)K * N + (size_t)K * K + 1) & ~(size_t)1; /* (then longs) */
    float *mem = malloc(floats * sizeof(float) + most * sizeof(long) + (size_t)K * bound_most);
    if (!mem) return -1;
    float *features = mem, *prenorm = features + K * H, *logits = prenorm + K * H, *cand = logits + K * N;
    long *slot_of = (long *)(mem + floats); /* a node's row slot (-1: none) */
    uint8_t *mask = (uint8_t *)(slot_of + most);
    int64_t frontier[K], rows[K], slots[K], child_ids[K * K];
    float child_values[K * K];
    long keep[K], top[K];
    top_logp(logits0, N, K, score, tok, top);
    for (int k = 0; k < K; k++) parent[k] = -1, rank[k] = k, frontier[k] = k, slot_of[k] = -1;
    for (int k = 0; k < K; k++) memcpy(features + k * H, prenorm0, H * sizeof(float));
    long n = K, slot = L - 1, F = K;
    for (int depth = 1; depth < levels; depth++) {
        long bound = slot + F;
        for (long r = 0; r < F; r++) {
            uint8_t *m = mask + r * bound;
            memset(m, 1, L - 1);
            memset(m + L - 1, 0, bound - (L - 1));
            slot_of[frontier[r]] = slot + r;
            for (long a = frontier[r]; a >= 0; a = parent[a]) m[slot_of[a]] = 1; /* itself and its ancestors */
            rows[r] = draft_ids[tok[frontier[r]]], slots[r] = slot + r;
        }
        long first = L - 2 + depth;
        int status = eagle3_rows(rows, F, embed, ep, es0, es1, es2, 0, 0, features, w, is_bf16, norm_before_residual,
                                 eps, H, Hq, Hkv, D, I, N, 0, cos + first * rope_stride, sin + first * rope_stride, 0,
                                 kv, S, slots, mask, bound, bound, prenorm, logits, threads);
        if (status) return free(mem), -1;
        for (long r = 0; r < F; r++) top_logp(logits + r * N, N, K, child_values + r * K, child_ids + r * K, top);
        for (long j = 0; j < F * K; j++) cand[j] = score[frontier[j / K]] + child_values[j];
        int kept = F * K < K ? (int)(F * K) : K;
        top_k(cand, F * K, kept, keep);
        for (long j = 0; j < F * K; j++) {
            score[n + j] = cand[j], tok[n + j] = child_ids[j], parent[n + j] = frontier[j / K], rank[n + j] = j % K;
            slot_of[n + j] = -1;
        }
        for (int i = 0; i < kept; i++) { /* the next level's rows read the prenorm of their parent's row */
            frontier[i] = n + keep[i];
            memcpy(features + i * H, prenorm + keep[i] / K * H, H * sizeof(float));
        }
        n += F * K, slot += F, F = kept;
    }
    free(mem);
    return n;
}

/* A whole EAGLE-2 tree draft in one call (eagle3.Eagle3Drafter._draft on a CPU, where the two calls
   of eagle3_rows and eagle3_tree and the choice of nodes in Python cost ~0.2 ms of cold Python a
   round): the catch-up rows, then the tree's levels from the newest row, then its `budget` best
   nodes. The catch-up: M accepted positions' taps [M, Kt] with the tokens after them, tokens [M],
   at positions and cache slots first .. first + M - 1, each attending to the slots up to its own
   (first + M = L - 1: the prefix the tree's rows attend to). The choice: nodes by score, largest
   first, the lower index first among equals, each taken once its parent is (a child never scores
   above its parent), until `budget`: out [budget, 3] holds each chosen node's parent (its place in
   out, -1 for the root's children), rank among its siblings and draft id, in the order chosen.
   Returns the nodes chosen, or -1 when out of memory. The rest as eagle3_rows and eagle3_tree. */
long eagle3_draft(const int64_t *tokens, long M, const float *taps, long Kt, long first, const float *embed, long ep,
                  long es0, long es1, long es2, const void *const *w, int is_bf16, int norm_before_residual, float eps,
                  long H, long Hq, long Hkv, long D, long I, long N, const float *cos, const float *sin,
                  long rope_stride, float *kv, long S, const int64_t *draft_ids, int levels, int K, int budget,
                  int64_t *out, int threads) {
    long L = first + M + 1, most = K + (long)(levels - 1) * K * K;
    size_t longs = (size_t)M + 4 * (size_t)most, floats = (size_t)M * H + N + most; /* longs first: aligned */
    int64_t *slots = malloc(longs * sizeof(int64_t) + floats * sizeof(float) + (size_t)M * (L - 1));
    if (!slots) return -1;
    int64_t *tok = slots + M, *parent = tok + most, *rank = parent + most,
            *place = rank + most; /* a node's place in out (-1: not chosen) */
    float *prenorm = (float *)(place + most), *logits = prenorm + M * H, *score = logits + N;
    uint8_t *mask = (uint8_t *)(score + most);
    for (long m = 0; m < M; m++) { /* causal: row m sees the slots up to its own */
        slots[m] = first + m;
        memset(mask + m * (L - 1), 1, first + m + 1);
        memset(mask + m * (L - 1) + first + m + 1, 0, L - 1 - (first + m + 1));
    }
    long n = -1;
    if (eagle3_rows(tokens, M, embed, ep, es0, es1, es2, taps, Kt, 0, w, is_bf16, norm_before_residual, eps, H, Hq,
                    Hkv, D, I, N, M - 1, cos + first * rope_stride, sin + first * rope_stride, rope_stride, kv, S,
                    slots, M > 1 ? mask : 0, L - 1, L - 1, prenorm, logits, threads) == 0)
        n = eagle3_tree(prenorm + (M - 1) * H, logits, draft_ids, L, levels, K, embed, ep, es0, es1, es2, w, is_bf16,
                        norm_before_residual, eps, H, Hq, Hkv, D, I, N, cos, sin, rope_stride, kv, S, score, tok,
                        parent, rank, threads);
    long chosen = 0;
    if (n > 0) {
        for (long i = 0; i < n; i++) place[i] = -1;
        while (chosen < budget) { /* the best node not chosen whose parent is (budget is a handful) */
            long best = -1;
            for (long i = 0; i < n; i++)
                if (place[i] < 0 && (parent[i] < 0 || place[parent[i]] >= 0) && (best < 0 || score[i] > score[best]))
                    best = i;
            if (best < 0) break;
            place[best] = chosen;
            out[3 * chosen] = parent[best] < 0 ? -1 : place[parent[best]];
            out[3 * chosen + 1] = rank[best], out[3 * chosen + 2] = tok[best];
            chosen++;
        }
    }
    free(slots);
    return n < 0 ? -1 : chosen;
}
