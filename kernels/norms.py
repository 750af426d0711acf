"""PyTorch references for the normalisations: RMSNorm, L2 norm and the fused forms the fuse pass targets.

All compute in at least fp32 (float64 stays float64) and return the input dtype,
so bf16 activations get fp32 statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor


def upcast(t: Tensor) -> Tensor:
    """Upcast to at least fp32 (float64 stays float64, so gradchecks see exact math)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2, last dim) + eps) * weight, in fp32, returned in x's dtype."""
    xf = upcast(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * upcast(weight)).to(x.dtype)


def l2_norm_ref(x: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(sum(x^2, last dim) + eps) (eps inside the root, as KDA's q/k norm), in x's dtype."""
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_gate_ref(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """y = RMSNorm(x) * sigmoid(gate), one fp32 pass (KDA's gated output norm), in x's dtype."""
    xf = upcast(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * upcast(weight) * torch.sigmoid(upcast(gate))).to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual).

    The sum is rounded to x's dtype before the norm, exactly like the unfused
    `s = x + residual; rms_norm(s)`, so the fuse pass can swap one for the other bit for bit.
    """
    s = x + residual
    return rms_norm_ref(s, weight, eps), s
