"""PyTorch references for the MoE router and fixed-capacity dispatch/combine (Stable LatentMoE).

Shapes: T tokens, E experts, K experts per token, C per-expert capacity, D feature width (the latent
width when the experts run latent). Every shape is fixed by the input shapes and static arguments: no
host synchronisation, no data-dependent sizes, so the ops trace, compile and run on meta.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from k3compile.kernels._common.consts import cached, const
from k3compile.kernels.norms.reference import as_dtype, upcast, upcast_dtype


def route_ref(
    logits_TE: Tensor, bias_E: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Router: scores, top-k selection by scores + bias, weights from the unbiased scores.

    Returns (weights [T, K], indices [T, K] int64, scores [T, E]), weights and scores in fp32 (float64
    stays float64). The bias only chooses experts, it never enters the weights; weights are the chosen
    scores, divided by their sum when `renormalize`, times `routed_scale`.
    """
    logits = upcast(logits_TE)
    if scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    elif scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    choice = scores if bias_E is None else scores + as_dtype(bias_E, scores.dtype)
    indices = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    if routed_scale == 1.0:  # x * 1.0 is x
        return weights, indices, scores
    return weights * const(routed_scale, weights), indices, scores


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Per-expert buffer C = ceil(capacity_factor * T * K / E), at least 1, at most T.

    T is the most one expert can receive (a token picks an expert at most once), so C = T is the dense,
    drop-free mode; `capacity_factor <= 0` selects it. Works on symbolic sizes as well as ints.
    """
    if capacity_factor <= 0:
        return num_tokens
    cap = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
    return torch.sym_min(num_tokens, torch.sym_max(1, cap))


def expert_slots(indices_TK: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """Buffer slot of every (token, choice): expert * C + its position among that expert's tokens.

    Positions follow token order (token-major over the flattened [T, K] choices), i.e. the position in a
    cumsum over the one-hot assignment, computed by a stable sort instead of a [T*K, E] one-hot.
    Choices at position >= C are dropped and get the sentinel slot E * C.
    Returns (slots [T, K] int64, load [E] int64 counted before dropping, dropped count [] int64).
    """
    flat = indices_TK.reshape(-1)
    n = flat.numel()
    load = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    load = load.scatter_add(0, flat, torch.ones_like(flat))
    start = load.cumsum(0) - load
    order = torch.sort(flat, stable=True).indices
    rank_sorted = torch.arange(n, device=flat.device) - start[flat[order]]
    pos = torch.empty_like(flat).scatter(0, order, rank_sorted)
    keep = pos < capacity
    slots = torch.where(keep, flat * capacity + pos, num_experts * capacity)
    dropped = (~keep).sum()
    return slots.view_as(indices_TK), load, dropped


def dispatch_ref(
    x_TD: Tensor, indices_TK: Tensor, num_experts: int, capacity_factor: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gather tokens into per-expert buffers of static capacity; unused rows are zero.

    Returns (buffer [E, C, D] in x's dtype, slots [T, K] int64, load [E] int64, dropped [] int64);
    `slots` is what `combine_ref` needs to bring expert outputs back.
    """
    t, d = x_TD.shape
    k = indices_TK.shape[-1]
    cap = expert_capacity(t, num_experts, k, capacity_factor)
    slots, load, dropped = expert_slots(indices_TK, num_experts, cap)
    token = torch.arange(t * k, device=x_TD.device) // k
    # token occupying each slot; empty slots (and the drop sentinel E*C) point at a zero row at index T
    token_of_slot = torch.full((num_experts * cap + 1,), t, dtype=torch.int64, device=x_TD.device)
    token_of_slot = token_of_slot.scatter_reduce(0, slots.reshape(-1), token, reduce="amin")
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, d)])
    buffer = x_pad[token_of_slot[: num_experts * cap]].view(num_experts, cap, d)
    return buffer, slots, load, dropped


