"""PyTorch reference of expert_rows_ffn: a routed expert's whole FFN over the rows it holds, a few experts at a time.

The chain it replaces, each op over all T*K rows: expert_rows_matmul (gate), expert_rows_matmul (up),
glu_train, mx_fake_quantize of the activation (optional), expert_rows_matmul (down). Here the experts go
in groups of about glu_train's chunk of rows: both projections, the activation and its quantisation run on
one group while it is in cache, then the group's down projection. Every value is the chain's (the same
matmuls on the same rows, the same elementwise code), and what the backward reads is less: the
activation's derivatives and the quantised activation, not the projections. Legend: N rows (sorted by
expert), E experts, I the rows' width, H the intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from k3compile.kernels.activations.reference import check_glu_kind
from k3compile.kernels.experts.reference import expert_groups
from k3compile.kernels.glu_train.reference import CHUNK, glu_fill
from k3compile.kernels.mx.reference import mx_fake_quantize_fast
from k3compile.kernels.norms.reference import upcast


def _round(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t rounded to `dtype` and back (the chain's ops hand each other x's dtype); t itself when that is its own."""
    return t if t.dtype == dtype else t.to(dtype).to(t.dtype)


def _batches(groups: list[tuple[int, int, int]], width: int) -> list[list[tuple[int, int, int]]]:
    """Consecutive experts in batches of at most CHUNK elements of `width`-wide rows (at least one expert each)."""
    out: list[list[tuple[int, int, int]]] = []
    for g in groups:
        if out and (g[2] - out[-1][0][1]) * width <= CHUNK:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def activate_ref(
    g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, kind: str, beta1: float, beta2: float,
    act_fmt: str | None, block: int,
) -> None:
    """One batch's activation: y (x's dtype) = q(act(g, u)), jg and ju its derivatives (the compute dtype), from
    the projections g and u (the compute dtype, rounded as the chain's ops hand them on)."""
    dtype = y.dtype
    g, u = _round(g, dtype), _round(u, dtype)
    a = g.new_empty(g.shape)
    glu_fill(g.view(-1), u.view(-1), a.view(-1), jg.view(-1), ju.view(-1), kind, beta1, beta2)
    a = a.to(dtype)
    y.copy_(a if act_fmt is None else mx_fake_quantize_fast(a, act_fmt, block))


def expert_rows_ffn(
    x_NI: Tensor, w_gate_EHI: Tensor, w_up_EHI: Tensor, w_down_EIH: Tensor, counts_E: Tensor, kind: str,
    beta1: float, beta2: float, act_fmt: str | None, block: int, activate: Callable = activate_ref,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`expert_rows_ffn_ref` with each batch's activation made by `activate` (the signature of `activate_ref`)."""
    check_glu_kind(kind, "expert_rows_ffn")
    dtype = x_NI.dtype
    x, wg, wu, wd = upcast(x_NI), upcast(w_gate_EHI), upcast(w_up_EHI), upcast(w_down_EIH)
    n, h = x.shape[0], wg.shape[-2]
    out = x.new_empty(n, wd.shape[-2])
    jg, ju = x.new_empty(n, h), x.new_empty(n, h)
    yq = x_NI.new_empty(n, h)
    groups, used = expert_groups(counts_E)
    for batch in _batches(groups, h):
        s0, t0 = batch[0][1], batch[-1][2]
        g, u = (x.new_empty(t0 - s0, h) for _ in range(2))
        for e, s, t in batch:
            torch.mm(x[s:t], wg[e].T, out=g[s - s0 : t - s0])
            torch.mm(x[s:t], wu[e].T, out=u[s - s0 : t - s0])
        activate(g, u, yq[s0:t0], jg[s0:t0], ju[s0:t0], kind, beta1, beta2, act_fmt, block)
        down_in = upcast(yq[s0:t0])
        for e, s, t in batch:
            torch.mm(down_in[s - s0 : t - s0], wd[e].T, out=out[s:t])
    for t in (out, jg, ju, yq):
        t[used:].zero_()
    return out.to(dtype), jg, ju, yq


def expert_rows_ffn_ref(
    x_NI: Tensor,
    w_gate_EHI: Tensor,
    w_up_EHI: Tensor,
    w_down_EIH: Tensor,
    counts_E: Tensor,
    kind: str,
    beta1: float,
    beta2: float,
    act_fmt: str | None,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out [N, I] in x's dtype, dy/dgate and dy/dup [N, H] in the compute dtype, the down projection's input
    [N, H] in x's dtype): out_e = q(act(x_e Wg_e^T, x_e Wu_e^T)) Wd_e^T, q the MX fake quantisation to
    `act_fmt` (blocks of `block`; none when None). Rows past sum(counts) come out zero."""
    return expert_rows_ffn(x_NI, w_gate_EHI, w_up_EHI, w_down_EIH, counts_E, kind, beta1, beta2, act_fmt, block)


def expert_rows_ffn_bwd_ref(
    grads: list[Tensor],
    outputs: list[Tensor],
    x_NI: Tensor,
    w_gate_EHI: Tensor,
    w_up_EHI: Tensor,
    w_down_EIH: Tensor,
    counts_E: Tensor,
    kind: str,
    beta1: float,
    beta2: float,
    act_fmt: str | None,
    block: int,
) -> list[Tensor]:
    """[dx, dw_gate, dw_up, dw_down] for grads[0] = d out, expert by expert from the saved derivatives and
    quantised activation (the quantisation straight-through, as mx_fake_quantize's); zero for an expert
    without rows and for the rows past sum(counts)."""
    _, jg, ju, yq = outputs
    x, wg, wu, wd = upcast(x_NI), upcast(w_gate_EHI), upcast(w_up_EHI), upcast(w_down_EIH)
    dout, down_in = upcast(grads[0]), upcast(yq)
    dtype = x_NI.dtype
    dx = torch.empty_like(x)
    dwg, dwu, dwd = torch.empty_like(wg), torch.empty_like(wu), torch.empty_like(wd)
    groups, used = expert_groups(counts_E)
    dx[used:].zero_()
    if len(groups) < wg.shape[0]:
        for dw in (dwg, dwu, dwd):
            dw[counts_E == 0] = 0
    for e, s, t in groups:
        torch.mm(dout[s:t].T, down_in[s:t], out=dwd[e])
        dy = _round(torch.mm(dout[s:t], wd[e]), dtype)  # all in the compute dtype, rounded as the chain's ops
        dg = _round(dy * jg[s:t], dtype)
        du = _round(dy * ju[s:t], dtype)
        torch.mm(dg.T, x[s:t], out=dwg[e])
        torch.mm(du.T, x[s:t], out=dwu[e])
        dx_e = dx[s:t]  # the chain's two gradients of x, each in x's dtype, summed
        torch.mm(dg, wg[e], out=dx_e)
        if dtype != x.dtype:
            dx_e.copy_(_round(dx_e, dtype))
        dx_e += _round(torch.mm(du, wu[e]), dtype)
    return [dx.to(dtype), dwg.to(w_gate_EHI.dtype), dwu.to(w_up_EHI.dtype), dwd.to(w_down_EIH.dtype)]
