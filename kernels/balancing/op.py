"""k3 load-balancing ops: Quantile Balancing (exact, histogram), DeepSeek sign update, auxiliary loss."""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.balancing import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


def _bias_like(bias: Tensor) -> Tensor:
    return bias.new_empty(bias.shape, dtype=torch.float32)


@k3_op("quantile_balance_update", fake=lambda scores, bias, k: _bias_like(bias))
def quantile_balance_update_op(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    return ref.quantile_balance_update(scores, bias, k)


@k3_op("qb_histogram", fake=lambda scores, bias, k, bins: scores.new_empty(scores.shape[-1], bins, dtype=torch.int64))
def qb_histogram_op(scores: Tensor, bias: Tensor, k: int, bins: int) -> Tensor:
    return ref.qb_histogram(scores, bias, k, bins)


@k3_op("qb_update_from_histogram", fake=lambda counts, bias, k: _bias_like(bias))
def qb_update_from_histogram_op(counts: Tensor, bias: Tensor, k: int) -> Tensor:
    return ref.qb_update_from_histogram(counts, bias, k)


@k3_op("sign_balance_update", fake=lambda load, bias, rate: _bias_like(bias))
def sign_balance_update_op(load: Tensor, bias: Tensor, rate: float) -> Tensor:
    return ref.sign_balance_update(load, bias, rate)


@k3_op(
    "moe_aux_loss",
    fake=lambda scores, indices: scores.new_empty((), dtype=torch.promote_types(scores.dtype, torch.float32)),
)
def moe_aux_loss_op(scores: Tensor, indices: Tensor) -> Tensor:
    return ref.aux_balance_loss(scores, indices)


def _aux_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])


def _aux_backward(ctx, grad):
    # Closed form, plain aten ops: with the aux loss attached, AOT autograd may move this backward into
    # the forward graph (its cotangent is a constant), where the generic torch.func.vjp recompute fails.
    scores, indices = ctx.saved_tensors
    s = scores.to(torch.promote_types(scores.dtype, torch.float32))
    t, e = s.shape
    flat = indices.reshape(-1)
    ones = torch.ones(flat.shape, dtype=s.dtype, device=s.device)
    f_E = torch.zeros(e, dtype=s.dtype, device=s.device).scatter_add(0, flat, ones) / flat.numel()
    total_T1 = s.sum(-1, keepdim=True)
    d = (f_E / total_T1 - (s @ f_E)[:, None] / total_T1.square()) * (e / t)
    return (grad * d).to(scores.dtype), None, None


moe_aux_loss_op.register_autograd(_aux_backward, setup_context=_aux_setup)


@k3_op("attach_aux_loss", fake=lambda x, loss, coef: empty_like(x))
def attach_aux_loss_op(x: Tensor, loss: Tensor, coef: float) -> Tensor:
    return x.clone()


def _attach_setup(ctx, inputs, output):
    ctx.coef = inputs[2]
    ctx.save_for_backward(inputs[1])


def _attach_backward(ctx, grad):
    (loss,) = ctx.saved_tensors
    return grad, torch.full_like(loss, ctx.coef), None, None


attach_aux_loss_op.register_autograd(_attach_backward, setup_context=_attach_setup)


def quantile_balance_update(scores: Tensor, bias: Tensor, k: int, *, backend: str = "auto") -> Tensor:
    """Exact Quantile Balancing: next step's selection bias [E] (fp32) from this batch's scores [T, E]."""
    return torch.ops.k3.quantile_balance_update.default(scores, bias, k, backend=backend)


def qb_histogram(scores: Tensor, bias: Tensor, k: int, bins: int = 1000, *, backend: str = "auto") -> Tensor:
    """Per-expert int64 histogram [E, bins] of the QB margins: sum it over ranks, then `qb_update_from_histogram`."""
    return torch.ops.k3.qb_histogram.default(scores, bias, k, bins, backend=backend)


def qb_update_from_histogram(counts: Tensor, bias: Tensor, k: int, *, backend: str = "auto") -> Tensor:
    """Quantile Balancing read from a (summed) margin histogram; same bias as the one it was binned with."""
    return torch.ops.k3.qb_update_from_histogram.default(counts, bias, k, backend=backend)


def quantile_balance_update_hist(
    scores: Tensor, bias: Tensor, k: int, bins: int = 1000, *, backend: str = "auto"
) -> Tensor:
    """Histogram Quantile Balancing on one rank (no all-reduce between the two halves)."""
    counts = qb_histogram(scores, bias, k, bins, backend=backend)
    return qb_update_from_histogram(counts, bias, k, backend=backend)


def sign_balance_update(load: Tensor, bias: Tensor, rate: float = 1e-3, *, backend: str = "auto") -> Tensor:
    """DeepSeek-V3 update b_j + rate * sign(mean load - load_j), fp32."""
    return torch.ops.k3.sign_balance_update.default(load, bias, rate, backend=backend)


def aux_balance_loss(scores: Tensor, indices: Tensor, *, backend: str = "auto") -> Tensor:
    """Switch/DeepSeek auxiliary loss E * sum_j f_j P_j (1 when even); differentiable w.r.t. scores."""
    return torch.ops.k3.moe_aux_loss.default(scores, indices, backend=backend)


def attach_aux_loss(x: Tensor, loss: Tensor, coef: float, *, backend: str = "auto") -> Tensor:
    """Return x unchanged, but make backward through it add coef * d(loss) to the gradients.

    Lets a module feed an auxiliary loss into training without returning it: attach it to any tensor
    on the path to the main loss (LatentMoE uses the routing weights).
    """
    return torch.ops.k3.attach_aux_loss.default(x, loss, coef, backend=backend)
