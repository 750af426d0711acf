"""Gated linear attention ops (`kda.delta_rule: false`): the chunked form and the fused decode step.

Layout as the KDA ops (q, k, g [B,T,H,K]; v [B,T,H,V]; state [B,H,K,V] fp32), without beta. No Triton kernel
implements them: every target binds the PyTorch reference (kernels.gla), which runs on CUDA tensors too, and
the backward recomputes it under torch.func.vjp (the registry's generic backward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.gla import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _chunk_fake(q, k, v, g, scale, initial_state, chunk_size):
    B, T, H, K = q.shape
    return v.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, K, v.shape[-1], dtype=_state_dtype(q))


@k3_op("gla_chunk", fake=_chunk_fake, differentiable=("q", "k", "v", "g", "initial_state"))
def gla_chunk_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None, initial_state: Tensor | None, chunk_size: int
) -> tuple[Tensor, Tensor]:
    o, S = ref.gla_chunk_ref(q, k, v, g, scale, initial_state, chunk_size)
    return o.contiguous(), S


def _decode_fake(q, k, v, g, state, scale):
    return v.new_empty(v.shape), empty_like(state, dtype=_state_dtype(q))


@k3_op("gla_decode_step", fake=_decode_fake, differentiable=("q", "k", "v", "g", "state"))
def gla_decode_step_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, scale: float | None
) -> tuple[Tensor, Tensor]:
    o, S = ref.gla_decode_step_ref(q, k, v, g, state, scale)
    return o.contiguous(), S


def gla(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale: float | None = None, initial_state: Tensor | None = None,
    chunk_size: int = ref.CHUNK, backend: str = "auto",
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Gated linear attention over a sequence, chunked: (o [B,T,H,V], final state [B,H,K,V])."""
    return torch.ops.k3.gla_chunk.default(q, k, v, g, scale, initial_state, chunk_size, backend=backend)


def gla_decode_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, scale: float | None = None, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """One decoding token: q, k, g [B,H,K], v [B,H,V], state [B,H,K,V] -> (o [B,H,V], new state)."""
    return torch.ops.k3.gla_decode_step.default(q, k, v, g, state, scale, backend=backend)
