"""Triton kernels for the MoE router: scores, top-k by scores + bias, weights from the unbiased scores.

Legend: T tokens, E experts (one row of up to 1024 in registers), K chosen experts (up to 16), H hidden size.
Top-k is K rounds of an argmax over the row, each masking its winner. Tie order: among equal values of
scores + bias the lowest expert index is chosen first (torch.topk gives no tie order; on inputs without
ties both select the same indices in the same, descending, order). `linear_route` leaves the router
matmul to torch (cuBLAS) and fuses everything after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

TUNABLE = {
    "moe_route": {"BLOCK_T": [1, 2, 4, 8, 16, 32], "num_warps": [1, 2, 4, 8], "num_stages": [1]},
    "moe_route_bwd": {"BLOCK_T": [1, 2, 4, 8, 16, 32], "num_warps": [1, 2, 4, 8], "num_stages": [1]},
}

_TILE_ELEMENTS = 2048  # [BLOCK_T, BLOCK_E] elements per program in the default configs (16 per thread)


@triton.jit
def _score_select(
    logits_ptr, bias_ptr, rows, rmask, E,
    HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Scores [BLOCK_T, BLOCK_E] (0 in padding), chosen experts [BLOCK_T, BLOCK_K] and their scores."""
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
    ).to(tl.float32)
    if SOFTMAX:
        x = tl.where(cmask[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    else:
        scores = tl.where(cmask[None, :], tl.sigmoid(x), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(cmask[None, :], choice, float("-inf"))
    kcol = tl.arange(0, BLOCK_K)[None, :]
    chosen = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    chosen_scores = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for k in tl.static_range(K):
        _, idx = tl.max(choice, axis=1, return_indices=True, return_indices_tie_break_left=True)
        hit = cols[None, :] == idx[:, None]
        chosen = tl.where(kcol == k, idx[:, None], chosen)
        chosen_scores = tl.where(kcol == k, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], chosen_scores)
        choice = tl.where(hit, float("-inf"), choice)
    return scores, chosen, chosen_scores


@triton.jit
def _route_fwd_kernel(
    logits_ptr, bias_ptr, weights_ptr, indices_ptr, scores_ptr, T, E, routed_scale,
    HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per BLOCK_T tokens: scores, top-k of scores + bias, (renormalised) scaled weights."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    scores, chosen, w = _score_select(
        logits_ptr, bias_ptr, rows, rmask, E, HAS_BIAS, SOFTMAX, K, BLOCK_T, BLOCK_E, BLOCK_K
    )
    if RENORMALIZE:
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-20)[:, None]
    w = w * routed_scale
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    tl.store(scores_ptr + rows64[:, None] * E + cols[None, :], scores, mask=rmask[:, None] & (cols < E)[None, :])
    kcol = tl.arange(0, BLOCK_K)
    kmask = rmask[:, None] & (kcol < K)[None, :]
    tl.store(weights_ptr + rows64[:, None] * K + kcol[None, :], w, mask=kmask)
    tl.store(indices_ptr + rows64[:, None] * K + kcol[None, :], chosen.to(tl.int64), mask=kmask)


@triton.jit
def _route_bwd_kernel(
    logits_ptr, bias_ptr, gw_ptr, gs_ptr, dlogits_ptr, T, E, routed_scale,
    HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dlogits from (g_weights, g_scores): recompute the choice, scatter the weights' gradient onto the
    chosen scores, add g_scores, then through sigmoid (s (1 - s)) or softmax (s (g - s . g))."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    scores, chosen, w = _score_select(
        logits_ptr, bias_ptr, rows, rmask, E, HAS_BIAS, SOFTMAX, K, BLOCK_T, BLOCK_E, BLOCK_K
    )
    rows64 = rows.to(tl.int64)
    kcol = tl.arange(0, BLOCK_K)
    gw = tl.load(gw_ptr + rows64[:, None] * K + kcol[None, :], mask=rmask[:, None] & (kcol < K)[None, :], other=0.0)
    gw = gw.to(tl.float32) * routed_scale
    if RENORMALIZE:
        total = tl.sum(w, axis=1)
        denom = tl.maximum(total, 1e-20)
        # d(w_j / denom) / dw_j plus the path through the clamped sum (open only where the sum >= 1e-20)
        through_sum = tl.where(total >= 1e-20, tl.sum(gw * w, axis=1) / (denom * denom), 0.0)
        gw = gw / denom[:, None] - through_sum[:, None]
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    offs = rows64[:, None] * E + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    ds = tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(K):
        idx_k = tl.sum(tl.where(kcol[None, :] == k, chosen, 0), axis=1)
        g_k = tl.sum(tl.where(kcol[None, :] == k, gw, 0.0), axis=1)
        ds += tl.where(cols[None, :] == idx_k[:, None], g_k[:, None], 0.0)
    if SOFTMAX:
        dx = scores * (ds - tl.sum(ds * scores, axis=1)[:, None])
    else:
        dx = ds * scores * (1.0 - scores)
    tl.store(dlogits_ptr + offs, dx.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _launch_args(logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, kernel: str):
    """Flattened [T, E] logits, bias (or a dummy pointer), the launch config and the constexprs."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    E = logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    x = logits.reshape(-1, E).contiguous()
    block_e = triton.next_power_of_2(E)
    defaults = {"BLOCK_T": max(1, min(64, _TILE_ELEMENTS // block_e)), "num_warps": 4, "num_stages": 1}
    cfg = launch_config(kernel, logits.device, defaults, dtype=logits.dtype, T=x.shape[0], E=E, K=top_k)
    meta = dict(
        HAS_BIAS=bias is not None, SOFTMAX=scoring == "softmax", K=top_k, BLOCK_T=cfg["BLOCK_T"], BLOCK_E=block_e,
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    b = bias.contiguous() if bias is not None else x
    return x, b, (triton.cdiv(x.shape[0], cfg["BLOCK_T"]),), meta


def route(
    logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(weights [..., K] fp32, indices [..., K] int64, scores [..., E] fp32) of the router logits [..., E]."""
    x, b, grid, meta = _launch_args(logits, bias, top_k, scoring, "moe_route")
    T, E = x.shape
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    indices = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    scores = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T:
        _route_fwd_kernel[grid](
            x, b, weights, indices, scores, T, E, float(routed_scale), RENORMALIZE=renormalize, **meta
        )
    lead = logits.shape[:-1]
    return weights.view(*lead, top_k), indices.view(*lead, top_k), scores.view(*lead, E)


def route_bwd(
    grads: list[Tensor], logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
    routed_scale: float,
) -> list[Tensor | None]:
    """[dlogits] (logits' dtype) for grads = [g_weights [..., K], g_scores [..., E]]; the selection is recomputed."""
    x, b, grid, meta = _launch_args(logits, bias, top_k, scoring, "moe_route_bwd")
    T, E = x.shape
    gw = grads[0].reshape(T, top_k).contiguous()
    gs = grads[1].reshape(T, E).contiguous()
    dlogits = torch.empty_like(x)
    if T:
        _route_bwd_kernel[grid](x, b, gw, gs, dlogits, T, E, float(routed_scale), RENORMALIZE=renormalize, **meta)
    return [dlogits.view(logits.shape)]


def linear_route(
    x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """route(x W^T, ...): the matmul by torch (cuBLAS), scoring and top-k by the fused kernel."""
    return route(F.linear(x, weight), bias, top_k, scoring, renormalize, routed_scale)


def linear_route_bwd(
    grads: list[Tensor], x: Tensor, weight: Tensor, bias: Tensor | None, top_k: int, scoring: str,
    renormalize: bool, routed_scale: float,
) -> list[Tensor | None]:
    """[dx, dweight]: dlogits from route_bwd on the recomputed logits, then dx = dlogits W, dW = dlogits^T x."""
    logits = F.linear(x, weight)
    dlogits = route_bwd(grads, logits, bias, top_k, scoring, renormalize, routed_scale)[0]
    g2 = dlogits.reshape(-1, weight.shape[0])
    dx = (g2 @ weight).view(x.shape)
    dweight = g2.t() @ x.reshape(-1, x.shape[-1])
    return [dx, dweight]
