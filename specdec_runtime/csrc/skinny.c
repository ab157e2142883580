/* y [M, N] = x [M, K] @ W^T (+ bias [N]) (+ res [M, N]) for a few rows of x (decode, verify and
   draft steps on a CPU), fp32, on torch's OpenMP threads, from W^T [N, K] packed in quads of rows
   (cpu_kernel.pack): quad q holds rows 4q to 4q + 3 as alternating chunks of K (8 elements for
   fp32; for bf16 LANES, 16 where the compiler targets AVX-512: skinny_lanes()), K padded to a
   multiple of the chunk with zeros (and N to a multiple of 4 with zero rows). See
   specdec_runtime/cpu_kernel.py.

   Each thread streams its own contiguous block of quads from memory once, one sequential stream;
   up to ROWS rows of x (12 where the CPU has 32 vector registers, else 6) reuse each chunk from
   registers, and more rows take several passes over a block while it is in cache. Four weight rows
   per load of x give one row of x four independent sums: with the pairs of rows this kernel read
   before, a one-row product waited on the latency of its two chains of multiply-adds and streamed
   at ~80% of a plain read when the machine's bandwidth was high (58-60 GB/s on a 2-core EPYC); with
   quads it streams at ~91%, and a decode step runs ~16% faster there (as fast where bandwidth is
   low). One row is bound by memory; its stream is prefetched 3 KiB ahead, every line, with the
   non-temporal hint: a decode step in ~0.91x the time of the hardware prefetcher alone on the
   2-core EPYC (Zen 5) when its memory reads ~50 GB/s, ~0.92-0.94x at ~78 GB/s (1, 2, 4 and 6 KiB
   ahead measured up to 3% slower in one phase or the other; an earlier session found the
   multi-row tiles' prefetching, 1 KiB non-temporal and 16 KiB into L2, slower than none for one
   row). Two or more rows are also bound by the multiply-adds, and while a core computes, the
   hardware prefetcher alone falls behind: their stream is prefetched 6 KiB ahead non-temporal and
   16 KiB ahead into L2, every line (verify steps of 5-9 rows in 0.94-0.97x the time of 1 KiB
   ahead; 4 KiB ahead without the L2 prefetch 1.1-1.16x). Products of up to 128 rows beat MKL's
   GEMM, and with TILE_WIDE up to 2048 (scripts/bench_cost.py).

   Every output is summed in one fixed order (one sum per lane over the chunks of K, the lanes
   folded, then the tail of K, then bias, then res), whatever M, the tiling and the thread split: a
   row's result does not depend on which other rows were computed with it. */
#pragma STDC FP_CONTRACT OFF            /* fused only where fma8 says so (vec.h) */
#pragma GCC optimize("fp-contract=off") /* GCC ignores the former */
#include <math.h>

#include "vec.h"

#ifndef ONE
#define ONE 3072 /* bytes ahead in the packed stream, non-temporal, where a tile computes one row */
#endif
#ifndef NEAR
#define NEAR 6144 /* and where it computes several, non-temporal */
#endif
#ifndef FAR
#define FAR 16384 /* and into L2 */
#endif

/* A packed weight of either element type: fp32 in chunks of 8 floats (AVX2's width), or bf16 (a
   drafter's weights rounded to bfloat16 for half the bytes; cpu_kernel.pack) in chunks of LANES
   (16 where the compiler targets AVX-512), widened exactly to fp32. Per type: its vector, lanes,
   loads of a weight chunk and of x, multiply-add and the lanes' sum. 16 lanes measured faster for
   bf16 weights at every row count (0.66-0.87x the time of 8, 1-12 rows, on the 2-core EPYC, Zen 5)
   but slower for fp32 at 4-6 rows (1.1-1.25x; faster only from 8 rows on), though this CPU's
   512-bit multiply-adds do twice the work of 256-bit ones (measured, README): why is not settled.
   fp32 passes of 7-12 rows use 512-bit registers another way, bitwise the same (TILE_WIDE). */
