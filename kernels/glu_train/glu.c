/* Gated activations with their derivatives (kernels/glu_train.py), optionally MX fake-quantised as they are made.
 *
 * kind 0 SiTU-GLU: y = A(g) B(u), A = b1 tanh(g/b1) sigmoid(g), B = b2 tanh(u/b2);
 *   dy/dg = B (sigmoid(g) (1 - tanh(g/b1)^2) + A (1 - sigmoid(g))), dy/du = A (1 - tanh(u/b2)^2).
 * kind 1 SwiGLU: y = silu(g) u, dy/dg = u sigmoid(g) (1 + g (1 - sigmoid(g))), dy/du = silu(g).
 */
#include "k3.h"

static void glu_span(const float *g, const float *u, float *y, float *jg, float *ju, int64_t n, int kind, float b1,
                     float b2) {
    if (kind == 0) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float tg = tanhf(g[i] / b1), sg = k3_sigmoid(g[i]), tu = tanhf(u[i] / b2);
            float a = tg * sg * b1, b = tu * b2;
            jg[i] = ((1.0f - tg * tg) * sg + (1.0f - sg) * a) * b;
            ju[i] = (1.0f - tu * tu) * a;
            y[i] = a * b;
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float sg = k3_sigmoid(g[i]), silu = g[i] * sg;
            jg[i] = (g[i] - silu + 1.0f) * sg * u[i];
            ju[i] = silu;
            y[i] = silu * u[i];
        }
    }
}

/* y, dy/dg, dy/du of act(g, u) over n values; with emax >= 0, y is MX fake-quantised in blocks of `block` (n a
 * multiple of block, the blocks along the rows) while it is in cache. */
void k3_glu_fill(const float *g, const float *u, float *y, float *jg, float *ju, int64_t n, int kind, float b1,
                 float b2, int block, int emin, int emax, int mbits, float max, int nthreads) {
    k3_mx f = k3_mx_format(emin, emax, mbits, max);
    int64_t span = emax >= 0 ? block : 4096, spans = (n + span - 1) / span;
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, n * 8))
    for (int64_t s = 0; s < spans; s++) {
        int64_t o = s * span, len = n - o < span ? n - o : span;
        glu_span(g + o, u + o, y + o, jg + o, ju + o, len, kind, b1, b2);
        if (emax >= 0) k3_mx_block(y + o, y + o, (int)len, f);
    }
}

/* dgate = gy dy/dg, dup = gy dy/du (glu_train's backward), one pass. */
void k3_glu_grads(const float *gy, const float *jg, const float *ju, float *dg, float *du, int64_t n, int nthreads) {
#pragma omp parallel for simd schedule(static) num_threads(k3_threads(nthreads, n * 4))
    for (int64_t i = 0; i < n; i++) {
        dg[i] = gy[i] * jg[i];
        du[i] = gy[i] * ju[i];
    }
}
