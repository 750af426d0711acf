"""References of the fused ops the fuse pass targets: each is exactly the composition it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3compile.kernels.activations.reference import check_glu_kind, glu_grads, glu_ref
from k3compile.kernels.moe.reference import route_ref
from k3compile.kernels.norms.reference import as_dtype, upcast


def linear(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) without a bias, as the one mm it runs for a contiguous x (fewer wrapper calls)."""
    if not x.is_contiguous() or x.dim() < 2:
        return F.linear(x, w)
    y = torch.mm(x.view(-1, x.shape[-1]), w.transpose(0, 1))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])


def linear_glu_ref(x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    """act(x W_gate^T, x W_up^T) for kind 'situ_glu' (with its betas) or 'swiglu'."""
    check_glu_kind(kind, "linear_glu")
    return glu_ref(linear(x, w_gate), linear(x, w_up), kind, beta1, beta2)


def linear_glu_bwd_ref(
    grads: list[Tensor], x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float, beta2: float
) -> list[Tensor]:
    """[dx, dw_gate, dw_up] of `linear_glu_ref` for grads = [dy].

    The projections are recomputed (the op saves only its inputs); the GLU's gradients are taken in fp32 and
    rounded to the projections' dtype, where the matmuls run, as autograd of the composition would.
    """
    check_glu_kind(kind, "linear_glu")
    x2 = x.reshape(-1, x.shape[-1])
    gate, up = F.linear(x2, w_gate), F.linear(x2, w_up)
    dgate, dup = (d.to(gate.dtype) for d in glu_grads(grads[0].reshape(gate.shape), gate, up, kind, beta1, beta2))
    dx = torch.addmm(dgate @ w_gate, dup, w_up)
    return [dx.view(x.shape), dgate.T @ x2, dup.T @ x2]


def linear_route_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits x W^T, scoring, selection bias and top-k in one op (the router's `route` after its matmul)."""
    return route_ref(linear(x, weight), bias, top_k, scoring, renormalize, routed_scale)


def linear_route_bwd_ref(
    grads: list[Tensor], x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
    routed_scale: float,
) -> list[Tensor]:
    """[dx, dweight] of `linear_route_ref` for grads = [d weights [T, K], d scores [T, E]], hand-derived.

    The logits and the selection are recomputed (the op saves its inputs). With raw = scores[indices] and
    w = raw / max(sum(raw), 1e-20) (renormalize), d raw = (gw - sum(gw w)) / max(sum(raw), 1e-20), the second
    term only where the clamp passes; d scores gets d raw added at the chosen experts; d logits is the
    sigmoid's s (1 - s) or the softmax's s (g - sum(g s)) times it; dx = d logits W, dW = d logits^T x.
    """
    x2 = x.reshape(-1, x.shape[-1])
    logits = linear(x2, weight)
    s = torch.sigmoid(upcast(logits)) if scoring == "sigmoid" else torch.softmax(upcast(logits), dim=-1)
    choice = s if bias is None else s + as_dtype(bias, s.dtype)
    indices = torch.topk(choice, top_k, dim=-1).indices
    raw = s.gather(-1, indices)
    gw = as_dtype(grads[0].reshape(raw.shape), s.dtype)
    if routed_scale != 1.0:
        gw = gw * routed_scale
    if renormalize:
        total = raw.sum(-1, keepdim=True)
        denom = total.clamp_min(1e-20)
        through_sum = (gw * raw).sum(-1, keepdim=True).div_(denom).mul_(total >= 1e-20)
        graw = (gw - through_sum).div_(denom)
    else:
        graw = gw
    gs = as_dtype(grads[1].reshape(s.shape), s.dtype).scatter_add(-1, indices, graw)
    if scoring == "sigmoid":
        dlogits = gs.mul_(s).mul_(1 - s)
    else:
        dlogits = (gs - (gs * s).sum(-1, keepdim=True)).mul_(s)
    dlogits = as_dtype(dlogits, logits.dtype)
    return [as_dtype((dlogits @ weight).view(x.shape), x.dtype), as_dtype(dlogits.T @ x2, weight.dtype)]
