"""k3 MLA ops: mla_attention (expanded, prefill/training), mla_decode_absorbed (latent cache), mla_rope and
mla_rope_at (rotary embedding at one position per sequence, for the decode step)."""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.mla import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


def _attention_fake(q_BTHK, k_nope_BSHN, k_pe_BSR, v_BSHV, scale):
    B, T, H, _ = q_BTHK.shape
    return q_BTHK.new_empty(B, T, H, v_BSHV.shape[-1])


@k3_op("mla_attention", fake=_attention_fake, differentiable=("q_BTHK", "k_nope_BSHN", "k_pe_BSR", "v_BSHV"))
def mla_attention_op(q_BTHK: Tensor, k_nope_BSHN: Tensor, k_pe_BSR: Tensor, v_BSHV: Tensor, scale: float) -> Tensor:
    return ref.mla_attention_ref(q_BTHK, k_nope_BSHN, k_pe_BSR, v_BSHV, scale)


def _absorbed_fake(q_BTHK, latent_BSC, w_kvb, scale, lengths_B=None):
    B, T, H, K = q_BTHK.shape
    L = w_kvb.shape[1]
    N = K - (latent_BSC.shape[-1] - L)
    return q_BTHK.new_empty(B, T, H, w_kvb.shape[0] // H - N)


@k3_op("mla_decode_absorbed", fake=_absorbed_fake, differentiable=("q_BTHK", "latent_BSC", "w_kvb"))
def mla_decode_absorbed_op(
    q_BTHK: Tensor, latent_BSC: Tensor, w_kvb: Tensor, scale: float, lengths_B: Tensor | None = None
) -> Tensor:
    return ref.mla_decode_absorbed_ref(q_BTHK, latent_BSC, w_kvb, scale, lengths_B)


@k3_op("mla_rope", fake=lambda x, start_pos, theta: empty_like(x), differentiable=("x",))
def mla_rope_op(x: Tensor, start_pos: int, theta: float) -> Tensor:
    return ref.rope_ref(x, start_pos, theta)


@k3_op("mla_rope_at", fake=lambda x, positions_B, theta: empty_like(x))
def mla_rope_at_op(x: Tensor, positions_B: Tensor, theta: float) -> Tensor:
    return ref.rope_at_ref(x, positions_B, theta)


def mla_attention(
    q_BTHK: Tensor, k_nope_BSHN: Tensor, k_pe_BSR: Tensor, v_BSHV: Tensor, scale: float, *, backend: str = "auto"
) -> Tensor:
    """Causal MLA attention with expanded per-head keys/values; k_pe is shared by all heads."""
    return torch.ops.k3.mla_attention.default(q_BTHK, k_nope_BSHN, k_pe_BSR, v_BSHV, scale, backend=backend)


def mla_decode_absorbed(
    q_BTHK: Tensor,
    latent_BSC: Tensor,
    w_kvb: Tensor,
    scale: float,
    lengths_B: Tensor | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Causal MLA attention over the latent cache [c_kv, k_pe], kv_b_proj absorbed into q and o.

    lengths_B: valid cache rows per sequence (a preallocated cache); None means all S rows.
    """
    return torch.ops.k3.mla_decode_absorbed.default(q_BTHK, latent_BSC, w_kvb, scale, lengths_B, backend=backend)


def mla_rope(x: Tensor, start_pos: int, theta: float, *, backend: str = "auto") -> Tensor:
    """Half-split rotary embedding of x [B, T, ..., R] at positions start_pos .. start_pos + T - 1."""
    return torch.ops.k3.mla_rope.default(x, start_pos, theta, backend=backend)


def mla_rope_at(x: Tensor, positions_B: Tensor, theta: float, *, backend: str = "auto") -> Tensor:
    """mla_rope of one token per sequence x [B, 1, ..., R], sequence b at position positions_B[b] (decoding)."""
    return torch.ops.k3.mla_rope_at.default(x, positions_B, theta, backend=backend)
