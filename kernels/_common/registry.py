"""Registers k3 ops as torch.library custom ops: one schema, a fake impl, a backward, and a backend choice.

Every op in the `k3` namespace is an opaque node to torch.fx, torch.compile and
export, runs on the meta device through its fake impl, and is differentiable
through a backward op `k3::<name>_bwd`. Kernels plug in below the op, never beside it:
every op's schema ends in `str backend="auto"`, and its implementation runs the PyTorch
reference, the Triton kernel or the C kernel that `k3compile.kernels.binding` names for it (see
`resolve`). The backward runs, on the same backend, a kernel module's `<fn>_bwd` or the op's
hand-written reference backward (`k3_op(backward=...)`); an op with neither recomputes its reference
under `torch.func.vjp`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import k3compile.kernels.binding as binding
from k3compile.kernels._common.launch import interpreting

NAMESPACE = "k3"
BACKENDS = ("auto", "torch", "triton", "c")
REGISTERED: dict = {}  # name -> the custom op k3_op made (with its reference, for k3compile.ops.direct)
FAKES: dict = {}  # OpOverload -> its fake impl, which the build's shape checks call without the dispatcher
BACKEND_FREE: set = set()  # OpOverloads whose output shapes and dtypes do not depend on the backend


def empty_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """torch.empty_like(x, dtype=dtype) for fake impls: by new_empty where x is contiguous (the same
    result), since on meta tensors empty_like runs a Python reference at about ten times the cost."""
    if x.is_contiguous():
        return x.new_empty(x.shape, dtype=dtype)
    return torch.empty_like(x, dtype=dtype)


def _device_of(args) -> torch.device:
    for a in args:
        if isinstance(a, Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0].device
    return torch.device("cpu")


def _float64(args) -> bool:
    return any(isinstance(a, Tensor) and a.dtype == torch.float64 for a in args)


def resolve(name: str, backend: str, args: Sequence, *, fake: bool = False) -> str:
    """"torch", "triton" or "c": the implementation of k3::`name` for `backend` and these arguments.

    "auto" takes the Triton kernel for CUDA tensors when one exists, the reference otherwise; "triton"
    insists on the kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); "c" takes the CPU target's C
    kernel (what bind_kernels chooses on the CPU target), or the reference, with a warning, on a machine
    where the C kernels cannot be built; "torch" is the reference. float64 always runs the reference (the
    kernels are fp32/bf16/fp16; float64 is for gradchecks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"k3::{name}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or _float64(args):
        return "torch"
    if backend == "c":
        return _resolve_c(name, args, fake)
    has_kernel = name in binding.TRITON_KERNELS
    device = _device_of(args)
    if backend == "auto":
        return "triton" if has_kernel and device.type == "cuda" else "torch"
    if not has_kernel:
        raise ValueError(f"k3::{name} has no Triton kernel (backend='triton'); use backend='torch' or 'auto'")
    if not fake and device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"k3::{name}: backend='triton' on {device.type} tensors needs a CUDA GPU, or TRITON_INTERPRET=1 to run "
            "the Triton kernel through the interpreter (or build with --target cpu)"
        )
    return "triton"


_WARNED: set[str] = set()


def _resolve_c(name: str, args: Sequence, fake: bool) -> str:
    if name not in binding.C_KERNELS:
        raise ValueError(f"k3::{name} has no C kernel (backend='c'); use backend='torch' or 'auto'")
    if fake:
        return "c"
    device = _device_of(args)
    if device.type != "cpu":
        raise RuntimeError(f"k3::{name}: backend='c' runs on CPU tensors, got {device.type} (build for a GPU target)")
    ok, why = binding.c_available()
    if ok:
        return "c"
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"C kernels unavailable ({why}): the k3 ops bound to them run their PyTorch references",
                      stacklevel=3)
    return "torch"


def _split_backend(n_params: int, args: tuple, kwargs: dict) -> tuple[list, str]:
    """(the op's own arguments, the backend): the dispatcher passes `backend` only when the caller did."""
    args = list(args)
    backend = kwargs.pop("backend", None)
    if backend is None:
        backend = args.pop() if len(args) > n_params else "auto"
    return args, backend


def _with_backend(schema: str) -> str:
    head, _, ret = schema.rpartition(") ->")
    sep = "" if head.endswith("(") else ", "
    return f'{head}{sep}str backend="auto") ->{ret}'


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


def k3_op(
    name: str,
    *,
    fake: Callable,
    differentiable: Sequence[str] = (),
    backward: Callable | None = None,
    fake_takes_backend: bool = False,
    saves_outputs: bool = False,
) -> Callable:
    """Decorator registering a typed PyTorch reference as `torch.ops.k3.<name>`, with a trailing `backend` argument.

    `fake` computes output metadata (shapes, dtypes) from the inputs alone (and from the backend too when
    `fake_takes_backend`: an op whose outputs depend on the kernel). `differentiable` names the tensor
    arguments that receive gradients; their gradients come from a second op `k3::<name>_bwd`. `backward`,
    the reference's hand-written backward, has the contract of a Triton `<fn>_bwd`: (the floating-point
    output cotangents, *the op's arguments) -> one gradient (or None) per differentiable argument; without
    it the reference backend recomputes the forward under torch.func.vjp. `saves_outputs`: the op's outputs
    are saved for the backward too (an op returning what its backward needs beside its result), and
    `backward` takes (cotangents, the op's outputs, *the op's arguments).
    """
    if backward is not None and not differentiable:
        raise ValueError(f"k3::{name}: a backward needs the differentiable arguments named")
    if saves_outputs and backward is None:
        raise ValueError(f"k3::{name}: saves_outputs needs a hand-written backward that reads them")

    def decorate(ref: Callable):
        n_params = len(inspect.signature(ref).parameters)

        def impl(*args, **kwargs):
            args, backend = _split_backend(n_params, args, kwargs)
            chosen = resolve(name, backend, args)
            if chosen == "triton":
                return binding.triton_function(name)(*args)
            if chosen == "c":
                return binding.c_function(name)(*args)
            return ref(*args)

        def fake_impl(*args, **kwargs):
            args, backend = _split_backend(n_params, args, kwargs)
            return fake(*args, backend) if fake_takes_backend else fake(*args)

        schema = _with_backend(torch.library.infer_schema(ref, mutates_args=()))
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema)
        op.register_fake(fake_impl)
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        FAKES[overload] = fake_impl
        if not fake_takes_backend:
            BACKEND_FREE.add(overload)
        if differentiable:
            _register_backward(name, ref, op, list(differentiable), backward, saves_outputs)
        op.reference = ref
        params = list(inspect.signature(ref).parameters)  # for k3compile.ops.direct, which runs ref and backward
        op.backward_reference, op.saves_outputs = backward, saves_outputs
        op.differentiable_index = tuple(params.index(a) for a in differentiable if a in params)
        REGISTERED[name] = op
        return op

    return decorate


