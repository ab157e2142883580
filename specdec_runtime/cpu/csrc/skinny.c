/* y [M, N] = x [M, K] @ W^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify and
   draft steps on a CPU, prefills of up to cpu_kernel.max_rows()), fp32, on torch's OpenMP threads,
   from W packed in panels (cpu_kernel.pack): panel j holds output columns j NR .. j NR + NR - 1 of
   W [K, N] for every k in turn, [K, NR], N padded to a multiple of NR with zero columns. NR is two
   vectors: 32 columns where the compiler targets AVX-512 (16 lanes), 16 elsewhere (skinny_panel()).
   fp32, or bf16 (a drafter's weights rounded to bfloat16 for half the bytes, widened exactly).

   Each thread streams its own contiguous run of panels from memory once, one sequential stream.
   A pass of up to ROWS rows of x (12 with AVX-512's 32 vector registers, else 6) keeps 2 vectors of
   sums a row in registers and, for each k, loads the panel's two vectors of W once and multiplies
   them by that row's x[k] broadcast: an outer product, as GEMM micro-kernels do, with no horizontal
   sums at the end. More rows take several passes over a panel while it is in cache. One row is
   bound by memory; its stream is prefetched 3 KiB ahead with the non-temporal hint. Two or more are
   also bound by the multiply-adds, and while a core computes, the hardware prefetcher alone falls
   behind: their stream is prefetched 6 KiB ahead into L1.

   This layout replaced quads of W^T's rows read in chunks of K (one vector of sums an output, folded
   at the end by horizontal sums, ~15% of a 12-row pass). scripts/bench_cost.py on the bundled target
   (2-core EPYC, Zen 5, ~50 GB/s; the two kernels alternated, twice): a verify step of 6 / 9 / 12
   rows went from 1.15 / 1.21-1.23 / 1.21-1.22 to 1.07-1.09 / 1.12-1.13 / 1.15 decode steps, a
   decode step no slower; products of 64-128 rows run at ~415 GFLOP/s on the 2 cores.

   Every output is summed in one fixed order: its products x[k] W[k, n] fused into one sum in order
   of k for each block of KB k's, the blocks' sums added in order, then bias, then res; whatever M,
   the passes and the thread split. A row's result does not depend on which other rows were
   computed with it. (One sum over all of K was 2.4x as far from the float64 product as torch's fp32
   on a test decoder; blocks of 64 keep it within twice torch's, the tests' bound.) */
#pragma STDC FP_CONTRACT OFF            /* fused only where fmaw says so (vec.h) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec.h"

#ifndef ONE
#define ONE 3072 /* bytes ahead in the packed stream, non-temporal, where a pass computes one row */
#endif
#ifndef NEAR
#define NEAR 6144 /* and into L1 where it computes several */
#endif

#define NR (2 * LANES) /* a panel's columns */
#define KB 64          /* k's summed apart, then added to the running sums (accuracy: README) */
#if LANES == 16
#define ROWS 12 /* 24 vectors of sums, the panel's 2 and x's: 27 of 32 registers */
#else
#define ROWS 6 /* 12 + 2 + 1 of 16 */
#endif

/* A panel's element type: fp32, or bf16 widened exactly (a shift). */
typedef float f32;
static inline vw loadp_f32(const f32 *p) { return loadw(p); }
static inline vw loadp_bf16(const bf16 *p) { return loadw_bf16(p); }

/* s in every lane (one broadcast; a loop over the lanes compiled to merging broadcasts, each waiting
   on the last). */
