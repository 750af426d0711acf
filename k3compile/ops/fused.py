"""Fused k3 ops produced by the fuse pass (references in kernels/fused.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels import fused as ref
from k3compile.ops.registry import k3_op


def _linear_glu_fake(x, w_gate, w_up, kind, beta1, beta2):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


@k3_op("linear_glu", fake=_linear_glu_fake, differentiable=("x", "w_gate", "w_up"))
def linear_glu_op(x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    return ref.linear_glu_ref(x, w_gate, w_up, kind, beta1, beta2)


def linear_glu(x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float = 0.0, beta2: float = 0.0) -> Tensor:
    """Gate and up projections with the gated activation applied, as one op."""
    return torch.ops.k3.linear_glu.default(x, w_gate, w_up, kind, beta1, beta2)
