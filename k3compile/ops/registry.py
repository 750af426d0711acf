"""Registers k3 ops as torch.library custom ops: one schema, a fake impl, and a backward.

Every op in the `k3` namespace is an opaque node to torch.fx, torch.compile and
export, runs on the meta device through its fake impl, and is differentiable
through a generic backward op that recomputes the PyTorch reference under
`torch.func.vjp`. Kernels (Triton, fused) plug in below the op, never beside it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

NAMESPACE = "k3"


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _as_declared(grads, like, inputs) -> list[Tensor]:
    """Gradients as the backward op's fake declares them: laid out like their input, and owning
    their memory (custom ops may not return one tensor twice or alias an input)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
    out = []
    for g, ref in zip(grads, like):
        target = torch.empty_like(ref)
        if g.stride() != target.stride() or g.untyped_storage().data_ptr() in taken:
            g = target.copy_(g)
        taken.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


def k3_op(name: str, *, fake: Callable, differentiable: Sequence[str] = ()) -> Callable:
    """Decorator registering a typed PyTorch reference as `torch.ops.k3.<name>`.

    `fake` computes output metadata (shapes, dtypes) from the inputs alone.
    `differentiable` names the tensor arguments that receive gradients; their
    gradients come from a second op `k3::<name>_bwd` that recomputes `ref`.
    """

    def decorate(ref: Callable):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", ref, mutates_args=())
        op.register_fake(fake)
        if differentiable:
            _register_backward(name, ref, op, list(differentiable))
        op.reference = ref
        return op

    return decorate


def _register_backward(name: str, ref: Callable, op, differentiable: list[str]) -> None:
    params = list(inspect.signature(ref).parameters)
    unknown = [a for a in differentiable if a not in params]
    if unknown:
        raise ValueError(f"k3::{name}: differentiable args {unknown} are not parameters of the op")
    diff_idx = [params.index(a) for a in differentiable]
    fwd_schema = torch.library.infer_schema(ref, mutates_args=())
    args_part = fwd_schema[fwd_schema.index("(") + 1 : fwd_schema.rindex(") ->")]
    bwd_schema = f"(Tensor[] grads, {args_part}) -> Tensor[]"

    def bwd_impl(grads: list[Tensor], *args) -> list[Tensor]:
        present = [i for i in diff_idx if args[i] is not None]
        diff = tuple(args[i] for i in present)

        def f(*d):
            full = list(args)
            for i, t in zip(present, d):
                full[i] = t
            outs = _as_tuple(ref(*full))
            return tuple(o for o in outs if o.is_floating_point())

        outs, vjp = torch.func.vjp(f, *diff)
        float_grads = [g for g in grads if g.is_floating_point()][: len(outs)]
        cotangents = tuple(
            (g if g.shape == o.shape else torch.zeros_like(o)).to(o.dtype) for g, o in zip(float_grads, outs)
        )
        got = dict(zip(present, _as_declared(vjp(cotangents), diff, list(args) + list(grads))))
        return [got[i] if i in got else torch.empty(0) for i in diff_idx]

    def bwd_fake(grads: list[Tensor], *args) -> list[Tensor]:
        return [torch.empty_like(args[i]) if args[i] is not None else args[0].new_empty(0) for i in diff_idx]

    bwd = torch.library.custom_op(f"{NAMESPACE}::{name}_bwd", bwd_impl, mutates_args=(), schema=bwd_schema)
    bwd.register_fake(bwd_fake)

    def setup_context(ctx, inputs, output):
        tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.tensor_pos = tensor_pos
        ctx.others = [None if isinstance(a, Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos))
        outs = _as_tuple(output)
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]

    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            args[i] = t
        device = ctx.saved_tensors[0].device
        filled = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype) in zip(grads, ctx.out_meta)
        ]
        got = bwd(filled, *args)
        result: list = [None] * len(args)
        for i, g in zip(diff_idx, got):
            if args[i] is not None and ctx.needs_input_grad[i]:
                result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
