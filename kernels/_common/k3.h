/* Shared by the CPU target's C kernels: vector maths declarations, MX rounding, the parallel-loop rule.
 *
 * Tensors arrive as contiguous fp32 arrays (the Python wrappers in kernels/<family>_c.py check that).
 * Loops over more than K3_PARALLEL_MIN elements' work run on `nthreads` OpenMP threads (torch's count).
 */
#ifndef K3_H
#define K3_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef K3_VECTOR_MATH /* libmvec: `#pragma omp simd` loops call the vector forms of these */
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
#endif

#define K3_PARALLEL_MIN (1 << 15)

static inline int k3_threads(int nthreads, int64_t work) { return work >= K3_PARALLEL_MIN && nthreads > 1 ? nthreads : 1; }

/* This OpenMP thread's row of `width` values in a [threads, width] buffer of per-thread partial sums. */
static inline float *k3_thread_row(float *partial, int64_t width) {
#ifdef _OPENMP
    return partial + (int64_t)omp_get_thread_num() * width;
#else
    (void)width;
    return partial;
#endif
}

static inline float k3_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

static inline uint32_t k3_bits(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline float k3_float(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }

/* An MX element format: its largest exponent and value, 2^emin (the smallest normal) and 2^-mbits (the step
 * between its significands). */
typedef struct { int emax; float max, lowest, step; } k3_mx;

static inline k3_mx k3_mx_format(int emin, int emax, int mbits, float max) {
    k3_mx f = {emax, max, ldexpf(1.0f, emin), ldexpf(1.0f, -mbits)};
    return f;
}

/* 2^-shared of a block whose largest magnitude is amax (finite): the E8M0 byte is max(E - emax, 0) for amax's
 * exponent field E, and 2^-shared = 2^(127 - byte), a normal fp32 (kernels/mx.py, _fast_scales). */
static inline float k3_mx_inv_scale(float amax, k3_mx f) {
    int32_t e = (int32_t)((k3_bits(amax) >> 23) & 0xFF) - f.emax;
    return k3_float((uint32_t)(254 - (e > 0 ? e : 0)) << 23);
}

/* m (|m| <= max after the clamp) rounded to the element grid, ties to even: m / ulp * ulp with ulp a power of
 * two, 2^(max(floor(log2|m|), emin) - mbits), so both steps are exact and rintf is the one rounding. */
static inline float k3_mx_round(float m, k3_mx f) {
    m = m > f.max ? f.max : (m < -f.max ? -f.max : m);
    float ulp = k3_float(k3_bits(m) & 0x7F800000u);
    ulp = (ulp < f.lowest ? f.lowest : ulp) * f.step;
    return rintf(m / ulp) * ulp;
}

/* One block of n values fake-quantised from x into y (x == y allowed): NaN whole when it holds a NaN or Inf. */
static inline void k3_mx_block(const float *x, float *y, int n, k3_mx f) {
    float amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        bad |= !(a <= 3.4028234663852886e38f); /* NaN or Inf */
        amax = a > amax ? a : amax;
    }
    if (bad) {
        for (int i = 0; i < n; i++) y[i] = NAN;
        return;
    }
    float inv = k3_mx_inv_scale(amax, f);
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] = k3_mx_round(x[i] * inv, f) / inv;
}

#endif
