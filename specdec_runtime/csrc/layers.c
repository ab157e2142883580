/* A decoder layer's two sublayers for a few rows (decode, verify and draft steps on a CPU), fp32,
   each in one call and one parallel region on torch's OpenMP threads. See specdec_runtime/cpu_kernel.py.

   torch runs a sublayer as some twenty small ops, each dispatched, allocated and forked over the
   threads; at one to a few rows their overhead was a third of a decode step. Here the norm, the
   products (skinny.c), rope, the cache write, attention and the gated activation run back to back
   with a barrier between them.

   Every value is computed in one fixed order that depends only on its own row: a row of a verify
   step is bitwise the same row of a decode step (attention sums over the slots in slot order, the
   masked ones skipped). Rope and the gated activation round each product before adding, as torch
   and transformers do. No product is fused into an add here (FP_CONTRACT off): GCC fuses some
   copies of an inlined loop and not others, and a row's sums must not depend on which copy ran. */
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
   summed in `lanes`' order, then the tail of n. */
static inline float dot_in(const float *a, const float *b, long n, float (*lanes)(v8)) {
    v8 s = {0};
    long k = 0;
    for (; k + 8 <= n; k += 8) s += load8(a + k) * load8(b + k);
    float t = lanes(s);
    for (; k < n; k++) t += a[k] * b[k];
    return t;
}

static float dot(const float *a, const float *b, long n) { return dot_in(a, b, n, hsum); }

/* out = w * (x / sqrt(mean(x^2) + eps)), as transformers' RMSNorm. */
static void norm_row(const float *x, long n, const float *w, float eps, float *out) {
    float r = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (long k = 0; k < n; k++) out[k] = w[k] * (x[k] * r);
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

/* q . k over D, its lanes in tree8's order. */
static float score(const float *q, const float *k, long D) { return dot_in(q, k, D, tree8); }

/* score() of the 8 keys k [8, D] into p [8]: eight independent sums, their lanes reduced together
   in three rounds of pairs (tree8's order for each key), where one key at a time spent more on its
   lanes' sum than on its products (a verify step's rows each read every cached key). */
static void scores8(const float *q, const float *k, long D, float *p) {
    v8 s[8] = {{0}};
    long d = 0;
    for (; d + 8 <= D; d += 8) {
        v8 qd = load8(q + d);
        for (int i = 0; i < 8; i++) s[i] += qd * load8(k + i * D + d);
    }
    v8 lo = pairs(pairs(s[0], s[1]), pairs(s[2], s[3])); /* keys 0-3: lanes (0+1)+(2+3), then (4+5)+(6+7) */
    v8 hi = pairs(pairs(s[4], s[5]), pairs(s[6], s[7])); /* keys 4-7 */
    store8(p, __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15));
    for (int i = 0; i < 8; i++)
        for (long e = d; e < D; e++) p[i] += q[e] * k[i * D + e];
}

/* out [D] = softmax(q . k_j * scale over the slots j < bound that mask allows) @ v. p: scratch of
   bound rounded up to 8 floats. Each score is score()'s, whichever keys share its block of 8; the
   weights' sum runs over 8 lanes of slots with 0 at every slot not attended to, so the result does
   not depend on bound past the last slot attended to (a row of a verify step sees more, masked,
   slots than the same row decoded). */
static void attend(const float *q, const float *k, const float *v, long D, const uint8_t *mask, long bound,
                   float scale, float *p, float *out) {
    long padded = (bound + 7) & ~7L;
    float top = -INFINITY;
    long j = 0;
    for (; j + 8 <= bound; j += 8) scores8(q, k + j * D, D, p + j);
    for (; j < bound; j++) p[j] = score(q, k + j * D, D);
    for (j = 0; j < bound; j++) p[j] *= scale;
    for (j = 0; j < bound; j++)
        if (!mask || mask[j]) top = p[j] > top ? p[j] : top;
    for (j = bound; j < padded; j++) p[j] = 0.0f;
    v8 sums = {0};
    for (j = 0; j < padded; j += 8) {
        v8 e = exp8(load8(p + j) - top);
        v8i keep = {0};
        if (j + 8 <= bound && mask)
            for (int i = 0; i < 8; i++) keep[i] = -(int)mask[j + i]; /* bool bytes: 0 or 1 */
        else
            for (int i = 0; i < 8; i++) keep[i] = j + i < bound && (!mask || mask[j + i]) ? -1 : 0;
        e = blend(keep, e, (v8){0});
        store8(p + j, e);
        sums += e;
    }
    float sum = hsum(sums);
    long d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) { /* 64 dims at a time in 2 x 8 registers: even and odd slots, each in order */
        v8 even[8] = {{0}}, odd[8] = {{0}};
        for (j = 0; j < bound; j += 2) { /* a slot not attended to (or at e^-88) adds nothing: skipped */
            const float *vj = v + j * D + d0;
            if (p[j] != 0.0f)
                for (int c = 0; c < 8; c++) even[c] += p[j] * load8(vj + 8 * c);
            if (j + 1 < bound && p[j + 1] != 0.0f)
                for (int c = 0; c < 8; c++) odd[c] += p[j + 1] * load8(vj + D + 8 * c);
        }
        for (int c = 0; c < 8; c++) store8(out + d0 + 8 * c, (even[c] + odd[c]) / sum);
    }
    for (long d = d0; d < D; d++) { /* head dims past a multiple of 64 */
        float t = 0.0f;
        for (j = 0; j < bound; j++) t += p[j] * v[j * D + d];
        out[d] = t / sum;
    }
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
    long nqkv = (H + 2 * Hkv) * D, heads = H + 2 * Hkv, group = H / Hkv;
    size_t hn = norm ? (size_t)(M * Kin) : 0;
    long padded = (bound + 7) & ~7L;
    float *buf = scratch(hn + M * nqkv + M * H * D + (size_t)threads * padded);
    if (!buf) return -1;
    float *h = norm ? buf : (float *)x, *qkv = buf + hn, *att = qkv + M * nqkv, *p = att + M * H * D;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel num_threads(threads)
    {
        if (norm) {
#pragma omp for schedule(static)
            for (long m = 0; m < M; m++) norm_row(x + m * Kin, Kin, norm, eps, h + m * Kin);
        }
        skinny_part(h, M, Kin, wqkv, is_bf16, nqkv, bqkv, 0, qkv);
#pragma omp for schedule(static)
        for (long i = 0; i < M * heads; i++) {
            long m = i / heads, head = i % heads;
            float *v = qkv + m * nqkv + head * D;
            if (head < H + Hkv) rope(v, cos + m * rope_stride, sin + m * rope_stride, D);
            if (head >= H) memcpy(kv + ((head - H) * S + slots[m]) * D, v, D * sizeof(float));
        }
        float *mine = p + (long)omp_get_thread_num() * padded;
#pragma omp for schedule(static)
        for (long i = 0; i < M * H; i++) {
            long m = i / H, head = i % H, g = head / group;
            attend(qkv + m * nqkv + head * D, kv + g * S * D, kv + (Hkv + g) * S * D, D,
                   mask ? mask + m * mask_stride : 0, bound, scale, mine, att + m * H * D + head * D);
        }
        skinny_part(att, M, H * D, wo, is_bf16, Hd, bo, residual, out);
    }
    return 0;
}

