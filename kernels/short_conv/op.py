"""The short-conv op: causal depthwise conv + SiLU with a decoding state (KDA's q, k, v convs).

Its backward is hand-written (kernels.short_conv.short_conv_bwd_ref, or the Triton module's on that backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.short_conv import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


def _short_conv_fake(x, weight, initial_state):
    B, _, C = x.shape
    return empty_like(x), x.new_empty(B, C, weight.shape[-1] - 1)


@k3_op(
    "short_conv",
    fake=_short_conv_fake,
    differentiable=("x", "weight", "initial_state"),
    backward=ref.short_conv_bwd_ref,
)
def short_conv_op(x: Tensor, weight: Tensor, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    y, state = ref.short_conv_ref(x, weight, initial_state)
    return y.contiguous(), state


def short_conv(
    x_BTC: Tensor, weight_CW: Tensor, initial_state: Tensor | None = None, output_final_state: bool = False,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """y = SiLU(causal depthwise conv(x)) (the SiLU is included); state = the last W-1 inputs [B, C, W-1].

    Feeding the returned state back as `initial_state` continues the sequence exactly (decoding).
    """
    y, state = torch.ops.k3.short_conv.default(x_BTC, weight_CW, initial_state, backend=backend)
    return y, (state if output_final_state else None)
