"""k3 norm ops: rms_norm, l2_norm, and the fused rms_norm_gate / add_rms_norm the fuse pass targets.

Each backward is hand-written (kernels/norms/reference.py `*_bwd_ref`, or the Triton module's on that backend);
add_rms_norm's reuses rms_norm's backward op on the saved sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.norms import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


@k3_op(
    "rms_norm",
    fake=lambda x, weight, eps: empty_like(x),
    differentiable=("x", "weight"),
    backward=ref.rms_norm_bwd_ref,
)
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ref.rms_norm_ref(x, weight, eps)


@k3_op("l2_norm", fake=lambda x, eps: empty_like(x), differentiable=("x",), backward=ref.l2_norm_bwd_ref)
def l2_norm_op(x: Tensor, eps: float) -> Tensor:
    return ref.l2_norm_ref(x, eps)


@k3_op(
    "rms_norm_gate",
    fake=lambda x, weight, gate, eps: empty_like(x),
    differentiable=("x", "weight", "gate"),
    backward=ref.rms_norm_gate_bwd_ref,
)
def rms_norm_gate_op(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    return ref.rms_norm_gate_ref(x, weight, gate, eps)


def _add_rms_norm_fake(x, residual, weight, eps):
    return empty_like(x), empty_like(x)


@k3_op("add_rms_norm", fake=_add_rms_norm_fake)
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return ref.add_rms_norm_ref(x, residual, weight, eps)


def _add_rms_norm_setup(ctx, inputs, output):
    ctx.eps, ctx.backend = inputs[3], inputs[4]
    ctx.save_for_backward(output[1], inputs[2])


def _add_rms_norm_backward(ctx, grad_normed, grad_sum):
    # Own backward: the generic recompute would return one gradient tensor for both x and residual,
    # which custom ops forbid (aliased outputs). It reuses rms_norm's backward op on the saved sum.
    s, weight = ctx.saved_tensors
    grad_s, grad_w = torch.ops.k3.rms_norm_bwd.default([grad_normed], s, weight, ctx.eps, ctx.backend)
    grad_s = grad_s + grad_sum
    return grad_s, grad_s, grad_w, None, None


add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5, *, backend: str = "auto") -> Tensor:
    """RMSNorm over the last dim, fp32 statistics, output in x's dtype."""
    return torch.ops.k3.rms_norm.default(x, weight, eps, backend=backend)


def l2_norm(x: Tensor, eps: float = 1e-6, *, backend: str = "auto") -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return torch.ops.k3.l2_norm.default(x, eps, backend=backend)


def rms_norm_gate(x: Tensor, weight: Tensor, gate: Tensor, eps: float = 1e-5, *, backend: str = "auto") -> Tensor:
    """RMSNorm(x) * sigmoid(gate) in one op."""
    return torch.ops.k3.rms_norm_gate.default(x, weight, gate, eps, backend=backend)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-5, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual) in one op."""
    return torch.ops.k3.add_rms_norm.default(x, residual, weight, eps, backend=backend)
