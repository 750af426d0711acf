"""How kernel outputs are compared with their references: relative RMS error, in float64; backwards with autograd.

Used by the kernel tests and by bench/gpu.py, so a tolerance means the same thing in both.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rel_rms(got: Tensor, want: Tensor) -> float:
    """sqrt(mean((got - want)^2) / mean(want^2)); against an all-zero `want`, the plain RMS of `got`; inf if either
    holds a NaN or an infinity, so a kernel (or reference) that overflows never compares as correct."""
    got, want = got.double(), want.double()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return math.inf
    err, ref = (got - want).pow(2).mean().item(), want.pow(2).mean().item()
    return math.sqrt(err / ref if ref > 0 else err)


def flat_tensors(out) -> list[Tensor]:
    """The tensors of an op's output (a tensor, or nested lists/tuples of them), in order."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    return []


def max_error(got, want) -> float:
    """Largest `rel_rms` over the floating-point outputs; inf if the structure, a shape or an integer output differs,
    or a floating-point output holds a NaN or an infinity (never lost to `max`, which drops a NaN)."""
    got, want = flat_tensors(got), flat_tensors(want)
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return math.inf
        if not b.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(a, b) else math.inf)
        else:
            worst = max(worst, rel_rms(a, b))
    return worst


def autograd_grads(fn, args, cotangents) -> list[Tensor | None]:
    """torch.autograd.grad of `fn(*args)` with these cotangents, w.r.t. the floating-point tensors in args (None
    elsewhere): what a hand-written backward of the reference `fn` is compared with."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a
              for a in args]
    outs = flat_tensors(fn(*leaves))
    wrt = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.requires_grad]
    got = iter(torch.autograd.grad(outs, wrt, cotangents[: len(outs)], allow_unused=True))
    return [next(got) if isinstance(leaf, Tensor) and leaf.requires_grad else None for leaf in leaves]
