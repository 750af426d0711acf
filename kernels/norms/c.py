"""C kernels of the row normalisations for the CPU target (kernels/norms/norms.c): rms_norm, rms_norm_gate and
l2_norm, forward and backward, one pass per row while it is in cache.

fp32 in and out; fp16/bf16 round trip through fp32 as the references' upcasts do; float64 and tensors the C
kernels cannot read (a subclass such as DTensor, another device: `native.takes`) keep the references. Values agree with the references to fp32 rounding (other summation orders, libmvec's expf).
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.norms import reference as ref
from k3compile.kernels._common.native import F32, F32_OR_NULL

_RMS = (F32, F32, F32_OR_NULL, F32, c_int64, c_int64, c_float, c_int)
_RMS_BWD = (F32, F32, F32, F32_OR_NULL, F32, F32, F32_OR_NULL, c_int64, c_int64, c_float, c_int)
_L2 = (F32, F32, c_int64, c_int64, c_float, c_int)
_L2_BWD = (F32, F32, F32, c_int64, c_int64, c_float, c_int)


def _check_shapes(kernel: str, x: Tensor, weight: Tensor, gate: Tensor | None) -> None:
    native.expect_numel(kernel, "weight", weight, x.shape[-1])
    if gate is not None:
        native.expect_numel(kernel, "gate", gate, x.numel())



def _rms(x: Tensor, weight: Tensor, gate: Tensor | None, eps: float) -> Tensor:
    _check_shapes("k3_rms_norm", x, weight, gate)
    xf, w = native.f32(x), native.f32(weight)
    g = None if gate is None else native.f32(gate)
    y = torch.empty_like(xf)
    D = xf.shape[-1]
    native.function("k3_rms_norm", _RMS)(xf, w, g, y, xf.numel() // D, D, eps, native.threads())
    return y.to(x.dtype)


def _rms_bwd(gy: Tensor, x: Tensor, weight: Tensor, gate: Tensor | None, eps: float) -> list[Tensor]:
    _check_shapes("k3_rms_norm_bwd", x, weight, gate)
    native.expect_numel("k3_rms_norm_bwd", "dy", gy, x.numel())
    xf, w, g = native.f32(x), native.f32(weight), native.f32(gy)
    a = None if gate is None else native.f32(gate)
    D, threads = xf.shape[-1], native.threads()
    dx = torch.empty_like(xf)
    dw = torch.zeros(threads, D, dtype=torch.float32)
    dgate = None if a is None else torch.empty_like(a)
    native.function("k3_rms_norm_bwd", _RMS_BWD)(g, xf, w, a, dx, dw, dgate, xf.numel() // D, D, eps, threads)
    out = [dx.to(x.dtype), dw.sum(dim=0).to(weight.dtype)]
    return out if gate is None else [*out, dgate.to(gate.dtype)]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, as `rms_norm_ref`."""
    if not native.takes(x, weight):
        return ref.rms_norm_ref(x, weight, eps)
    return _rms(x, weight, None, eps)


def rms_norm_bwd(grads: list[Tensor], x: Tensor, weight: Tensor, eps: float) -> list[Tensor]:
    """[dx, dweight] of `rms_norm` for grads = [dy]."""
    if not native.takes(grads[0], x, weight):
        return ref.rms_norm_bwd_ref(grads, x, weight, eps)
    return _rms_bwd(grads[0], x, weight, None, eps)


def rms_norm_gate(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * sigmoid(gate), as `rms_norm_gate_ref`."""
    if not native.takes(x, weight, gate):
        return ref.rms_norm_gate_ref(x, weight, gate, eps)
    return _rms(x, weight, gate, eps)


def rms_norm_gate_bwd(grads: list[Tensor], x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> list[Tensor]:
    """[dx, dweight, dgate] of `rms_norm_gate` for grads = [dy]."""
    if not native.takes(grads[0], x, weight, gate):
        return ref.rms_norm_gate_bwd_ref(grads, x, weight, gate, eps)
    return _rms_bwd(grads[0], x, weight, gate, eps)


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(sum(x^2) + eps), as `l2_norm_ref`."""
    if not native.takes(x):
        return ref.l2_norm_ref(x, eps)
    xf = native.f32(x)
    y = torch.empty_like(xf)
    D = xf.shape[-1]
    native.function("k3_l2_norm", _L2)(xf, y, xf.numel() // D, D, eps, native.threads())
    return y.to(x.dtype)


def l2_norm_bwd(grads: list[Tensor], x: Tensor, eps: float) -> list[Tensor]:
    """[dx] of `l2_norm` for grads = [dy]."""
    if not native.takes(grads[0], x):
        return ref.l2_norm_bwd_ref(grads, x, eps)
    native.expect_numel("k3_l2_norm_bwd", "dy", grads[0], x.numel())
    xf, g = native.f32(x), native.f32(grads[0])
    dx = torch.empty_like(xf)
    D = xf.shape[-1]
    native.function("k3_l2_norm_bwd", _L2_BWD)(g, xf, dx, xf.numel() // D, D, eps, native.threads())
    return [dx.to(x.dtype)]
