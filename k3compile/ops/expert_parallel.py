"""Expert-parallel exchange: fixed-capacity expert buffers to the ranks owning the experts and back.

The process's expert-parallel group (`set_group`, by `k3compile.runtime.distributed`) has g ranks; rank r
owns experts [r E/g, (r+1) E/g). `to_expert_owners` sends rows [s E/g, (s+1) E/g) of a rank's dispatch
buffer [E, C, w] to rank s with one autograd all-to-all (equal splits: static, no host synchronisation)
and returns what the rank's own experts process, [E/g, g C, w] (source ranks side by side in the
capacity dim). `from_expert_owners` is its inverse for the expert outputs. Without a group (one process)
both are the identity, so a build with parallel.ep > 1 also runs, with every expert, in one process.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

_GROUP: dict[str, dist.ProcessGroup | None] = {"ep": None}


def set_group(group: dist.ProcessGroup | None) -> None:
    """Use `group` as the expert-parallel group of this process (None: one process holds every expert)."""
    _GROUP["ep"] = group


def group() -> dist.ProcessGroup | None:
    return _GROUP["ep"]


def size() -> int:
    g = _GROUP["ep"]
    return 1 if g is None else g.size()


def rank() -> int:
    g = _GROUP["ep"]
    return 0 if g is None else g.rank()


def _exchange(x: Tensor) -> Tensor:
    """Equal chunks of the leading dim to each rank of the group (autograd: the backward is the inverse exchange)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, _GROUP["ep"])
    return funcol.wait_tensor(out)  # a plain tensor (eager returns an AsyncCollectiveTensor the k3 ops cannot view)


def to_expert_owners(buffer_ECW: Tensor) -> Tensor:
    """This rank's dispatch buffer [E, C, w] -> its local experts' inputs from every rank, [E/g, g C, w]."""
    g = size()
    if g == 1:
        return buffer_ECW
    E, C, w = buffer_ECW.shape
    recv_GLCW = _exchange(buffer_ECW).view(g, E // g, C, w)  # chunk s: rank s's rows for this rank's experts
    return recv_GLCW.transpose(0, 1).reshape(E // g, g * C, w)


def from_expert_owners(out_LMW: Tensor) -> Tensor:
    """Local experts' outputs [E/g, g C, w] -> this rank's expert outputs [E, C, w] (the inverse exchange)."""
    g = size()
    if g == 1:
        return out_LMW
    L, M, w = out_LMW.shape
    send_GLCW = out_LMW.view(L, g, M // g, w).transpose(0, 1)  # chunk s: the outputs for rank s's tokens
    return _exchange(send_GLCW).view(g * L, M // g, w)
