"""Mixed-precision training the way torch.autocast does it: bf16 compute over fp32 master weights.

`training.precision` chooses for a run:

- `fp32`: every weight, activation, gradient and optimizer state in fp32.
- `bf16`: the forward (and so its backward) runs under `torch.autocast(dtype=torch.bfloat16)`: matmuls, and the
  k3 ops in `BF16_OPS` (grouped expert matmuls, the fused GLU projection, MLA attention), take bf16 copies of
  their fp32 inputs; norms, the loss and the rest run as autocast decides (fp32 where precision matters). The
  parameters, their gradients and Muon's and AdamW's state stay fp32; the optimizer updates fp32 weights.
- `auto` (default): bf16 on a CUDA GPU with native bf16 (Ampere and later), fp32 elsewhere: a CPU run's numbers
  are unchanged.

QAT is unchanged: `mx_fake_quantize` runs on the fp32 master weights, and its MX values (a 3-bit or 4-bit
significand times a power of two) are exact in bf16, so the expert matmuls see the same quantised weights.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "fp32", "bf16")

# k3 ops whose work is matmuls: under autocast they take bf16 copies of every floating-point input, as
# torch.mm does (their kernels then multiply bf16 on tensor cores). Every other k3 op sees its inputs as they come.
BF16_OPS = ("expert_glu", "expert_matmul", "linear_glu", "mla_attention")
_REGISTERED: set[str] = set()


def register_autocast() -> None:
    """Register BF16_OPS' autocast rule (cast inputs to bf16) on CUDA and CPU; once per process."""
    import k3compile.ops  # noqa: F401  (defines the torch.ops.k3 operators)

    for name in BF16_OPS:
        if name in _REGISTERED or not hasattr(torch.ops.k3, name):
            continue
        for device_type in ("cuda", "cpu"):
            torch.library.register_autocast(f"k3::{name}", device_type, torch.bfloat16)
        _REGISTERED.add(name)


def training_precision(setting: str, device: torch.device | str) -> tuple[torch.dtype | None, str]:
    """(the autocast dtype for `setting` on `device`, None for plain fp32; a line saying why). Decided once per run."""
    from k3compile.runtime.muon import native_bf16_matmul

    if setting not in PRECISIONS:
        raise ValueError(f"training precision must be one of {PRECISIONS}, got {setting!r}")
    device = torch.device(device)
    master = "fp32 weights, gradients and optimizer state"
    if setting == "fp32":
        return None, f"precision fp32 (training.precision): {master}"
    if setting == "bf16":
        native, why = native_bf16_matmul(device)
        slow = "" if native else f" (emulated: {why})"
        return torch.bfloat16, f"precision bf16 compute{slow} over {master} (training.precision)"
    if device.type == "cuda":
        native, why = native_bf16_matmul(device)
        if native:
            return torch.bfloat16, f"precision bf16 compute over {master} (auto: {why})"
        return None, f"precision fp32 (auto: {why})"
    return None, f"precision fp32 (auto: {device.type})"


def autocast(dtype: torch.dtype | None, device: torch.device):
    """The context a forward runs in: autocast to `dtype` on `device`'s type, or nothing for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    register_autocast()
    return torch.autocast(device.type, dtype=dtype)
