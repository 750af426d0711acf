"""Attention Residuals: the per-sublayer mixing module and the bookkeeping of its depth sources.

Sublayers are numbered globally: layer l has attention sublayer 2l and FFN sublayer 2l + 1; the
AttnRes before the final norm is sublayer 2 * num_layers. Block mode (K3): the sources of sublayer
k are the embedding, one summary per finished block (the sum of all 2 * block_size sublayer outputs
of block_size layers), and the partial sum of the current block once it has at least one output.
Full mode: the embedding and every earlier sublayer output, one source each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3compile.modules.norms import RMSNorm
from k3compile.ops.attn_res import attn_res

SUBLAYERS_PER_LAYER = 2  # attention, then FFN
MODES = ("block", "full")


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


@dataclass(frozen=True)
class Source:
    """One AttnRes source: the embedding (no sublayers) or the sum of the listed sublayer outputs."""

    kind: str  # "embedding", "block" (finished), "partial" (current block) or "sublayer" (full mode)
    sublayers: tuple[int, ...] = ()


def _check(mode: str, block_size: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"attn_res mode must be one of {MODES}, got {mode!r}")
    if (mode == "block") != (block_size is not None):
        raise ValueError("block mode needs block_size; full mode takes none")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def source_plan(sublayer: int, mode: str, block_size: int | None = None) -> list[Source]:
    """The sources the AttnRes before global sublayer `sublayer` mixes, in stacking order."""
    _check(mode, block_size)
    plan = [Source("embedding")]
    if mode == "full":
        return plan + [Source("sublayer", (k,)) for k in range(sublayer)]
    per_block = SUBLAYERS_PER_LAYER * block_size
    current = sublayer // per_block
    plan += [Source("block", tuple(range(n * per_block, (n + 1) * per_block))) for n in range(current)]
    if sublayer > current * per_block:
        plan.append(Source("partial", tuple(range(current * per_block, sublayer))))
    return plan


class AttnResSources:
    """Run-time source list for one forward pass: feed each sublayer output in order, read the stack.

    Follows `source_plan` exactly; `sources()` before sublayer k returns the plan of sublayer k.
    """

    def __init__(self, embedding_BTD: Tensor, mode: str, block_size: int | None = None):
        _check(mode, block_size)
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
