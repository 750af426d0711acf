"""Which implementation runs each op on each target: the data bind_kernels and the ops' dispatch read.

Every k3 op has a PyTorch reference (the `cpu` implementation and the fallback everywhere). GPU
targets use the Triton kernel named here where there is one: `TRITON_KERNELS` maps an op to
"<module>.<function>" under k3compile.kernels, a function with the op's own signature; the same
module's "<function>_bwd", when present, is the op's backward. Launch configurations come from
`kernels/configs/<target>.json` (see k3compile.kernels.launch), by kernel module; an op's record is
its module's tuned kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache

from k3compile.kernels.launch import GPU_TARGETS, TARGETS, module_configs

__all__ = ["GPU_TARGETS", "TARGETS", "TRITON_KERNELS", "choose", "op_configs", "triton_function"]

TRITON_KERNELS: dict[str, str] = {
    "add_rms_norm": "norms_triton.add_rms_norm",
    "attn_res": "attn_res_triton.attn_res",
    "expert_glu": "moe_triton.expert_glu",
    "expert_matmul": "moe_triton.expert_matmul",
    "kda_chunk": "kda_triton.kda_chunk",
    "kda_chunk_bwd": "kda_triton.kda_chunk_bwd_op",
    "kda_decode_step": "kda_decode_triton.kda_decode_step",
    "kda_gate": "kda_gate_triton.kda_gate",
    "l2_norm": "norms_triton.l2_norm",
    "linear_route": "route_triton.linear_route",
    "mla_decode_absorbed": "mla_decode_triton.mla_decode_absorbed",
    "moe_route": "route_triton.route",
    "mx_dequantize": "mx_triton.mx_dequantize",
    "mx_expert_glu": "moe_triton.mx_expert_glu",
    "mx_expert_matmul": "moe_triton.mx_expert_matmul",
    "mx_fake_quantize": "mx_triton.mx_fake_quantize",
    "mx_linear": "mx_triton.mx_linear",
    "mx_quantize": "mx_triton.mx_quantize",
    "rms_norm": "norms_triton.rms_norm",
    "rms_norm_gate": "norms_triton.rms_norm_gate",
    "short_conv": "short_conv_triton.short_conv",
    "situ_glu": "activations_triton.situ_glu",
    "swiglu": "activations_triton.swiglu",
}


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


def choose(op: str, target: str) -> dict:
    """The implementation of k3 op `op` on `target`, with the reason for the choice."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    if target == "cpu":
        return {"impl": "torch", "reason": "PyTorch reference on CPU"}
    kernel = TRITON_KERNELS.get(op)
    if kernel is None:
        return {"impl": "torch", "reason": f"no Triton kernel for k3::{op}"}
    tuned = op_configs(op, target)
    reason = f"tuned for {target}" if tuned else f"kernel defaults (no {target} tuning yet)"
    return {"impl": f"triton:{kernel}", "reason": reason, "config": tuned}
