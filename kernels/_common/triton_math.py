"""Triton device helpers shared by several kernel modules: stable sigmoid and tanh, the GLU activations and
their derivative, and a round-to-nearest-even store cast.

sigmoid and tanh are built from tl.exp (stable forms, a series for small |z|) so the same code runs in the
interpreter and on every GPU Triton version, which do not all have a tanh. The GLU math is written once
here, so the elementwise kernels (kernels/activations/triton.py) and the grouped-GEMM epilogues
(kernels/experts/triton.py) compute the same function.
"""

from __future__ import annotations

import triton
import triton.language as tl

# |z| below: tanh's odd series to z^9 is exact to ~1e-8 relative; above: 1 - exp(-2|z|) does not cancel
_TANH_SERIES_MAX = tl.constexpr(0.25)


@triton.jit
def sigmoid(x):
    """1 / (1 + exp(-x)) without overflow: exp only ever sees -|x|, so both tails keep relative accuracy."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def tanh(z):
    """tanh(z) = sign(z) (1 - e) / (1 + e) with e = exp(-2|z|) (never overflows); its Taylor series near 0,
    where 1 - e would cancel."""
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(z < 0, -big, big)
    z2 = z * z
    small = z * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0 + z2 * (62.0 / 2835.0)))))
    return tl.where(a < _TANH_SERIES_MAX, small, big)


@triton.jit
def glu(g, u, beta1, beta2, SITU: tl.constexpr):
    """y = act(g) * lin(u) on fp32 tiles: SiTU-GLU (b1 tanh(g/b1) sigmoid(g)) * (b2 tanh(u/b2)), or SwiGLU
    silu(g) * u."""
    s = sigmoid(g)
    if SITU:
        y = beta1 * tanh(g / beta1) * s * (beta2 * tanh(u / beta2))
    else:
        y = g * s * u
    return y


@triton.jit
def glu_grad(g, u, dy, beta1, beta2, SITU: tl.constexpr):
    """(dgate, dup) = (dy lin(u) act'(g), dy act(g) lin'(u)) of `glu` for the output cotangent dy, fp32 tiles.

    SiTU: act' = (1 - t1^2) s + b1 t1 s (1 - s), lin' = 1 - t2^2 (t1 = tanh(g/b1), t2 = tanh(u/b2),
    s = sigmoid(g)); SwiGLU: act' = s (1 + g (1 - s)), lin' = 1.
    """
    s = sigmoid(g)
    if SITU:
        t1 = tanh(g / beta1)
        t2 = tanh(u / beta2)
        act = beta1 * t1 * s
        lin = beta2 * t2
        dg = dy * lin * ((1.0 - t1 * t1) * s + act * (1.0 - s))
        du = dy * act * (1.0 - t2 * t2)
    else:
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
    return dg, du


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """fp32 tile `v` in DTYPE, rounded to nearest-even (NaN stays NaN, overflow rounds to Inf).

    bf16 is rounded by hand on the fp32 bits: the interpreter's fp32 -> bf16 cast truncates, and the same
    integer ops give the GPU's (and torch's) result, so bf16 outputs match bit for bit on both. Other
    dtypes are a plain cast.
    """
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = tl.where(v != v, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DTYPE)
    return out
