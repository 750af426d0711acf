"""Gated MLA: multi-head latent attention with a compressed KV cache and a sigmoid output gate."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3compile.modules.norms import RMSNorm
from k3compile.kernels.mla.op import mla_attention, mla_decode_absorbed, mla_rope, mla_rope_at


class MLAMixer(nn.Module):
    """Gated MLA token mixer (reference section 3).

    q = q_b_proj(q_a_norm(q_a_proj x)) or q_proj x; [c_kv, k_pe] = kv_a_proj x; c_kv is normed by
    kv_a_norm; k_nope and v come from kv_b_proj c_kv. k_pe is one vector shared by all heads,
    rotated (with q's rope part) only when `rope`. y = o_proj(attn * sigmoid(g_proj x)).
    The latent norms use `latent_norm_eps` (None: `norm_eps`).

    Cache: a tensor [B, S, kv_lora_rank + qk_rope_head_dim] holding, per token, the NORMED c_kv
    and the (rotated, if rope) k_pe - nothing per head. forward(x, cache, start_pos) writes the new
    tokens at [start_pos, start_pos + T): into the cache if it is long enough (preallocated),
    else by cutting it at start_pos and appending. It returns the updated cache.
    With start_pos == 0 the whole sequence attends in the expanded form (keys/values per head);
    with start_pos > 0 (chunked prefill) the absorbed form attends over the latent.
    forward(x, cache, positions=p) is the static decode step: one token per sequence, written in
    place at row p[b] of the preallocated cache, attending over rows 0..p[b] (absorbed form); shapes
    never change from one step to the next and nothing reads p on the host.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: bool = False,
        rope_theta: float = 10000.0,
        output_gate: bool = True,
        norm_eps: float = 1e-5,
        latent_norm_eps: float | None = None,
    ):
        super().__init__()
        if rope and qk_rope_head_dim % 2:
            raise ValueError(f"rope needs an even qk_rope_head_dim, got {qk_rope_head_dim}")
        H, D = num_heads, hidden_size
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = H, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope, self.rope_theta, self.output_gate = rope, rope_theta, output_gate
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        dq = qk_nope_head_dim + qk_rope_head_dim
        latent_eps = norm_eps if latent_norm_eps is None else latent_norm_eps
        if q_lora_rank:
            self.q_a_proj = nn.Linear(D, q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, H * dq, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * dq, bias=False)
        self.kv_a_proj = nn.Linear(D, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
        if output_gate:
            self.g_proj = nn.Linear(D, H * v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, D, bias=False)

    @property
    def cache_values_per_token(self) -> int:
        """Values cached per token for this layer: kv_lora_rank + qk_rope_head_dim (K3: 512 + 64 = 576)."""
        return self.kv_lora_rank + self.rope_dim

    def forward(
        self, x_BTD: Tensor, cache: Tensor | None = None, start_pos: int = 0, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        B, T, _ = x_BTD.shape
        H, N, L = self.num_heads, self.nope_dim, self.kv_lora_rank
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD)))
        else:
            q = self.q_proj(x_BTD)
        q_BTHK = q.reshape(B, T, H, N + self.rope_dim)
        c_kv, k_pe = self.kv_a_proj(x_BTD).split([L, self.rope_dim], dim=-1)
        if self.rope and positions is not None:  # the decode step: each sequence at its own position
            q_BTHK = torch.cat([q_BTHK[..., :N], mla_rope_at(q_BTHK[..., N:], positions, self.rope_theta)], dim=-1)
            k_pe = mla_rope_at(k_pe, positions, self.rope_theta)
        elif self.rope:
            q_BTHK = torch.cat([q_BTHK[..., :N], mla_rope(q_BTHK[..., N:], start_pos, self.rope_theta)], dim=-1)
            k_pe = mla_rope(k_pe, start_pos, self.rope_theta)
        latent_BTC = torch.cat([self.kv_a_norm(c_kv), k_pe], dim=-1)
        if positions is not None:
            cache = _write_rows(cache, latent_BTC, positions)
            o_BTHV = mla_decode_absorbed(q_BTHK, cache, self.kv_b_proj.weight, self.scale, positions + 1)
            return self._output(o_BTHV, x_BTD), cache
        if cache is not None and start_pos == 0:  # prefill into a preallocated cache (traceable: no shape checks)
            cache = cache.slice_scatter(latent_BTC.to(cache.dtype), dim=1, start=0, end=T)
            ctx_BSC = latent_BTC
        else:
            cache, ctx_BSC = _write_cache(cache, latent_BTC, start_pos)
        if start_pos == 0:
            kv = self.kv_b_proj(ctx_BSC[..., :L]).reshape(B, -1, H, N + self.v_dim)
            o_BTHV = mla_attention(q_BTHK, kv[..., :N], ctx_BSC[..., L:], kv[..., N:], self.scale)
        else:
            o_BTHV = mla_decode_absorbed(q_BTHK, ctx_BSC, self.kv_b_proj.weight, self.scale)
        return self._output(o_BTHV, x_BTD), cache

    def _output(self, o_BTHV: Tensor, x_BTD: Tensor) -> Tensor:
        o = o_BTHV.flatten(2)
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o)


def _write_rows(cache_BSC: Tensor, latent_B1C: Tensor, positions_B: Tensor) -> Tensor:
    """Write each sequence's one new latent at its own row, in place (static shapes, no host sync)."""
    T = latent_B1C.shape[1]
    if isinstance(T, int) and T != 1:  # (under fx tracing T is symbolic)
        raise ValueError(f"the decode step takes one token per sequence, got T={T}")
    index = positions_B.view(-1, 1, 1).expand(-1, 1, cache_BSC.shape[-1])
    return cache_BSC.scatter_(1, index, latent_B1C.to(cache_BSC.dtype))


def _write_cache(cache: Tensor | None, latent_BTC: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
    """Put the new latents at [start_pos, start_pos + T); return (new cache, the valid prefix to attend over)."""
    if cache is None:
        if start_pos != 0:
            raise ValueError(f"start_pos {start_pos} needs a cache holding the earlier tokens")
        return latent_BTC, latent_BTC
    if start_pos > cache.shape[1]:
        raise ValueError(f"start_pos {start_pos} is past the cache length {cache.shape[1]}")
    end = start_pos + latent_BTC.shape[1]
    if cache.shape[1] >= end:
        cache = cache.slice_scatter(latent_BTC.to(cache.dtype), dim=1, start=start_pos, end=end)
    else:
        cache = torch.cat([cache[:, :start_pos], latent_BTC.to(cache.dtype)], dim=1)
    return cache, cache[:, :end]
