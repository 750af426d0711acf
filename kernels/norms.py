"""PyTorch references for the normalisations: RMSNorm, L2 norm and the fused forms the fuse pass targets.

All compute in at least fp32 (float64 stays float64) and return the input dtype,
so bf16 activations get fp32 statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.consts import const


def upcast(t: Tensor) -> Tensor:
    """Upcast to at least fp32 (float64 stays float64, so gradchecks see exact math); t itself when it is."""
    if t.dtype == torch.float32 or t.dtype == torch.float64:
        return t  # what t.to(...) returns too, without dispatching a no-op cast
    return t.to(torch.promote_types(t.dtype, torch.float32))


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch.promote_types(dtype, torch.float32), without dispatching it for fp32 / float64."""
    if dtype == torch.float32 or dtype == torch.float64:
        return dtype
    return torch.promote_types(dtype, torch.float32)


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype), skipping the no-op cast when t already has it."""
    return t if t.dtype == dtype else t.to(dtype)


def _inv_rms(xf: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(xf^2, last dim) + eps), keepdim, with the bits of torch's mean (a sum, then / n)."""
    n = xf.shape[-1]
    ss = (xf * xf).sum(dim=-1, keepdim=True)  # xf * xf: the bits of xf.pow(2)
    if n & (n - 1) == 0:  # / n is * (1/n), exact: fold it into the + eps (one rounding either way)
        return torch.addcmul(const(eps, ss), ss, const(1.0 / n, ss)).rsqrt_()
    return ss.div_(const(n, ss)).add_(const(eps, ss)).rsqrt_()


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2, last dim) + eps) * weight, in fp32, returned in x's dtype."""
    xf = upcast(x)
    return as_dtype(xf * _inv_rms(xf, eps) * upcast(weight), x.dtype)


def l2_norm_ref(x: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(sum(x^2, last dim) + eps) (eps inside the root, as KDA's q/k norm), in x's dtype."""
    xf = upcast(x)
    inv = (xf * xf).sum(dim=-1, keepdim=True).add_(const(eps, xf)).rsqrt_()
    return as_dtype(xf * inv, x.dtype)


def rms_norm_gate_ref(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """y = RMSNorm(x) * sigmoid(gate), one fp32 pass (KDA's gated output norm), in x's dtype."""
    xf = upcast(x)
    return as_dtype(xf * _inv_rms(xf, eps) * upcast(weight) * torch.sigmoid(upcast(gate)), x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual).

    The sum is rounded to x's dtype before the norm, exactly like the unfused
    `s = x + residual; rms_norm(s)`, so the fuse pass can swap one for the other bit for bit.
    """
    s = x + residual
    return rms_norm_ref(s, weight, eps), s
