"""k3 MoE ops: router (moe_route), fixed-capacity dispatch/combine, and the batched expert MLP."""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.moe import reference as ref
from k3compile.kernels.activations.op import gelu, situ_glu, swiglu
from k3compile.kernels.mx.op import mx_fake_quantize
from k3compile.kernels._common.registry import k3_op

ACTIVATIONS = ("situ_glu", "swiglu", "gelu")
expert_capacity = ref.expert_capacity  # static C for T tokens; 0 or less selects dense (C = T)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _route_fake(logits, bias, top_k, scoring, renormalize, routed_scale):
    t, e = logits.shape
    dt = _acc_dtype(logits)
    weights = logits.new_empty(t, top_k, dtype=dt)
    return weights, logits.new_empty(t, top_k, dtype=torch.int64), logits.new_empty(t, e, dtype=dt)


@k3_op("moe_route", fake=_route_fake, differentiable=("logits",))
def moe_route_op(
    logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return ref.route_ref(logits, bias, top_k, scoring, renormalize, routed_scale)


def _dispatch_fake(x, indices, num_experts, capacity_factor):
    t, d = x.shape
    cap = ref.expert_capacity(t, num_experts, indices.shape[-1], capacity_factor)
    return (
        x.new_empty(num_experts, cap, d),
        indices.new_empty(indices.shape, dtype=torch.int64),
        x.new_empty(num_experts, dtype=torch.int64),
        x.new_empty((), dtype=torch.int64),
    )


@k3_op("moe_dispatch", fake=_dispatch_fake, differentiable=("x",))
def moe_dispatch_op(
    x: Tensor, indices: Tensor, num_experts: int, capacity_factor: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return ref.dispatch_ref(x, indices, num_experts, capacity_factor)


def _dispatch_rows_fake(x, indices, num_experts, capacity_factor):
    n = indices.numel()
    load = x.new_empty(num_experts, dtype=torch.int64)
    return (x.new_empty(n, x.shape[-1]), indices.new_empty(indices.shape, dtype=torch.int64), load.new_empty(load.shape),
            load, x.new_empty((), dtype=torch.int64))  # fmt: skip


@k3_op("moe_dispatch_rows", fake=_dispatch_rows_fake, differentiable=("x",), backward=ref.dispatch_rows_bwd_ref)
def moe_dispatch_rows_op(
    x: Tensor, indices: Tensor, num_experts: int, capacity_factor: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return ref.dispatch_rows_ref(x, indices, num_experts, capacity_factor)


def _combine_fake(expert_out, weights, slots):
    return expert_out.new_empty(weights.shape[0], expert_out.shape[-1])


@k3_op("moe_combine", fake=_combine_fake, differentiable=("expert_out", "weights"))
def moe_combine_op(expert_out: Tensor, weights: Tensor, slots: Tensor | None) -> Tensor:
    return ref.combine_ref(expert_out, weights, slots)


def route(
    logits: Tensor,
    bias: Tensor | None,
    top_k: int,
    scoring: str = "sigmoid",
    renormalize: bool = True,
    routed_scale: float = 1.0,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Router on logits [T, E]: (weights [T, K] fp32, indices [T, K] int64, scores [T, E] fp32).

    Top-k of scores + bias chooses; weights are the chosen unbiased scores (renormalised) * routed_scale.
    Differentiable w.r.t. logits.
    """
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    return torch.ops.k3.moe_route.default(logits, bias, top_k, scoring, renormalize, routed_scale, backend=backend)


def moe_dispatch(
    x: Tensor, indices: Tensor, num_experts: int, capacity_factor: float | None = None, *, backend: str = "auto"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tokens x [T, D] into expert buffers [E, C, D], C = ceil(capacity_factor * T * K / E) (<= T).

    capacity_factor None is the dense, drop-free mode C = T. Returns (buffer, slots [T, K] for
    `moe_combine`, load [E] int64 before dropping, dropped [] int64 choices over capacity).
    """
    cf = 0.0 if capacity_factor is None else float(capacity_factor)
    return torch.ops.k3.moe_dispatch.default(x, indices, num_experts, cf, backend=backend)


def moe_dispatch_rows(
    x: Tensor, indices: Tensor, num_experts: int, capacity_factor: float | None = None, *, backend: str = "auto"
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`moe_dispatch` without the buffer's empty rows: (rows [T*K, D] sorted by expert, the dropped choices'
    rows zero at the end; slots [T, K] into rows for `moe_combine` over rows[None]; counts [E] rows per expert;
    load; dropped), the same choices kept and dropped as `moe_dispatch` at this capacity."""
    cf = 0.0 if capacity_factor is None else float(capacity_factor)
    return torch.ops.k3.moe_dispatch_rows.default(x, indices, num_experts, cf, backend=backend)


def moe_combine(expert_out: Tensor, weights: Tensor, slots: Tensor | None, *, backend: str = "auto") -> Tensor:
    """Expert outputs [E, C, D] back to tokens [T, D], weighted by the routing weights [T, K]; slots None:
    one output row per (token, choice), in that order ([T * K, 1, D])."""
    return torch.ops.k3.moe_combine.default(expert_out, weights, slots, backend=backend)


def expert_mlp(
    buffer: Tensor,
    gate_weight: Tensor | None,
    up_weight: Tensor,
    down_weight: Tensor,
    activation: str = "situ_glu",
    beta1: float = 4.0,
    beta2: float = 25.0,
    act_quant: tuple[str, int] | None = None,
    weight_quant: tuple[str, int] | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """All experts at once by batched matmuls: buffer [E, C, w], gate/up [E, I, w], down [E, w, I] -> [E, C, w].

    Gated activations (situ_glu, swiglu) need gate_weight; gelu is ungated and takes none.
    act_quant = (MX element format, block) fake-quantises both matmul inputs (buffer and hidden)
    along their last dim, as the quantisation policy's activation format asks; weight_quant likewise
    fake-quantises the three weights (QAT, straight-through), as the training build's pack_mxfp4 does.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight_quant is not None:
        gate_weight, up_weight, down_weight = (
            None if w is None else mx_fake_quantize(w, *weight_quant, backend=backend)
            for w in (gate_weight, up_weight, down_weight)
        )
    if act_quant is not None:
        buffer = mx_fake_quantize(buffer, *act_quant, backend=backend)
    up = torch.matmul(buffer, up_weight.transpose(-1, -2))
    if activation == "gelu":
        hidden = gelu(up, backend=backend)
    else:
        if gate_weight is None:
            raise ValueError(f"{activation} needs gate_weight")
        gate = torch.matmul(buffer, gate_weight.transpose(-1, -2))
        if activation == "situ_glu":
            hidden = situ_glu(gate, up, beta1, beta2, backend=backend)
        else:
            hidden = swiglu(gate, up, backend=backend)
    if act_quant is not None:
        hidden = mx_fake_quantize(hidden, *act_quant, backend=backend)
    return torch.matmul(hidden, down_weight.transpose(-1, -2))

