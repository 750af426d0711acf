"""Load balancing between optimizer steps for any model whose routers carry the LatentMoE buffers.

Routers are found by buffer name (`<prefix>.bias` with `<prefix>.load` beside it), so this works on emitted
models, whose routers are plain containers, as on `k3compile.modules.moe.Router`. The rule is the one of
`Router.update_balance`, through the same ops: the statistics of one step become the bias of the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3compile.ops.balancing import qb_update_from_histogram, sign_balance_update
from k3compile.spec.schema import Router as RouterConfig

STAT_BUFFERS = ("load", "dropped", "qb_bias", "qb_counts", "aux_loss")  # non-persistent training statistics


@dataclass(frozen=True)
class RouterBuffers:
    """One router's buffers: the persistent selection bias and whatever statistics its balancing records."""

    name: str  # module path, e.g. "layers.1.moe.router"
    bias: Tensor
    load: Tensor
    dropped: Tensor
    qb_bias: Tensor | None
    qb_counts: Tensor | None
    aux_loss: Tensor | None


def find_routers(model: nn.Module) -> list[RouterBuffers]:
    """Every router of `model`, in buffer order (layer order for emitted models)."""
    buffers = dict(model.named_buffers())
    routers = []
    for name in buffers:
        prefix = name.removesuffix(".bias")
        if name.endswith(".bias") and f"{prefix}.load" in buffers:
            stat = {s: buffers.get(f"{prefix}.{s}") for s in STAT_BUFFERS}
            routers.append(RouterBuffers(prefix, buffers[name], **stat))
    return routers


def snapshot_stats(routers: list[RouterBuffers]) -> list[dict[str, Tensor]]:
    """Copies of the statistics, so an evaluation forward (which records them too) can be undone."""
    return [{s: getattr(r, s).clone() for s in STAT_BUFFERS if getattr(r, s) is not None} for r in routers]


@torch.no_grad()
def restore_stats(routers: list[RouterBuffers], saved: list[dict[str, Tensor]]) -> None:
    for r, stats in zip(routers, saved):
        for s, value in stats.items():
            getattr(r, s).copy_(value)


@dataclass(frozen=True)
class BalanceStats:
    """One step's routing summary: imbalance = max load / mean load per layer, averaged over layers (1 = even);
    dropped = fraction of the routed choices that overflowed an expert's capacity; aux_loss averaged (if any)."""

    imbalance: float | None
    dropped: float | None
    aux_loss: float | None


@torch.no_grad()
def update_balance(routers: list[RouterBuffers], config: RouterConfig, top_k: int) -> BalanceStats:
    """Apply the balancing rule to every router's bias from the statistics since the last call, then reset them.

    quantile: the exact QB bias of the last batch (`qb_bias`) or QB read from the histogram (`qb_counts`);
    bias_sign: one DeepSeek-V3 sign step on the load; aux_loss and none leave the bias alone. A router that saw
    no training tokens keeps its bias.
    """
    imbalance, dropped, routed, aux = [], 0, 0, []
    for r in routers:
        load = r.load.double()
        seen = r.load.sum() > 0
        if config.balancing == "quantile" and r.qb_counts is not None:
            new = qb_update_from_histogram(r.qb_counts, r.bias, top_k)
            r.qb_counts.zero_()
        elif config.balancing == "quantile" and r.qb_bias is not None:
            new = r.qb_bias
        elif config.balancing == "bias_sign":
            new = sign_balance_update(r.load, r.bias, config.bias_update_rate)
        else:
            new = r.bias
        r.bias.copy_(torch.where(seen, new, r.bias))
        if bool(seen):
            imbalance.append(float(load.max() / load.mean()))
        dropped += int(r.dropped)
        routed += int(r.load.sum())
        if r.aux_loss is not None:
            aux.append(float(r.aux_loss))
        r.load.zero_()
        r.dropped.zero_()
    return BalanceStats(
        imbalance=sum(imbalance) / len(imbalance) if imbalance else None,
        dropped=dropped / routed if routed else None,
        aux_loss=sum(aux) / len(aux) if aux else None,
    )
