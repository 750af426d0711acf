"""GPU bench cases for the MoE expert grouped GEMMs (kernels/experts/triton.py) against eager PyTorch.

K3-like slice: 64 of the 896 experts, capacity C = 256 rows each, latent w = 2048, expert intermediate
I = 1536, bf16 activations with bf16 or MXFP4 (e2m1, block 32) weights. The references are the eager
composition the ops run today: batched matmuls (after dequantising MXFP4 weights), then the activation.
"""

from __future__ import annotations

import torch
from gpu_case import GpuCase

from k3compile.kernels.experts import triton as mt
from k3compile.kernels.activations.reference import situ_glu_ref
from k3compile.kernels.mx.reference import mx_dequantize_fast, mx_quantize_fast

BETAS = (4.0, 25.0)
BLOCK = 32


def _glu(x, wg, wu):
    return situ_glu_ref(x @ wg.mT, x @ wu.mT, *BETAS)


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    E, C, w, I = (2, 16, 64, 32) if dry_run else (64, 256, 2048, 1536)
    bf = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    dims = f"E={E} C={C} w={w} I={I}"

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(bf)

    x, h = randn(E, C, w), randn(E, C, I)  # GLU input buffer, down-projection input
    wg, wu = randn(E, I, w, scale=w**-0.5), randn(E, I, w, scale=w**-0.5)
    wd = randn(E, w, I, scale=I**-0.5)
    gq, uq, dq = (mx_quantize_fast(t, "e2m1", BLOCK) for t in (wg, wu, wd))
    dy_glu, dy_mm = randn(E, C, I), randn(E, C, w)

    def deq(q):
        return mx_dequantize_fast(*q, "e2m1", BLOCK, bf)

    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, h, wd)]
    xg, gg, ug, hg, wdg = leaves

    gemm = 2 * E * C * w * I  # one [C, w] x [w, I] GEMM per expert
    act, wt = 2 * E * C, 2 * E * w * I  # bytes per feature column of a buffer; of one bf16 weight
    mx_wt = E * w * I // 2 + E * w * I // BLOCK  # packed e2m1 + E8M0 scales
    rtol = 1e-2  # bf16 outputs; the reference also rounds gate/up to bf16
    return [
        GpuCase(
            f"moe expert_glu situ {dims} bf16",
            lambda: mt.expert_glu(x, wg, wu, "situ_glu", *BETAS),
            lambda: _glu(x, wg, wu),
            flops=2 * gemm, bytes=act * (w + I) + 2 * wt, rtol=rtol,
        ),
        GpuCase(
            f"moe mx_expert_glu situ {dims} mxfp4",
            lambda: mt.mx_expert_glu(x, *gq, *uq, BLOCK, "situ_glu", *BETAS),
            lambda: _glu(x, deq(gq), deq(uq)),
            flops=2 * gemm, bytes=act * (w + I) + 2 * mx_wt, rtol=rtol,
        ),
        GpuCase(
            f"moe expert_matmul {dims} bf16",
            lambda: mt.expert_matmul(h, wd),
            lambda: h @ wd.mT,
            flops=gemm, bytes=act * (I + w) + wt, rtol=rtol,
        ),
        GpuCase(
            f"moe mx_expert_matmul {dims} mxfp4",
            lambda: mt.mx_expert_matmul(h, *dq, BLOCK),
            lambda: h @ deq(dq).mT,
            flops=gemm, bytes=act * (I + w) + mx_wt, rtol=rtol,
        ),
        GpuCase(  # recompute gate/up (2 GEMMs), dx (2), dW_gate and dW_up (2)
            f"moe expert_glu_bwd situ {dims} bf16",
            lambda: mt.expert_glu_bwd([dy_glu], x, wg, wu, "situ_glu", *BETAS),
            lambda: torch.autograd.grad(_glu(xg, gg, ug), (xg, gg, ug), dy_glu),
            flops=6 * gemm, bytes=act * (2 * w + I) + 4 * wt, rtol=2 * rtol,
        ),
        GpuCase(  # dx and dW
            f"moe expert_matmul_bwd {dims} bf16",
            lambda: mt.expert_matmul_bwd([dy_mm], h, wd),
            lambda: torch.autograd.grad(hg @ wdg.mT, (hg, wdg), dy_mm),
            flops=2 * gemm, bytes=act * (2 * I + w) + 2 * wt, rtol=rtol,
        ),
    ]
