"""Which implementation runs each op on each target: the data bind_kernels reads.

Every k3 op has a PyTorch reference (the `cpu` implementation and the fallback
everywhere). GPU targets use a Triton kernel where one is registered here, with
its launch configuration from `kernels/configs/<target>.json`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

TARGETS = ("cpu", "a100", "h100", "h200", "b200")
GPU_TARGETS = TARGETS[1:]
CONFIG_DIR = Path(__file__).parent / "configs"

# op name (without the k3:: prefix) -> Triton kernel name; filled in as kernels land.
TRITON_KERNELS: dict[str, str] = {}


@lru_cache(maxsize=None)
def launch_configs(target: str) -> dict:
    """Launch configurations per Triton kernel for `target` ({} when none are tuned yet)."""
    path = CONFIG_DIR / f"{target}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def choose(op: str, target: str) -> dict:
    """The implementation of k3 op `op` on `target`, with the reason for any fallback."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    if target == "cpu":
        return {"impl": "torch", "reason": "PyTorch reference on CPU"}
    kernel = TRITON_KERNELS.get(op)
    if kernel is None:
        return {"impl": "torch", "reason": f"no Triton kernel for k3::{op} yet"}
    return {"impl": f"triton:{kernel}", "reason": "", "config": launch_configs(target).get(kernel, {})}
