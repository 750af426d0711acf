"""KDA ops: chunked and recurrent Kimi Delta Attention, the fused decode step, and the decay gate.

Layout: q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log decay (<= 0); beta [B,T,H]; state [B,H,K,V] fp32.
q and k are used as given (the layer L2-normalises them first); the default scale is K**-0.5.
Outputs take v's dtype; the state is fp32 (float64 for float64 inputs).

k3::kda_chunk has its own backward, k3::kda_chunk_bwd (kernels.kda.kda_chunk_bwd): the forward returns the
per-chunk states and intermediates it computed as extra outputs, and the backward reads them instead of
running the forward again under torch.func.vjp. The other ops use the registry's generic backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.kda import reference as ref
from k3compile.kernels._common.registry import empty_like, k3_op, resolve

MODES = ("chunk", "recurrent")
_DIFF = ("q", "k", "v", "g", "beta", "initial_state")


def triton_saved_shapes(B: int, T: int, H: int, K: int, V: int, chunk_size: int) -> list[tuple[int, ...]]:
    """Shapes of what the Triton chunk kernel saves for its backward (imports Triton only when asked)."""
    from k3compile.kernels.kda.triton import chunk_saved_shapes

    return chunk_saved_shapes(B, T, H, K, V, chunk_size)


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _kda_fake(q, k, v, g, beta, scale, initial_state, *rest):
    B, T, H, K = q.shape
    V = v.shape[-1]
    return v.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=_state_dtype(q))


def _chunk_fake(q, k, v, g, beta, scale, initial_state, chunk_size, backend):
    B, T, H, K = q.shape
    V = v.shape[-1]
    dtype = _state_dtype(q)
    args = (q, k, v, g, beta, scale, initial_state, chunk_size)
    triton = resolve("kda_chunk", backend, args, fake=True) == "triton"
    shapes = triton_saved_shapes if triton else ref.chunk_saved_shapes
    saved = [q.new_empty(s, dtype=dtype) for s in shapes(B, T, H, K, V, chunk_size)]
    return [v.new_empty(B, T, H, V), q.new_empty(B, H, K, V, dtype=dtype), *saved]


@k3_op("kda_chunk", fake=_chunk_fake, fake_takes_backend=True)
def kda_chunk_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    chunk_size: int,
) -> list[Tensor]:
    """[o, final state, *saved]: the saved tensors are outputs so that the backward reuses them.

    The Triton kernel saves its own set (kernels.kda_triton.chunk_saved_shapes); the backward runs on the same
    backend as the forward, so each reads what its own forward kept.
    """
    o, S, saved = ref.kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, chunk_size)
    return [o, S, *saved]


def _chunk_bwd_fake(do, dstate, saved, q, k, v, g, beta, scale, initial_state):
    grads = [x.new_empty(x.shape) for x in (q, k, v, g, beta)]
    if initial_state is None:
        return grads + [q.new_empty(0)]
    return grads + [initial_state.new_empty(initial_state.shape)]


@k3_op("kda_chunk_bwd", fake=_chunk_bwd_fake)
def kda_chunk_bwd_op(
    do: Tensor,
    dstate: Tensor,
    saved: list[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
) -> list[Tensor]:
    """[dq, dk, dv, dg, dbeta, dinitial_state (empty without one)], hand-derived (kernels.kda.kda_chunk_bwd)."""
    grads = ref.kda_chunk_bwd(do, dstate, ref.chunk_saved(saved), q, k, v, g, beta, scale, initial_state)
    return [*grads[:5], q.new_empty(0) if grads[5] is None else grads[5]]


def _chunk_setup_context(ctx, inputs, output):
    """Keeps the forward's saved outputs, and the inputs for their shapes and dtypes."""
    q, k, v, g, beta, scale, initial_state, _, backend = inputs
    ctx.scale, ctx.backend = scale, backend
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, g, beta, initial_state, *output[2:])


