"""C form of expert_rows_ffn for the CPU target: the reference's loop (kernels/experts/rows_ffn.py), with each batch's
activation, its derivatives and its MX fake quantisation made in one C pass (kernels/glu_train/glu.c) instead of about
twenty PyTorch passes. The projections stay torch.mm calls; the backward is the reference's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.experts.rows_ffn import activate_ref
from k3compile.kernels.experts.rows_ffn import expert_rows_ffn as _ffn
from k3compile.kernels.glu_train.c import glu_fill


def _activate(g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, kind: str, beta1: float, beta2: float,
              act_fmt: str | None, block: int) -> None:
    if y.dtype != torch.float32 or g.dtype != torch.float32 or not native.takes(g, u, y, jg, ju):
        return activate_ref(g, u, y, jg, ju, kind, beta1, beta2, act_fmt, block)
    glu_fill(g, u, y, jg, ju, kind, beta1, beta2, act_fmt, block)


def expert_rows_ffn(
    x_NI: Tensor, w_gate_EHI: Tensor, w_up_EHI: Tensor, w_down_EIH: Tensor, counts_E: Tensor, kind: str,
    beta1: float, beta2: float, act_fmt: str | None, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`expert_rows_ffn_ref`'s outputs, the activation through the C kernel (fp32; other dtypes as the reference)."""
    return _ffn(x_NI, w_gate_EHI, w_up_EHI, w_down_EIH, counts_E, kind, beta1, beta2, act_fmt, block, _activate)
