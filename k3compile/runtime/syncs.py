"""What in a piece of code would make the host wait for the GPU, found by running it anywhere (the CPU too).

A GPU runs ahead of the host only while the host never needs a value the GPU computes: `float(loss)`,
`.item()`, `.tolist()`, `.cpu()`, `if tensor:` and every op whose output shape depends on values
(`nonzero`, boolean-mask indexing, `unique`) wait for it. The same reads break a CUDA graph capture, which
records kernel launches and cannot return values to the host while it records; a tensor made from host data
inside the captured code (`torch.tensor(...)`) would be frozen into the graph. `watch()` records each such
read as the code runs, so tests on CPU can assert that a training step or a decode step has none: a
TorchFunctionMode sees the Tensor methods that copy to the host and the torch functions whose output shape
depends on values; a TorchDispatchMode (`ops=True`) also sees the aten ops those become, inside composite ops
too. The dispatch mode cannot watch a backward that runs torch.func inside a custom op (functorch's wrappers
do not pass through a Python dispatch mode), so a training step is watched with `ops=False`. Neither sees inside
a custom op the dispatcher runs (a mode is off while its handler runs): a k3 op called as `torch.ops.k3.<op>`
is watched from outside only (its call, not its implementation), while ops called directly (a CPU build's
`k3compile.ops.direct`) are watched inside too. Inside a GPU build's k3 ops, the CUDA graph capture is the check.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that copy a tensor's values to the host (dispatching nothing on a CPU tensor).
_HOST_COPIES = {"tolist", "item", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
# torch functions and Tensor methods whose output shape depends on the values
_VALUE_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
_MADE_FROM_HOST = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


@dataclass(frozen=True)
class HostRead:
    """One read: what (a Tensor method, torch function or aten op, and why) and where (file:line of the caller)."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.what} at {self.where}"


_ROOT = str(Path(__file__).resolve().parents[2]) + "/"  # the repository (or site-packages) k3compile sits in


def _caller() -> str:
    """file:line of the innermost frame outside torch (torch.optim aside) and this module, relative to the folder
    k3compile is installed in or to site-packages."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        if name == __file__ or ("/torch/" in name and "/torch/optim/" not in name):
            continue
        if "site-packages/" in name:
            name = name[name.rindex("site-packages/") + len("site-packages/") :]
        elif name.startswith(_ROOT):
            name = name[len(_ROOT) :]
        return f"{name}:{frame.lineno}"
    return "?"


def _masks(args) -> bool:
    """Whether an indexing call's index holds a boolean mask (a value-dependent number of elements)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in parts)


def _shape_from_values(func, args) -> bool:
    """Whether this call's output shape depends on tensor values (aten.index is so only with a boolean mask)."""
    if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
        masks = (torch.bool, torch.uint8)
        return any(isinstance(i, torch.Tensor) and i.dtype in masks for i in args[1] if i is not None)
    return torch.Tag.dynamic_output_shape in func.tags


class _Ops(TorchDispatchMode):
    def __init__(self, found: list[HostRead]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.data_dependent_output in func.tags or _shape_from_values(func, args):
            self.found.append(HostRead(str(func), _caller()))
        elif func in _MADE_FROM_HOST:
            self.found.append(HostRead(f"{func} (a tensor made from host data)", _caller()))
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, found: list[HostRead]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_COPIES:
            self.found.append(HostRead(f"Tensor.{name}", _caller()))
        elif name in _VALUE_SHAPED or (name in _INDEXING and _masks(args)) or (name == "where" and len(args) == 1):
            self.found.append(HostRead(f"{name} (its output shape depends on values)", _caller()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch(ops: bool = True) -> Iterator[list[HostRead]]:
    """Inside, every host read of a tensor's values is appended to the yielded list; `ops=False` watches the Python
    calls only."""
    found: list[HostRead] = []
    with _Methods(found), _Ops(found) if ops else contextlib.nullcontext():
        yield found
