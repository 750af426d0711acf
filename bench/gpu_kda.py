"""GPU bench cases: chunked KDA (kernels/kda/triton.py) against the PyTorch chunked form (kernels/kda/reference.py).

K3 shapes: B=1..2, T=8192, H=32, K=V=128, chunks of C=64, with an initial state; inputs as the layer makes
them (q, k L2-normalised per head, g = -5 sigmoid(x), beta = sigmoid(x)). fp32 cases hold the 1e-4 bar;
bf16 cases run the kernels' TF32 dots and compare bf16 outputs. Useful work per head: a forward is
6 T K^2 + 3 T C K + T C^2 FLOPs, a forward plus backward three times that; bytes count the inputs read,
the outputs and saved tensors written, and for the backward those read back and the gradients written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpu_case import GpuCase

from k3compile.kernels.kda import reference as ref
from k3compile.kernels.kda import triton as kda_triton

FP32 = 4


def _inputs(device: str, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(dtype)
    v = randn(B, T, H, V).to(dtype)
    g = -5.0 * torch.sigmoid(randn(B, T, H, K))
    beta = torch.sigmoid(randn(B, T, H)).to(dtype)
    h0 = randn(B, H, K, V)
    do, dstate = randn(B, T, H, V).to(dtype), randn(B, H, K, V)
    return (q, k, v, g, beta, None, h0), do, dstate


def _cases(device: str, B: int, T: int, H: int, K: int, V: int, C: int, dtype: torch.dtype) -> list[GpuCase]:
    args, do, dstate = _inputs(device, B, T, H, K, V, dtype)

    def fwd_bwd(module):
        o, S, saved = module.kda_chunk_fwd(*args, C)
        return o, S, *module.kda_chunk_bwd(do, dstate, saved, *args)

    el = torch.finfo(dtype).bits // 8
    tokens = B * T * H
    inputs = tokens * ((2 * K + V + 1) * el + K * FP32) + B * H * K * V * FP32  # q, k, v, beta; g, h0 fp32
    outputs = tokens * V * el + B * H * K * V * FP32  # o, final state
    saved = FP32 * sum(torch.Size(s).numel() for s in kda_triton.chunk_saved_shapes(B, T, H, K, V, C))
    # The backward reads the inputs, dO, dstate and the saved tensors, writes the gradients, and writes and
    # reads back its per-chunk intermediates (state gradients, dV', dA_qk, dA_kk, partial dq, dk, dG).
    N = -(-T // C)
    scratch = FP32 * B * H * N * (K * V + C * V + 2 * C * C + 3 * C * K)
    backward = 2 * inputs + outputs + saved + 2 * scratch
    flops = B * H * (6 * T * K * K + 3 * T * C * K + T * C * C)
    shape = f"B={B} T={T} H={H} K={K} V={V} C={C} {str(dtype).removeprefix('torch.')}"
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    return [
        GpuCase(
            name=f"kda_chunk_fwd {shape}",
            triton=lambda: kda_triton.kda_chunk_fwd(*args, C)[:2],
            reference=lambda: ref.kda_chunk_fwd(*args, C)[:2],
            flops=float(flops),
            bytes=float(inputs + outputs + saved),
            rtol=rtol,
        ),
        GpuCase(
            name=f"kda_chunk_fwd+bwd {shape}",
            triton=lambda: fwd_bwd(kda_triton),
            reference=lambda: fwd_bwd(ref),
            flops=3.0 * flops,
            bytes=float(inputs + outputs + saved + backward),
            rtol=rtol,
            compile=False,  # the reference backward's chunk loop would unroll T/C steps under dynamo
        ),
    ]


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    if dry_run:
        return _cases(device, 1, 40, 2, 32, 32, 16, torch.float32)
    return _cases(device, 1, 8192, 32, 128, 128, 64, torch.float32) + _cases(
        device, 2, 8192, 32, 128, 128, 64, torch.bfloat16
    )
