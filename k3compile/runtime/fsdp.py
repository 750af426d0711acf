"""FSDP2 on the dp x ep mesh: non-expert parameters sharded over every rank, routed experts over their dp group.

The emitted forward is one function reading every module's parameters, so FSDP2 wraps the root only (a
wrapped submodule's hooks would never fire and the graph would see its sharded DTensors) with two parameter
groups: FSDP2's per-parameter mesh (`shard_placement_fn` returning a mesh) puts this rank's expert stacks
[E/ep, ...] on the "dp" ranks holding the same experts and every other parameter on all dp x ep ranks. The
root's pre-forward hook gathers both groups, so the graph reads plain full tensors (QAT's blocks included);
backward reduce-scatters each group's gradients and divides them by the world size, which makes both the
gradient of the global batch's mean loss (experts' already sum their EP group's tokens, the all-to-all's
backward).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3compile.runtime.distributed import Layout


def shard(layout: Layout, model: nn.Module) -> None:
    """fully_shard `model` in place for this layout (one process: unchanged)."""
    if not layout.distributed:
        return
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    experts = {id(p) for n, p in model.named_parameters() if n in getattr(model, "expert_shards", ())}
    dp = FSDPMeshInfo(layout.experts_mesh["dp"], shard_mesh_dim=0)

    def place(p: nn.Parameter) -> ShardPlacementResult | None:
        """Expert stacks: rows over their dp group; the rest: FSDP2's default (rows over the world mesh)."""
        return ShardPlacementResult(Shard(0), dp) if id(p) in experts else None

    fully_shard(model, mesh=layout.world_mesh, shard_placement_fn=place if experts else None)
    model.set_gradient_divide_factor(float(layout.world))
    if layout.device.type == "cpu":  # gloo has no pre-scaled sum: sum, then divide
        model.set_force_sum_reduction_for_comms(True)


def local(t: Tensor) -> Tensor:
    """This rank's part of a (possibly FSDP-sharded DTensor) tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters a forward without backward (validation) left behind."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


@torch.no_grad()
def clip_grad_norm(layout: Layout, params: list[Tensor], max_norm: float) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole model: FSDP's shards are disjoint over all ranks (experts'
    over ep x dp), so the squared norm is one all-reduce of every rank's local sum. Returns the norm before
    clipping as a tensor on the device (reading it would make the host wait)."""
    import torch.distributed as dist

    params = [p for p in params if p.grad is not None]
    if not layout.distributed:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [local(p.grad) for p in params]
    sq = torch.zeros((), dtype=torch.float32, device=layout.device)
    for g in grads:
        sq += g.float().square().sum()
    dist.all_reduce(sq)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
