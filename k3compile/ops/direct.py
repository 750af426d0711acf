"""The k3 ops' PyTorch references called without the dispatcher, for emitted CPU training code.

A torch.library custom op costs about 0.25 ms of Python a call, forward and backward together (schema
defaults, the autograd wrapper, a second op for the backward); a step of a small model calls hundreds.
Here each op with a hand-written backward is a torch.autograd.Function over the same two functions the
registry runs for backend "torch" (the reference and its backward), so the values and gradients are the
op's bit for bit. `direct.<name>(*args)` takes the op's arguments without `backend`. An op without
gradients runs its reference under no_grad; one with its own autograd or a recomputing backward runs the op
itself (kda_chunk and mx_fake_quantize, with their own autograd, have Functions here too).
"""

from __future__ import annotations

import torch
from torch import Tensor

import k3compile.ops  # noqa: F401  (registers the ops whose references run here)
from k3compile.kernels import kda as kda_ref
from k3compile.kernels.mx import mx_fake_quantize_fast
from k3compile.ops.registry import REGISTERED, zero_cotangent

K3 = torch.ops.k3


class _Op(torch.autograd.Function):
    """One registered op: forward = its reference, backward = its hand-written backward (the registry's contract)."""

    @staticmethod
    def forward(ctx, op, *args):
        out = op.reference(*args)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.op, ctx.others = op, [None if isinstance(a, Tensor) else a for a in args]
        ctx.tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_pos), *(outs if op.saves_outputs else ()))
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, *grads):
        op, saved = ctx.op, ctx.saved_tensors
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_pos, saved):
            args[i] = t
        float_grads = [
            g if g is not None else zero_cotangent(shape, dtype, saved[0].device, op.saves_outputs)
            for g, (shape, dtype) in zip(grads, ctx.out_meta)
            if dtype.is_floating_point
        ]
        if op.saves_outputs:
            got = op.backward_reference(float_grads, list(saved[len(ctx.tensor_pos):]), *args)
        else:
            got = op.backward_reference(float_grads, *args)
        result: list = [None] * len(args)
        for i, g in zip(op.differentiable_index, got):
            if ctx.needs_input_grad[1 + i] and g is not None:
                result[i] = g
        return (None, *result)


class _KdaChunk(torch.autograd.Function):
    """k3::kda_chunk's reference forward and hand-written backward (kernels.kda), as k3compile.ops.kda wires them."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, chunk_size):
        o, S, saved = kda_ref.kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, chunk_size)
        ctx.scale = scale
        ctx.mark_non_differentiable(*saved)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *saved)
        ctx.set_materialize_grads(False)
        return (o, S, *saved)

    @staticmethod
    def backward(ctx, do, dstate, *_):
        q, k, v, g, beta, initial_state, *saved = ctx.saved_tensors
        if do is None:  # the filled zeros autograd would give, as for the op
            do = torch.zeros_like(v)
        if dstate is None:
            dstate = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[-1], dtype=saved[0].dtype, device=q.device)
        grads = kda_ref.kda_chunk_bwd(do, dstate, kda_ref.chunk_saved(saved), q, k, v, g, beta, ctx.scale, initial_state)
        grads = [x if need else None for x, need in zip(grads, (*ctx.needs_input_grad[:5], ctx.needs_input_grad[6]))]
        return (*grads[:5], None, grads[5] if initial_state is not None else None, None)


class _FakeQuantize(torch.autograd.Function):
    """k3::mx_fake_quantize with its straight-through gradient."""

    @staticmethod
    def forward(ctx, x, fmt, block):
        return mx_fake_quantize_fast(x, fmt, block)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _direct(name: str, run=None):
    """k3::<name> as `run(*args)` (the op itself when run is None); under torch.compile always the op, which the
    compiler keeps opaque."""
    op = getattr(K3, name).default

    def call(*args):
        if run is None or torch.compiler.is_compiling():
            return op(*args, backend="torch")
        return run(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _no_grad(op, args):
    with torch.no_grad():
        return op.reference(*args)


kda_chunk = _direct("kda_chunk", _KdaChunk.apply)
mx_fake_quantize = _direct("mx_fake_quantize", _FakeQuantize.apply)


def __getattr__(name: str):
    """direct.<name>: the Function for an op with a hand-written backward, the reference for one without
    gradients, the op itself else (an op with its own autograd, or whose backward recomputes the forward)."""
    getattr(K3, name)  # AttributeError for a name that is not a k3 op
    op = REGISTERED.get(name)
    if op is not None and op.backward_reference is not None:
        fn = _direct(name, lambda *args: _Op.apply(op, *args))
    elif op is not None and op._backward_fn is None:  # no autograd registered: its outputs need no gradient
        fn = _direct(name, lambda *args: _no_grad(op, args))
    else:
        fn = _direct(name)
    globals()[name] = fn
    return fn
