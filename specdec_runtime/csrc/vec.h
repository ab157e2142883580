/* 8-lane fp32 vectors (AVX2's width) with GCC's vector extensions, shared by the kernels. */
#pragma once

#if defined(__FMA__) && defined(__x86_64__)
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

/* 8 bfloat16s as floats (exact: the bits shifted into place). */
static inline v8 load8_bf16(const bf16 *p) {
    v8h h;
    __builtin_memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, v8u) << 16);
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

/* The lanes' sum, in one fixed order. */
static inline float hsum(v8 s) { return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])); }

/* Lanes of a where m is set (all bits), else of b. */
static inline v8 blend(v8i m, v8 a, v8 b) { return (v8)(((v8i)a & m) | ((v8i)b & ~m)); }

/* e^x per lane, to about 1 ulp (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times
   2^n); 0 below -87.3, the largest float's neighbourhood above 88.7. */
static inline v8 exp8(v8 x) {
    const v8 one = (v8){0} + 1.0f;
    v8i tiny = x < -87.33654f;
    x = blend(x > 88.72283f, (v8){0} + 88.72283f, x);
    v8 fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i); /* toward zero, then down to floor(fx) */
    v8 fn = __builtin_convertvector(n, v8);
    v8i over = fn > fx;
    fn -= blend(over, one, (v8){0});
    n += over; /* -1 where it was rounded up */
    x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
    v8 y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + one;
    v8 scale = (v8)((n + 127) << 23);
    return blend(tiny, (v8){0}, y * scale);
}
