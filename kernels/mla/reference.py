"""PyTorch references for Gated MLA's attention cores and its optional RoPE.

Legend: B batch, T new (query) tokens, S key tokens (cached + new, S >= T), H heads,
K = N + R query/key head dim (N no-position part, R rope part shared by all heads),
V value head dim, L kv_lora_rank (width of the cached latent c_kv), C = L + R cached values per token.
Queries are the last T of the S positions: query i sits at position S - T + i and sees keys 0..S-T+i.
Scores, softmax and the weighted sums run in at least fp32; outputs come back contiguous in q's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels._common.consts import cached, const
from k3compile.kernels.norms.reference import as_dtype, upcast


def rope_ref(x: Tensor, start_pos: int, theta: float) -> Tensor:
    """Rotary embedding on the last dim of x [B, T, ..., R] at positions start_pos + t.

    Half-split (NeoX) pairing: channel i rotates with channel i + R/2 by angle pos * theta^(-2i/R).
    """
    T = x.shape[1]
    pos = torch.arange(start_pos, start_pos + T, device=x.device, dtype=upcast(x).dtype)
    return _rotate(x, pos, theta, (1, T))


def _rotate(x: Tensor, pos: Tensor, theta: float, lead: tuple[int, int]) -> Tensor:
    """x [lead..., ..., R] rotated half-split: channel i with i + R/2 by angle pos * theta^(-2i/R), where
    pos lies over x's first two dims as `lead` ([1, T] for one sequence, [B, 1] for one token each)."""
    R = x.shape[-1]
    xf = upcast(x)
    inv_freq = theta ** (-torch.arange(0, R // 2, device=x.device, dtype=xf.dtype) * 2 / R)
    angle = (pos.to(xf.dtype)[:, None] * inv_freq[None, :]).view(lead + (1,) * (x.dim() - 3) + (R // 2,))
    cos, sin = torch.cos(angle), torch.sin(angle)
    x1, x2 = xf[..., : R // 2], xf[..., R // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_at_ref(x: Tensor, positions_B: Tensor, theta: float) -> Tensor:
    """`rope_ref` for one token per sequence, each at its own position: x [B, 1, ..., R], positions [B].

    The decode step's form: positions are a tensor, so the step keeps static shapes and reads no host value.
    """
    return _rotate(x, positions_B, theta, (-1, 1))


def _causal_softmax(scores_BHTS: Tensor, lengths_B: Tensor | None = None) -> Tensor:
    """Softmax over keys with the causal mask for queries at the last T of each sequence's valid keys.

    Without lengths every sequence fills all S keys; with them sequence b holds lengths[b] valid keys
    (a preallocated cache) and its queries sit at positions lengths[b] - T .. lengths[b] - 1.
    """
    T, S = scores_BHTS.shape[-2:]
    k_pos = torch.arange(S, device=scores_BHTS.device)
    if lengths_B is None:
        q_pos = torch.arange(S - T, S, device=scores_BHTS.device)
        visible = k_pos[None, :] <= q_pos[:, None]
    else:
        q_pos_BT = lengths_B[:, None] - T + torch.arange(T, device=scores_BHTS.device)
        visible = (k_pos[None, None, :] <= q_pos_BT[:, :, None])[:, None]  # [B, 1, T, S]
    return torch.softmax(scores_BHTS.masked_fill(~visible, float("-inf")), dim=-1)


def mla_attention_ref(q_BTHK: Tensor, k_nope_BSHN: Tensor, k_pe_BSR: Tensor, v_BSHV: Tensor, scale: float) -> Tensor:
    """Expanded (naive) MLA: per-head keys [k_nope_h, k_pe], causal softmax attention -> o [B, T, H, V].

    Used for training and prefill, where expanding the latent once per token is cheapest.
    """
    N = k_nope_BSHN.shape[-1]
    q = upcast(q_BTHK)
    scores = torch.einsum("bthn,bshn->bhts", q[..., :N], upcast(k_nope_BSHN))
    scores = scores + torch.einsum("bthr,bsr->bhts", q[..., N:], upcast(k_pe_BSR))
    p = _causal_softmax(scores * scale)
    return torch.einsum("bhts,bshv->bthv", p, upcast(v_BSHV)).to(q_BTHK.dtype).contiguous()


def mla_decode_absorbed_ref(
    q_BTHK: Tensor, latent_BSC: Tensor, w_kvb: Tensor, scale: float, lengths_B: Tensor | None = None
) -> Tensor:
    """Absorbed MLA over the latent cache: attends over [c_kv, k_pe] without expanding keys or values.

    latent_BSC holds the normed c_kv (first L values) and k_pe (last R) of every cached token.
    w_kvb is kv_b_proj.weight [H*(N+V), L]: its key rows fold into the query
    (q_lat = W_uk^T q_nope, so q_nope . k_nope = q_lat . c_kv) and its value rows are applied
    after attention (o = W_uv (P c_kv)). Same result as the expanded form, O(S * C) per query.
    lengths_B (int64), when given, is how many leading cache rows of each sequence are valid.
    """
    B, T, H, K = q_BTHK.shape
    S = latent_BSC.shape[1]
    L = w_kvb.shape[1]
    R = latent_BSC.shape[-1] - L
    N = K - R
    w = _shaped(upcast(w_kvb), H, -1, L)
    w_uk_HNL, w_uv_HVL = w[:, :N], w[:, N:]
    q_nHK = _shaped(upcast(q_BTHK), B * T, H, K)  # n = (b, t)
    lat = upcast(latent_BSC)
    # Heads as the bmm batch: q_lat = q_nope W_uk per head; then [q_lat, q_pe] . [c_kv, k_pe] in one bmm.
    q_lat_HnL = torch.bmm(q_nHK[..., :N].transpose(0, 1), w_uk_HNL)
    q_BMC = torch.cat([q_lat_HnL.transpose(0, 1), q_nHK[..., N:]], dim=-1).view(B, T * H, L + R)  # m = (t, h)
    scores_BTHS = (torch.bmm(q_BMC, lat.transpose(1, 2)) * const(scale, lat)).view(B, T, H, S)
    hidden = _hidden_keys(T, S, lengths_B, lat)
    if hidden is not None:
        scores_BTHS = scores_BTHS.masked_fill_(hidden, float("-inf"))
    p_BMS = torch.softmax(scores_BTHS, dim=-1).view(B, T * H, S)
    o_lat_HnL = torch.bmm(p_BMS, lat[..., :L]).view(B * T, H, L).transpose(0, 1)
    o_nHV = torch.bmm(o_lat_HnL, w_uv_HVL.transpose(1, 2)).transpose(0, 1)
    return as_dtype(o_nHV, q_BTHK.dtype).contiguous().view(B, T, H, -1)


def _shaped(t: Tensor, *shape: int) -> Tensor:
    """t.reshape(shape), as the one view it is for a contiguous t."""
    return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def _hidden_keys(T: int, S: int, lengths_B: Tensor | None, like: Tensor) -> Tensor | None:
    """The causal mask of `_causal_softmax` as the keys each query must not see, [B or 1, T, 1, S] bool
    (None when every key is visible: one query over a full cache).

    Query t of sequence b sits at position lengths[b] - T + t (S - T + t without lengths) and hides key s
    when s - t > lengths[b] - T.
    """
    if lengths_B is None:
        if T == 1:
            return None
        return cached(("mla_hidden", T, S), like, lambda: _key_minus_query(T, S, like.device).gt(S - T)[None, :, None])
    offs_TS = cached(("mla_offsets", T, S), like, lambda: _key_minus_query(T, S, like.device))
    return (offs_TS > (lengths_B - const(T, lengths_B)).view(-1, 1, 1)).unsqueeze(2)


def _key_minus_query(T: int, S: int, device: torch.device) -> Tensor:
    return torch.arange(S, device=device)[None, :] - torch.arange(T, device=device)[:, None]
