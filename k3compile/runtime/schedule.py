"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay to min_lr_ratio x the peak."""

from __future__ import annotations

import math

from k3compile.spec.schema import Schedule


def lr_at(step: int, total_steps: int, peak_lr: float, schedule: Schedule) -> float:
    """Learning rate of update `step` (0-based) in a run of `total_steps` updates.

    Warmup: peak * (step + 1) / warmup_steps for the first warmup_steps updates. Then the decay runs from
    the peak (first update after warmup) to peak * min_lr_ratio (the last update); a single update after
    warmup gets the peak. constant stays at the peak.
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    if schedule.kind == "constant":
        return peak_lr
    span = total_steps - 1 - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else 0.0
    if schedule.kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    floor = schedule.min_lr_ratio
    return peak_lr * (floor + (1.0 - floor) * shape)
