"""Triton KDA decode step: one fused kernel for the single-token recurrence (reference `kda_decode_step_ref`).

Per head, with the state S [K, V] in fp32:

    S <- Diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = scale * S^T q

One program owns one (batch, head, V-block): the columns of S are independent given k, so each program keeps
its [K, BLOCK_V] slice in registers, reads it once and writes the new state once (a fresh tensor: the caller
may keep the old one). The step is memory-bound on the state, so blocks are sized for coalesced V rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

_DEFAULTS = {"BLOCK_V": 32, "num_warps": 4, "num_stages": 1}

TUNABLE = {
    "kda_decode_step": {"BLOCK_V": [16, 32, 64, 128], "num_warps": [1, 2, 4, 8], "num_stages": [1]},
}


@triton.jit
def _kda_decode_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, s_new_ptr,
    scale, K, V,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Program (b*H + h, V-block): decay, delta-rule update and readout of S[:, V-block] for one head.

    b*H + h is grid axis 0, the one without CUDA's 65535 limit (a decode batch of 2048 x 32 heads exceeds it)."""
    bh = tl.program_id(0).to(tl.int64)
    pid_v = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]

    q = tl.load(q_ptr + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + bh * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + bh * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + bh).to(tl.float32)

    s_offs = bh * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(s_ptr + s_offs, mask=mask_kv, other=0.0).to(tl.float32)
    S = S * tl.exp(g)[:, None]
    residual = v - tl.sum(k[:, None] * S, axis=0)
    S = S + (beta * k)[:, None] * residual[None, :]
    o = tl.sum(q[:, None] * S, axis=0) * scale

    tl.store(s_new_ptr + s_offs, S, mask=mask_kv)
    tl.store(o_ptr + bh * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def kda_decode_step(
    q_BHK: Tensor,
    k_BHK: Tensor,
    v_BHV: Tensor,
    g_BHK: Tensor,
    beta_BH: Tensor,
    state_BHKV: Tensor,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoding token of KDA: (o [B, H, V] in v's dtype, new fp32 state [B, H, K, V]); the old state is kept."""
    B, H, K = q_BHK.shape
    V = v_BHV.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta, state = (t.contiguous() for t in (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV))
    o = torch.empty(B, H, V, dtype=v_BHV.dtype, device=v.device)
    new_state = torch.empty(B, H, K, V, dtype=torch.float32, device=v.device)
    cfg = launch_config("kda_decode_step", v.device, _DEFAULTS, dtype=v.dtype, K=K, V=V, BH=B * H)
    block_v = min(cfg["BLOCK_V"], triton.next_power_of_2(V))
    grid = (B * H, triton.cdiv(V, block_v))
    _kda_decode_step_kernel[grid](
        q, k, v, g, beta, state, o, new_state,
        float(scale), K, V,
        BLOCK_K=triton.next_power_of_2(K), BLOCK_V=block_v,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return o, new_state
