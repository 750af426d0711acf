/* The MoE combine (kernels/moe.py: combine_ref) over expert output rows: y_t = sum_k w_tk rows[slot_tk], a slot of
 * n_rows or more (a dropped choice) contributing zero. rows [n_rows, D], w and slots [T, K], y [T, D]. */
#include "k3.h"

void k3_moe_combine(const float *rows, const float *w, const int64_t *slots, float *y, int64_t T, int64_t K,
                    int64_t D, int64_t n_rows, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, T * K * D))
    for (int64_t t = 0; t < T; t++) {
        float *yt = y + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) yt[d] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            int64_t s = slots[t * K + k];
            if (s < 0 || s >= n_rows) continue;
            const float *r = rows + s * D;
            float wk = w[t * K + k];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) yt[d] += wk * r[d];
        }
    }
}

/* drows[slot_tk] = w_tk dy_t (every other row zero: drows is zeroed here), dw_tk = rows[slot_tk] . dy_t (0 when
 * dropped). Each kept slot is read by one (token, choice), so the scatter has no conflicts. */
void k3_moe_combine_bwd(const float *dy, const float *rows, const float *w, const int64_t *slots, float *drows,
                        float *dw, int64_t T, int64_t K, int64_t D, int64_t n_rows, int nthreads) {
    int nt = k3_threads(nthreads, T * K * D);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < n_rows; i++) memset(drows + i * D, 0, (size_t)D * sizeof(float));
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < T; t++) {
        const float *g = dy + t * D;
        for (int64_t k = 0; k < K; k++) {
            int64_t s = slots[t * K + k];
            if (s < 0 || s >= n_rows) {
                dw[t * K + k] = 0.0f;
                continue;
            }
            const float *r = rows + s * D;
            float *dr = drows + s * D, wk = w[t * K + k], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) {
                dr[d] = wk * g[d];
                dot += r[d] * g[d];
            }
            dw[t * K + k] = dot;
        }
    }
}
