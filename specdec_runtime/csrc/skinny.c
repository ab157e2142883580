/* y [M, N] = x [M, K] @ W^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify and
   draft steps on a CPU), fp32, on torch's OpenMP threads, from W^T [N, K] packed in pairs of rows
   (cpu_kernel.pack): pair p holds rows 2p and 2p + 1 as alternating 8-float chunks of K, K padded
   to a multiple of 8 with zeros (and N to an even count with a zero row). See
   specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of pairs from memory once, one sequential stream;
   up to ROWS rows of x (12 where the CPU has 32 vector registers, else 6) reuse each chunk from
   registers, and more rows take several passes over a block while it is in cache. Two weight rows
   per load of x halve the loads per product. One row is bound by memory: its stream is prefetched
   1 KiB ahead into L1. Two or more rows are also bound by the multiply-adds, and while a core
   computes, the hardware prefetcher alone falls behind: their stream is also prefetched 16 KiB
   ahead into L2. On a 2-core Zen 4 (scripts/bench_cost.py) a verify step of 8 tokens then costs
   1.14-1.25 decode steps (was 1.9-2.8), and products of up to 128 rows beat MKL's GEMM.

   Every output is summed in one fixed order (one 8-lane sum over the chunks of K, folded, then the
   tail of K, then bias, then res), whatever M, the tiling and the thread split: a row's result
   does not depend on which other rows were computed with it. */
#pragma STDC FP_CONTRACT OFF            /* fused only where fma8 says so (vec.h) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>

#include "vec.h"

#define NEAR 1024  /* bytes ahead in the packed stream, into L1 */
#define FAR 16384  /* and into L2, where the tile also computes several rows */

/* Loads of a packed weight of either element type: fp32, or bf16 (a drafter's weights rounded to
   bfloat16 for half the bytes; cpu_kernel.pack), widened exactly to fp32. */
typedef float f32;
static inline v8 load8_f32(const f32 *p) { return load8(p); }
static inline float f32_float(f32 v) { return v; }

#if defined(__x86_64__)
#define IN_REGISTER(v) __asm__("" : "+v"(v)) /* one load of x feeds both products (GCC reloads it otherwise) */
#else
#define IN_REGISTER(v) (void)0
#endif

/* MR rows of x against one pair of W^T's rows (w: the pair's 2 * K8 elements): 2 * MR accumulators
   (the compiler unrolls the constant loops and keeps them in registers). two: whether the pair's
   second row is a real one (N odd: the last pair's is padding). */
#define TILE(T, MR)                                                                                     \
    static void tile_##T##_##MR(const float *x, const void *wp, long K, float *y, long N, int two,      \
                                const float *bias, const float *res) {                                  \
        const T *w = wp;                                                                                \
        v8 a[MR], b[MR];                                                                                \
        for (int m = 0; m < MR; m++) a[m] = b[m] = (v8){0};                                             \
        long k = 0;                                                                                     \
        for (; k + 8 <= K; k += 8) {                                                                    \
            __builtin_prefetch((const char *)(w + 2 * k) + NEAR, 0, 0);                                 \
            if (MR > 1) __builtin_prefetch((const char *)(w + 2 * k) + FAR, 0, 2);                      \
            v8 p = load8_##T(w + 2 * k), q = load8_##T(w + 2 * k + 8);                                  \
            for (int m = 0; m < MR; m++) {                                                              \
                v8 xm = load8(x + m * K + k);                                                           \
                IN_REGISTER(xm);                                                                        \
                a[m] = fma8(p, xm, a[m]);                                                               \
                b[m] = fma8(q, xm, b[m]);                                                               \
            }                                                                                           \
        }                                                                                               \
        for (int m = 0; m < MR; m++) {                                                                  \
            float s = hsum(a[m]), t = hsum(b[m]);                                                       \
            for (long j = k; j < K; j++) {                                                              \
                s = fmaf(T##_float(w[k + j]), x[m * K + j], s);                                         \
                t = fmaf(T##_float(w[k + 8 + j]), x[m * K + j], t);                                     \
            }                                                                                           \
            if (bias) s += bias[0], t += two ? bias[1] : 0.0f;                                          \
            if (res) s += res[m * N], t += two ? res[m * N + 1] : 0.0f;                                 \
            y[m * N] = s;                                                                               \
            if (two) y[m * N + 1] = t;                                                                  \
        }                                                                                               \
    }

typedef void (*tile_fn)(const float *, const void *, long, float *, long, int, const float *, const float *);
#if defined(__AVX512VL__) /* 32 vector registers: 24 accumulators, the pair and x */
#define ROWS 12
#define TILES(T)                                                                                        \
    TILE(T, 1) TILE(T, 2) TILE(T, 3) TILE(T, 4) TILE(T, 5) TILE(T, 6) TILE(T, 7) TILE(T, 8) TILE(T, 9)   \
        TILE(T, 10) TILE(T, 11) TILE(T, 12)
#define TABLE(T)                                                                                        \
    {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6, tile_##T##_7, \
     tile_##T##_8, tile_##T##_9, tile_##T##_10, tile_##T##_11, tile_##T##_12}
#else /* AVX2's 16: 12 accumulators */
#define ROWS 6
#define TILES(T) TILE(T, 1) TILE(T, 2) TILE(T, 3) TILE(T, 4) TILE(T, 5) TILE(T, 6)
#define TABLE(T) {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6}
#endif
TILES(f32)
TILES(bf16)
static const tile_fn tiles[2][ROWS + 1] = {TABLE(f32), TABLE(bf16)};

#define BLOCK 8 /* pairs of w's rows per task */

/* The rows of w (packed fp32, or bf16 where is_bf16 is set) this thread computes, inside an enclosing
   parallel region (layers.c runs a whole sublayer in one region): an orphaned worksharing loop, so
   its split is skinny_matmul's. */
void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y) {
    long pairs = (N + 1) / 2, passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    size_t stride = 2 * ((K + 7) & ~7L) * (is_bf16 ? sizeof(unsigned short) : sizeof(float)); /* bytes a pair */
#pragma omp for schedule(static)
    for (long p0 = 0; p0 < pairs; p0 += BLOCK) {
        long p1 = p0 + BLOCK < pairs ? p0 + BLOCK : pairs;
        for (long m = 0; m < M; m += per) { /* passes of equal rows: 16 rows as 8 + 8, not 12 + 4 */
            long mr = M - m < per ? M - m : per;
            for (long p = p0; p < p1; p++) {
                long n = 2 * p;
                tiles[is_bf16 != 0][mr](x + m * K, (const char *)w + p * stride, K, y + m * N + n, N, n + 1 < N,
                                     bias ? bias + n : 0, res ? res + m * N + n : 0);
            }
        }
    }
}

void skinny_matmul(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                   const float *res, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    skinny_part(x, M, K, w, is_bf16, N, bias, res, y);
}

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