static inline vw splat(float s) {
#if LANES == 16
    return (vw){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#else
    return (vw){s, s, s, s, s, s, s, s};
#endif
}

/* MR rows of x [MR, K] (row stride K) times one panel w [K, NR]: the sums acc [MR, NR]. */
#define PANEL(T, MR)                                                                                              \
    static void panel_##T##_##MR(const float *x, long K, const T *w, float *acc) {                                \
        enum { LINES = NR * (int)sizeof(T) / 64 > 0 ? NR * (int)sizeof(T) / 64 : 1 }; /* lines a k reads */      \
        for (long k0 = 0; k0 < K; k0 += KB) {                                                                     \
            long k1 = k0 + KB < K ? k0 + KB : K;                                                                  \
            vw a[MR][2];                                                                                          \
            for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = (vw){0};                                             \
            for (long k = k0; k < k1; k++) {                                                                      \
                const T *wk = w + k * NR;                                                                         \
                for (int l = 0; l < LINES; l++)                                                                   \
                    if (MR == 1)                                                                                  \
                        __builtin_prefetch((const char *)wk + 64 * l + ONE, 0, 0);                                \
                    else                                                                                          \
                        __builtin_prefetch((const char *)wk + 64 * l + NEAR, 0, 3);                               \
                vw w0 = loadp_##T(wk), w1 = loadp_##T(wk + LANES);                                                \
                for (int m = 0; m < MR; m++) {                                                                    \
                    vw xm = splat(x[m * K + k]);                                                                  \
                    a[m][0] = fmaw(w0, xm, a[m][0]);                                                              \
                    a[m][1] = fmaw(w1, xm, a[m][1]);                                                              \
                }                                                                                                 \
            }                                                                                                     \
            for (int m = 0; m < MR; m++)                                                                          \
                for (int h = 0; h < 2; h++) {                                                                     \
                    vw t = a[m][h];                                                                               \
                    if (k0) t += loadw(acc + m * NR + h * LANES);                                                 \
                    __builtin_memcpy(acc + m * NR + h * LANES, &t, sizeof t);                                     \
                }                                                                                                 \
        }                                                                                                         \
    }

typedef void (*panel_fn)(const float *, long, const void *, float *);
#define PANELS(T)                                                                                                 \
    PANEL(T, 1) PANEL(T, 2) PANEL(T, 3) PANEL(T, 4) PANEL(T, 5) PANEL(T, 6) PANELS_WIDE(T)
