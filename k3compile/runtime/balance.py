"""Load balancing between optimizer steps for any model whose routers carry the LatentMoE buffers.

Routers are found by buffer name (`<prefix>.bias` with `<prefix>.load` beside it), so this works on emitted
models, whose routers are plain containers, as on `k3compile.modules.moe.Router`. The rule is the one of
`Router.update_balance`, through the same ops: the statistics of one step become the bias of the next.
Everything stays on the routers' device: the step's summary comes back as tensors (`BalanceReadings`), which
the trainer reads with other steps' numbers once per log interval (k3compile.runtime.readings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3compile.kernels.balancing.op import qb_update_from_histogram, sign_balance_update
from k3compile.runtime.readings import read
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

    @classmethod
    def of(cls, values: dict) -> BalanceStats:
        """The summary of `BalanceReadings.tensors()` once read (k3compile.runtime.readings.read)."""
        imbalance = [v for v, seen in zip(values["imbalance"], values["seen"]) if seen]
        dropped, routed = sum(int(d) for d in values["dropped"]), sum(int(n) for n in values["routed"])
        aux = values.get("aux_loss") or []
        return cls(
            imbalance=sum(imbalance) / len(imbalance) if imbalance else None,
            dropped=dropped / routed if routed else None,
            aux_loss=sum(aux) / len(aux) if aux else None,
        )


@dataclass(frozen=True)
class BalanceReadings:
    """One step's statistics per router, on the routers' device (copies: the buffers move on)."""

    imbalance: Tensor  # [R] float64: max load / mean load (not a number where the router saw no tokens)
    seen: Tensor  # [R] bool: the router saw training tokens
    dropped: Tensor  # [R] int64: routed choices over an expert's capacity
    routed: Tensor  # [R] int64: routed choices
    aux_loss: Tensor | None  # [R'] the auxiliary losses of the routers that record one

    def tensors(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def summary(self) -> BalanceStats:
        """Read now (the host waits for the device): what a log interval's one read gives for this step."""
        return BalanceStats.of(read(self.tensors()))


@torch.no_grad()
def update_balance(routers: list[RouterBuffers], config: RouterConfig, top_k: int) -> BalanceReadings:
    """Apply the balancing rule to every router's bias from the statistics since the last call, then reset them.

    quantile: the exact QB bias of the last batch (`qb_bias`) or QB read from the histogram (`qb_counts`);
    bias_sign: one DeepSeek-V3 sign step on the load; aux_loss and none leave the bias alone. A router that saw
    no training tokens keeps its bias. Nothing is read on the host: the step's statistics come back as tensors.
    """
    device = routers[0].bias.device if routers else torch.device("cpu")

    def stacked(values: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.stack(values) if values else torch.zeros(0, dtype=dtype, device=device)

    loads = [r.load.double() for r in routers]  # torch.stack copies the rest before the buffers are reset
    aux = [r.aux_loss.reshape(()) for r in routers if r.aux_loss is not None]
    readings = BalanceReadings(
        imbalance=stacked([load.max() / load.mean() for load in loads], torch.float64),
        seen=stacked([r.load.sum() > 0 for r in routers], torch.bool),
        dropped=stacked([r.dropped.reshape(()) for r in routers], torch.int64),
        routed=stacked([r.load.sum() for r in routers], torch.int64),
        aux_loss=torch.stack(aux) if aux else None,
    )
    for r in routers:
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
        r.load.zero_()
        r.dropped.zero_()
    return readings


@torch.no_grad()
def balance(model: nn.Module) -> BalanceReadings | None:
    """One load-balancing update of `model`'s routers from the training forwards since the last call, by its
    spec's rule (what `k3compile.train` does after each optimizer step); call it after `optimizer.step()`.

    Under torch.distributed (DDP, FSDP2) every rank must call it: the integer statistics are summed over the
    default group first, so the biases stay equal on all ranks. None for a model without MoE.
    """
    import torch.distributed as dist

    spec = getattr(model, "spec", None)
    if spec is None or spec.moe is None:
        return None
    routers = find_routers(model)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for r in routers:
            for t in (r.load, r.dropped, r.qb_counts):
                if t is not None:
                    dist.all_reduce(t)
    return update_balance(routers, spec.moe.router, spec.moe.top_k)

