"""GPU bench cases: the KDA layer's elementwise ops around the core (Triton kernels vs the PyTorch references).

K3 shapes: the decay gate on f [B=4, T=4096, H=32, K=128] bf16 (lower_bounded_sigmoid, fp32 g); the short
convolution on x [B=4, T=4096, C=4096] bf16 with width W=4 and an initial state. Both are bandwidth-bound:
GB/s over the bytes each call must move.
"""

from __future__ import annotations

import torch
from gpu_case import GpuCase

from k3compile.kernels.kda import gate_triton as kda_gate_triton
from k3compile.kernels.short_conv import triton as short_conv_triton
from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.kernels.short_conv.reference import short_conv_ref

BF16 = 2  # bytes per element
FP32 = 4


def _gate_cases(device: str, B: int, T: int, H: int, K: int) -> list[GpuCase]:
    g = torch.Generator(device=device).manual_seed(0)
    f = (torch.randn(B, T, H, K, device=device, generator=g) * 3).to(torch.bfloat16)
    A_log = torch.randn(H, device=device, generator=g) * 0.5
    dt_bias = torch.randn(H * K, device=device, generator=g)
    args = ("lower_bounded_sigmoid", -5.0)
    dg = torch.randn(B, T, H, K, device=device, generator=g)  # g is fp32, so is its gradient
    leaves = [t.clone().requires_grad_() for t in (f, A_log, dt_bias)]

    def reference_bwd():
        return torch.autograd.grad(kda_gate_ref(*leaves, *args), leaves, dg)

    n = B * T * H * K
    params = (H + H * K) * FP32
    shape = f"B={B} T={T} H={H} K={K}"
    return [
        GpuCase(
            name=f"kda_gate {shape} bf16",
            triton=lambda: kda_gate_triton.kda_gate(f, A_log, dt_bias, *args),
            reference=lambda: kda_gate_ref(f, A_log, dt_bias, *args),
            flops=6.0 * n,  # add, scale, exp, 1 + e, reciprocal, lower_bound
            bytes=float(n * (BF16 + FP32) + params),  # read f, write g
            rtol=1e-5,
        ),
        GpuCase(
            name=f"kda_gate_bwd {shape} bf16",
            triton=lambda: kda_gate_triton.kda_gate_bwd([dg], f, A_log, dt_bias, *args),
            reference=reference_bwd,
            flops=14.0 * n,  # recompute the sigmoid, its derivative, df, the two parameter-gradient sums
            bytes=float(n * (BF16 + FP32 + BF16) + 2 * params),  # read f and dg, write df; params in and out
            rtol=1e-2,
        ),
    ]


def _conv_cases(device: str, B: int, T: int, C: int, W: int) -> list[GpuCase]:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(B, T, C, device=device, generator=g).to(torch.bfloat16)
    weight = (torch.randn(C, W, device=device, generator=g) / W**0.5).to(torch.bfloat16)
    state = torch.randn(B, C, W - 1, device=device, generator=g).to(torch.bfloat16)
    g_y = torch.randn(B, T, C, device=device, generator=g).to(torch.bfloat16)
    g_state = torch.randn(B, C, W - 1, device=device, generator=g).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, weight, state)]

    def reference_bwd():
        return torch.autograd.grad(short_conv_ref(*leaves), leaves, (g_y, g_state))

    n = B * T * C
    small = (C * W + 2 * B * C * (W - 1)) * BF16  # weight, state in and out
    shape = f"B={B} T={T} C={C} W={W}"
    return [
        GpuCase(
            name=f"short_conv {shape} bf16",
            triton=lambda: short_conv_triton.short_conv(x, weight, state),
            reference=lambda: short_conv_ref(x, weight, state),
            flops=(2.0 * W + 4.0) * n,  # W multiply-adds, SiLU
            bytes=float(2 * n * BF16 + small),  # read x, write y
            rtol=1e-2,
        ),
        GpuCase(
            name=f"short_conv_bwd {shape} bf16",
            triton=lambda: short_conv_triton.short_conv_bwd([g_y, g_state], x, weight, state),
            reference=reference_bwd,
            flops=(4.0 * W + 10.0) * n,  # recompute the conv, SiLU', dx taps, dweight products
            bytes=float(3 * n * BF16 + 2 * small),  # read x and g_y, write dx; weight, states in and out
            rtol=1e-2,
        ),
    ]


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    if dry_run:
        return _gate_cases(device, 1, 16, 2, 16) + _conv_cases(device, 1, 16, 40, 4)
    return _gate_cases(device, 4, 4096, 32, 128) + _conv_cases(device, 4, 4096, 4096, 4)
