"""What bench/gpu.py measures: one Triton kernel call, its PyTorch reference, and the work it does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class GpuCase:
    """One row of the GPU table.

    `triton()` and `reference()` run the same computation on the same inputs (built once, outside the
    timed calls); the reference is the eager PyTorch one, and bench/gpu.py also times it under
    torch.compile. `flops` and `bytes` are the useful work of one call, computed from the shapes
    (FLOP-bound kernels report TFLOP/s, the others GB/s). The outputs must agree to `rtol` in relative
    RMS error (sqrt(mean((a-b)^2) / mean(b^2)) over every floating-point output). `compile` False skips
    the torch.compile column where compiling the reference would unroll a long Python loop (minutes).
    """

    name: str
    triton: Callable[[], object]
    reference: Callable[[], object]
    flops: float
    bytes: float
    rtol: float = 1e-4
    compile: bool = True
