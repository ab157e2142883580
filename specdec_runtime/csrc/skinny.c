/* y [M, N] = x [M, K] @ W^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify and
   draft steps on a CPU), fp32, on torch's OpenMP threads, from W^T [N, K] packed in quads of rows
   (cpu_kernel.pack): quad q holds rows 4q to 4q + 3 as alternating 8-float chunks of K, K padded
   to a multiple of 8 with zeros (and N to a multiple of 4 with zero rows). See
   specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of quads from memory once, one sequential stream;
   up to ROWS rows of x (12 where the CPU has 32 vector registers, else 6) reuse each chunk from
   registers, and more rows take several passes over a block while it is in cache. Four weight rows
   per load of x give one row of x four independent sums: with the pairs of rows this kernel read
   before, a one-row product waited on the latency of its two chains of multiply-adds and streamed
   at ~80% of a plain read when the machine's bandwidth was high (58-60 GB/s on a 2-core Zen 4); with
   quads it streams at ~91%, and a decode step runs ~16% faster there (as fast where bandwidth is
   low). One row is bound by memory, and the hardware prefetcher keeps up with its one stream (a
   software prefetch 1 KiB ahead measured slower). Two or more rows are also bound by the
   multiply-adds, and while a core computes, the hardware prefetcher alone falls behind: their
   stream is prefetched 1 KiB ahead into L1 and 16 KiB ahead into L2, every line. Products of up to
   128 rows beat MKL's GEMM (scripts/bench_cost.py).

   Every output is summed in one fixed order (one 8-lane sum over the chunks of K, folded, then the
   tail of K, then bias, then res), whatever M, the tiling and the thread split: a row's result
   does not depend on which other rows were computed with it (and is bitwise what the pairs gave). */
#pragma STDC FP_CONTRACT OFF            /* fused only where fma8 says so (vec.h) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>

#include "vec.h"

#define NEAR 1024  /* bytes ahead in the packed stream, into L1, where a tile computes several rows */
#define FAR 16384  /* and into L2 */

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

/* MR rows of x against the R of one quad's 4 rows that start at row h (R = 4: the whole quad, in
   one pass; R = 2: its halves in turn, where 4 * MR accumulators would not fit in registers; w:
   the quad's 4 * K8 elements): R * MR accumulators (the compiler unrolls the constant loops and
   keeps them in registers). `rows`: how many of the quad's rows are real (N not a multiple of 4:
   the last quad's others are padding). */
#define LINES(T) (int)(32 * sizeof(T) / 64) /* 64-byte lines a step of a quad reads: 2 fp32, 1 bf16 */
#define TILE(T, MR, R)                                                                                  \
    static void tile_##T##_##MR(const float *x, const void *wp, long K, float *y, long N, int rows,     \
                                const float *bias, const float *res) {                                  \
        for (int h = 0; h < 4; h += R) {                                                                \
            const T *w = (const T *)wp + 8 * h;                                                         \
            v8 a[MR][R];                                                                                \
            for (int m = 0; m < MR; m++)                                                                \
                for (int r = 0; r < R; r++) a[m][r] = (v8){0};                                          \
            long k = 0;                                                                                 \
            for (; k + 8 <= K; k += 8) {                                                                \
                for (int l = 0; MR > 1 && l < LINES(T); l++) { /* every line; one row: none */         \
                    __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + NEAR, 0, 0);                \
                    __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + FAR, 0, 2);                 \
                }                                                                                       \
                v8 p[R];                                                                                \
                for (int r = 0; r < R; r++) p[r] = load8_##T(w + 4 * k + 8 * r);                        \
                for (int m = 0; m < MR; m++) {                                                          \
                    v8 xm = load8(x + m * K + k);                                                       \
                    IN_REGISTER(xm);                                                                    \
                    for (int r = 0; r < R; r++) a[m][r] = fma8(p[r], xm, a[m][r]);                      \
                }                                                                                       \
            }                                                                                           \
            for (int m = 0; m < MR; m++)                                                                \
                for (int r = 0; r < R && h + r < rows; r++) {                                           \
                    const T *tail = w + 4 * k + 8 * r; /* row r's last chunk: K - k values, then zeros */  \
                    float s = hsum(a[m][r]);                                                            \
                    for (long j = k; j < K; j++) s = fmaf(T##_float(tail[j - k]), x[m * K + j], s);     \
                    if (bias) s += bias[h + r];                                                         \
                    if (res) s += res[m * N + h + r];                                                   \
                    y[m * N + h + r] = s;                                                               \
                }                                                                                       \
        }                                                                                               \
    }

typedef void (*tile_fn)(const float *, const void *, long, float *, long, int, const float *, const float *);
#if defined(__AVX512VL__) /* 32 vector registers: up to 24 accumulators, the quad's loads and x */
#define ROWS 12
#define TILES(T)                                                                                        \
    TILE(T, 1, 4) TILE(T, 2, 4) TILE(T, 3, 4) TILE(T, 4, 4) TILE(T, 5, 4) TILE(T, 6, 4) TILE(T, 7, 2)   \
        TILE(T, 8, 2) TILE(T, 9, 2) TILE(T, 10, 2) TILE(T, 11, 2) TILE(T, 12, 2)
#define TABLE(T)                                                                                        \
    {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6, tile_##T##_7, \
     tile_##T##_8, tile_##T##_9, tile_##T##_10, tile_##T##_11, tile_##T##_12}
#else /* AVX2's 16: 12 accumulators */
#define ROWS 6
#define TILES(T) TILE(T, 1, 4) TILE(T, 2, 4) TILE(T, 3, 4) TILE(T, 4, 2) TILE(T, 5, 2) TILE(T, 6, 2)
#define TABLE(T) {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6}
#endif
TILES(f32)
TILES(bf16)
static const tile_fn tiles[2][ROWS + 1] = {TABLE(f32), TABLE(bf16)};

#define BLOCK 4 /* quads of w's rows per task */

/* The rows of w (packed fp32, or bf16 where is_bf16 is set) this thread computes, inside an enclosing
   parallel region (layers.c runs a whole sublayer in one region): an orphaned worksharing loop, so
   its split is skinny_matmul's. */
void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y) {
    long quads = (N + 3) / 4, passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    size_t stride = 4 * ((K + 7) & ~7L) * (is_bf16 ? sizeof(unsigned short) : sizeof(float)); /* bytes a quad */
#pragma omp for schedule(static)
    for (long q0 = 0; q0 < quads; q0 += BLOCK) {
        long q1 = q0 + BLOCK < quads ? q0 + BLOCK : quads;
        for (long m = 0; m < M; m += per) { /* passes of equal rows: 16 rows as 8 + 8, not 12 + 4 */
            long mr = M - m < per ? M - m : per;
            for (long q = q0; q < q1; q++) {
                long n = 4 * q;
                tiles[is_bf16 != 0][mr](x + m * K, (const char *)w + q * stride, K, y + m * N + n, N,
                                        N - n < 4 ? (int)(N - n) : 4, bias ? bias + n : 0, res ? res + m * N + n : 0);
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
