"""Attention Residuals: the per-sublayer mixing module and the bookkeeping of its depth sources.

Sublayers are numbered globally: layer l has attention sublayer 2l and FFN sublayer 2l + 1; the
AttnRes before the final norm is sublayer 2 * num_layers. Block mode (K3): the sources of sublayer
k are the embedding, one summary per finished block (the sum of all 2 * block_size sublayer outputs
of block_size layers), and the partial sum of the current block once it has at least one output.
Full mode: the embedding and every earlier sublayer output, one source each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from k3compile.analysis.sources import SUBLAYERS_PER_LAYER, Source, check_mode, source_plan
from k3compile.modules.norms import RMSNorm
from k3compile.kernels.attn_res.op import attn_res

__all__ = ["AttnRes", "AttnResSources", "Source", "source_plan"]


class AttnRes(nn.Module):
    """h = sum_i softmax_i(query . RMSNorm(v_i)) v_i; `query` starts at zero (a plain average)."""

    def __init__(self, hidden_size: int, norm_eps: float = 1e-5):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = RMSNorm(hidden_size, norm_eps)

    def forward(self, sources: Tensor | Sequence[Tensor]) -> Tensor:
        """sources: stacked [S, B, T, D] or a sequence of S tensors [B, T, D]."""
        if isinstance(sources, (list, tuple)):
            sources = torch.stack(sources)
        return attn_res(sources, self.query, self.norm.weight, self.norm.eps)


class AttnResSources:
    """Run-time source list for one forward pass: feed each sublayer output in order, read the stack.

    Follows `source_plan` exactly; `sources()` before sublayer k returns the plan of sublayer k.
    """

    def __init__(self, embedding_BTD: Tensor, mode: str, block_size: int | None = None):
        check_mode(mode, block_size)
        self.mode = mode
        self.per_block = SUBLAYERS_PER_LAYER * block_size if block_size is not None else 0
        self.finished: list[Tensor] = [embedding_BTD]
        self.partial: Tensor | None = None
        self.in_block = 0

    def sources(self) -> Tensor:
        """All current sources stacked as [S, B, T, D]."""
        extra = [self.partial] if self.partial is not None else []
        return torch.stack(self.finished + extra)

    def add(self, out_BTD: Tensor) -> None:
        """Record the output of the next sublayer."""
        if self.mode == "full":
            self.finished.append(out_BTD)
            return
        self.partial = out_BTD if self.partial is None else self.partial + out_BTD
        self.in_block += 1
        if self.in_block == self.per_block:
            self.finished.append(self.partial)
            self.partial, self.in_block = None, 0
