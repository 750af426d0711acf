"""Fused k3 ops produced by the fuse pass (references in kernels/fused/reference.py).

Both backwards are hand-written (kernels.fused.linear_glu_bwd_ref, linear_route_bwd_ref), or the Triton
module's on that backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.fused import reference as ref
from k3compile.kernels._common.registry import k3_op


def _linear_glu_fake(x, w_gate, w_up, kind, beta1, beta2):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


@k3_op(
    "linear_glu", fake=_linear_glu_fake, differentiable=("x", "w_gate", "w_up"), backward=ref.linear_glu_bwd_ref
)
def linear_glu_op(x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    return ref.linear_glu_ref(x, w_gate, w_up, kind, beta1, beta2)


def _linear_route_fake(x, weight, bias, top_k, scoring, renormalize, routed_scale):
    t, e = x.shape[0], weight.shape[0]
    dt = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    return x.new_empty(t, top_k, dtype=dt), x.new_empty(t, top_k, dtype=torch.int64), x.new_empty(t, e, dtype=dt)


@k3_op("linear_route", fake=_linear_route_fake, differentiable=("x", "weight"), backward=ref.linear_route_bwd_ref)
def linear_route_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return ref.linear_route_ref(x, weight, bias, top_k, scoring, renormalize, routed_scale)


def linear_glu(
    x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float = 0.0, beta2: float = 0.0, *, backend: str = "auto"
) -> Tensor:
    """Gate and up projections with the gated activation applied, as one op."""
    return torch.ops.k3.linear_glu.default(x, w_gate, w_up, kind, beta1, beta2, backend=backend)
