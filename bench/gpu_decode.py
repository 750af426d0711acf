"""GPU bench cases for the decoding kernels (kernels/kda/decode_triton.py, kernels/mla/triton.py).

KDA: one decode step at B = 16..64 sequences, H = 32 heads, K = V = 128, bf16 q/k/v/beta, fp32 gates and state;
memory-bound on the fp32 state, which is read once and written once (GB/s).
MLA: absorbed decoding of one token for B = 32 sequences over a bf16 latent cache of S = 8k..32k tokens,
K3 heads (H = 64, kv_lora L = 512, rope R = 64, nope N = 128, v V = 128); bytes are the latent cache read
(what bounds decode), flops the absorb, scores, P @ c_kv and W_uv matmuls.
The references are the eager PyTorch ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpu_case import GpuCase

from k3compile.kernels.kda import decode_triton as kdt
from k3compile.kernels.mla import triton as mdt
from k3compile.kernels.kda.reference import kda_decode_step_ref
from k3compile.kernels.mla.reference import mla_decode_absorbed_ref

RTOL = 1e-2  # bf16 outputs; the MLA kernel also rounds q_lat and P to bf16 for the tensor-core dots


def _kda_case(device: str, B: int, H: int, K: int, V: int) -> GpuCase:
    bf = torch.bfloat16
    q = torch.randn(B, H, K, device=device).to(bf)
    k = F.normalize(torch.randn(B, H, K, device=device), dim=-1).to(bf)
    v = torch.randn(B, H, V, device=device).to(bf)
    g = F.logsigmoid(torch.randn(B, H, K, device=device) + 3.0)
    beta = torch.rand(B, H, device=device).to(bf)
    state = torch.randn(B, H, K, V, device=device) * 0.1
    args = (q, k, v, g, beta, state, None)
    state_bytes = 2 * B * H * K * V * 4  # fp32 state in and out
    io_bytes = B * H * (2 * 2 * K + 4 * K + 2 * 2 * V + 2)  # q, k (bf16), g (fp32), v and o (bf16), beta
    return GpuCase(
        f"kda_decode_step B={B} H={H} K=V={K}",
        lambda: kdt.kda_decode_step(*args),
        lambda: kda_decode_step_ref(*args),
        flops=7 * B * H * K * V,  # per state entry: decay, k^T S, rank-1 update (2), q^T S
        bytes=state_bytes + io_bytes,
        rtol=RTOL,
    )


def _mla_case(device: str, B: int, T: int, S: int, H: int, L: int, R: int, N: int, V: int) -> GpuCase:
    bf = torch.bfloat16
    q = torch.randn(B, T, H, N + R, device=device).to(bf)
    latent = torch.randn(B, S, L + R, device=device).to(bf)
    w_kvb = (torch.randn(H * (N + V), L, device=device) * L**-0.5).to(bf)
    scale = (N + R) ** -0.5
    keys_seen = B * sum(S - T + 1 + t for t in range(T))  # causal: query t sees S - T + 1 + t keys
    attn = 2 * H * keys_seen * ((L + R) + L)  # scores over [c_kv | k_pe], then P @ c_kv
    proj = 2 * B * T * H * L * (N + V)  # q_nope @ W_uk and o_lat @ W_uv^T
    return GpuCase(
        f"mla_decode_absorbed B={B} T={T} H={H} S={S}",
        lambda: mdt.mla_decode_absorbed(q, latent, w_kvb, scale),
        lambda: mla_decode_absorbed_ref(q, latent, w_kvb, scale),
        flops=attn + proj,
        bytes=B * S * (L + R) * 2,  # the bf16 latent cache, read once
        rtol=RTOL,
    )


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    torch.manual_seed(0)
    if dry_run:
        return [_kda_case(device, 2, 2, 16, 16), _mla_case(device, 1, 1, 40, 2, 32, 16, 16, 16)]
    kda = [_kda_case(device, B, 32, 128, 128) for B in (16, 32, 64)]
    mla = [_mla_case(device, 32, 1, S, 64, 512, 64, 128, 128) for S in (8192, 16384, 32768)]
    return kda + mla
