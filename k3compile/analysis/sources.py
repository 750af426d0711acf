"""How many sources each attention-residual application mixes (block or full AttnRes)."""

from __future__ import annotations

from k3compile.spec.schema import Spec


def attn_res_source_counts(spec: Spec) -> list[int]:
    """Sources seen by each application in order: per layer before attention and FFN, then final.

    Block mode: the embedding, every finished block summary and, once a sublayer of
    the current block has finished, its partial sum. Full mode: the embedding and
    every earlier sublayer output. Plain residuals: no applications.
    """
    r = spec.residual
    if r.kind != "attn_res":
        return []
    counts = []
    for sub in range(2 * spec.num_layers + 1):  # sublayers finished before this application
        if r.mode == "full":
            counts.append(1 + sub)
        else:
            per_block = 2 * r.block_size
            counts.append(1 + sub // per_block + (1 if sub % per_block else 0))
    return counts