typedef float f32;
typedef v8 vec_f32;
#define LANES_f32 8
static inline v8 loadp_f32(const f32 *p) { return load8(p); }
static inline v8 loadx_f32(const float *p) { return load8(p); }
static inline v8 fma_f32(v8 a, v8 b, v8 c) { return fma8(a, b, c); }
static inline float hsum_f32(v8 s) { return hsum(s); }
static inline float f32_float(f32 v) { return v; }
#define PAD_bf16 0
typedef vw vec_bf16;
#define LANES_bf16 LANES
static inline vw loadp_bf16(const bf16 *p) { return loadw_bf16(p); }
static inline vw loadx_bf16(const float *p) { return loadw(p); }
static inline vw fma_bf16(vw a, vw b, vw c) { return fmaw(a, b, c); }
static inline float hsum_bf16(vw s) { return hsumw(s); }

/* hsum() of each of 8 accumulators r[0..7], 8 sums at a time, each in hsum's order ((0 + 4) + (1 +
   5)) + ((2 + 6) + (3 + 7)): some 20 instructions for all 8, where hsum() takes 7 or more for one.
   Tiles pass a quad's 4 rows for two rows of x: (row m's 4 sums, row m + 1's 4). */
static inline v8 hsum8(const v8 *r) {
    v8 u[4]; /* lanes i + (i + 4), two accumulators side by side */
    for (int i = 0; i < 4; i++)
        u[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    v8 v[2]; /* adjacent pairs of those: (u0 + u1), (u2 + u3) of four accumulators */
    for (int i = 0; i < 2; i++)
        v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 2, 4, 6, 8, 10, 12, 14) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* y[m N + r] (+ bias, + res) for rows m and m + 1 and a quad's 4 rows r from their 8 sums (hsum8),
   each added in the order of the one-by-one epilogue: the sum, then bias, then res. */
static inline void store4x2(v8 s, float *y, long m, long N, const float *bias, const float *res) {
    v4 b, r0, r1;
    if (bias) {
        __builtin_memcpy(&b, bias, sizeof b);
        s += __builtin_shufflevector(b, b, 0, 1, 2, 3, 0, 1, 2, 3);
    }
    if (res) {
        __builtin_memcpy(&r0, res + m * N, sizeof r0);
        __builtin_memcpy(&r1, res + (m + 1) * N, sizeof r1);
        s += __builtin_shufflevector(r0, r1, 0, 1, 2, 3, 4, 5, 6, 7);
    }
    v4 lo = __builtin_shufflevector(s, s, 0, 1, 2, 3), hi = __builtin_shufflevector(s, s, 4, 5, 6, 7);
    __builtin_memcpy(y + m * N, &lo, sizeof lo);
    __builtin_memcpy(y + (m + 1) * N, &hi, sizeof hi);
}

/* A product accumulator as 8 lanes whose hsum() is its own lanes' sum (hsum_T). */
static inline v8 as8_f32(v8 v) { return v; }
static inline v8 as8_bf16(vw v) { return fold8(v); }

#if defined(__x86_64__)
#define IN_REGISTER(v) __asm__("" : "+v"(v)) /* one load of x feeds both products (GCC reloads it otherwise) */
#else
#define IN_REGISTER(v) (void)0
#endif

/* MR rows of x against the R of one quad's 4 rows that start at row h (R = 4: the whole quad, in
   one pass; R = 2: its halves in turn, where 4 * MR accumulators would not fit in registers; w:
   the quad's 4 * K padded elements): R * MR accumulators (the compiler unrolls the constant loops
   and keeps them in registers). `rows`: how many of the quad's rows are real (N not a multiple of
   4: the last quad's others are padding); `live`: how many of the MR rows of x are (where PAD_T is
   set a tile may run more rows than it is given: the rest repeat the last row of x, and their sums
   are not stored). */
#define LINES(T) (int)(4 * LANES_##T * sizeof(T) / 64) /* 64-byte lines a step of a quad reads */
#define TILE(T, MR, R)                                                                                            \
    static void tile_##T##_##MR(const float *x, const void *wp, long K, float *y, long N, int rows,               \
                                const float *bias, const float *res, int live) {                                  \
        const float *xr[MR];                                                                                      \
        for (int m = 0; m < MR; m++) xr[m] = x + (PAD_##T && m >= live ? live - 1 : m) * K;                       \
        for (int h = 0; h < 4; h += R) {                                                                          \
            const T *w = (const T *)wp + LANES_##T * h;                                                           \
            vec_##T a[MR][R];                                                                                     \
            for (int m = 0; m < MR; m++)                                                                          \
                for (int r = 0; r < R; r++) a[m][r] = (vec_##T){0};                                               \
            long k = 0;                                                                                           \
            for (; k + LANES_##T <= K; k += LANES_##T) {                                                          \
                for (int l = 0; l < LINES(T); l++) { /* every line */                                             \
                    if (MR == 1) {                                                                                \
                        __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + ONE, 0, 0);                       \
                        continue;                                                                                 \
                    }                                                                                             \
                    __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + NEAR, 0, 0);                          \
                    __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + FAR, 0, 2);                           \
                }                                                                                                 \
                vec_##T p[R];                                                                                     \
                for (int r = 0; r < R; r++) p[r] = loadp_##T(w + 4 * k + LANES_##T * r);                          \
                for (int m = 0; m < MR; m++) {                                                                    \
                    vec_##T xm = loadx_##T(xr[m] + k);                                                            \
                    IN_REGISTER(xm);                                                                              \
                    for (int r = 0; r < R; r++) a[m][r] = fma_##T(p[r], xm, a[m][r]);                             \
                }                                                                                                 \
            }                                                                                                     \
            int m = 0;                                                                                            \
            if (R == 4 && k == K && rows == 4) /* two rows' sums at a time (hsum8), then one by one */             \
                for (; m + 2 <= (PAD_##T ? live : MR); m += 2) {                                                  \
                    v8 r8[8];                                                                                     \
                    for (int i = 0; i < 8; i++) r8[i] = as8_##T(a[m + i / 4][i % 4]);                             \
                    store4x2(hsum8(r8), y, m, N, bias, res);                                                      \
                }                                                                                                 \
            for (; m < (PAD_##T ? live : MR); m++)                                                                \
                for (int r = 0; r < R && h + r < rows; r++) {                                                     \
                    const T *tail = w + 4 * k + LANES_##T * r; /* row r's last chunk: K - k values, then zeros */ \
                    float s = hsum_##T(a[m][r]);                                                                  \
                    for (long j = k; j < K; j++) s = fmaf(T##_float(tail[j - k]), x[m * K + j], s);               \
                    if (bias) s += bias[h + r];                                                                   \
                    if (res) s += res[m * N + h + r];                                                             \
                    y[m * N + h + r] = s;                                                                         \
                }                                                                                                 \
        }                                                                                                         \
    }

typedef void (*tile_fn)(const float *, const void *, long, float *, long, int, const float *, const float *, int);
#if defined(__AVX512VL__) /* 32 vector registers: up to 24 accumulators, the quad's loads and x */
#define ROWS 12
/* fp32 passes of 2-3 rows run the 4-row tile and of 5 the 6-row one: in fast phases (a stream of
   ~60 GB/s) the 2-core EPYC ran the target's products of 3 and 5 rows 5-10% faster that way (2
   rows ~3%; 4 and 6 rows were already faster than 3 and 5), and the same in slow ones; bf16 tiles
   ran 3-6% slower padded, so they keep their own (a throwaway C harness, README). */
#define PAD_f32 1
#define TILES(T)                                                                                                  \
    TILE(T, 1, 4) TILE(T, 2, 4) TILE(T, 3, 4) TILE(T, 4, 4) TILE(T, 5, 4) TILE(T, 6, 4) TILE(T, 7, 2)             \
        TILE(T, 8, 2) TILE(T, 9, 2) TILE(T, 10, 2) TILE(T, 11, 2) TILE(T, 12, 2)
#define TABLE(T)                                                                                                  \
    {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6, tile_##T##_7,         \
     tile_##T##_8, tile_##T##_9, tile_##T##_10, tile_##T##_11, tile_##T##_12}
#else /* AVX2's 16: 12 accumulators */
#define ROWS 6
#define PAD_f32 0 /* (not measured on AVX2) */
#define TILES(T) TILE(T, 1, 4) TILE(T, 2, 4) TILE(T, 3, 4) TILE(T, 4, 2) TILE(T, 5, 2) TILE(T, 6, 2)
#define TABLE(T) {0, tile_##T##_1, tile_##T##_2, tile_##T##_3, tile_##T##_4, tile_##T##_5, tile_##T##_6}
#endif
#if defined(__AVX512VL__)
/* fp32 passes of 7-12 rows in 512-bit registers: one load holds two rows' chunks of a quad (rows 0
   and 1, or 2 and 3: side by side in the pack) and x's 8 floats are broadcast to both halves, so
   every lane sums what the 8-lane tile's lane sums, in the same order (bitwise the same outputs),
   with half the multiply-add instructions, and the whole quad fits one pass (2 * MR accumulators,
   24 at most; the 8-lane tiles take its halves in turn). A pass of that many rows is bound by its
   multiply-adds (a prefill, a large tree's verify), and on the 2-core EPYC (Zen 5: two full-width
   512-bit FMA units a core, 2x the 256-bit rate, measured) the target's products ran in 0.65-0.75x
   the time at 12-128 rows and 0.91-0.93x at 7-8. At 1-6 rows, bound by memory, the same tiles ran
   1.06-1.23x slower (also without software prefetch, or with x doubled in memory instead of
   broadcast), so those keep the 8-lane tiles (README). */
#define TILE_WIDE(MR)                                                                                             \
    static void tile_wide_##MR(const float *x, const void *wp, long K, float *y, long N, int rows,                \
                               const float *bias, const float *res, int live) {                                   \
        const float *xr[MR], *w = (const float *)wp;                                                              \
        for (int m = 0; m < MR; m++) xr[m] = x + m * K;                                                           \
        __m512 a[MR][2];                                                                                          \
        for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();                                     \
        long k = 0;                                                                                               \
        for (; k + 8 <= K; k += 8) {                                                                              \
            for (int l = 0; l < 2; l++) { /* the two lines of this step of the quad */                           \
                __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + NEAR, 0, 0);                              \
                __builtin_prefetch((const char *)(w + 4 * k) + 64 * l + FAR, 0, 2);                               \
            }                                                                                                     \
            __m512 p01 = _mm512_loadu_ps(w + 4 * k), p23 = _mm512_loadu_ps(w + 4 * k + 16);                       \
            for (int m = 0; m < MR; m++) {                                                                        \
                __m512 xm = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[m] + k));                                   \
                a[m][0] = _mm512_fmadd_ps(p01, xm, a[m][0]);                                                      \
                a[m][1] = _mm512_fmadd_ps(p23, xm, a[m][1]);                                                      \
            }                                                                                                     \
        }                                                                                                         \
        int m = 0;                                                                                                \
        if (k == K && rows == 4) /* two rows' sums at a time (hsum8), then one by one */                          \
            for (; m + 2 <= live; m += 2) {                                                                       \
                v8 r8[8];                                                                                         \
                for (int i = 0; i < 8; i++) {                                                                     \
                    __m512 both = a[m + i / 4][i % 4 / 2];                                                        \
                    r8[i] = (v8)(i & 1 ? _mm512_extractf32x8_ps(both, 1) : _mm512_castps512_ps256(both));         \
                }                                                                                                 \
                store4x2(hsum8(r8), y, m, N, bias, res);                                                          \
            }                                                                                                     \
        for (; m < live; m++)                                                                                     \
            for (int r = 0; r < rows; r++) {                                                                      \
                const float *tail = w + 4 * k + 8 * r; /* as in TILE */                                           \
                __m512 both = a[m][r >> 1];                                                                       \
                v8 half = (v8)(r & 1 ? _mm512_extractf32x8_ps(both, 1) : _mm512_castps512_ps256(both));           \
                float s = hsum(half);                                                                             \
                for (long j = k; j < K; j++) s = fmaf(tail[j - k], x[m * K + j], s);                              \
                if (bias) s += bias[r];                                                                           \
                if (res) s += res[m * N + r];                                                                     \
                y[m * N + r] = s;                                                                                 \
            }                                                                                                     \
    }
