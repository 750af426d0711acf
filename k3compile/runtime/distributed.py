"""Training across processes: the dp x ep device mesh, batch slices, gradient and routing-statistic reductions.

Every one of the world = dp x ep ranks reads its own rows of the global batch (the EP group is carved out
of the data-parallel ranks, as in torchtitan and DeepSeek's expert parallelism). Rank = d * ep + e: the
"ep" mesh dimension groups the ranks that exchange expert buffers (k3compile.ops.expert_parallel), the
"dp" dimension the ranks holding the same experts. Parameters are sharded with FSDP2 over this mesh
(k3compile.runtime.fsdp). The routing statistics are summed over all ranks with one integer all-reduce per
step, so Quantile Balancing reads the global histogram.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from k3compile.ops import expert_parallel
from k3compile.runtime.device import use
from k3compile.spec.schema import Spec


class LayoutError(ValueError):
    """The parallel degrees do not fit the processes started; one line."""


@dataclass
class Layout:
    """This process's place in the dp x ep mesh (world 1: a single process, no groups)."""

    world: int = 1
    rank: int = 0
    dp: int = 1
    ep: int = 1
    mesh: object = None  # torch.distributed.device_mesh.DeviceMesh with dims ("dp", "ep")
    world_mesh: object = None  # the same ranks as one dim ("world"): FSDP2's mesh for non-expert parameters
    experts_mesh: object = None  # dims ("ep", "dp"): expert rows split over ep, then each rank's over dp
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # `start` created the process group (and `stop` destroys it)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group(dim)

    def rows(self, batch: Tensor) -> Tensor:
        """This rank's rows of a global batch [B, T] (B divisible by the world size)."""
        if self.world == 1:
            return batch
        per = batch.shape[0] // self.world
        return batch[self.rank * per : (self.rank + 1) * per]


def launched() -> bool:
    """Whether this process was started by torch.distributed.run with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def degrees(spec: Spec, world: int) -> tuple[int, int]:
    """(dp, ep) for `world` processes: the spec's, with dp inferred as world / ep when left at 1."""
    p = spec.parallel
    if p.tp > 1 or p.pp > 1:
        raise LayoutError(f"parallel.tp={p.tp}, parallel.pp={p.pp}: only data and expert parallelism are implemented")
    dp = p.dp if p.dp > 1 or world % p.ep else world // p.ep
    if dp * p.ep != world:
        raise LayoutError(f"parallel.dp x parallel.ep = {p.dp} x {p.ep} does not match the {world} processes started")
    return dp, p.ep


def check_batch(spec: Spec, world: int) -> None:
    if spec.training.batch_size % world:
        raise LayoutError(f"training.batch_size ({spec.training.batch_size}) is not divisible by the {world} processes")
    if spec.moe is not None and world > 1 and spec.moe.router.balancing == "quantile" and spec.moe.router.histogram_bins is None:
        raise LayoutError(
            "exact quantile balancing reads one process's whole batch; across processes set "
            "moe.router.histogram_bins (e.g. --set moe.router.histogram_bins=256) so the histogram is all-reduced"
        )


def start(spec: Spec, training: bool = True, device: torch.device | None = None) -> Layout:
    """Join the process group torch.distributed.run set up and build the ("dp", "ep") mesh on `device` (this
    process's: k3compile.runtime.device.runtime_device; default cuda:LOCAL_RANK where CUDA is, else the CPU);
    world 1: no group. `training=False` (serving: every rank decodes the same requests) skips the training
    batch's checks."""
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if not launched():
        if spec.parallel.tp > 1 or spec.parallel.pp > 1:
            degrees(spec, 1)
        use(device)
        return Layout(device=device)
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ["WORLD_SIZE"])
    dp, ep = degrees(spec, world)
    if training:
        check_batch(spec, world)
    cuda = device.type == "cuda"
    use(device)
    owns = not dist.is_initialized()  # a caller's group (several runs in one launch) is left to the caller
    if owns:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    from torch.distributed.device_mesh import DeviceMesh

    mesh = init_device_mesh(device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    experts_mesh = DeviceMesh(device.type, mesh.mesh.T.contiguous(), mesh_dim_names=("ep", "dp"))
    return Layout(world, dist.get_rank(), dp, ep, mesh, world_mesh, experts_mesh, device, owns)


def backend() -> str:
    return dist.get_backend() if dist.is_initialized() else "none"


def use_experts(layout: Layout) -> None:
    """Make the mesh's "ep" group the one the train graph's all-to-alls use (None in one process)."""
    expert_parallel.set_group(layout.group("ep") if layout.ep > 1 else None)


def stop(layout: Layout) -> None:
    expert_parallel.set_group(None)
    if layout.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(layout: Layout) -> None:
    if layout.distributed:
        dist.barrier()


def mean(layout: Layout, value: Tensor) -> Tensor:
    """The mean over all ranks of a per-rank scalar (equal batch slices: the global mean), in float64 on the
    device: nothing is read on the host."""
    t = value.detach().to(torch.float64)
    if not layout.distributed:
        return t
    t = t.reshape(1).clone()
    dist.all_reduce(t)
    return t[0] / layout.world


def _all_reduce_flat(tensors: list[Tensor], group) -> None:
    """Sum `tensors` (one dtype) over `group` in place with one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def reduce_statistics(layout: Layout, routers: list) -> None:
    """Sum every router's integer statistics (load, dropped, QB histogram) over all ranks: one all-reduce."""
    if not layout.distributed or not routers:
        return
    _all_reduce_flat([t for r in routers for t in (r.load, r.dropped, r.qb_counts) if t is not None], None)
