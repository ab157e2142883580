/* 8-lane fp32 vectors (AVX2's width) with GCC's vector extensions, shared by the kernels, and the
   LANES-wide ones of skinny.c's bf16 products. */
#pragma once

#if (defined(__FMA__) || defined(__AVX512F__)) && defined(__x86_64__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
typedef unsigned v8u __attribute__((vector_size(32)));
typedef unsigned short v8h __attribute__((vector_size(16)));
typedef unsigned short bf16; /* a bfloat16's bits: the top half of a float's */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float bf16_float(bf16 h) {
    unsigned u = (unsigned)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

/* a * b + c rounded once where the CPU fuses (FMA), else twice: the same on every call, whatever
   the compiler would contract (the kernels build with contraction off). */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__) && defined(__x86_64__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* The vectors of skinny.c's bf16 products: 16 lanes where the compiler targets AVX-512 (half the
   widening instructions a weight: measured faster at every row count; its fp32 products measured
   slower at 5-6 rows in 16 lanes and keep 8), else 8. */
#if !defined(LANES) && defined(__AVX512F__) && defined(__x86_64__)
#define LANES 16 /* (-DLANES=8 builds the 8-lane products on AVX-512 too, to compare the two) */
#elif !defined(LANES)
#define LANES 8
#endif
#if LANES == 16
typedef float vw __attribute__((vector_size(64)));
typedef int vwi __attribute__((vector_size(64)));
typedef unsigned vwu __attribute__((vector_size(64)));
typedef unsigned short vwh __attribute__((vector_size(32)));
static inline vw fmaw(vw a, vw b, vw c) { return (vw)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#else
typedef v8 vw;
typedef v8i vwi;
typedef v8u vwu;
typedef v8h vwh;
static inline vw fmaw(vw a, vw b, vw c) { return fma8(a, b, c); }
#endif

static inline vw loadw(const float *p) {
    vw v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* LANES bfloat16s as floats (exact: the bits shifted into place). */
static inline vw loadw_bf16(const bf16 *p) {
    vwh h;
    __builtin_memcpy(&h, p, sizeof h);
    return (vw)(__builtin_convertvector(h, vwu) << 16);
}

/* The lanes' sum, in one fixed order: ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), the first two rounds
   on 4 lanes at a time (GCC made 15 scalar instructions of it written lane by lane; every output
   of a product ends with one). */
typedef float v4 __attribute__((vector_size(16)));
static inline float hsum(v8 s) {
    v4 u = __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
    v4 v = u + __builtin_shufflevector(u, u, 1, 0, 3, 2); /* (0 + 4) + (1 + 5) in lane 0, (2 + 6) + (3 + 7) in 2 */
    return v[0] + v[2];
}

/* A product vector as 8 lanes: 16 lanes folded, lane i + lane i + 8. */
static inline v8 fold8(vw s) {
#if LANES == 16
    v8 lo, hi;
    __builtin_memcpy(&lo, &s, sizeof lo);
    __builtin_memcpy(&hi, (const char *)&s + sizeof lo, sizeof hi);
    return lo + hi;
#else
    return s;
#endif
}

/* A product vector's lanes' sum, in one fixed order (16 lanes: folded to 8 first). */
static inline float hsumw(vw s) { return hsum(fold8(s)); }

/* Lanes of a where m is set (all bits), else of b. */
static inline v8 blend(v8i m, v8 a, v8 b) { return (v8)(((v8i)a & m) | ((v8i)b & ~m)); }
static inline vw blendw(vwi m, vw a, vw b) { return (vw)(((vwi)a & m) | ((vwi)b & ~m)); }

/* The larger (smaller) of a's and b's lanes; b where either is a NaN (as vmaxps, vminps). */
#if defined(__AVX__) && defined(__x86_64__)
static inline v8 max8(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
static inline v8 min8(v8 a, v8 b) { return (v8)_mm256_min_ps((__m256)a, (__m256)b); }
#else
static inline v8 max8(v8 a, v8 b) { return blend(a > b, a, b); }
static inline v8 min8(v8 a, v8 b) { return blend(a < b, a, b); }
#endif
#if LANES == 16
static inline vw maxw(vw a, vw b) { return (vw)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vw minw(vw a, vw b) { return (vw)_mm512_min_ps((__m512)a, (__m512)b); }
#else
static inline vw maxw(vw a, vw b) { return max8(a, b); }
static inline vw minw(vw a, vw b) { return min8(a, b); }
#endif

/* e^x per lane, to about 1 ulp (Cephes' expf: x = n ln 2 + r, n = x log2(e) rounded to nearest, a
   degree-6 polynomial in r, times 2^n), the multiply-adds fused (FMA: fma8 / fmaw, the same on every
   call); 0 below -87.3 (and at -inf), the largest float's neighbourhood above 88.7. EXP(name, V, I,
   FMA, MAX, MIN) defines it for vectors V with lanes of int I (same lanes, same results: exp8, and
   expw on LANES lanes). */
#define EXP(name, V, I, FMA, MAX, MIN)                                                                            \
    static inline V name(V x) {                                                                                   \
        const V zero = {0};                                                                                       \
        I tiny = x < -87.33654f;                                                                                  \
        x = MIN(zero + 88.72283f, MAX(zero - 87.33654f, x)); /* a NaN stays one (MAX and MIN return b then) */  \
        V fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* 1.5 x 2^23: rounded to nearest */     \
        I n = __builtin_convertvector(fn, I);                                                                     \
        V r = FMA(fn, zero - 0.693359375f, x);                                                                    \
        r = FMA(fn, zero + 2.12194440e-4f, r);                                                                    \
        V y = FMA(zero + 1.9875691500e-4f, r, zero + 1.3981999507e-3f);                                           \
        y = FMA(y, r, zero + 8.3334519073e-3f);                                                                   \
        y = FMA(y, r, zero + 4.1665795894e-2f);                                                                   \
        y = FMA(y, r, zero + 1.6666665459e-1f);                                                                   \
        y = FMA(y, r, zero + 5.0000001201e-1f);                                                                   \
        y = FMA(y, r * r, r + 1.0f);                                                                              \
        return (V)((I)(y * (V)((n + 127) << 23)) & ~tiny);                                                        \
    }
EXP(exp8, v8, v8i, fma8, max8, min8)
EXP(expw, vw, vwi, fmaw, maxw, minw)