def _chunk_backward(ctx, grads):
    do, dstate = grads[:2]  # the saved tensors' grads are unused
    q, k, v, g, beta, initial_state, *saved = ctx.saved_tensors
    grads = torch.ops.k3.kda_chunk_bwd.default(
        do, dstate, saved, q, k, v, g, beta, ctx.scale, initial_state, backend=ctx.backend
    )
    grads = [x if need else None for x, need in zip(grads, ctx.needs_input_grad[:5] + ctx.needs_input_grad[6:7])]
    result = (*grads[:5], None, grads[5] if initial_state is not None else None, None, None)
    return result[: len(ctx.needs_input_grad)]  # one per argument given: a default `backend` is not


kda_chunk_op.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


@k3_op("kda_recurrent", fake=_kda_fake, differentiable=_DIFF)
def kda_recurrent_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
) -> tuple[Tensor, Tensor]:
    o, S = ref.kda_recurrent_ref(q, k, v, g, beta, scale, initial_state)
    return o.contiguous(), S


def _decode_fake(q, k, v, g, beta, state, scale):
    return v.new_empty(v.shape), empty_like(state, dtype=_state_dtype(q))


@k3_op("kda_decode_step", fake=_decode_fake, differentiable=("q", "k", "v", "g", "beta", "state"))
def kda_decode_step_op(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float | None
) -> tuple[Tensor, Tensor]:
    o, S = ref.kda_decode_step_ref(q, k, v, g, beta, state, scale)
    return o.contiguous(), S


@k3_op(
    "kda_gate",
    fake=lambda f, A_log, dt_bias, form, lower_bound: empty_like(f, dtype=ref.gate_dtype(f)),
    differentiable=("f", "A_log", "dt_bias"),
)
def kda_gate_op(f: Tensor, A_log: Tensor, dt_bias: Tensor, form: str, lower_bound: float) -> Tensor:
    return ref.kda_gate_ref(f, A_log, dt_bias, form, lower_bound)


def kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Kimi Delta Attention over a sequence: (o [B,T,H,V], final state [B,H,K,V] or None).

    mode "chunk" is the chunkwise-parallel UT-transform form (training, prefill; chunk_size a power of
    two, T padded inside); mode "recurrent" steps token by token. Both agree to fp32 rounding.
    """
    if mode == "chunk":
        out = torch.ops.k3.kda_chunk.default(q, k, v, g, beta, scale, initial_state, chunk_size, backend=backend)
        o, S = out[0], out[1]  # the rest is what the backward reuses
    elif mode == "recurrent":
        o, S = torch.ops.k3.kda_recurrent.default(q, k, v, g, beta, scale, initial_state, backend=backend)
    else:
        raise ValueError(f"unknown KDA mode {mode!r}; expected one of {MODES}")
    return o, (S if output_final_state else None)


def kda_decode_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """One decoding token: q, k, g [B,H,K], v [B,H,V], beta [B,H], state [B,H,K,V] -> (o [B,H,V], new state)."""
    return torch.ops.k3.kda_decode_step.default(q, k, v, g, beta, state, scale, backend=backend)


def kda_gate(
    f: Tensor, A_log: Tensor, dt_bias: Tensor, form: str, lower_bound: float = -5.0, *, backend: str = "auto"
) -> Tensor:
    """Log decay g [B,T,H,K] fp32 from the gate projection f [B,T,H,K], A_log [H], dt_bias [H*K].

    form "lower_bounded_sigmoid" (K3): g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias));
    form "softplus" (Kimi Linear): g = -exp(A_log) * softplus(f + dt_bias) (lower_bound ignored).
    """
    if form not in ref.DECAY_FORMS:
        raise ValueError(f"unknown KDA decay form {form!r}; expected one of {ref.DECAY_FORMS}")
    return torch.ops.k3.kda_gate.default(f, A_log, dt_bias, form, lower_bound, backend=backend)