TILE_WIDE(7) TILE_WIDE(8) TILE_WIDE(9) TILE_WIDE(10) TILE_WIDE(11) TILE_WIDE(12)
TILE(f32, 1, 4) TILE(f32, 2, 4) TILE(f32, 3, 4) TILE(f32, 4, 4) TILE(f32, 5, 4) TILE(f32, 6, 4)
#define WIDE_F32 1
#define TABLE_f32                                                                                                 \
    {0, tile_f32_1, tile_f32_2, tile_f32_3, tile_f32_4, tile_f32_5, tile_f32_6, tile_wide_7, tile_wide_8,         \
     tile_wide_9, tile_wide_10, tile_wide_11, tile_wide_12}
#else
TILES(f32)
#define TABLE_f32 TABLE(f32)
#define WIDE_F32 0
#endif
TILES(bf16)
static const tile_fn tiles[2][ROWS + 1] = {TABLE_f32, TABLE(bf16)};

/* The tile a pass of mr rows runs (PAD_f32: a larger one for a few fp32 counts). */
static long tile_rows(int is_bf16, long mr) {
    if (PAD_f32 && !is_bf16 && (mr == 2 || mr == 3 || mr == 5)) return mr == 5 ? 6 : 4;
    return mr;
}

#define BLOCK 4 /* quads of w's rows per task */