#if ROWS == 12
#define PANELS_WIDE(T) PANEL(T, 7) PANEL(T, 8) PANEL(T, 9) PANEL(T, 10) PANEL(T, 11) PANEL(T, 12)
#define TABLE(T)                                                                                                  \
    {0, (panel_fn)panel_##T##_1, (panel_fn)panel_##T##_2, (panel_fn)panel_##T##_3, (panel_fn)panel_##T##_4,       \
     (panel_fn)panel_##T##_5, (panel_fn)panel_##T##_6, (panel_fn)panel_##T##_7, (panel_fn)panel_##T##_8,          \
     (panel_fn)panel_##T##_9, (panel_fn)panel_##T##_10, (panel_fn)panel_##T##_11, (panel_fn)panel_##T##_12}
#else
#define PANELS_WIDE(T)
#define TABLE(T)                                                                                                  \
    {0, (panel_fn)panel_##T##_1, (panel_fn)panel_##T##_2, (panel_fn)panel_##T##_3, (panel_fn)panel_##T##_4,       \
     (panel_fn)panel_##T##_5, (panel_fn)panel_##T##_6}
#endif
PANELS(f32)
PANELS(bf16)
static const panel_fn panels[2][ROWS + 1] = {TABLE(f32), TABLE(bf16)};

/* A pass's sums acc [mr, NR] (rows m.., columns n0..n0 + width - 1 of y [M, N]) + bias + res, in that
   order, into y. */
static inline void store_pass(const float *acc, long m, long mr, long N, long n0, long width,
                              const float *bias, const float *res, float *y) {
    for (long i = 0; i < mr; i++)
        for (long c = 0; c < width; c++) {
            float s = acc[i * NR + c];
            if (bias) s += bias[n0 + c];
            if (res) s += res[(m + i) * N + n0 + c];
            y[(m + i) * N + n0 + c] = s;
        }
}

/* Products of bf16 pairs (AVX512-BF16's VDPBF16PS: 32 multiply-adds an instruction, twice an fp32
   FMA's), is_bf16 = 2: W packed in pairs (cpu_kernel.pack(pairs=True)), panel j [K / 2, NR, 2] with
   the weights of k = 2i and 2i + 1 of an output side by side, and x rounded to bf16 too (to
   nearest, ties to even), as serving engines run drafters: the products exact, summed in fp32 in no
   fixed order. For the lm_head's screen (layers.c: head_part), which only bounds the logits, and a
   drafter's weights (eagle3.FusedLayer), never a target's. From cache, one core: 9 rows at 488
   GFLOP/s, 4 at 326, against 213 and 163 for bf16 weights widened to fp32 (the 2-core EPYC). */
#if defined(__AVX512BF16__) && LANES == 16
#define PAIRS 1
#define PAIR_PANEL(MR)                                                                                            \
    static void pairs_##MR(const uint32_t *xp, long K2, const bf16 *w, float *acc) {                              \
        __m512 a[MR][2];                                                                                          \
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();                                    \
        for (long i = 0; i < K2; i++) {                                                                           \
            const bf16 *wi = w + i * 2 * NR;                                                                      \
            __builtin_prefetch((const char *)wi + NEAR, 0, MR == 1 ? 0 : 3);                                    \
            __builtin_prefetch((const char *)wi + 64 + NEAR, 0, MR == 1 ? 0 : 3);                               \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(wi), w1 = (__m512bh)_mm512_loadu_si512(wi + NR);         \
            for (int m = 0; m < MR; m++) {                                                                        \
                __m512bh xm = (__m512bh)_mm512_set1_epi32((int)xp[m * K2 + i]);                                   \
                a[m][0] = _mm512_dpbf16_ps(a[m][0], w0, xm);                                                      \
                a[m][1] = _mm512_dpbf16_ps(a[m][1], w1, xm);                                                      \
            }                                                                                                     \
        }                                                                                                         \
        for (int m = 0; m < MR; m++) {                                                                            \
            _mm512_storeu_ps(acc + m * NR, a[m][0]);                                                              \
            _mm512_storeu_ps(acc + m * NR + LANES, a[m][1]);                                                      \
        }                                                                                                         \
    }
PAIR_PANEL(1) PAIR_PANEL(2) PAIR_PANEL(3) PAIR_PANEL(4) PAIR_PANEL(5) PAIR_PANEL(6) PAIR_PANEL(7) PAIR_PANEL(8)
PAIR_PANEL(9) PAIR_PANEL(10) PAIR_PANEL(11) PAIR_PANEL(12)
typedef void (*pair_fn)(const uint32_t *, long, const bf16 *, float *);
static const pair_fn pair_panels[ROWS + 1] = {0,        pairs_1,  pairs_2, pairs_3, pairs_4,  pairs_5, pairs_6,
                                              pairs_7,  pairs_8,  pairs_9, pairs_10, pairs_11, pairs_12};

/* x [M, K] (K even) as bf16 pairs [M, K / 2] in this thread's own buffer (each thread of a product
   converts the rows itself: a few microseconds, no barrier); NULL when out of memory. */
static const uint32_t *pairs_of(const float *x, long M, long K) {
    static __thread uint32_t *buf;
    static __thread size_t size;
    size_t n = (size_t)M * (K / 2);
    if (n > size) {
        free(buf);
        size = (n + 1023) & ~(size_t)1023;
        buf = aligned_alloc(64, size * sizeof(uint32_t));
        if (!buf) return size = 0, NULL;
    }
    for (long m = 0; m < M; m++) {
        const float *r = x + m * K;
        uint32_t *o = buf + m * (K / 2);
        long k = 0;
        for (; k + 32 <= K; k += 32) { /* 32 floats -> 16 pairs, x[k] in the low half of the first */
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(r + k));
            _mm512_storeu_si512(o + k / 2, (__m512i)h);
        }
        for (; k < K; k += 2) {
            __m128bh h = _mm_cvtneps_pbh(_mm_set_ps(0, 0, r[k + 1], r[k]));
            uint32_t u;
            __builtin_memcpy(&u, &h, 4);
            o[k / 2] = u;
        }
    }
    return buf;
}

