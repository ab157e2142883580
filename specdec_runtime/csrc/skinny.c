/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify
   and draft steps on a CPU), fp32, on torch's OpenMP threads. See specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of w's rows from memory once; up to 6 rows of x
   reuse each row of w from cache. Every output is summed in one fixed order (two 8-lane partial
   sums over alternating 8-column chunks of K, folded pairwise, then the tail of K, then bias,
   then res), whatever M, the tiling and the thread split: a row's result does not depend on which
   other rows were computed with it. */
#include <stddef.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float fold(v8 a, v8 b) {
    v8 s = a + b;
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

/* MR rows of x against NR rows of w: 2 * MR * NR accumulators, at most 12 so they stay in the 16
   vector registers of AVX2 (the compiler unrolls both constant loops). */
#define TILE(MR, NR)                                                                             \
    static void tile_##MR##_##NR(const float *x, const float *w, long K, float *y, long N,     \
                                 const float *bias, const float *res) {                        \
        v8 a[MR][NR], b[MR][NR];                                                               \
        for (int m = 0; m < MR; m++)                                                           \
            for (int r = 0; r < NR; r++) a[m][r] = b[m][r] = (v8){0};                          \
        long k = 0;                                                                            \
        for (; k + 16 <= K; k += 16)                                                           \
            for (int r = 0; r < NR; r++) {                                                     \
                v8 p = load8(w + r * K + k), q = load8(w + r * K + k + 8);                     \
                for (int m = 0; m < MR; m++) {                                                 \
                    a[m][r] += p * load8(x + m * K + k);                                       \
                    b[m][r] += q * load8(x + m * K + k + 8);                                   \
                }                                                                              \
            }                                                                                  \
        for (int m = 0; m < MR; m++)                                                           \
            for (int r = 0; r < NR; r++) {                                                     \
                float s = fold(a[m][r], b[m][r]);                                              \
                for (long j = k; j < K; j++) s += w[r * K + j] * x[m * K + j];                 \
                if (bias) s += bias[r];                                                        \
                if (res) s += res[m * N + r];                                                  \
                y[m * N + r] = s;                                                              \
            }                                                                                  \
    }

TILE(1, 4) TILE(2, 3) TILE(3, 2) TILE(4, 1) TILE(5, 1) TILE(6, 1)
TILE(1, 1) TILE(2, 1) TILE(3, 1)

typedef void (*tile_fn)(const float *, const float *, long, float *, long, const float *, const float *);
static const tile_fn wide[7] = {0, tile_1_4, tile_2_3, tile_3_2, tile_4_1, tile_5_1, tile_6_1};
static const tile_fn narrow[7] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
static const long width[7] = {0, 4, 3, 2, 1, 1, 1};

#define ROWS 6   /* rows of x per tile */
#define BLOCK 12 /* rows of w per task: a multiple of every tile width */

void skinny_matmul(const float *x, long M, long K, const float *w, long N, const float *bias,
                   const float *res, float *y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long n0 = 0; n0 < N; n0 += BLOCK) {
        long n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
        for (long m = 0; m < M; m += ROWS) {
            long mr = M - m < ROWS ? M - m : ROWS, n = n0;
            const float *xm = x + m * K, *rm = res ? res + m * N : 0;
            for (; n + width[mr] <= n1; n += width[mr])
                wide[mr](xm, w + n * K, K, y + m * N + n, N, bias ? bias + n : 0, rm ? rm + n : 0);
            for (; n < n1; n++)
                narrow[mr](xm, w + n * K, K, y + m * N + n, N, bias ? bias + n : 0, rm ? rm + n : 0);
        }
    }
}