/* out [M, Hd] = x + down(silu(gate(norm(x))) * up(norm(x))), gate and up the halves of one
   product [M, 2I]; the weights packed (skinny.c), in bf16 where is_bf16 is set. Returns 0, or -1 when
   out of memory. */
int mlp_block(const float *x, long M, long Hd, const float *norm, float eps, const void *wgu, int is_bf16,
              const float *bgu, long I, const void *wd, const float *bd, float *out, int threads) {
    float *h = scratch(M * Hd + M * 2 * I + M * I);
    if (!h) return -1;
    float *gu = h + M * Hd, *act = gu + M * 2 * I;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) norm_row(x + m * Hd, Hd, norm, eps, h + m * Hd);
        skinny_part(h, M, Hd, wgu, is_bf16, 2 * I, bgu, 0, gu);
#pragma omp for schedule(static)
        for (long m = 0; m < M; m++) {
            const float *g = gu + m * 2 * I, *u = g + I;
            float *a = act + m * I;
            long i = 0;
            for (; i + 8 <= I; i += 8) {
                v8 gi = load8(g + i);
                store8(a + i, gi / (1.0f + exp8(-gi)) * load8(u + i));
            }
            for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        skinny_part(act, M, I, wd, is_bf16, Hd, bd, x, out);
    }
    return 0;
}

/* A layer's weights in decoder_layers' pointer array, in this order (biases may be NULL). */
enum { ATTN_NORM, QKV, QKV_BIAS, O, O_BIAS, MLP_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, PER_LAYER };

/* Layers [first, last) of a decoder for M rows of one sequence, x [M, Hd] updated in place: each
   layer's attention_block, then its mlp_block, as model.Decoder._forward calls them one by one,
   without a trip through Python between them. w: PER_LAYER pointers a layer (the enum above), the
   weights packed (in bf16 where is_bf16 is set); kv: layer 0's cache [2 Hkv, S, D], the next
   layer's kv_stride floats further. flags[i - first]: 1 skips layer i's attention, 2 its MLP.
   tap_at[i - first], i in [first, last]: which of the ntaps blocks of taps [M, ntaps * Hd] gets x
   as it enters layer i (as it leaves the last layer at i = last), or -1. Returns 0, or -1 when
   out of memory. */
int decoder_layers(float *x, long M, long Hd, long first, long last, const void *const *w, int is_bf16,
                   const int *flags, float eps, long H, long Hkv, long D, long I, float *kv, long kv_stride,
                   const float *cos, const float *sin, long rope_stride, long S, const int64_t *slots,
                   const uint8_t *mask, long mask_stride, long bound, const long *tap_at, float *taps, long ntaps,
                   int threads) {
    for (long i = first; i <= last; i++) {
        long t = tap_at[i - first];
        if (t >= 0)
            for (long m = 0; m < M; m++) memcpy(taps + (m * ntaps + t) * Hd, x + m * Hd, Hd * sizeof(float));
        if (i == last) break;
        const void *const *l = w + i * PER_LAYER;
        if (!(flags[i - first] & 1) &&
            attention_block(x, M, Hd, l[ATTN_NORM], eps, x, l[QKV], is_bf16, l[QKV_BIAS], H, Hkv, D, l[O], l[O_BIAS],
                            Hd, cos, sin, rope_stride, kv + i * kv_stride, S, slots, mask, mask_stride, bound, x,
                            threads))
            return -1;
        if (!(flags[i - first] & 2) && mlp_block(x, M, Hd, l[MLP_NORM], eps, l[GATE_UP], is_bf16, l[GATE_UP_BIAS], I,
                                                 l[DOWN], l[DOWN_BIAS], x, threads))
            return -1;
    }
    return 0;
}
