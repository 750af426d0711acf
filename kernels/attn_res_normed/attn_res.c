/* AttnRes with each source normalised once (kernels/attn_res_normed.py): per token, a softmax over the S sources
 * of r_i (v_i . u), u = query * norm_weight, then the sources mixed by it; and 1/rms of one source.
 * Legend: S sources, N tokens, D hidden size; sources [S, N, D], r [S, N], h and dh [N, D]. */
#include "k3.h"

static inline float dot(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < d; k++) s += a[k] * b[k];
    return s;
}

/* p[i] = softmax_i(z[i]) over S values, in place. */
static inline void softmax(float *z, int64_t S) {
    float m = z[0], sum = 0.0f;
    for (int64_t i = 1; i < S; i++) m = z[i] > m ? z[i] : m;
    for (int64_t i = 0; i < S; i++) sum += (z[i] = expf(z[i] - m));
    for (int64_t i = 0; i < S; i++) z[i] /= sum;
}

#define MAX_SOURCES 256

void k3_rms_inv(const float *x, float *r, int64_t N, int64_t D, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * D))
    for (int64_t n = 0; n < N; n++) r[n] = 1.0f / sqrtf(dot(x + n * D, x + n * D, D) / (float)D + eps);
}

/* dx = dr (-r^3 x / D), r recomputed. */
void k3_rms_inv_bwd(const float *dr, const float *x, float *dx, int64_t N, int64_t D, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * D))
    for (int64_t n = 0; n < N; n++) {
        const float *xn = x + n * D;
        float r = 1.0f / sqrtf(dot(xn, xn, D) / (float)D + eps), c = -dr[n] * r * r * r / (float)D;
        float *o = dx + n * D;
#pragma omp simd
        for (int64_t k = 0; k < D; k++) o[k] = c * xn[k];
    }
}

void k3_attn_res_normed(const float *v, const float *r, const float *u, float *h, int64_t S, int64_t N, int64_t D,
                        int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, S * N * D))
    for (int64_t n = 0; n < N; n++) {
        float p[MAX_SOURCES];
        for (int64_t i = 0; i < S; i++) p[i] = r[i * N + n] * dot(v + (i * N + n) * D, u, D);
        softmax(p, S);
        float *o = h + n * D;
        const float *v0 = v + n * D;
#pragma omp simd
        for (int64_t k = 0; k < D; k++) o[k] = p[0] * v0[k];
        for (int64_t i = 1; i < S; i++) {
            const float *vi = v + (i * N + n) * D;
            float pi = p[i];
#pragma omp simd
            for (int64_t k = 0; k < D; k++) o[k] += pi * vi[k];
        }
    }
}

/* dv_i = p_i dh + dz_i r_i u, dr_i = dz_i s_i, du_partial[thread] += dz_i r_i v_i, with s_i = v_i . u,
 * p = softmax(r s), dz_i = p_i (dh . v_i - sum_j p_j dh . v_j). du_partial is [nthreads, D], zeroed by the caller. */
void k3_attn_res_normed_bwd(const float *dh, const float *v, const float *r, const float *u, float *dv, float *dr,
                            float *du_partial, int64_t S, int64_t N, int64_t D, int nthreads) {
    int nt = k3_threads(nthreads, S * N * D);
#pragma omp parallel num_threads(nt)
    {
        float *du = k3_thread_row(du_partial, D);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float s[MAX_SOURCES], p[MAX_SOURCES], dp[MAX_SOURCES];
            const float *dhn = dh + n * D;
            float mean = 0.0f;
            for (int64_t i = 0; i < S; i++) {
                const float *vi = v + (i * N + n) * D;
                s[i] = dot(vi, u, D);
                p[i] = r[i * N + n] * s[i];
                dp[i] = dot(vi, dhn, D);
            }
            softmax(p, S);
            for (int64_t i = 0; i < S; i++) mean += p[i] * dp[i];
            for (int64_t i = 0; i < S; i++) {
                const float *vi = v + (i * N + n) * D;
                float *dvi = dv + (i * N + n) * D;
                float dz = p[i] * (dp[i] - mean), ri = r[i * N + n], cu = dz * ri, pi = p[i];
                dr[i * N + n] = dz * s[i];
#pragma omp simd
                for (int64_t k = 0; k < D; k++) {
                    dvi[k] = pi * dhn[k] + cu * u[k];
                    du[k] += cu * vi[k];
                }
            }
        }
    }
}