/* The rows of w (packed fp32, or bf16 where is_bf16 is set) this thread computes, inside an enclosing
   parallel region (layers.c runs a whole sublayer in one region): an orphaned worksharing loop, so
   its split is skinny_matmul's. */
void skinny_part(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                 const float *res, float *y) {
    long quads = (N + 3) / 4, passes = (M + ROWS - 1) / ROWS, per = (M + passes - 1) / passes;
    long lanes = is_bf16 ? LANES_bf16 : LANES_f32;
    size_t stride = 4 * ((K + lanes - 1) / lanes * lanes) * (is_bf16 ? sizeof(bf16) : sizeof(float)); /* bytes a quad */
#pragma omp for schedule(static)
    for (long q0 = 0; q0 < quads; q0 += BLOCK) {
        long q1 = q0 + BLOCK < quads ? q0 + BLOCK : quads;
        for (long m = 0; m < M; m += per) { /* passes of equal rows: 16 rows as 8 + 8, not 12 + 4 */
            long mr = M - m < per ? M - m : per, tile = tile_rows(is_bf16, mr);
            for (long q = q0; q < q1; q++) {
                long n = 4 * q;
                tiles[is_bf16 != 0][tile](x + m * K, (const char *)w + q * stride, K, y + m * N + n, N,
                                          N - n < 4 ? (int)(N - n) : 4, bias ? bias + n : 0, res ? res + m * N + n : 0,
                                          (int)mr);
            }
        }
    }
}

void skinny_matmul(const float *x, long M, long K, const void *w, int is_bf16, long N, const float *bias,
                   const float *res, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    skinny_part(x, M, K, w, is_bf16, N, bias, res, y);
}

/* The lanes of the chunks a packed weight of this type is read in (cpu_kernel.pack). */
int skinny_lanes(int is_bf16) { return is_bf16 ? LANES_bf16 : LANES_f32; }

/* 1 where fp32 passes of 7-12 rows run in 512-bit registers (TILE_WIDE): cpu_kernel.max_rows(). */
int skinny_wide(void) { return WIDE_F32; }

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
