"""k3 ops for AttnRes with each source normalised once: rms_inv (per source) and attn_res_normed (per site).

The attn_res pass uses them on the CPU target, where the reference re-reading every source at every
site costs; the GPU kernel of k3::attn_res normalises in the same pass over a source that mixes it.
Both backwards are hand-written (kernels/attn_res_normed/reference.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.attn_res_normed import reference as ref
from k3compile.kernels._common.registry import k3_op


def _rms_inv_fake(x_BTD, eps):
    return x_BTD.new_empty(x_BTD.shape[:-1], dtype=torch.promote_types(x_BTD.dtype, torch.float32))


@k3_op("rms_inv", fake=_rms_inv_fake, differentiable=("x_BTD",), backward=ref.rms_inv_bwd_ref)
def rms_inv_op(x_BTD: Tensor, eps: float) -> Tensor:
    return ref.rms_inv_ref(x_BTD, eps)


def _attn_res_normed_fake(sources_SBTD, rinv_SBT, query_D, norm_weight_D):
    return sources_SBTD.new_empty(sources_SBTD.shape[1:])


@k3_op(
    "attn_res_normed",
    fake=_attn_res_normed_fake,
    differentiable=("sources_SBTD", "rinv_SBT", "query_D", "norm_weight_D"),
    backward=ref.attn_res_normed_bwd_ref,
)
def attn_res_normed_op(sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor) -> Tensor:
    return ref.attn_res_normed_ref(sources_SBTD, rinv_SBT, query_D, norm_weight_D)


def rms_inv(x_BTD: Tensor, eps: float = 1e-5, *, backend: str = "auto") -> Tensor:
    """r [B, T] = 1/sqrt(mean(x^2) + eps) of one AttnRes source, computed once for every site reading it."""
    return torch.ops.k3.rms_inv.default(x_BTD, eps, backend=backend)


def attn_res_normed(
    sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor, *, backend: str = "auto"
) -> Tensor:
    """attn_res(sources, query, norm_weight, eps) given each source's rms_inv(source, eps) stacked as [S, B, T]."""
    return torch.ops.k3.attn_res_normed.default(sources_SBTD, rinv_SBT, query_D, norm_weight_D, backend=backend)
