"""Gated linear attention (KDA without the delta rule), PyTorch reference: naive, chunked and one decode step.

S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T and o_t = scale * S_t^T q_t: the write is a plain outer product,
with no beta and no delta correction. Layout as KDA's: q, k, g [B,T,H,K]; v [B,T,H,V]; state [B,H,K,V] fp32
(float64 for float64 inputs); outputs take v's dtype.

The chunked form never exponentiates a positive number: inside a chunk the pairwise decay
exp(G_t - G_s) (G the in-chunk cumulative log decay) is formed per channel only where s <= t (a
[C, C, K] tensor, -inf elsewhere), the state read takes exp(G_t) <= 1 and the state write exp(G_C - G_s)
<= 1. So any decay, however strong, is exact (no floor, no overflow); the cost of the per-channel pairwise
tensor is why the chunk is small (CHUNK = 16).
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 16


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _state(q_BTHK: Tensor, v_BTHV: Tensor, state_BHKV: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The state before the first token: zeros, or a copy of the given one (an op may not return its input)."""
    B, _, H, K = q_BTHK.shape
    if state_BHKV is None:
        return q_BTHK.new_zeros(B, H, K, v_BTHV.shape[-1], dtype=dtype)
    return state_BHKV.to(dtype, copy=True)


def gla_naive(
    q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTHK: Tensor, scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The literal recurrence, one Python step per token, in the inputs' precision (at least fp32): (o, state)."""
    dtype = torch.promote_types(q_BTHK.dtype, torch.float32)
    q, k, v, g = (t.to(dtype) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    outs = []
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S + k[:, t, ..., :, None] * v[:, t, ..., None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return (torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)), S


def gla_decode_step_ref(
    q_BHK: Tensor, k_BHK: Tensor, v_BHV: Tensor, g_BHK: Tensor, state_BHKV: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """One decoding token: (o_BHV in v's dtype, new state in the compute dtype)."""
    dtype = _compute_dtype(q_BHK)
    scale = q_BHK.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, S = (t.to(dtype) for t in (q_BHK, k_BHK, v_BHV, g_BHK, state_BHKV))
    S = torch.addcmul(torch.exp(g)[..., None] * S, k[..., :, None], v[..., None, :])
    o = torch.matmul(q[..., None, :] * scale, S)[..., 0, :]
    return o.to(v_BHV.dtype), S


def gla_chunk_ref(
    q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTHK: Tensor, scale: float | None = None,
    initial_state_BHKV: Tensor | None = None, chunk_size: int = CHUNK,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Chunkwise-parallel gated linear attention: (o_BTHV in v's dtype, final state). T is padded inside
    (zero keys and zero log decay in the padding leave the state as it was)."""
    dtype = _compute_dtype(q_BTHK)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = _state(q_BTHK, v_BTHV, initial_state_BHKV, dtype)
    if T == 0:
        return v_BTHV.new_zeros(v_BTHV.shape), S
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T

    def chunks(x: Tensor) -> Tensor:  # [B,T,H,X] -> [N, B, H, C, X] in the compute dtype
        x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4)

    q, k, v, g = chunks(q_BTHK) * scale, chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    G = g.cumsum(-2)  # in-chunk cumulative log decay, <= 0 and falling
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    pair = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    scores = torch.einsum("nbhtk,nbhsk,nbhtsk->nbhts", q, k, pair)  # [N,B,H,C,C], zero above the diagonal
    intra = scores @ v
    q_decayed = q * G.exp()
    k_to_end = k * (G[..., -1:, :] - G).exp()  # each key decayed to the chunk's end
    end_decay = G[..., -1, :].exp()[..., None]  # [N,B,H,K,1]
    outs = []
    for n in range(N):
        outs.append(intra[n] + q_decayed[n] @ S)
        S = end_decay[n] * S + k_to_end[n].transpose(-1, -2) @ v[n]
    o = torch.stack(outs).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(v_BTHV.dtype), S
