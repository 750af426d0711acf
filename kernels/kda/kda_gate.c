/* KDA's log decay from the gate projection (kernels/kda.py: kda_gate_ref), f [N, H, K] with a = exp(A_log[h]) and
 * x = f + dt_bias[h, K]: form 0 (K3) g = lower_bound sigmoid(a x); form 1 (Kimi Linear) g = -a softplus(x). */
#include "k3.h"

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

void k3_kda_gate(const float *f, const float *A_log, const float *dt_bias, float *g, int64_t N, int64_t H, int64_t K,
                 int form, float lower_bound, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, N * H * K))
    for (int64_t nh = 0; nh < N * H; nh++) {
        int64_t h = nh % H;
        const float *fr = f + nh * K, *b = dt_bias + h * K;
        float *gr = g + nh * K, a = expf(A_log[h]);
        if (form == 0) {
#pragma omp simd
            for (int64_t k = 0; k < K; k++) gr[k] = lower_bound * k3_sigmoid(a * (fr[k] + b[k]));
        } else {
            for (int64_t k = 0; k < K; k++) gr[k] = -a * softplus(fr[k] + b[k]);
        }
    }
}

/* df = dg dg/dx; partial sums per thread of d dt_bias (= df, [threads, H, K]) and d A_log (= dg dg/dA_log,
 * [threads, H]), both zeroed by the caller. form 0: dg/dx = lower_bound s (1 - s) a, dg/dA_log = that times x;
 * form 1: dg/dx = -a sigmoid(x), dg/dA_log = g. */
void k3_kda_gate_bwd(const float *dg, const float *f, const float *A_log, const float *dt_bias, float *df,
                     float *ddt_partial, float *dA_partial, int64_t N, int64_t H, int64_t K, int form,
                     float lower_bound, int nthreads) {
#pragma omp parallel num_threads(k3_threads(nthreads, N * H * K))
    {
        float *ddt = k3_thread_row(ddt_partial, H * K), *dA = k3_thread_row(dA_partial, H);
#pragma omp for schedule(static)
        for (int64_t nh = 0; nh < N * H; nh++) {
            int64_t h = nh % H;
            const float *fr = f + nh * K, *b = dt_bias + h * K, *gr = dg + nh * K;
            float *dfr = df + nh * K, *ddth = ddt + h * K, a = expf(A_log[h]), acc = 0.0f;
            if (form == 0) {
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < K; k++) {
                    float x = fr[k] + b[k], s = k3_sigmoid(a * x), d = gr[k] * lower_bound * s * (1.0f - s);
                    dfr[k] = d * a;
                    ddth[k] += d * a;
                    acc += d * a * x;
                }
            } else {
                for (int64_t k = 0; k < K; k++) {
                    float x = fr[k] + b[k], d = -gr[k] * a * k3_sigmoid(x);
                    dfr[k] = d;
                    ddth[k] += d;
                    acc += gr[k] * -a * softplus(x);
                }
            }
            dA[h] += acc;
        }
    }
}
