"""Launch configurations for the Triton kernels, as data: per target GPU, per kernel, per dtype and shape bucket.

`kernels/_common/configs/<target>.json` maps a kernel module to its kernels, each an ordered list of buckets:

    {"norms.triton": {"rms_norm": [{"max": {"N": 1024}, "config": {"BLOCK_M": 4, "num_warps": 4}},
                                   {"config": {"BLOCK_M": 1, "num_warps": 8}}]},
     "experts.triton": {"expert_matmul": [{"dtype": "bf16", "min": {"M": 1024}, "config": {"BLOCK_M": 128}},
                                      {"dtype": "bf16", "config": {"BLOCK_M": 64}}]}}

The first bucket that matches the call wins; its `config` is laid over the kernel's own defaults. A bucket
matches when each of its optional conditions holds: `max` (every named size at most its bound), `min` (every
named size at least its bound) and `dtype` (the call's input dtype, "fp32" / "bf16" / "fp16"; a call that
names no dtype matches any). bench/tune_gpu.py writes open-ended buckets: one per tuned size, largest first,
each covering the sizes from its own up to the next larger tuned one (`min`), the smallest also everything
below (no `min`), so a call larger than every tuned size takes the largest one's configuration rather than the
defaults. bind_kernels reads these files to record each op's choice, and the kernels read them at launch by
the device they run on (a CPU tensor under TRITON_INTERPRET=1 uses the defaults and `cpu.json`).

`DEVICES` holds what the configurations must respect per GPU target (architecture, SMs, shared memory per
program); `gemm_shared` and `fit_shared` size a pipelined tl.dot loop against it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
TARGETS = ("cpu", "a100", "h100", "h200", "b200")
GPU_TARGETS = TARGETS[1:]
_H200_MIN_BYTES = 100 * 2**30  # H100 and H200 are both sm_90; the H200 has 141 GB, the H100 80-94 GB


@dataclass(frozen=True)
class Device:
    """A GPU target's limits: compute capability x 10, SMs, and the most shared memory one program may use."""

    arch: int
    sms: int
    shared: int


# Data-sheet figures (SXM parts); shared memory is the per-block opt-in maximum (A100 163 KiB, Hopper and
# Blackwell 227 KiB), which Triton's launch checks.
DEVICES = {
    "a100": Device(arch=80, sms=108, shared=163 * 1024),
    "h100": Device(arch=90, sms=132, shared=227 * 1024),
    "h200": Device(arch=90, sms=132, shared=227 * 1024),
    "b200": Device(arch=100, sms=148, shared=227 * 1024),
}
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
_planned: str | None = None  # the target `planning` pretends every device is


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
    if _planned is not None:
        return DEVICES[_planned].sms
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def device_target(device: torch.device | str) -> str:
    """The target whose configurations a kernel on `device` uses: a GPU target for CUDA, else "cpu"."""
    if _planned is not None:
        return _planned
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def capability(device: torch.device | str) -> int:
    """Compute capability x 10 of `device` (0 off CUDA)."""
    target = device_target(device)
    return DEVICES[target].arch if target in DEVICES else 0


def shared_limit(device: torch.device | str) -> int | None:
    """The most shared memory one program may use on `device` (bytes; None off CUDA: no limit applies)."""
    target = device_target(device)
    return DEVICES[target].shared if target in DEVICES else None


@contextmanager
def planning(target: str) -> Iterator[None]:
    """Choose launch configurations as on `target` whatever the tensors' device (kernels/_common/sm_check.py compiles
    the launches a wrapper makes on meta tensors for each GPU)."""
    global _planned
    if target not in DEVICES:
        raise ValueError(f"unknown GPU target {target!r}; expected one of {tuple(DEVICES)}")
    _planned, outer = target, _planned
    try:
        yield
    finally:
        _planned = outer


def gemm_shared(block_m: int, block_n: int, block_k: int, num_stages: int, a_bytes: int, b_bytes: int,
                pairs: int = 1) -> int:
    """Shared memory (bytes) of a software-pipelined tensor-core tl.dot loop: Triton's Hopper pipeline keeps
    num_stages copies of each [block_m, block_k] x [block_k, block_n] operand pair; `pairs` products a step."""
    return num_stages * pairs * block_k * (block_m * a_bytes + block_n * b_bytes)


def fit_shared(cfg: dict, limit: int | None, need: Callable[[dict], int], shrink: tuple[str, ...] = ("BLOCK_K",),
               floor: int = 16) -> dict:
    """cfg with num_stages lowered (to 2), then each `shrink` block halved in turn (not below `floor`), until
    need(cfg) <= limit; unchanged when it fits or there is no limit (CPU)."""
    cfg = dict(cfg)
    if limit is None:
        return cfg
    while need(cfg) > limit and cfg.get("num_stages", 1) > 2:
        cfg["num_stages"] -= 1
    for key in shrink:
        while need(cfg) > limit and cfg[key] > floor:
            cfg[key] //= 2
    return cfg


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


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """"fp32" / "bf16" / "fp16" for a torch dtype (other dtypes by their torch name); None stays None."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return DTYPE_NAMES.get(str(dtype), str(dtype).removeprefix("torch."))


def matches(bucket: dict, sizes: dict[str, int], dtype: str | None = None) -> bool:
    """Whether `bucket`'s conditions (max, min, dtype; each optional) hold for a call with these sizes and dtype."""
    if dtype is not None and bucket.get("dtype", dtype) != dtype:
        return False
    if any(sizes.get(key, 0) > bound for key, bound in bucket.get("max", {}).items()):
        return False
    return all(sizes.get(key, 0) >= bound for key, bound in bucket.get("min", {}).items())


def pick(buckets: list[dict], sizes: dict[str, int], dtype: torch.dtype | str | None = None) -> dict:
    """The config of the first bucket that matches `sizes` and `dtype` ({} when none does)."""
    name = dtype_name(dtype)
    for bucket in buckets:
        if matches(bucket, sizes, name):
            return dict(bucket["config"])
    return {}


_forced: dict[str, dict] = {}  # kernel -> config, set by `forcing` (the tuner's trials)
_seen: list[tuple[str, dict, str | None, dict]] | None = None  # (kernel, sizes, dtype, defaults) while `recording`


def launch_config(
    kernel: str, device: torch.device | str, defaults: dict, dtype: torch.dtype | str | None = None, **sizes: int
) -> dict:
    """`defaults` overlaid with the tuned configuration of `kernel` for `device`'s target, this dtype and sizes."""
    if _seen is not None:
        _seen.append((kernel, sizes, dtype_name(dtype), defaults))
    if kernel in _forced:
        return {**defaults, **_forced[kernel]}
    return {**defaults, **pick(configs(device_target(device)).get(kernel, []), sizes, dtype)}


@contextmanager
def forcing(kernel: str, config: dict) -> Iterator[None]:
    """Launch `kernel` with `config` over its defaults, whatever the tables say (bench/tune_gpu.py's trials)."""
    _forced[kernel] = config
    try:
        yield
    finally:
        del _forced[kernel]


@contextmanager
def recording() -> Iterator[list[tuple[str, dict, str | None, dict]]]:
    """Collect (kernel, sizes, dtype name, the kernel's defaults) for every launch_config call inside the block."""
    global _seen
    _seen, outer = [], _seen
    try:
        yield _seen
    finally:
        _seen = outer
