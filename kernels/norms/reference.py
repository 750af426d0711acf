"""PyTorch references for the normalisations: RMSNorm, L2 norm and the fused forms the fuse pass targets.

All compute in at least fp32 (float64 stays float64) and return the input dtype,
so bf16 activations get fp32 statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels._common.consts import const


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


FEW_ROWS = 16  # up to this many rows (a decoding step's tokens) a norm takes its fewest-calls form


def _few_rows(xf: Tensor) -> bool:
    return xf.numel() <= FEW_ROWS * xf.shape[-1]


def _few_rows_inv_root(xf: Tensor, eps: float, scale: float) -> Tensor:
    """rsqrt(scale * sum(xf^2, last dim) + eps), keepdim, from one vector_norm call instead of a square and a
    sum: the same value to fp32 rounding, in the fewest calls a decoding step's few rows pay for."""
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    return torch.addcmul(const(eps, norm), norm, norm, value=scale).rsqrt_()


def _inv_rms(xf: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(xf^2, last dim) + eps), keepdim, with the bits of torch's mean (a sum, then / n); a few rows
    take `_few_rows_inv_root`."""
    n = xf.shape[-1]
    if _few_rows(xf):
        return _few_rows_inv_root(xf, eps, 1.0 / n)
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
    if _few_rows(xf):
        inv = _few_rows_inv_root(xf, eps, 1.0)
    else:
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


# ---------------------------------------------------------------------------------------------------------
# Hand-written backwards, registered with the ops (k3_op(backward=...)) in place of recomputing the forward
# under torch.func.vjp. Each takes (the output cotangents, *the op's arguments) like the Triton `_bwd`s and
# returns one gradient per differentiable argument, in that argument's dtype. The row statistic 1/rms is
# recomputed (one read of x); everything else is a few elementwise passes and two reductions.


def _rms_backward(gy: Tensor, xf: Tensor, wf: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, xhat = x / rms) of y = xhat * w for the cotangent gy, all [N, D] in the compute dtype.

    dx = (gy w - xhat mean(gy w xhat)) / rms;  dweight = sum over rows of gy xhat.
    """
    D = xf.shape[-1]
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    xhat = xf * inv_rms
    gy_xhat = gy * xhat
    mean_dot = (gy_xhat @ wf).unsqueeze(-1).div_(D)  # mean(gy w xhat) per row, as one matrix-vector product
    dx = torch.addcmul(gy * wf, xhat, mean_dot, value=-1).mul_(inv_rms)
    return dx, gy_xhat.sum(dim=0), xhat


def _rows(t: Tensor) -> Tensor:
    """t upcast (fp32 at least) as [rows, last dim]."""
    return upcast(t).reshape(-1, t.shape[-1])


def rms_norm_bwd_ref(grads: list[Tensor], x: Tensor, weight: Tensor, eps: float) -> list[Tensor]:
    """[dx, dweight] of `rms_norm_ref` for grads = [dy]."""
    dx, dw, _ = _rms_backward(_rows(grads[0]), _rows(x), upcast(weight), eps)
    return [dx.view(x.shape).to(x.dtype), dw.to(weight.dtype)]


def l2_norm_bwd_ref(grads: list[Tensor], x: Tensor, eps: float) -> list[Tensor]:
    """[dx] of `l2_norm_ref` for grads = [dy]: with r = 1/sqrt(sum x^2 + eps) and y = x r, dx = r (dy - y sum(dy y))."""
    gy, xf = _rows(grads[0]), _rows(x)
    r = torch.rsqrt(xf.pow(2).sum(dim=-1, keepdim=True) + eps)
    y = xf * r
    dot = (gy * y).sum(dim=-1, keepdim=True)
    return [torch.addcmul(gy, y, dot, value=-1).mul_(r).view(x.shape).to(x.dtype)]


def rms_norm_gate_bwd_ref(grads: list[Tensor], x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> list[Tensor]:
    """[dx, dweight, dgate] of `rms_norm_gate_ref` for grads = [dy]: RMSNorm's backward for the cotangent
    dy sigmoid(gate), and dgate = dy RMSNorm(x) sigmoid'(gate) with sigmoid' = s (1 - s)."""
    wf = upcast(weight)
    s = torch.sigmoid(_rows(gate))
    gy_s = _rows(grads[0]) * s
    dx, dw, xhat = _rms_backward(gy_s, _rows(x), wf, eps)
    d_s = gy_s.mul_(xhat).mul_(wf)  # dy y: the gradient w.r.t. sigmoid(gate), times s (gy_s is not needed again)
    dgate = torch.addcmul(d_s, d_s, s, value=-1)
    return [dx.view(x.shape).to(x.dtype), dw.to(weight.dtype), dgate.view(gate.shape).to(gate.dtype)]
