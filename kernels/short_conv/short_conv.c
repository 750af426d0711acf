/* KDA's causal depthwise short convolution with SiLU (kernels/short_conv.py), tokens-major: x [B, T, C], the taps
 * [W, C] (tap W-1 multiplies the current token), the history [B, W-1, C] (NULL: zeros). */
#include "k3.h"

/* The input row at padded position j (0 .. W-2: history, then the tokens) of sequence b. */
static inline const float *row(const float *x, const float *hist, int64_t b, int64_t j, int64_t T, int64_t C,
                               int64_t W, const float *zeros) {
    if (j >= W - 1) return x + (b * T + j - (W - 1)) * C;
    return hist ? hist + (b * (W - 1) + j) * C : zeros;
}

#define MAX_TAPS 64

/* a = sum_w taps[w] rows[w] into a, tap by tap (each a contiguous vector loop over the channels). */
static inline void preactivation(float *a, const float **rows, const float *taps, int64_t C, int64_t W) {
    const float *r0 = rows[0];
#pragma omp simd
    for (int64_t c = 0; c < C; c++) a[c] = taps[c] * r0[c];
    for (int64_t w = 1; w < W; w++) {
        const float *rw = rows[w], *tw = taps + w * C;
#pragma omp simd
        for (int64_t c = 0; c < C; c++) a[c] += tw[c] * rw[c];
    }
}

void k3_short_conv(const float *x, const float *hist, const float *taps, float *y, const float *zeros, int64_t B,
                   int64_t T, int64_t C, int64_t W, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, B * T * C * W))
    for (int64_t bt = 0; bt < B * T; bt++) {
        int64_t b = bt / T, t = bt % T;
        const float *rows[MAX_TAPS];
        for (int64_t w = 0; w < W; w++) rows[w] = row(x, hist, b, t + w, T, C, W, zeros);
        float *yo = y + bt * C;
        preactivation(yo, rows, taps, C, W);
#pragma omp simd
        for (int64_t c = 0; c < C; c++) yo[c] = yo[c] * k3_sigmoid(yo[c]);
    }
}

/* da = dy SiLU'(a) into `da` [B, T, C] (a recomputed); then per sequence dxp[j] = sum_w taps[w] da[j - w] over the
 * padded positions, plus dstate [B, W-1, C] on the last W-1 of them (NULL: none), split into dx and dhist (NULL:
 * not wanted); dw_partial[thread] += da[t] xp[t + w] ([threads, W, C], zeroed by the caller). */
void k3_short_conv_bwd(const float *x, const float *hist, const float *taps, const float *dy, const float *dstate,
                       float *da, float *dx, float *dhist, float *dw_partial, const float *zeros, int64_t B, int64_t T,
                       int64_t C, int64_t W, int nthreads) {
#pragma omp parallel num_threads(k3_threads(nthreads, B * T * C * W))
    {
        float *dw = k3_thread_row(dw_partial, W * C);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t t = 0; t < T; t++) {
                const float *rows[MAX_TAPS];
                for (int64_t w = 0; w < W; w++) rows[w] = row(x, hist, b, t + w, T, C, W, zeros);
                const float *g = dy + (b * T + t) * C;
                float *d = da + (b * T + t) * C;
                preactivation(d, rows, taps, C, W);
#pragma omp simd
                for (int64_t c = 0; c < C; c++) {
                    float a = d[c], s = k3_sigmoid(a);
                    d[c] = g[c] * s * (1.0f + a * (1.0f - s));
                }
                for (int64_t w = 0; w < W; w++) {
                    const float *xr = rows[w];
                    float *dww = dw + w * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) dww[c] += d[c] * xr[c];
                }
            }
            for (int64_t j = 0; j < T + W - 1; j++) { /* padded position j gets taps[w] da[j - w] */
                float *out = j >= W - 1 ? dx + (b * T + j - (W - 1)) * C : (dhist ? dhist + (b * (W - 1) + j) * C : NULL);
                if (!out) continue;
                const float *ds = dstate && j >= T ? dstate + (b * (W - 1) + j - T) * C : NULL;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) out[c] = ds ? ds[c] : 0.0f;
                for (int64_t w = 0; w < W; w++) {
                    int64_t t = j - w;
                    if (t < 0 || t >= T) continue;
                    const float *d = da + (b * T + t) * C, *tp = taps + w * C;
#pragma omp simd
                    for (int64_t c = 0; c < C; c++) out[c] += tp[c] * d[c];
                }
            }
        }
    }
}
