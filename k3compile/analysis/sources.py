"""Which sources each attention-residual application mixes (block or full AttnRes); no torch.

Sublayers are numbered globally: layer l has attention sublayer 2l and FFN sublayer 2l + 1; the
AttnRes before the final norm is sublayer 2 * num_layers. The attn_res pass, the AttnRes module
and the FLOP count all read this one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3compile.spec.schema import Spec

SUBLAYERS_PER_LAYER = 2  # attention, then FFN
MODES = ("block", "full")


@dataclass(frozen=True)
class Source:
    """One AttnRes source: the embedding (no sublayers) or the sum of the listed sublayer outputs."""

    kind: str  # "embedding", "block" (finished), "partial" (current block) or "sublayer" (full mode)
    sublayers: tuple[int, ...] = ()


def check_mode(mode: str, block_size: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"attn_res mode must be one of {MODES}, got {mode!r}")
    if (mode == "block") != (block_size is not None):
        raise ValueError("block mode needs block_size; full mode takes none")
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def source_plan(sublayer: int, mode: str, block_size: int | None = None) -> list[Source]:
    """The sources the AttnRes before global sublayer `sublayer` mixes, in stacking order."""
    check_mode(mode, block_size)
    plan = [Source("embedding")]
    if mode == "full":
        return plan + [Source("sublayer", (k,)) for k in range(sublayer)]
    per_block = SUBLAYERS_PER_LAYER * block_size
    current = sublayer // per_block
    plan += [Source("block", tuple(range(n * per_block, (n + 1) * per_block))) for n in range(current)]
    if sublayer > current * per_block:
        plan.append(Source("partial", tuple(range(current * per_block, sublayer))))
    return plan


def attn_res_source_counts(spec: Spec) -> list[int]:
    """Sources seen by each application in order (per layer before attention and FFN, then final)."""
    r = spec.residual
    if r.kind != "attn_res":
        return []
    return [len(source_plan(sub, r.mode, r.block_size)) for sub in range(SUBLAYERS_PER_LAYER * spec.num_layers + 1)]
