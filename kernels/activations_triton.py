"""Triton kernels for the GLU activations of kernels/activations.py: SiTU-GLU and SwiGLU, forward and backward.

Elementwise over the flattened tensors, BLOCK elements per program, fp32 math, the reference's dtypes out.
tanh and sigmoid are built from tl.exp (stable forms, a series for small |z|) so the same code runs in the
interpreter and on every GPU Triton version, which do not all have a tanh.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels.launch import launch_config
from k3compile.kernels.norms_triton import _rounded, _sigmoid

_SPACE = {"BLOCK": [512, 1024, 2048, 4096, 8192], "num_warps": [2, 4, 8, 16]}
TUNABLE = {name: dict(_SPACE) for name in ("situ_glu", "swiglu", "situ_glu_bwd", "swiglu_bwd")}
_DEFAULTS = {"BLOCK": 2048, "num_warps": 8, "num_stages": 1}

# |z| below: tanh's odd series to z^9 is exact to ~1e-8 relative; above: 1 - exp(-2|z|) does not cancel
_TANH_SERIES_MAX = tl.constexpr(0.25)


@triton.jit
def _tanh(z):
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
def _glu_fwd_kernel(gate_ptr, up_ptr, y_ptr, n, beta1, beta2, SITU: tl.constexpr, BLOCK: tl.constexpr):
    """y = act(g) * lin(u): SiTU (b1 tanh(g/b1) sigmoid(g)) * (b2 tanh(u/b2)), or SwiGLU silu(g) * u."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sg = _sigmoid(g)
    if SITU:
        y = beta1 * _tanh(g / beta1) * sg * (beta2 * _tanh(u / beta2))
    else:
        y = g * sg * u
    tl.store(y_ptr + offs, _rounded(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(gy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, beta1, beta2,
                    SITU: tl.constexpr, BLOCK: tl.constexpr):
    """dgate = dy * lin(u) * act'(g), dup = dy * act(g) * lin'(u).

    SiTU: act' = (1 - t1^2) s + b1 t1 s (1 - s), lin' = 1 - t2^2 (t1 = tanh(g/b1), t2 = tanh(u/b2), s = sigmoid(g));
    SwiGLU: act' = s (1 + g (1 - s)), lin' = 1.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sg = _sigmoid(g)
    if SITU:
        t1 = _tanh(g / beta1)
        t2 = _tanh(u / beta2)
        act = beta1 * t1 * sg
        lin = beta2 * t2
        dact = (1.0 - t1 * t1) * sg + act * (1.0 - sg)
        dgate = gy * lin * dact
        dup = gy * act * (1.0 - t2 * t2)
    else:
        dgate = gy * u * sg * (1.0 + g * (1.0 - sg))
        dup = gy * g * sg
    tl.store(dgate_ptr + offs, _rounded(dgate, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, _rounded(dup, dup_ptr.dtype.element_ty), mask=mask)


def _check(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return gate.contiguous(), up.contiguous()


def _launch_fwd(name: str, gate: Tensor, up: Tensor, beta1: float, beta2: float, situ: bool) -> Tensor:
    g, u = _check(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = g.numel()
    if n:
        cfg = launch_config(name, gate.device, _DEFAULTS, n=n)
        _glu_fwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
            g, u, y, n, beta1, beta2, SITU=situ, BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def _launch_bwd(name: str, grads: list[Tensor], gate: Tensor, up: Tensor, beta1: float, beta2: float,
                situ: bool) -> list[Tensor | None]:
    g, u = _check(gate, up)
    gy = grads[0].contiguous()
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = g.numel()
    if n:
        cfg = launch_config(name, gate.device, _DEFAULTS, n=n)
        _glu_bwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
            gy, g, u, dgate, dup, n, beta1, beta2, SITU=situ, BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return [dgate, dup]


def situ_glu(gate: Tensor, up: Tensor, beta1: float, beta2: float) -> Tensor:
    """SiTU-GLU [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], in gate's dtype."""
    return _launch_fwd("situ_glu", gate, up, beta1, beta2, situ=True)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU silu(g) * u, in gate's dtype."""
    return _launch_fwd("swiglu", gate, up, 1.0, 1.0, situ=False)


def situ_glu_bwd(grads: list[Tensor], gate: Tensor, up: Tensor, beta1: float, beta2: float) -> list[Tensor | None]:
    """[dgate, dup] of situ_glu for grads = [dy]."""
    return _launch_bwd("situ_glu_bwd", grads, gate, up, beta1, beta2, situ=True)


def swiglu_bwd(grads: list[Tensor], gate: Tensor, up: Tensor) -> list[Tensor | None]:
    """[dgate, dup] of swiglu for grads = [dy]."""
    return _launch_bwd("swiglu_bwd", grads, gate, up, 1.0, 1.0, situ=False)
