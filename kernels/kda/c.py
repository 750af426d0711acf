"""C kernels of kda_gate for the CPU target (kernels/kda/kda_gate.c): the log decay in one pass, and a hand-written
backward (the reference recomputes the forward under torch.func.vjp) with per-thread sums for the per-channel bias
and the per-head A_log. fp32 out (bf16/fp16 gate projections are read through fp32); float64 and tensors the C
kernels cannot read (`native.takes`) keep the reference."""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.kda.reference import DECAY_FORMS, kda_gate_ref
from k3compile.kernels._common.native import F32

_FWD = (F32,) * 4 + (c_int64,) * 3 + (c_int, c_float, c_int)
_BWD = (F32,) * 7 + (c_int64,) * 3 + (c_int, c_float, c_int)



def _form(form: str) -> int:
    if form not in DECAY_FORMS:
        raise ValueError(f"unknown KDA decay form {form!r}; expected one of {DECAY_FORMS}")
    return DECAY_FORMS.index(form)


def _check_shapes(kernel: str, f: Tensor, A_log: Tensor, dt_bias: Tensor) -> None:
    H, K = f.shape[-2:]
    native.expect_numel(kernel, "A_log", A_log, H)
    native.expect_numel(kernel, "dt_bias", dt_bias, H * K)


def kda_gate(f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str, lower_bound: float) -> Tensor:
    """Log decay g (<= 0, fp32) from the gate projection f, as `kda_gate_ref`."""
    if not native.takes(f_BTHK, A_log_H, dt_bias_P):
        return kda_gate_ref(f_BTHK, A_log_H, dt_bias_P, form, lower_bound)
    _check_shapes("k3_kda_gate", f_BTHK, A_log_H, dt_bias_P)
    f, a, b = native.f32(f_BTHK), native.f32(A_log_H), native.f32(dt_bias_P)
    H, K = f.shape[-2:]
    g = torch.empty_like(f)
    native.function("k3_kda_gate", _FWD)(f, a, b, g, f.numel() // (H * K), H, K, _form(form), lower_bound,
                                         native.threads())
    return g


def kda_gate_bwd(grads: list[Tensor], f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str,
                 lower_bound: float) -> list[Tensor]:
    """[df, dA_log, ddt_bias] of `kda_gate` for grads = [dg]."""
    if not native.takes(grads[0], f_BTHK, A_log_H, dt_bias_P):
        leaves = [t.detach().requires_grad_() for t in (f_BTHK, A_log_H, dt_bias_P)]
        with torch.enable_grad():
            return list(torch.autograd.grad(kda_gate_ref(*leaves, form, lower_bound), leaves, grads[0]))
    _check_shapes("k3_kda_gate_bwd", f_BTHK, A_log_H, dt_bias_P)
    native.expect_numel("k3_kda_gate_bwd", "dg", grads[0], f_BTHK.numel())
    f, a, b, dg = native.f32(f_BTHK), native.f32(A_log_H), native.f32(dt_bias_P), native.f32(grads[0])
    H, K = f.shape[-2:]
    threads = native.threads()
    df = torch.empty_like(f)
    ddt, dA = torch.zeros(threads, H * K), torch.zeros(threads, H)
    native.function("k3_kda_gate_bwd", _BWD)(dg, f, a, b, df, ddt, dA, f.numel() // (H * K), H, K, _form(form),
                                             lower_bound, threads)
    return [df.to(f_BTHK.dtype), dA.sum(0).to(A_log_H.dtype), ddt.sum(0).to(dt_bias_P.dtype)]
