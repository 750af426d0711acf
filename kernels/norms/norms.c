/* Row normalisations (kernels/norms.py) over N rows of D: RMSNorm, RMSNorm times sigmoid(gate) (KDA's output norm),
 * and the L2 norm of KDA's q and k; forward and backward, one pass over a row while it is in cache. */
#include "k3.h"

static inline float sumsq(const float *x, int64_t D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < D; k++) s += x[k] * x[k];
    return s;
}

/* y = x / sqrt(mean(x^2) + eps) * w (* sigmoid(gate) when gate is not NULL). */
void k3_rms_norm(const float *x, const float *w, const float *gate, float *y, int64_t N, int64_t D, float eps,
                 int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * D))
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * D;
        float *yn = y + n * D;
        float r = 1.0f / sqrtf(sumsq(xn, D) / (float)D + eps);
        if (gate) {
            const float *gn = gate + n * D;
#pragma omp simd
            for (int64_t k = 0; k < D; k++) yn[k] = xn[k] * r * w[k] * k3_sigmoid(gn[k]);
        } else {
#pragma omp simd
            for (int64_t k = 0; k < D; k++) yn[k] = xn[k] * r * w[k];
        }
    }
}

/* RMSNorm's backward for the cotangent gy (times sigmoid(gate) when gate is not NULL, whose gradient goes to
 * dgate): dx = (gy w - xhat mean(gy w xhat)) r, dw_partial[thread] += gy xhat (zeroed by the caller, [threads, D]),
 * dgate = gy y (1 - sigmoid(gate)) with y the gated output. */
void k3_rms_norm_bwd(const float *gy, const float *x, const float *w, const float *gate, float *dx, float *dw_partial,
                     float *dgate, int64_t N, int64_t D, float eps, int nthreads) {
#pragma omp parallel num_threads(k3_threads(nthreads, N * D))
    {
        float *dw = k3_thread_row(dw_partial, D);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xn = x + n * D, *gn = gy + n * D;
            float *dxn = dx + n * D;
            float r = 1.0f / sqrtf(sumsq(xn, D) / (float)D + eps), dot = 0.0f;
            if (gate) {
                const float *an = gate + n * D;
                float *dgn = dgate + n * D;
#pragma omp simd reduction(+ : dot)
                for (int64_t k = 0; k < D; k++) {
                    float s = k3_sigmoid(an[k]), g = gn[k] * s, xh = xn[k] * r;
                    dxn[k] = g; /* gy s, kept for the second pass */
                    dw[k] += g * xh;
                    dgn[k] = g * xh * w[k] * (1.0f - s);
                    dot += g * w[k] * xh;
                }
            } else {
#pragma omp simd reduction(+ : dot)
                for (int64_t k = 0; k < D; k++) {
                    float xh = xn[k] * r;
                    dxn[k] = gn[k];
                    dw[k] += gn[k] * xh;
                    dot += gn[k] * w[k] * xh;
                }
            }
            float mean = dot / (float)D;
#pragma omp simd
            for (int64_t k = 0; k < D; k++) dxn[k] = (dxn[k] * w[k] - xn[k] * r * mean) * r;
        }
    }
}

/* y = x / sqrt(sum(x^2) + eps). */
void k3_l2_norm(const float *x, float *y, int64_t N, int64_t D, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * D))
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * D;
        float *yn = y + n * D, r = 1.0f / sqrtf(sumsq(xn, D) + eps);
#pragma omp simd
        for (int64_t k = 0; k < D; k++) yn[k] = xn[k] * r;
    }
}

/* dx = r (gy - y sum(gy y)), y = x r. */
void k3_l2_norm_bwd(const float *gy, const float *x, float *dx, int64_t N, int64_t D, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * D))
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * D, *gn = gy + n * D;
        float *dxn = dx + n * D, r = 1.0f / sqrtf(sumsq(xn, D) + eps), dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t k = 0; k < D; k++) dot += gn[k] * xn[k] * r;
#pragma omp simd
        for (int64_t k = 0; k < D; k++) dxn[k] = (gn[k] - xn[k] * r * dot) * r;
    }
}
