"""k3::glu_train: SiTU-GLU or SwiGLU returning its elementwise derivatives, which its backward reads.

The fuse pass puts it in CPU training graphs in place of the GLU projections' fused ops, whose backwards
recompute the projections and the activation (reference in kernels/glu_train/reference.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.glu_train import reference as ref
from k3compile.kernels.norms.reference import upcast_dtype
from k3compile.kernels._common.registry import empty_like, k3_op


def _fake(gate, up, kind, beta1, beta2):
    acc = upcast_dtype(gate.dtype)
    return empty_like(gate), gate.new_empty(gate.shape, dtype=acc), gate.new_empty(gate.shape, dtype=acc)


@k3_op("glu_train", fake=_fake, differentiable=("gate", "up"), backward=ref.glu_train_bwd_ref, saves_outputs=True)
def glu_train_op(gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float) -> tuple[Tensor, Tensor, Tensor]:
    return ref.glu_train_ref(gate, up, kind, beta1, beta2)


def glu_train(
    gate: Tensor, up: Tensor, kind: str, beta1: float = 0.0, beta2: float = 0.0, *, backend: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    """(act(gate, up), d act/d gate, d act/d up); only the first is differentiable through the op's backward."""
    return torch.ops.k3.glu_train.default(gate, up, kind, beta1, beta2, backend=backend)
