"""C kernel of mx_fake_quantize for the CPU target (kernels/mx/mx.c): the bits of `mx_fake_quantize_fast`.

The same fp32 arithmetic as the fast path (block amax, a power-of-two scale, rintf's ties-to-even on the element
grid), one pass over each block while it is in registers. fp16/bf16 inputs round trip through fp32 as the fast
path's do; float64 keeps the float64 reference, and tensors the C kernel cannot read (`native.takes`) the fast
path's PyTorch form.
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.mx.reference import FAST_DTYPES, check_mx_shape, mx_fake_quantize_fast, mx_fake_quantize_ref, mx_format
from k3compile.kernels._common.native import F32

_ARGS = (F32, F32, c_int64, c_int, c_int, c_int, c_int, c_float, c_int)


def format_args(fmt: str) -> tuple[int, int, int, float]:
    """(emin, emax, mbits, max) of an MX element format, as the C kernels take it."""
    f = mx_format(fmt)
    return f.emin, f.emax, f.mbits, f.max


def mx_fake_quantize(x: Tensor, fmt: str, block: int = 32) -> Tensor:
    """dequant(quant(x)) in x's dtype, through the C kernel."""
    check_mx_shape(x.shape[-1], fmt, block)
    if x.dtype not in FAST_DTYPES:
        return mx_fake_quantize_ref(x, fmt, block)
    if not native.takes(x):
        return mx_fake_quantize_fast(x, fmt, block)
    xf = native.f32(x)
    y = torch.empty_like(xf)
    native.function("k3_mx_fake_quantize", _ARGS)(xf, y, xf.numel() // block, block, *format_args(fmt),
                                                 native.threads())
    return y if x.dtype == torch.float32 else y.to(x.dtype)
