"""PyTorch references for the grouped expert GEMMs on fixed-capacity buffers [E, C, ...].

Every expert e runs its own matmuls on its C buffer rows (zero rows where unused): the gated
projection act(x W_gate^T, x W_up^T) [E, C, I] and the plain projection x W^T. Weights come as
stacked tensors (gate/up [E, I, w], down [E, w, I]) or as MXFP4 (e2m1) payloads [E, out, in/2] with
E8M0 scales [E, out, in/block]. All accumulate in at least fp32 and return x's dtype; these are the
oracles of the fused Triton kernels in moe_triton.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.activations.reference import check_glu_kind, glu_grads, glu_ref
from k3compile.kernels.mx.reference import mx_dequantize_fast
from k3compile.kernels.norms.reference import FEW_ROWS, as_dtype, upcast, upcast_dtype

def _acc_dtype(x: Tensor) -> torch.dtype:
    return upcast_dtype(x.dtype)


def _matmul_t(x: Tensor, w: Tensor) -> Tensor:
    """x @ w^T over the leading dims; one bmm when both are 3-d with the same batch (what matmul runs then)."""
    if x.dim() == 3 and w.dim() == 3 and x.shape[0] == w.shape[0]:
        return torch.bmm(x, w.transpose(-1, -2))
    return x @ w.transpose(-1, -2)


def expert_glu_ref(
    x_ECw: Tensor, w_gate_EIw: Tensor, w_up_EIw: Tensor, kind: str, beta1: float, beta2: float
) -> Tensor:
    """act(x W_gate^T, x W_up^T) per expert -> [E, C, I], as the unfused composition computed in fp32.

    kind "situ_glu" uses beta1/beta2; "swiglu" (silu(gate) * up) ignores them.
    """
    check_glu_kind(kind, "expert GLU")
    x = upcast(x_ECw)
    return as_dtype(glu_ref(_matmul_t(x, upcast(w_gate_EIw)), _matmul_t(x, upcast(w_up_EIw)), kind, beta1, beta2),
                    x_ECw.dtype)


def expert_matmul_ref(x_ECI: Tensor, w_EwI: Tensor) -> Tensor:
    """x @ w^T per expert: [E, C, I] x [E, w, I] -> [E, C, w], fp32 accumulation."""
    return as_dtype(_matmul_t(upcast(x_ECI), upcast(w_EwI)), x_ECI.dtype)


def _batched(t: Tensor) -> Tensor:
    """[..., R, K] upcast, with the leading (expert) dims folded into one: [E, R, K]."""
    return upcast(t).reshape(-1, *t.shape[-2:])


def expert_glu_bwd_ref(
    grads: list[Tensor], x_ECw: Tensor, w_gate_EIw: Tensor, w_up_EIw: Tensor, kind: str, beta1: float, beta2: float
) -> list[Tensor]:
    """[dx, dw_gate, dw_up] of `expert_glu_ref` for grads = [dy], in fp32 like the forward.

    The gate/up projections are recomputed (the op saves only its inputs), then per expert
    dx = dgate W_gate + dup W_up, dW_gate = dgate^T x, dW_up = dup^T x, with (dgate, dup) from `glu_grads`.
    """
    check_glu_kind(kind, "expert GLU")
    x, wg, wu = _batched(x_ECw), _batched(w_gate_EIw), _batched(w_up_EIw)
    dgate, dup = glu_grads(grads[0].reshape(*x.shape[:-1], -1), x @ wg.mT, x @ wu.mT, kind, beta1, beta2)
    dx = torch.baddbmm(dgate @ wg, dup, wu)
    return [dx.view(x_ECw.shape).to(x_ECw.dtype), (dgate.mT @ x).view(w_gate_EIw.shape).to(w_gate_EIw.dtype),
            (dup.mT @ x).view(w_up_EIw.shape).to(w_up_EIw.dtype)]


def expert_matmul_bwd_ref(grads: list[Tensor], x_ECI: Tensor, w_EwI: Tensor) -> list[Tensor]:
    """[dx, dw] of `expert_matmul_ref` for grads = [dy]: dx = dy w, dw = dy^T x per expert, in fp32."""
    x, w = _batched(x_ECI), _batched(w_EwI)
    dy = upcast(grads[0]).reshape(*x.shape[:-1], -1)
    return [(dy @ w).view(x_ECI.shape).to(x_ECI.dtype), (dy.mT @ x).view(w_EwI.shape).to(w_EwI.dtype)]


def mx_expert_glu_ref(
    x_ECw: Tensor,
    gate_data: Tensor,
    gate_scale: Tensor,
    up_data: Tensor,
    up_scale: Tensor,
    block: int,
    kind: str,
    beta1: float,
    beta2: float,
) -> Tensor:
    """`expert_glu_ref` with MXFP4 gate/up weights ([E, I, w/2] uint8 + [E, I, w/block] E8M0), dequantised first.

    With a few rows per expert (a decoding step's gathered experts) gate and up are dequantised and multiplied
    as one [E, 2I, w] stack: half the calls, and the copy of the payload is small against its dequantised form.
    """
    acc = _acc_dtype(x_ECw)
    if x_ECw.shape[-2] <= FEW_ROWS and gate_data.shape == up_data.shape and gate_scale.shape == up_scale.shape:
        check_glu_kind(kind, "expert GLU")
        w = mx_dequantize_fast(torch.cat([gate_data, up_data], dim=-2), torch.cat([gate_scale, up_scale], dim=-2),
                               "e2m1", block, acc)
        rows = gate_data.shape[-2]
        gate, up = _matmul_t(upcast(x_ECw), w).split([rows, rows], dim=-1)  # sizes: split_with_sizes, 4 calls fewer
        return as_dtype(glu_ref(gate, up, kind, beta1, beta2), x_ECw.dtype)
    w_gate = mx_dequantize_fast(gate_data, gate_scale, "e2m1", block, acc)
    w_up = mx_dequantize_fast(up_data, up_scale, "e2m1", block, acc)
    return expert_glu_ref(x_ECw, w_gate, w_up, kind, beta1, beta2)


def mx_expert_matmul_ref(x_ECI: Tensor, data: Tensor, scale: Tensor, block: int) -> Tensor:
    """`expert_matmul_ref` with an MXFP4 weight ([E, w, I/2] uint8 + [E, w, I/block] E8M0), dequantised first."""
    return expert_matmul_ref(x_ECI, mx_dequantize_fast(data, scale, "e2m1", block, _acc_dtype(x_ECI)))


def expert_groups(counts_E: Tensor) -> tuple[list[tuple[int, int, int]], int]:
    """((expert, first row, end row) of every expert with rows, the rows they hold): one host read of the
    counts (a CPU kernel)."""
    out, start = [], 0
    for e, c in enumerate(counts_E.tolist()):
        if c:
            out.append((e, start, start + c))
        start += c
    return out, start


def expert_rows_matmul_ref(x_NI: Tensor, w_EwI: Tensor, counts_E: Tensor) -> Tensor:
    """x @ w_e^T for each expert's rows of x sorted by expert (counts_E rows each, from row 0): [N, I] -> [N, w].

    The rows past sum(counts) are zero. fp32 accumulation, x's dtype out: `expert_matmul_ref` on the rows an
    expert actually holds, not its fixed-capacity buffer.
    """
    x, w = upcast(x_NI), upcast(w_EwI)
    y = x.new_empty(x.shape[0], w.shape[-2])
    groups, used = expert_groups(counts_E)
    for e, s, t in groups:
        torch.mm(x[s:t], w[e].T, out=y[s:t])
    y[used:].zero_()
    return as_dtype(y, x_NI.dtype)


def expert_rows_matmul_bwd_ref(grads: list[Tensor], x_NI: Tensor, w_EwI: Tensor, counts_E: Tensor) -> list[Tensor]:
    """[dx, dw] of `expert_rows_matmul_ref` for grads = [dy]: dx_e = dy_e w_e, dw_e = dy_e^T x_e; zero for an
    expert without rows and for the rows past sum(counts)."""
    x, w, dy = upcast(x_NI), upcast(w_EwI), upcast(grads[0])
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    groups, used = expert_groups(counts_E)
    dx[used:].zero_()
    if len(groups) < w.shape[0]:
        dw[counts_E == 0] = 0
    for e, s, t in groups:
        torch.mm(dy[s:t], w[e], out=dx[s:t])
        torch.mm(dy[s:t].T, x[s:t], out=dw[e])
    return [dx.to(x_NI.dtype), dw.to(w_EwI.dtype)]
