"""Numbers that training leaves on the device, read back to the host together.

Reading a GPU tensor's value (`float(loss)`, `.item()`, `.tolist()`) makes the host wait until the GPU has
computed it, which stalls the queue of kernels the host runs ahead with. The trainer therefore keeps each
step's loss, gradient norm and routing statistics as tensors and reads every pending step's numbers at once,
once per log interval, with one device-to-host copy (`read`). On the CPU the values are the same numbers the
tensors hold (float64 holds every float32 and every count below 2^53 exactly).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _tensors(tree, found: list[Tensor]) -> None:
    if isinstance(tree, Tensor):
        found.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _tensors(v, found)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _tensors(v, found)


def _rebuild(tree, values: list[float], at: list[int]):
    if isinstance(tree, Tensor):
        start = at[0]
        at[0] += tree.numel()
        return values[start] if tree.dim() == 0 else values[start : at[0]]
    if isinstance(tree, dict):
        return {k: _rebuild(v, values, at) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(v, values, at) for v in tree)
    return tree


def read(tree):
    """`tree` (dicts, lists and tuples of tensors and plain values) with every tensor replaced by its value: a
    float for a 0-d tensor, a flat list of floats otherwise. One copy to the host for all of them, one wait."""
    found: list[Tensor] = []
    _tensors(tree, found)
    if not found:
        return tree
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in found])
    return _rebuild(tree, flat.tolist(), [0])