/* skinny_part for is_bf16 = 2. */
static void pairs_part(const float *x, long M, long K, const void *w, long N, const float *bias, const float *res,
                       float *y) {
    long K2 = K / 2, count = (N + NR - 1) / NR, passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    const uint32_t *xp = pairs_of(x, M, K);
    float acc[ROWS * NR];
#pragma omp for schedule(static)
    for (long j = 0; j < count; j++) {
        if (!xp) __builtin_trap(); /* out of memory for a few kilobytes */
        long n0 = j * NR, width = N - n0 < NR ? N - n0 : NR;
        for (long m = 0; m < M; m += per) {
            long mr = M - m < per ? M - m : per;
            pair_panels[mr](xp + m * K2, K2, (const bf16 *)w + j * K * NR, acc);
            store_pass(acc, m, mr, N, n0, width, bias, res, y);
        }
    }
}
#else
#define PAIRS 0
static void pairs_part(const float *x, long M, long K, const void *w, long N, const float *bias, const float *res,
                       float *y) {
    (void)x, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)res, (void)y;
    __builtin_trap(); /* cpu_kernel packs pairs only where skinny_pairs() says so */
}
#endif

/* Panel j of the product (output columns j NR .. j NR + NR - 1) for all M rows: skinny_part's work
   for one panel, in passes of equal rows (16 rows as 8 + 8, not 12 + 4). */
void skinny_panel_rows(const float *x, long M, long K, const void *w, int is_bf16, long N, long j, const float *bias,
                       const float *res, float *y) {
    long passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    long n0 = j * NR, width = N - n0 < NR ? N - n0 : NR;
    size_t stride = (size_t)K * NR * (is_bf16 ? sizeof(bf16) : sizeof(float)); /* bytes a panel */
    float acc[ROWS * NR];
    for (long m = 0; m < M; m += per) {
        long mr = M - m < per ? M - m : per;
        panels[is_bf16 != 0][mr](x + m * K, K, (const char *)w + j * stride, acc);
        store_pass(acc, m, mr, N, n0, width, bias, res, y);
    }
}

/* The rows of w (packed fp32, or bf16 where is_bf16 is set) this thread computes, inside an enclosing
   parallel region (layers.c runs a whole sublayer in one region): an orphaned worksharing loop over
   the panels, so its split is skinny_matmul's; it ends on the loop's barrier. */
void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y) {
    if (is_bf16 == 2) return pairs_part(x, M, K, w, N, bias, res, y);
    long count = (N + NR - 1) / NR;
#pragma omp for schedule(static)
    for (long j = 0; j < count; j++) skinny_panel_rows(x, M, K, w, is_bf16, N, j, bias, res, y);
}

void skinny_matmul(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                   const float *res, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    skinny_part(x, M, K, w, is_bf16, N, bias, res, y);
}

/* 1 where products of bf16 pairs are built (cpu_kernel.pairs()). */
int skinny_pairs(void) { return PAIRS; }

/* The columns of a panel (cpu_kernel.pack). */
int skinny_panel(void) { return NR; }

/* 1 where passes of 7-12 rows run in one pass of 512-bit registers: cpu_kernel.max_rows(). */
int skinny_wide(void) { return ROWS == 12; }

/* The sum of x [n] (n a multiple of 32), read once by `threads` threads, each a contiguous part: the
   plainest streaming read, that scripts/bench_cost.py holds a decode step's bytes to (torch's sum
   of a tensor read up to a third slower than this on a 2-core Zen 4). */
float stream_sum(const float *x, long n, int threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
#pragma omp for schedule(static)
        for (long i = 0; i < n; i += 32) {
            s0 += load8(x + i), s1 += load8(x + i + 8);
            s2 += load8(x + i + 16), s3 += load8(x + i + 24);
        }
        total += hsum((s0 + s1) + (s2 + s3));
    }
    return total;
}
