"""Which implementation runs each op on each target: the data bind_kernels and the ops' dispatch read.

Every k3 op has a PyTorch reference (the fallback everywhere). GPU targets use the Triton kernel named
here where there is one: `TRITON_KERNELS` maps an op to "<module>.<function>" under k3compile.kernels, a
function with the op's own signature; the same module's "<function>_bwd", when present, is the op's
backward. The CPU target uses the C kernel `C_KERNELS` names, in the same form, where the machine can
build them (k3compile.kernels._common.native); `cpu_kernels="torch"` keeps every reference. Launch configurations come from
`kernels/_common/configs/<target>.json` (see k3compile.kernels._common.launch), by kernel module; an op's record is
its module's tuned kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache

from k3compile.kernels._common.launch import GPU_TARGETS, TARGETS, module_configs

__all__ = [
    "CPU_KERNEL_CHOICES", "C_KERNELS", "GPU_TARGETS", "TARGETS", "TRITON_KERNELS", "c_available", "c_function", "choose",
    "op_configs", "triton_function",
]

TRITON_KERNELS: dict[str, str] = {
    "add_rms_norm": "norms.triton.add_rms_norm",
    "attn_res": "attn_res.triton.attn_res",
    "expert_glu": "experts.triton.expert_glu",
    "expert_matmul": "experts.triton.expert_matmul",
    "kda_chunk": "kda.triton.kda_chunk",
    "kda_chunk_bwd": "kda.triton.kda_chunk_bwd_op",
    "kda_decode_step": "kda.decode_triton.kda_decode_step",
    "kda_gate": "kda.gate_triton.kda_gate",
    "l2_norm": "norms.triton.l2_norm",
    "linear_route": "moe.triton.linear_route",
    "mla_decode_absorbed": "mla.triton.mla_decode_absorbed",
    "moe_route": "moe.triton.route",
    "mx_dequantize": "mx.triton.mx_dequantize",
    "mx_expert_glu": "experts.triton.mx_expert_glu",
    "mx_expert_matmul": "experts.triton.mx_expert_matmul",
    "mx_fake_quantize": "mx.triton.mx_fake_quantize",
    "mx_linear": "mx.triton.mx_linear",
    "mx_quantize": "mx.triton.mx_quantize",
    "rms_norm": "norms.triton.rms_norm",
    "rms_norm_gate": "norms.triton.rms_norm_gate",
    "short_conv": "short_conv.triton.short_conv",
    "situ_glu": "activations.triton.situ_glu",
    "swiglu": "activations.triton.swiglu",
}


C_KERNELS: dict[str, str] = {
    "attn_res_normed": "attn_res_normed.c.attn_res_normed",
    "expert_rows_ffn": "experts.c.expert_rows_ffn",
    "glu_train": "glu_train.c.glu_train",
    "kda_gate": "kda.c.kda_gate",
    "l2_norm": "norms.c.l2_norm",
    "moe_combine": "moe.c.moe_combine",
    "mx_fake_quantize": "mx.c.mx_fake_quantize",
    "rms_inv": "attn_res_normed.c.rms_inv",
    "rms_norm": "norms.c.rms_norm",
    "rms_norm_gate": "norms.c.rms_norm_gate",
    "short_conv": "short_conv.c.short_conv",
}

CPU_KERNEL_CHOICES = ("auto", "c", "torch")  # build option: C kernels where they build / insist / references only


def c_available() -> tuple[bool, str]:
    """(whether the C kernels build and load on this machine, why not)."""
    from k3compile.kernels._common import native

    return native.available()


@lru_cache(maxsize=None)
def c_function(op: str, suffix: str = "") -> Callable | None:
    """The C-kernel implementation of k3 op `op` (suffix "_bwd": its backward, None when it has none)."""
    module, _, function = C_KERNELS[op].rpartition(".")
    found = getattr(importlib.import_module(f"k3compile.kernels.{module}"), function + suffix, None)
    if found is None and not suffix:
        raise LookupError(f"k3::{op}: k3compile.kernels.{module} has no function {function!r}")
    return found


@lru_cache(maxsize=None)
def triton_function(op: str, suffix: str = "") -> Callable | None:
    """The Triton implementation of k3 op `op` (suffix "_bwd": its backward, None when it has none).

    Imports the kernel module on first use, so nothing imports Triton unless a Triton backend runs.
    """
    module, _, function = TRITON_KERNELS[op].rpartition(".")
    found = getattr(importlib.import_module(f"k3compile.kernels.{module}"), function + suffix, None)
    if found is None and not suffix:
        raise LookupError(f"k3::{op}: k3compile.kernels.{module} has no function {function!r}")
    return found


def op_configs(op: str, target: str) -> dict:
    """The tuned launch configurations of the kernels in `op`'s module on `target`, by kernel ({} when untuned)."""
    module = TRITON_KERNELS[op].rpartition(".")[0]
    return module_configs(target).get(module, {})


def choose(op: str, target: str, cpu_kernels: str = "auto") -> dict:
    """The implementation of k3 op `op` on `target`, with the reason for the choice. On the CPU target
    `cpu_kernels` is "auto" (the C kernel where one exists and builds here), "c" (the C kernel, a
    RuntimeError where they cannot be built) or "torch" (the references)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    if target == "cpu":
        return _choose_cpu(op, cpu_kernels)
    kernel = TRITON_KERNELS.get(op)
    if kernel is None:
        return {"impl": "torch", "reason": f"no Triton kernel for k3::{op}"}
    tuned = op_configs(op, target)
    reason = f"tuned for {target}" if tuned else f"kernel defaults (no {target} tuning yet)"
    return {"impl": f"triton:{kernel}", "reason": reason, "config": tuned}


def _choose_cpu(op: str, cpu_kernels: str) -> dict:
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_CHOICES}, got {cpu_kernels!r}")
    kernel = C_KERNELS.get(op)
    if cpu_kernels == "torch" or kernel is None:
        why = "C kernels off (cpu_kernels='torch')" if kernel is not None else "PyTorch reference on CPU"
        return {"impl": "torch", "reason": why}
    ok, why = c_available()
    if ok:
        return {"impl": f"c:{kernel}", "reason": "C kernel built for this CPU"}
    if cpu_kernels == "c":
        raise RuntimeError(f"k3::{op}: C kernels requested but unavailable: {why}")
    return {"impl": "torch", "reason": f"PyTorch reference ({why})"}
