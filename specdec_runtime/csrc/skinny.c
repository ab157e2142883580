/* y [M, N] = x [M, K] @ W^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify and
   draft steps on a CPU), fp32, on torch's OpenMP threads, from W^T [N, K] packed in pairs of rows
   (cpu_kernel.pack): pair p holds rows 2p and 2p + 1 as alternating 8-float chunks of K, K padded
   to a multiple of 8 with zeros (and N to an even count with a zero row). See
   specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of pairs from memory once, one sequential stream
   prefetched 1 KiB ahead; up to 6 rows of x reuse each chunk from registers. Two weight rows per
   load of x halve the loads per product, which is what kept 4-6 rows from running at the 1-row
   rate (one row at a time: 1.27x the 1-row time for 4 rows; pairs and the prefetch: 1.04x).

   Every output is summed in one fixed order (one 8-lane sum over the chunks of K, folded, then the
   tail of K, then bias, then res), whatever M, the tiling and the thread split: a row's result
   does not depend on which other rows were computed with it. */
#pragma STDC FP_CONTRACT OFF            /* fused only where fma8 says so (vec.h) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>

#include "vec.h"

#define PREFETCH 1024 /* bytes ahead in the packed stream */

/* Loads of a packed weight of either element type: fp32, or bf16 (a drafter's weights rounded to
   bfloat16 for half the bytes; cpu_kernel.pack), widened exactly to fp32. */
typedef float f32;
static inline v8 load8_f32(const f32 *p) { return load8(p); }
static inline float f32_float(f32 v) { return v; }

/* MR rows of x against one pair of W^T's rows (w: the pair's 2 * K8 elements): 2 * MR accumulators
   (at most 12 of AVX2's 16 vector registers; the compiler unrolls the constant loops). two: whether
   the pair's second row is a real one (N odd: the last pair's is padding). */
#define TILE(T, MR)                                                                                     \
    static void tile_##T##_##MR(const float *x, const void *wp, long K, float *y, long N, int two,      \
                                const float *bias, const float *res) {                                  \
        const T *w = wp;                                                                                \
        v8 a[MR], b[MR];                                                                                \
        for (int m = 0; m < MR; m++) a[m] = b[m] = (v8){0};                                             \
        long k = 0;                                                                                     \
        for (; k + 8 <= K; k += 8) {                                                                    \
            __builtin_prefetch((const char *)(w + 2 * k) + PREFETCH, 0, 0);                             \
            v8 p = load8_##T(w + 2 * k), q = load8_##T(w + 2 * k + 8);                                  \
            for (int m = 0; m < MR; m++) {                                                              \
                v8 xm = load8(x + m * K + k);                                                           \
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

#define TILES(T) TILE(T, 1) TILE(T, 2) TILE(T, 3) TILE(T, 4) TILE(T, 5) TILE(T, 6)
TILES(f32)
TILES(bf16)

typedef void (*tile_fn)(const float *, const void *, long, float *, long, int, const float *, const float *);
static const tile_fn tiles[2][7] = {{0, tile_f32_1, tile_f32_2, tile_f32_3, tile_f32_4, tile_f32_5, tile_f32_6},
                                    {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6}};

#define ROWS 6  /* rows of x per tile */
#define BLOCK 8 /* pairs of w's rows per task */

/* The rows of w (packed fp32, or bf16 where is_bf16 is set) this thread computes, inside an enclosing
   parallel region (layers.c runs a whole sublayer in one region): an orphaned worksharing loop, so
   its split is skinny_matmul's. */
void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y) {
    long pairs = (N + 1) / 2;
    size_t stride = 2 * ((K + 7) & ~7L) * (is_bf16 ? sizeof(unsigned short) : sizeof(float)); /* bytes a pair */
#pragma omp for schedule(static)
    for (long p0 = 0; p0 < pairs; p0 += BLOCK) {
        long p1 = p0 + BLOCK < pairs ? p0 + BLOCK : pairs;
        for (long m = 0; m < M; m += ROWS) {
            long mr = M - m < ROWS ? M - m : ROWS;
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
