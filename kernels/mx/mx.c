/* MX fake quantisation (OCP MX v1.0, kernels/mx.py): the bits of mx_fake_quantize_fast, one pass over the blocks. */
#include "k3.h"

void k3_mx_fake_quantize(const float *x, float *y, int64_t nblocks, int block, int emin, int emax, int mbits,
                         float max, int nthreads) {
    k3_mx f = k3_mx_format(emin, emax, mbits, max);
#pragma omp parallel for schedule(static) num_threads(k3_threads(nthreads, nblocks * block))
    for (int64_t b = 0; b < nblocks; b++) k3_mx_block(x + b * block, y + b * block, block, f);
}
