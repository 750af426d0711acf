"""k3 MX ops: mx_quantize, mx_dequantize, mx_fake_quantize (straight-through) and mx_linear.

Rules and layout decisions are documented in k3compile.kernels.mx.reference. The ops run its `_fast` functions,
which give the reference's bits (tests/kernels/test_mx.py checks them against `_ref`). mx_linear is the
reference the MX-packing pass and the Triton dot_scaled kernel are checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.mx import reference as ref
import k3compile.kernels.binding as binding
from k3compile.kernels._common.registry import empty_like, k3_op, resolve


def _quantize_fake(x, fmt, block):
    data_shape, data_dtype, scale_shape = ref.mx_quant_meta(x.shape, fmt, block)
    return x.new_empty(data_shape, dtype=data_dtype), x.new_empty(scale_shape, dtype=torch.uint8)


@k3_op("mx_quantize", fake=_quantize_fake)
def mx_quantize_op(x: Tensor, fmt: str, block: int) -> tuple[Tensor, Tensor]:
    return ref.mx_quantize_fast(x, fmt, block)


def _quantize_setup(ctx, inputs, output):
    # Quantisation is a step function: its fp8 payload must not look differentiable (QAT uses
    # mx_fake_quantize), so nothing downstream of it asks for a gradient.
    ctx.mark_non_differentiable(*output)


mx_quantize_op.register_autograd(lambda ctx, *grads: (None, None, None, None), setup_context=_quantize_setup)


def _dequantize_fake(data, scale, fmt, block, dtype):
    return data.new_empty(ref.mx_dequant_meta(data.shape, scale.shape, fmt, block), dtype=dtype)


@k3_op("mx_dequantize", fake=_dequantize_fake)
def mx_dequantize_op(data: Tensor, scale: Tensor, fmt: str, block: int, dtype: torch.dtype) -> Tensor:
    return ref.mx_dequantize_fast(data, scale, fmt, block, dtype)


def _fake_quantize_fake(x, fmt, block):
    ref.check_mx_shape(x.shape[-1], fmt, block)
    return empty_like(x)


@k3_op("mx_fake_quantize", fake=_fake_quantize_fake)
def mx_fake_quantize_op(x: Tensor, fmt: str, block: int) -> Tensor:
    return ref.mx_fake_quantize_fast(x, fmt, block)


def _straight_through(ctx, grad):
    # QAT straight-through estimator: the rounding is treated as the identity.
    return grad, None, None, None


mx_fake_quantize_op.register_autograd(_straight_through)


def _linear_fake(x, data, scale, fmt, block, act_fmt):
    out = ref.mx_dequant_meta(data.shape, scale.shape, fmt, block)[0]
    return x.new_empty((*x.shape[:-1], out))


@k3_op("mx_linear", fake=_linear_fake)
def mx_linear_op(
    x: Tensor, data: Tensor, scale: Tensor, fmt: str, block: int, act_fmt: str | None
) -> Tensor:
    return ref.mx_linear_fast(x, data, scale, fmt, block, act_fmt)


def _linear_setup(ctx, inputs, output):
    x, data, scale, fmt, block, act_fmt, backend = inputs
    ctx.fmt, ctx.block, ctx.act_fmt, ctx.backend = fmt, block, act_fmt, backend
    ctx.save_for_backward(x, data, scale)


def _linear_backward(ctx, grad_y):
    # dy/dx = dequant(W), with the activation fake-quant (if any) passed straight through.
    x, data, scale = ctx.saved_tensors
    args = (x, data, scale, ctx.fmt, ctx.block, ctx.act_fmt)
    if resolve("mx_linear", ctx.backend, args) == "triton":
        grad_x = binding.triton_function("mx_linear", "_bwd")([grad_y], *args)[0]
    else:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = torch.ops.k3.mx_dequantize.default(data, scale, ctx.fmt, ctx.block, acc, backend=ctx.backend)
        grad_x = (grad_y.to(acc) @ w).to(x.dtype)
    return grad_x, None, None, None, None, None, None


mx_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def mx_quantize(x: Tensor, fmt: str, block: int = 32, *, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """MX-quantise x [..., n] along the last dim: (payload, E8M0 scale bytes [..., n/block]).

    Payload: packed uint8 [..., n/2] for "e2m1"; float8_e4m3fn / float8_e5m2 [..., n] for "e4m3" / "e5m2".
    """
    return torch.ops.k3.mx_quantize.default(x, fmt, block, backend=backend)


def mx_dequantize(
    data: Tensor, scale: Tensor, fmt: str, block: int = 32, dtype: torch.dtype = torch.float32,
    *,
    backend: str = "auto",
) -> Tensor:
    """Decode an MX payload and its E8M0 scales to [..., n] values in `dtype` (NaN for 0xFF blocks)."""
    return torch.ops.k3.mx_dequantize.default(data, scale, fmt, block, dtype, backend=backend)


def mx_fake_quantize(x: Tensor, fmt: str, block: int = 32, *, backend: str = "auto") -> Tensor:
    """MX quantise-dequantise in x's dtype with a straight-through (identity) gradient, for QAT."""
    return torch.ops.k3.mx_fake_quantize.default(x, fmt, block, backend=backend)


def mx_linear(
    x: Tensor, data: Tensor, scale: Tensor, fmt: str = "e2m1", block: int = 32, act_fmt: str | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """y = x @ dequant(W)^T for MX weights W [out, in] blocked along `in`; differentiable in x.

    `act_fmt` (e.g. "e4m3") fake-quantises x along its last dim first (straight-through in backward).
    """
    return torch.ops.k3.mx_linear.default(x, data, scale, fmt, block, act_fmt, backend=backend)
