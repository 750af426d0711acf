"""The two generic ops lowering emits and passes resolve.

`k3::token_mixer(x, layer)` stands for "this layer's attention" until the
interleave pass replaces it by KDA or Gated MLA; `k3::depth_mix(sources, site)`
stands for "the input of this sublayer" (the embedding and every earlier
sublayer output) until the attn_res pass wires plain or attention residuals.
Its reference is the plain residual sum, so an unresolved graph still runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.ops.registry import k3_op


@k3_op("token_mixer", fake=lambda x, layer: torch.empty_like(x))
def token_mixer(x: Tensor, layer: int) -> Tensor:
    raise RuntimeError(f"layer {layer}: unresolved token mixer; the interleave pass chooses KDA or MLA")


@k3_op("depth_mix", fake=lambda sources, site: torch.empty_like(sources[0]))
def depth_mix(sources: list[Tensor], site: int) -> Tensor:
    out = sources[0].clone()
    for s in sources[1:]:
        out = out + s
    return out


def _depth_mix_setup(ctx, inputs, output):
    ctx.n = len(inputs[0])


def _depth_mix_backward(ctx, grad):
    return ([grad] * ctx.n, None, None)[: len(ctx.needs_input_grad)]  # one per argument given


depth_mix.register_autograd(_depth_mix_backward, setup_context=_depth_mix_setup)


TOKEN_MIXER = torch.ops.k3.token_mixer.default
DEPTH_MIX = torch.ops.k3.depth_mix.default
