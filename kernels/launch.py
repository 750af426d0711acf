"""Launch configurations for the Triton kernels, as data: per target GPU, per kernel, per shape bucket.

`kernels/configs/<target>.json` maps a kernel module to its kernels, each an ordered list of buckets:

    {"norms_triton": {"rms_norm": [{"max": {"N": 1024}, "config": {"BLOCK_M": 4, "num_warps": 4}},
                                   {"config": {"BLOCK_M": 1, "num_warps": 8}}]}}

The first bucket whose `max` bounds all hold for the call's sizes wins (a bucket without `max` matches
everything); its `config` is laid over the kernel's own defaults. `bench/tune_gpu.py` writes these files
on a real GPU; bind_kernels reads them to record each op's choice, and the kernels read them at launch by
the device they run on (a CPU tensor under TRITON_INTERPRET=1 uses the defaults).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
TARGETS = ("cpu", "a100", "h100", "h200", "b200")
GPU_TARGETS = TARGETS[1:]
_H200_MIN_BYTES = 100 * 2**30  # H100 and H200 are both sm_90; the H200 has 141 GB, the H100 80-94 GB


def interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@lru_cache(maxsize=None)
def _cuda_target(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    major = props.major
    if major >= 10:
        return "b200"
    if major == 9:
        return "h200" if props.total_memory >= _H200_MIN_BYTES else "h100"
    return "a100"


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors a grid should fill on `device` (1 off CUDA: the interpreter runs programs in turn)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_target(device: torch.device | str) -> str:
    """The target whose configurations a kernel on `device` uses: a GPU target for CUDA, else "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def module_configs(target: str) -> dict[str, dict[str, list]]:
    """The configuration file of `target`: {kernel module: {kernel: buckets}} ({} when none are tuned yet)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    path = CONFIG_DIR / f"{target}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@lru_cache(maxsize=None)
def configs(target: str) -> dict[str, list]:
    """Every kernel's buckets for `target`, by kernel name (kernel names are unique across modules)."""
    return {kernel: buckets for kernels in module_configs(target).values() for kernel, buckets in kernels.items()}


def pick(buckets: list[dict], sizes: dict[str, int]) -> dict:
    """The config of the first bucket whose `max` bounds hold for `sizes` ({} when none matches)."""
    for bucket in buckets:
        bounds = bucket.get("max", {})
        if all(sizes.get(key, 0) <= bound for key, bound in bounds.items()):
            return dict(bucket["config"])
    return {}


_forced: dict[str, dict] = {}  # kernel -> config, set by `forcing` (the tuner's trials)
_seen: list[tuple[str, dict]] | None = None  # (kernel, sizes) of each launch while `recording`


def launch_config(kernel: str, device: torch.device | str, defaults: dict, **sizes: int) -> dict:
    """`defaults` overlaid with the tuned configuration of `kernel` for `device`'s target and these sizes."""
    if _seen is not None:
        _seen.append((kernel, sizes))
    if kernel in _forced:
        return {**defaults, **_forced[kernel]}
    return {**defaults, **pick(configs(device_target(device)).get(kernel, []), sizes)}


@contextmanager
def forcing(kernel: str, config: dict) -> Iterator[None]:
    """Launch `kernel` with `config` over its defaults, whatever the tables say (bench/tune_gpu.py's trials)."""
    _forced[kernel] = config
    try:
        yield
    finally:
        del _forced[kernel]


@contextmanager
def recording() -> Iterator[list[tuple[str, dict]]]:
    """Collect (kernel, sizes) for every launch_config call inside the block."""
    global _seen
    _seen, outer = [], _seen
    try:
        yield _seen
    finally:
        _seen = outer
