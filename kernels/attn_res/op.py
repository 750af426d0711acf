"""k3 attention-residual op: attn_res (softmax over depth sources with a learned pseudo-query).

Its backward is hand-written (kernels.attn_res.attn_res_bwd_ref, or the Triton module's on that backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.attn_res import reference as ref
from k3compile.kernels._common.registry import k3_op


def _attn_res_fake(sources_SBTD, query_D, norm_weight_D, eps):
    return sources_SBTD.new_empty(sources_SBTD.shape[1:])


@k3_op(
    "attn_res",
    fake=_attn_res_fake,
    differentiable=("sources_SBTD", "query_D", "norm_weight_D"),
    backward=ref.attn_res_bwd_ref,
)
def attn_res_op(sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float) -> Tensor:
    return ref.attn_res_ref(sources_SBTD, query_D, norm_weight_D, eps)


def attn_res(
    sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float = 1e-5, *, backend: str = "auto"
) -> Tensor:
    """h [B, T, D] = sum_i softmax_i(query . RMSNorm(v_i)) v_i over sources stacked as [S, B, T, D]."""
    return torch.ops.k3.attn_res.default(sources_SBTD, query_D, norm_weight_D, eps, backend=backend)