def zero_cotangent(shape, dtype: torch.dtype, device: torch.device, broadcast: bool) -> Tensor:
    """A zero cotangent for an output autograd gave none: a broadcast 0-d zero when `broadcast`, else filled."""
    zero = torch.zeros((), dtype=dtype, device=device)
    return zero.expand(shape) if broadcast else torch.zeros(shape, dtype=dtype, device=device)


def _fill_missing(got: dict[int, Tensor], diff_idx: list[int]) -> list[Tensor]:
    """One gradient per differentiable argument, an empty tensor for arguments that were None."""
    return [got[i] if i in got else torch.empty(0) for i in diff_idx]


def _register_backward(
    name: str, ref: Callable, op, differentiable: list[str], ref_bwd: Callable | None, saves_outputs: bool = False
) -> None:
    params = list(inspect.signature(ref).parameters)
    unknown = [a for a in differentiable if a not in params]
    if unknown:
        raise ValueError(f"k3::{name}: differentiable args {unknown} are not parameters of the op")
    diff_idx = [params.index(a) for a in differentiable]
    fwd_schema = _with_backend(torch.library.infer_schema(ref, mutates_args=()))
    args_part = fwd_schema[fwd_schema.index("(") + 1 : fwd_schema.rindex(") ->")]
    saved = "Tensor[] outputs, " if saves_outputs else ""
    bwd_schema = f"(Tensor[] grads, {saved}{args_part}) -> Tensor[]"

    def bwd_impl(grads: list[Tensor], *args, **kwargs) -> list[Tensor]:
        outputs = list(args[0]) if saves_outputs else []
        args, backend = _split_backend(len(params), args[int(saves_outputs):], kwargs)
        chosen = resolve(name, backend, args)
        kernel = ref_bwd
        if chosen == "triton":
            kernel = binding.triton_function(name, "_bwd")
        elif chosen == "c":
            kernel = binding.c_function(name, "_bwd") or ref_bwd
        if kernel is not None:
            float_grads = [g for g in grads if g.is_floating_point()]
            got = kernel(float_grads, outputs, *args) if saves_outputs else kernel(float_grads, *args)
            present = [i for i, g in zip(diff_idx, got) if g is not None]
            taken = [*args, *grads, *outputs]
            declared = _as_declared([g for g in got if g is not None], [args[i] for i in present], taken)
            return _fill_missing(dict(zip(present, declared)), diff_idx)
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
        return _fill_missing(got, diff_idx)

    def bwd_fake(grads: list[Tensor], *args, **kwargs) -> list[Tensor]:
        args, _ = _split_backend(len(params), args[int(saves_outputs):], kwargs)
        return [empty_like(args[i]) if args[i] is not None else args[0].new_empty(0) for i in diff_idx]

    bwd = torch.library.custom_op(f"{NAMESPACE}::{name}_bwd", bwd_impl, mutates_args=(), schema=bwd_schema)
    bwd.register_fake(bwd_fake)
    overload = getattr(getattr(torch.ops, NAMESPACE), f"{name}_bwd").default
    FAKES[overload] = bwd_fake
    BACKEND_FREE.add(overload)

    def setup_context(ctx, inputs, output):
        tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.tensor_pos = tensor_pos
        ctx.others = [None if isinstance(a, Tensor) else a for a in inputs]
        outs = _as_tuple(output)
        ctx.save_for_backward(*(inputs[i] for i in tensor_pos), *(outs if saves_outputs else ()))
        ctx.out_meta = [(o.shape, o.dtype) for o in outs]

    def backward(ctx, *grads):
        args = list(ctx.others)
        saved = ctx.saved_tensors
        for i, t in zip(ctx.tensor_pos, saved):
            args[i] = t
        device = saved[0].device
        filled = [  # an op saving its outputs reads no cotangent of them: a broadcast zero, not a filled one
            g if g is not None else zero_cotangent(shape, dtype, device, saves_outputs)
            for g, (shape, dtype) in zip(grads, ctx.out_meta)
        ]
        got = bwd(filled, list(saved[len(ctx.tensor_pos):]), *args) if saves_outputs else bwd(filled, *args)
        result: list = [None] * len(args)
        for i, g in zip(diff_idx, got):
            if args[i] is not None and ctx.needs_input_grad[i]:
                result[i] = g
        # One gradient per argument given: ops taking tensor lists do not count a defaulted `backend`.
        return tuple(result[: len(ctx.needs_input_grad)])

    op.register_autograd(backward, setup_context=setup_context)
