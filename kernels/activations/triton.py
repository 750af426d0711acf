"""Triton kernels for the GLU activations of kernels/activations/reference.py: SiTU-GLU and SwiGLU, forward and backward.

Elementwise over the flattened tensors, BLOCK elements per program, fp32 math (kernels/_common/triton_math.py's
`glu` / `glu_grad`, shared with the MoE epilogues), the reference's dtypes out, bf16 rounded to nearest-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config
from k3compile.kernels._common.triton_math import glu, glu_grad, round_to

_SPACE = {"BLOCK": [512, 1024, 2048, 4096, 8192], "num_warps": [2, 4, 8, 16]}
TUNABLE = {name: dict(_SPACE) for name in ("situ_glu", "swiglu", "situ_glu_bwd", "swiglu_bwd")}
_DEFAULTS = {"BLOCK": 2048, "num_warps": 8, "num_stages": 1}


@triton.jit
def _glu_fwd_kernel(gate_ptr, up_ptr, y_ptr, n, beta1, beta2, SITU: tl.constexpr, BLOCK: tl.constexpr):
    """y = glu(g, u): SiTU-GLU or SwiGLU over BLOCK elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = glu(g, u, beta1, beta2, SITU)
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(gy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, beta1, beta2,
                    SITU: tl.constexpr, BLOCK: tl.constexpr):
    """(dgate, dup) = glu_grad(g, u, dy) over BLOCK elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dgate, dup = glu_grad(g, u, gy, beta1, beta2, SITU)
    tl.store(dgate_ptr + offs, round_to(dgate, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, round_to(dup, dup_ptr.dtype.element_ty), mask=mask)


def _check(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    return gate.contiguous(), up.contiguous()


def _launch_fwd(name: str, gate: Tensor, up: Tensor, beta1: float, beta2: float, situ: bool) -> Tensor:
    g, u = _check(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = g.numel()
    if n:
        cfg = launch_config(name, gate.device, _DEFAULTS, dtype=gate.dtype, n=n)
        _glu_fwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
            g, u, y, n, beta1, beta2, SITU=situ, BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def _launch_bwd(name: str, grads: list[Tensor], gate: Tensor, up: Tensor, beta1: float, beta2: float,
                situ: bool) -> list[Tensor | None]:
    g, u = _check(gate, up)
    gy = grads[0].contiguous()
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = g.numel()
    if n:
        cfg = launch_config(name, gate.device, _DEFAULTS, dtype=gate.dtype, n=n)
        _glu_bwd_kernel[(triton.cdiv(n, cfg["BLOCK"]),)](
            gy, g, u, dgate, dup, n, beta1, beta2, SITU=situ, BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return [dgate, dup]


def situ_glu(gate: Tensor, up: Tensor, beta1: float, beta2: float) -> Tensor:
    """SiTU-GLU [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], in gate's dtype."""
    return _launch_fwd("situ_glu", gate, up, beta1, beta2, situ=True)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU silu(g) * u, in gate's dtype."""
    return _launch_fwd("swiglu", gate, up, 1.0, 1.0, situ=False)


def situ_glu_bwd(grads: list[Tensor], gate: Tensor, up: Tensor, beta1: float, beta2: float) -> list[Tensor | None]:
    """[dgate, dup] of situ_glu for grads = [dy]."""
    return _launch_bwd("situ_glu_bwd", grads, gate, up, beta1, beta2, situ=True)


def swiglu_bwd(grads: list[Tensor], gate: Tensor, up: Tensor) -> list[Tensor | None]:
    """[dgate, dup] of swiglu for grads = [dy]."""
    return _launch_bwd("swiglu_bwd", grads, gate, up, 1.0, 1.0, situ=False)
