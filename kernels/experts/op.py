"""k3 grouped expert ops: the gate/up GEMMs with the GLU fused, and the down GEMM, over fixed-capacity buffers.

Buffers are [..., C, w] with stacked weights [..., out, in] (leading dims: experts, or ranks x experts after
shard_experts). The fuse pass rewrites the experts' matmuls into these ops, and into their MXFP4 forms when
pack_mxfp4 left the weights packed, so GPU targets run one grouped Triton GEMM per projection. The
differentiable ops' backwards are hand-written (kernels.experts `*_bwd_ref`, or moe_triton's on that backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.experts import rows_ffn as ffn_ref
from k3compile.kernels.experts import reference as ref
from k3compile.kernels.activations.reference import check_glu_kind
from k3compile.kernels.norms.reference import upcast_dtype
from k3compile.kernels._common.registry import k3_op


def _out(x: Tensor, rows: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], rows))


@k3_op(
    "expert_glu",
    fake=lambda x, w_gate, w_up, kind, beta1, beta2: _out(x, w_gate.shape[-2]),
    differentiable=("x", "w_gate", "w_up"),
    backward=ref.expert_glu_bwd_ref,
)
def expert_glu_op(x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    return ref.expert_glu_ref(x, w_gate, w_up, kind, beta1, beta2)


@k3_op(
    "expert_matmul", fake=lambda x, w: _out(x, w.shape[-2]), differentiable=("x", "w"), backward=ref.expert_matmul_bwd_ref
)
def expert_matmul_op(x: Tensor, w: Tensor) -> Tensor:
    return ref.expert_matmul_ref(x, w)


@k3_op(
    "expert_rows_matmul",
    fake=lambda x, w, counts: _out(x, w.shape[-2]),
    differentiable=("x", "w"),
    backward=ref.expert_rows_matmul_bwd_ref,
)
def expert_rows_matmul_op(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    return ref.expert_rows_matmul_ref(x, w, counts)


def _ffn_fake(x, w_gate, w_up, w_down, counts, kind, beta1, beta2, act_fmt, block):
    rows = (x.shape[0], w_gate.shape[-2])
    acc = upcast_dtype(x.dtype)
    return _out(x, w_down.shape[-2]), x.new_empty(rows, dtype=acc), x.new_empty(rows, dtype=acc), x.new_empty(rows)


@k3_op(
    "expert_rows_ffn",
    fake=_ffn_fake,
    differentiable=("x", "w_gate", "w_up", "w_down"),
    backward=ffn_ref.expert_rows_ffn_bwd_ref,
    saves_outputs=True,
)
def expert_rows_ffn_op(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    counts: Tensor,
    kind: str,
    beta1: float,
    beta2: float,
    act_fmt: str | None,
    block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return ffn_ref.expert_rows_ffn_ref(x, w_gate, w_up, w_down, counts, kind, beta1, beta2, act_fmt, block)


@k3_op(
    "mx_expert_glu",
    fake=lambda x, gate_data, gate_scale, up_data, up_scale, block, kind, beta1, beta2: _out(x, gate_data.shape[-2]),
)
def mx_expert_glu_op(
    x: Tensor,
    gate_data: Tensor,
    gate_scale: Tensor,
    up_data: Tensor,
    up_scale: Tensor,
    block: int,
    kind: str,
    beta1: float,
    beta2: float,
) -> Tensor:
    return ref.mx_expert_glu_ref(x, gate_data, gate_scale, up_data, up_scale, block, kind, beta1, beta2)


@k3_op("mx_expert_matmul", fake=lambda x, data, scale, block: _out(x, data.shape[-2]))
def mx_expert_matmul_op(x: Tensor, data: Tensor, scale: Tensor, block: int) -> Tensor:
    return ref.mx_expert_matmul_ref(x, data, scale, block)


def expert_glu(
    x: Tensor, w_gate: Tensor, w_up: Tensor, kind: str, beta1: float = 4.0, beta2: float = 25.0, *, backend: str = "auto"
) -> Tensor:
    """act(x W_gate^T, x W_up^T) per expert: x [..., C, w], weights [..., I, w] -> [..., C, I]."""
    check_glu_kind(kind, "expert GLU")
    return torch.ops.k3.expert_glu.default(x, w_gate, w_up, kind, beta1, beta2, backend=backend)


def expert_matmul(x: Tensor, w: Tensor, *, backend: str = "auto") -> Tensor:
    """x W^T per expert: x [..., C, I], w [..., w, I] -> [..., C, w]."""
    return torch.ops.k3.expert_matmul.default(x, w, backend=backend)


def expert_rows_matmul(x: Tensor, w: Tensor, counts: Tensor, *, backend: str = "auto") -> Tensor:
    """x W_e^T for the rows of x sorted by expert, counts [E] rows each: x [N, I], w [E, w, I] -> [N, w]."""
    return torch.ops.k3.expert_rows_matmul.default(x, w, counts, backend=backend)


def expert_rows_ffn(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    counts: Tensor,
    kind: str,
    beta1: float = 4.0,
    beta2: float = 25.0,
    act_fmt: str | None = None,
    block: int = 32,
    *,
    backend: str = "auto",
) -> Tensor:
    """Each expert's FFN on the rows of x sorted by expert (counts [E] each): q(act(x W_gate^T, x W_up^T)) W_down^T
    with q the MX fake quantisation to act_fmt (none when None); x [N, I], gate/up [E, H, I], down [E, I, H]
    -> [N, I]."""
    check_glu_kind(kind, "expert_rows_ffn")
    return torch.ops.k3.expert_rows_ffn.default(
        x, w_gate, w_up, w_down, counts, kind, beta1, beta2, act_fmt, block, backend=backend
    )[0]


def mx_expert_glu(
    x: Tensor,
    gate_data: Tensor,
    gate_scale: Tensor,
    up_data: Tensor,
    up_scale: Tensor,
    block: int = 32,
    kind: str = "situ_glu",
    beta1: float = 4.0,
    beta2: float = 25.0,
    *,
    backend: str = "auto",
) -> Tensor:
    """`expert_glu` with MXFP4 gate/up weights (packed e2m1 [..., I, w/2] + E8M0 scales [..., I, w/block])."""
    check_glu_kind(kind, "expert GLU")
    return torch.ops.k3.mx_expert_glu.default(
        x, gate_data, gate_scale, up_data, up_scale, block, kind, beta1, beta2, backend=backend
    )


def mx_expert_matmul(x: Tensor, data: Tensor, scale: Tensor, block: int = 32, *, backend: str = "auto") -> Tensor:
    """`expert_matmul` with an MXFP4 weight (packed e2m1 [..., w, I/2] + E8M0 scales [..., w, I/block])."""
    return torch.ops.k3.mx_expert_matmul.default(x, data, scale, block, backend=backend)
