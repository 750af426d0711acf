"""k3 activation ops: situ_glu (K3), swiglu and gelu.

The GLUs' backwards are hand-written (kernels.activations `*_bwd_ref`, or the Triton module's on that
backend); gelu's recomputes its reference under torch.func.vjp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.activations import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


@k3_op(
    "situ_glu",
    fake=lambda gate, up, beta1, beta2: empty_like(gate),
    differentiable=("gate", "up"),
    backward=ref.situ_glu_bwd_ref,
)
def situ_glu_op(gate: Tensor, up: Tensor, beta1: float, beta2: float) -> Tensor:
    return ref.situ_glu_ref(gate, up, beta1, beta2)


@k3_op(
    "swiglu", fake=lambda gate, up: empty_like(gate), differentiable=("gate", "up"), backward=ref.swiglu_bwd_ref
)
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return ref.swiglu_ref(gate, up)


@k3_op("gelu", fake=lambda x, approximate: empty_like(x), differentiable=("x",))
def gelu_op(x: Tensor, approximate: str) -> Tensor:
    return ref.gelu_ref(x, approximate)


def situ_glu(gate: Tensor, up: Tensor, beta1: float = 4.0, beta2: float = 25.0, *, backend: str = "auto") -> Tensor:
    """[b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]; K3 uses b1 = 4, b2 = 25."""
    return torch.ops.k3.situ_glu.default(gate, up, beta1, beta2, backend=backend)


def swiglu(gate: Tensor, up: Tensor, *, backend: str = "auto") -> Tensor:
    """silu(gate) * up."""
    return torch.ops.k3.swiglu.default(gate, up, backend=backend)


def gelu(x: Tensor, approximate: str = "none", *, backend: str = "auto") -> Tensor:
    """GELU, exact (erf) by default; approximate="tanh" selects the tanh form."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return torch.ops.k3.gelu.default(x, approximate, backend=backend)
