"""C kernels of rms_inv and attn_res_normed for the CPU target (kernels/attn_res_normed/attn_res.c).

One pass per token over its S sources (fp32, contiguous): the logits, the softmax and the mix in the forward;
the logits again, then every source's gradient, the 1/rms gradients and the query's partial sums in the
backward (one partial row per thread, summed here). fp16/bf16 round trip through fp32 as the references'
upcasts do; float64 and tensors the C kernels cannot read (`native.takes`) keep the references. Values agree
with them to fp32 rounding (other summation orders).
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels.attn_res_normed import reference as ref
from k3compile.kernels._common import native
from k3compile.kernels._common.native import F32

MAX_SOURCES = 256  # the C kernels keep a token's per-source scalars on the stack
_RMS = (F32, F32, c_int64, c_int64, c_float, c_int)
_RMS_BWD = (F32, F32, F32, c_int64, c_int64, c_float, c_int)
_MIX = (F32, F32, F32, F32, c_int64, c_int64, c_int64, c_int)
_MIX_BWD = (F32,) * 7 + (c_int64, c_int64, c_int64, c_int)



def rms_inv(x_BTD: Tensor, eps: float) -> Tensor:
    """r [B, T] = 1/sqrt(mean(x^2) + eps), as `rms_inv_ref`."""
    if not native.takes(x_BTD):
        return ref.rms_inv_ref(x_BTD, eps)
    x = native.f32(x_BTD)
    r = torch.empty(x.shape[:-1], dtype=torch.float32)
    native.function("k3_rms_inv", _RMS)(x, r, r.numel(), x.shape[-1], eps, native.threads())
    return r


def rms_inv_bwd(grads: list[Tensor], x_BTD: Tensor, eps: float) -> list[Tensor]:
    """[dx] of `rms_inv` for grads = [dr]."""
    if not native.takes(grads[0], x_BTD):
        return ref.rms_inv_bwd_ref(grads, x_BTD, eps)
    x, dr = native.f32(x_BTD), native.f32(grads[0])
    native.expect_numel("k3_rms_inv_bwd", "dr", dr, x.numel() // x.shape[-1])
    dx = torch.empty_like(x)
    native.function("k3_rms_inv_bwd", _RMS_BWD)(dr, x, dx, dr.numel(), x.shape[-1], eps, native.threads())
    return [dx.to(x_BTD.dtype)]


def _fits(*tensors: Tensor) -> bool:
    return native.takes(*tensors) and tensors[0].shape[0] <= MAX_SOURCES


def _check_shapes(kernel: str, v: Tensor, r: Tensor, q: Tensor, w: Tensor) -> None:
    native.expect_numel(kernel, "rinv", r, v.numel() // v.shape[-1])
    native.expect_numel(kernel, "query", q, v.shape[-1])
    native.expect_numel(kernel, "norm_weight", w, v.shape[-1])


def attn_res_normed(sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor) -> Tensor:
    """h = sum_i softmax_i(r_i (v_i . (query * norm_weight))) v_i, as `attn_res_normed_ref`."""
    if not _fits(sources_SBTD, rinv_SBT, query_D, norm_weight_D):
        return ref.attn_res_normed_ref(sources_SBTD, rinv_SBT, query_D, norm_weight_D)
    _check_shapes("k3_attn_res_normed", sources_SBTD, rinv_SBT, query_D, norm_weight_D)
    v, r = native.f32(sources_SBTD), native.f32(rinv_SBT)
    u = native.f32(query_D) * native.f32(norm_weight_D)  # in fp32 whatever the parameters' dtype
    S, D = v.shape[0], v.shape[-1]
    h = torch.empty(v.shape[1:], dtype=torch.float32)
    native.function("k3_attn_res_normed", _MIX)(v, r, u, h, S, h.numel() // D, D, native.threads())
    return h.to(sources_SBTD.dtype)


def attn_res_normed_bwd(
    grads: list[Tensor], sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor
) -> list[Tensor]:
    """[dsources, drinv, dquery, dnorm_weight] of `attn_res_normed` for grads = [dh]."""
    if not _fits(sources_SBTD, rinv_SBT, query_D, norm_weight_D, grads[0]):
        return ref.attn_res_normed_bwd_ref(grads, sources_SBTD, rinv_SBT, query_D, norm_weight_D)
    _check_shapes("k3_attn_res_normed_bwd", sources_SBTD, rinv_SBT, query_D, norm_weight_D)
    native.expect_numel("k3_attn_res_normed_bwd", "dh", grads[0], sources_SBTD[0].numel())
    v, r, dh = native.f32(sources_SBTD), native.f32(rinv_SBT), native.f32(grads[0])
    q, w = native.f32(query_D), native.f32(norm_weight_D)
    u = q * w
    S, D = v.shape[0], v.shape[-1]
    threads = native.threads()
    dv, dr = torch.empty_like(v), torch.empty_like(r)
    du = torch.zeros(threads, D, dtype=torch.float32)
    native.function("k3_attn_res_normed_bwd", _MIX_BWD)(dh, v, r, u, dv, dr, du, S, dh.numel() // D, D, threads)
    du = du.sum(dim=0)
    return [dv.to(sources_SBTD.dtype), dr.to(rinv_SBT.dtype), (du * w).to(query_D.dtype),
            (du * q).to(norm_weight_D.dtype)]
