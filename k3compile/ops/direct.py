"""The k3 ops' implementations called without the dispatcher, for emitted CPU training code.

A torch.library custom op costs about 0.25 ms of Python a call, forward and backward together (schema
defaults, the autograd wrapper, a second op for the backward); a step of a small model calls hundreds.
Here each op with a hand-written backward is a torch.autograd.Function over the same two functions the
registry runs for its backend, so the values and gradients are the op's bit for bit: `direct.<name>(*args)`
for backend "torch" (the reference and its backward), `direct.c.<name>(*args)` for backend "c" (the C kernel
and its backward, the reference's where it has none), each taking the op's arguments without `backend`. An
op without gradients runs under no_grad; one with its own autograd or a recomputing backward runs the op
itself (kda_chunk and mx_fake_quantize, with their own autograd, have Functions here too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

import k3compile.ops  # noqa: F401  (registers the ops whose references run here)
import k3compile.kernels.binding as binding
from k3compile.kernels.kda import reference as kda_ref
from k3compile.kernels.mx.reference import mx_fake_quantize_fast
from k3compile.kernels._common.registry import REGISTERED, resolve, zero_cotangent

K3 = torch.ops.k3


class Impl(NamedTuple):
    """One implementation of a registered op: its forward and hand-written backward, with the op's contract."""

    forward: Callable
    backward: Callable
    saves_outputs: bool
    differentiable_index: tuple[int, ...]


class _Op(torch.autograd.Function):
    """One registered op's implementation: forward, then its hand-written backward (the registry's contract)."""

    @staticmethod
    def forward(ctx, op: Impl, *args):
        out = op.forward(*args)
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
            got = op.backward(float_grads, list(saved[len(ctx.tensor_pos):]), *args)
        else:
            got = op.backward(float_grads, *args)
        result: list = [None] * len(args)
        for i, g in zip(op.differentiable_index, got):
            if ctx.needs_input_grad[1 + i] and g is not None:
                result[i] = g
        return (None, *result)


class _KdaChunk(torch.autograd.Function):
    """k3::kda_chunk's reference forward and hand-written backward (kernels.kda), as k3compile.kernels.kda.op wires them."""

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
    def forward(ctx, x, fmt, block, quantize=mx_fake_quantize_fast):
        return quantize(x, fmt, block)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _direct(name: str, run=None, backend: str = "torch"):
    """k3::<name> as `run(*args)` (the op itself on `backend` when run is None); under torch.compile always the
    op, which the compiler keeps opaque."""
    op = getattr(K3, name).default

    def call(*args):
        if run is None or torch.compiler.is_compiling():
            return op(*args, backend=backend)
        return run(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _no_grad(forward, args):
    with torch.no_grad():
        return forward(*args)


kda_chunk = _direct("kda_chunk", _KdaChunk.apply)
mx_fake_quantize = _direct("mx_fake_quantize", _FakeQuantize.apply)


def _make(name: str, forward: Callable, backward: Callable | None, backend: str):
    """direct.<name> (backend "torch") or direct.c.<name> (backend "c") over `forward` and `backward` (None: the
    op's hand-written reference backward): the Function when there is a backward, forward under no_grad for an op
    without gradients, the op itself else (an op with its own autograd, or whose backward recomputes the forward)."""
    getattr(K3, name)  # AttributeError for a name that is not a k3 op
    op = REGISTERED.get(name)
    backward = backward or (op.backward_reference if op is not None else None)
    if op is not None and backward is not None:
        impl = Impl(forward, backward, op.saves_outputs, op.differentiable_index)
        return _direct(name, lambda *args: _Op.apply(impl, *args), backend)
    if op is not None and op._backward_fn is None:  # no autograd registered: its outputs need no gradient
        return _direct(name, lambda *args: _no_grad(forward, args), backend)
    return _direct(name, backend=backend)


def __getattr__(name: str):
    """direct.<name>: the op's reference, as `_make` wraps it."""
    op = REGISTERED.get(name)
    fn = _make(name, op.reference if op is not None else None, None, "torch")
    globals()[name] = fn
    return fn


def _c_kernel(name: str):
    """direct.c.<name>: the C kernel's Function, made at its first eager call (which builds the C library, or finds
    that it cannot be built: then the reference, k3compile.kernels._common.registry warning once); under torch.compile the op
    on backend "c", as every direct call."""
    made = None

    def run(*args):
        nonlocal made
        if made is None:
            if resolve(name, "c", ()) == "torch":
                made = globals()[name] if name in globals() else __getattr__(name)
            elif name == "mx_fake_quantize":
                quantize = binding.c_function(name)
                made = lambda x, fmt, block: _FakeQuantize.apply(x, fmt, block, quantize)  # noqa: E731
            else:
                made = _make(name, binding.c_function(name), binding.c_function(name, "_bwd"), "c")
        return made(*args)

    return _direct(name, run, "c")


class _CKernels:
    """direct.c: one attribute per op with a C kernel (k3compile.kernels.binding.C_KERNELS), made at import, so
    that torch.compile finds plain attributes."""

    def __init__(self):
        for name in binding.C_KERNELS:
            setattr(self, name, _c_kernel(name))

    def __getattr__(self, name: str):
        raise AttributeError(f"k3::{name} has no C kernel")


c = _CKernels()
