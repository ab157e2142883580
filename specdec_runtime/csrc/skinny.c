/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify
   and draft steps on a CPU), fp32, on torch's OpenMP threads. See specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of w's rows from memory once, one row at a time;
   up to 6 rows of x reuse each row of w from cache. Every output is summed in one fixed order (two
   8-lane partial sums over alternating 8-column chunks of K, folded pairwise, then the tail of K,
   then bias, then res), whatever M, the tiling and the thread split: a row's result does not
   depend on which other rows were computed with it. */
#include "vec.h"

static inline float fold(v8 a, v8 b) { return hsum(a + b); }

/* MR rows of x against one row of w: 2 * MR accumulators (at most 12, in AVX2's 16 vector
   registers; the compiler unrolls the constant loops). One weight row at a time keeps each thread
   on one sequential stream, which measured faster than tiles of 2-4 weight rows (1-3 rows of x:
   25.6 / 22.8 / 21.1 GB/s against 23.0 / 19.0 / 16.1, with a 2-thread sum at 28 GB/s). */
#define TILE(MR)                                                                                  \
    static void tile_##MR(const float *x, const float *w, long K, float *y, long N, const float *bias, \
                          const float *res) {                                                     \
        v8 a[MR], b[MR];                                                                          \
        for (int m = 0; m < MR; m++) a[m] = b[m] = (v8){0};                                       \
        long k = 0;                                                                               \
        for (; k + 16 <= K; k += 16) {                                                            \
            v8 p = load8(w + k), q = load8(w + k + 8);                                            \
            for (int m = 0; m < MR; m++) {                                                        \
                a[m] += p * load8(x + m * K + k);                                                 \
                b[m] += q * load8(x + m * K + k + 8);                                             \
            }                                                                                     \
        }                                                                                         \
        for (int m = 0; m < MR; m++) {                                                            \
            float s = fold(a[m], b[m]);                                                           \
            for (long j = k; j < K; j++) s += w[j] * x[m * K + j];                                \
            if (bias) s += *bias;                                                                 \
            if (res) s += res[m * N];                                                             \
            y[m * N] = s;                                                                         \
        }                                                                                         \
    }

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

typedef void (*tile_fn)(const float *, const float *, long, float *, long, const float *, const float *);
static const tile_fn tiles[7] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

#define ROWS 6   /* rows of x per tile */
#define BLOCK 16 /* rows of w per task */

/* The rows of w this thread computes, inside an enclosing parallel region (layers.c runs a whole
   sublayer in one region): an orphaned worksharing loop, so its split is skinny_matmul's. */
void skinny_part(const float *x, long M, long K, const float *w, long N, const float *bias, const float *res,
                 float *y) {
#pragma omp for schedule(static)
    for (long n0 = 0; n0 < N; n0 += BLOCK) {
        long n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
        for (long m = 0; m < M; m += ROWS) {
            long mr = M - m < ROWS ? M - m : ROWS;
            for (long n = n0; n < n1; n++)
                tiles[mr](x + m * K, w + n * K, K, y + m * N + n, N, bias ? bias + n : 0, res ? res + m * N + n : 0);
        }
    }
}

void skinny_matmul(const float *x, long M, long K, const float *w, long N, const float *bias,
                   const float *res, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    skinny_part(x, M, K, w, N, bias, res, y);
}