def _shaped(t: Tensor, *shape: int) -> Tensor:
    """t.reshape(shape), as the one view it is for a contiguous t."""
    return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def combine_ref(out_ECD: Tensor, weights_TK: Tensor, slots_TK: Tensor | None) -> Tensor:
    """y_t = sum_k w_tk * out[slot_tk]; dropped choices (slot E*C) contribute zero. Sums in fp32.

    slots None: out holds one row per (token, choice) in that order, [T * K, 1, D] (the decode graph's
    gathered experts), so no gather is needed. Returns [T, D] in out's dtype.
    """
    e, c, d = out_ECD.shape
    acc = upcast_dtype(out_ECD.dtype)
    if slots_TK is None:
        t, k = weights_TK.shape
        rows = as_dtype(_shaped(out_ECD, t, k, d), acc)
        return as_dtype(torch.bmm(_shaped(as_dtype(weights_TK, acc), t, 1, k), rows).view(t, d), out_ECD.dtype)
    t, k = slots_TK.shape
    dtype, device = out_ECD.dtype, out_ECD.device
    zero = cached(("moe_zero_row", d, dtype), out_ECD, lambda: torch.zeros(1, d, dtype=dtype, device=device))
    flat = torch.cat([_shaped(out_ECD, e * c, d), zero])
    gathered = as_dtype(flat.index_select(0, _shaped(slots_TK, t * k)), acc).view(t, k, d)
    # sum_k w_tk * out[slot_tk]: a [1, K] x [K, D] product per token, the bmm einsum("tk,tkd->td") runs
    y = torch.bmm(_shaped(as_dtype(weights_TK, acc), t, 1, k), gathered).view(t, d)
    return as_dtype(y, out_ECD.dtype)


def _rows_layout(indices_TK: Tensor, num_experts: int, capacity_factor: float) -> tuple[Tensor, ...]:
    """(row of each (token, choice) [T*K], sentinel T*K when dropped; token of each row [T*K], T when empty;
    kept rows per expert [E]; load [E]; dropped []): the capacity path's kept choices, expert-major."""
    t, k = indices_TK.shape
    n = t * k
    cap = expert_capacity(t, num_experts, k, capacity_factor)
    slots, load, dropped = expert_slots(indices_TK, num_experts, cap)
    flat, slot = indices_TK.reshape(-1), slots.reshape(-1)
    counts = load.clamp_max(cap)
    start = counts.cumsum(0) - counts
    keep = slot < num_experts * cap
    row = torch.where(keep, start[flat] + (slot - flat * cap), n)
    token = torch.arange(n, device=flat.device) // k
    token_of_row = torch.full((n + 1,), t, dtype=torch.int64, device=flat.device).scatter_(0, row, token)[:n]
    # the sentinel n took any dropped token: cut off, so every row past the kept ones reads the zero row
    return row, token_of_row, counts, load, dropped


def dispatch_rows_ref(
    x_TD: Tensor, indices_TK: Tensor, num_experts: int, capacity_factor: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The capacity dispatch without its empty rows: the kept (token, choice) rows sorted by expert.

    Expert e's rows are [start_e, start_e + counts_e), start = exclusive cumsum of counts, in the token order
    the capacity buffer holds them in; the T*K - sum(counts) rows after them (the dropped choices) are zero.
    Returns (rows [T*K, D], slots [T, K] into rows (T*K for a dropped choice, what `combine_ref` reads with the
    rows as one [1, T*K, D] buffer), counts [E] int64, load [E] int64, dropped [] int64), the load and dropped
    count exactly `dispatch_ref`'s.
    """
    t, d = x_TD.shape
    row, token_of_row, counts, load, dropped = _rows_layout(indices_TK, num_experts, capacity_factor)
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, d)])
    return x_pad[token_of_row], row.view_as(indices_TK), counts, load, dropped


def dispatch_rows_bwd_ref(
    grads: list[Tensor], x_TD: Tensor, indices_TK: Tensor, num_experts: int, capacity_factor: float
) -> list[Tensor]:
    """[dx] of `dispatch_rows_ref` for grads = [d rows]: each token sums its kept rows' cotangents."""
    t, d = x_TD.shape
    token_of_row = _rows_layout(indices_TK, num_experts, capacity_factor)[1]
    dx = x_TD.new_zeros(t + 1, d).index_add_(0, token_of_row, grads[0].to(x_TD.dtype))
    return [dx[:t]]
