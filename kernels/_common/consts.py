"""Cached 0-dim tensors for the Python numbers the PyTorch references mix into tensor arithmetic.

`x * 0.5` wraps 0.5 in a fresh float64 tensor and casts it to x's dtype on every call: an allocation and a
copy (four extra aten calls) around each scalar operand. A 0-dim tensor of x's dtype on x's device gives
the same bits (the wrapped scalar is cast to the operation's dtype, exactly as here) without either, which
is most of the per-call cost of the small ops a decode step runs (T = 1).

Under a dispatch mode (FakeTensorMode, a TorchDispatchMode) or on meta a fresh tensor is made instead, so
no fake tensor is ever cached; under torch.func transforms the cached tensor is made with functorch off, a
plain tensor that the transforms lift, never one of their wrappers.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CACHE: dict[tuple, Tensor] = {}


def const(value: float | int, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """`value` as a cached 0-dim tensor of `dtype` (default: like's dtype) on like's device.

    Use it only as an operand (never as the target of an in-place op): the tensor is shared.
    """
    dtype = like.dtype if dtype is None else dtype
    if torch._C._len_torch_dispatch_stack() or like.device.type == "meta":
        return torch.tensor(value, dtype=dtype, device=like.device)  # made under the mode, never cached
    key = (repr(value), dtype, like.device)  # repr: -0.0 and 0.0 (equal, same hash) stay apart, NaN finds itself
    t = _CACHE.get(key)
    if t is None:
        # a plain tensor even under torch.func (vjp, vmap): never a wrapper; and a normal one even when first
        # made under inference_mode (serving), so that autograd may save it later (training)
        with torch._C._DisableFuncTorch(), torch.inference_mode(False):
            t = _CACHE[key] = torch.tensor(value, dtype=dtype, device=like.device)
    return t


def cached(key: tuple, like: Tensor, make) -> Tensor:
    """make() once per (key, like's device), kept for reuse (index tables, masks); read-only for its users.

    make must build from factory functions on like's device (torch.zeros, torch.arange), not from like.
    """
    if torch._C._len_torch_dispatch_stack() or like.device.type == "meta":
        return make()
    key = (key, like.device)
    t = _CACHE.get(key)
    if t is None:
        with torch._C._DisableFuncTorch(), torch.inference_mode(False):
            t = _CACHE[key] = make()
    return t
