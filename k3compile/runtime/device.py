"""Where a run's tensors live: the build's target decides, and the machine must have what it needs.

A build for a GPU target (its ops bound to Triton kernels) trains and serves on `cuda:LOCAL_RANK` (the
process's GPU under torchrun, GPU 0 alone); a CPU build runs on the CPU, also on a machine with a GPU. A GPU
build on a machine without a GPU is refused in one line (`DeviceError`), except under TRITON_INTERPRET=1,
where its Triton kernels run on CPU tensors through Triton's interpreter (how CI tests them; slow).
"""

from __future__ import annotations

import os

import torch

from k3compile.kernels._common.launch import interpreting


class DeviceError(ValueError):
    """The build's target cannot run on this machine; one line."""


def is_gpu_target(target: str) -> bool:
    return target != "cpu"


def local_rank() -> int:
    """This process's GPU: torchrun's LOCAL_RANK, 0 without it."""
    text = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(text)
    except ValueError:
        raise DeviceError(f"LOCAL_RANK={text!r} is not an integer") from None


def runtime_device(target: str, what: str | None = None, fix: str = "rebuild it with --target cpu") -> torch.device:
    """The device a build for `target` runs on here: cuda:LOCAL_RANK for a GPU target, else the CPU.

    The refusal reads "<what> (Triton kernels) and this machine has no GPU; <fix>, or ...": `what` says what
    was made for the target ("build/k3_tiny was built for h200", "spec 'x' targets h200").
    """
    if not is_gpu_target(target):
        return torch.device("cpu")
    if torch.cuda.is_available():
        rank, count = local_rank(), torch.cuda.device_count()
        if not 0 <= rank < count:
            raise DeviceError(f"LOCAL_RANK is {rank} but this machine has {count} GPU(s)")
        return torch.device("cuda", rank)
    if interpreting():
        return torch.device("cpu")
    raise DeviceError(
        f"{what or f'the build was built for {target}'} (Triton kernels) and this machine has no GPU; {fix}, "
        "or set TRITON_INTERPRET=1 to run the kernels through Triton's interpreter (slow)"
    )


def use(device: torch.device) -> None:
    """Make `device` the current CUDA device (kernels launched without an explicit device go there)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def to_device(batch, device: torch.device):
    """A host batch (a tensor, or a tuple of them) on `device`: on CUDA from pinned memory with an asynchronous
    copy, so the host draws the next batch while the GPU computes; on the CPU the batch itself (no copy)."""
    if isinstance(batch, tuple):
        return tuple(to_device(b, device) for b in batch)
    if batch.device == device:
        return batch
    if device.type == "cuda":
        batch = batch.pin_memory()  # torch's pinned-memory cache reuses a buffer only once its copy is done
    return batch.to(device, non_blocking=True)
