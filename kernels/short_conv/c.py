"""C kernels of short_conv for the CPU target (kernels/short_conv/short_conv.c): tokens-major, no transposes or padded
copies of the input; the backward recomputes the pre-activation and sums the taps' gradients per thread.

fp32 (fp16/bf16 round trip through fp32 as the reference's); float64, tensors the C kernels cannot read
(`native.takes`) and one-token decoding steps keep the reference. Values agree with it to fp32 rounding (another summation order, libmvec's expf).
"""

from __future__ import annotations

from ctypes import c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.short_conv import reference as ref
from k3compile.kernels._common.native import F32, F32_OR_NULL

MAX_TAPS = 64  # the C kernels keep a token's W input rows on the stack
_FWD = (F32, F32_OR_NULL, F32, F32, F32) + (c_int64,) * 4 + (c_int,)
_BWD = (F32, F32_OR_NULL, F32, F32, F32_OR_NULL, F32, F32, F32_OR_NULL, F32, F32) + (c_int64,) * 4 + (c_int,)



def _uses_reference(x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None, *grads: Tensor | None) -> bool:
    W = weight_CW.shape[-1]
    decoding = x_BTC.shape[1] == 1 and initial_state_BCW is not None
    readable = native.takes(x_BTC, weight_CW, initial_state_BCW, *grads)
    return not readable or W > MAX_TAPS or W < 2 or decoding


def _check_shapes(kernel: str, x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None) -> None:
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    native.expect_numel(kernel, "weight", weight_CW, C * W)
    if initial_state_BCW is not None:
        native.expect_numel(kernel, "initial_state", initial_state_BCW, B * C * (W - 1))


def _operands(x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None):
    """(x, history [B, W-1, C] or None, taps [W, C], a zero row [C]) in contiguous fp32."""
    hist = None if initial_state_BCW is None else native.f32(initial_state_BCW.transpose(1, 2))
    return native.f32(x_BTC), hist, native.f32(weight_CW.T), torch.zeros(x_BTC.shape[-1], dtype=torch.float32)


def short_conv(x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(SiLU(causal depthwise conv(x)), the last W-1 inputs [B, C, W-1]), as `short_conv_ref`."""
    if _uses_reference(x_BTC, weight_CW, initial_state_BCW):
        return ref.short_conv_ref(x_BTC, weight_CW, initial_state_BCW)
    _check_shapes("k3_short_conv", x_BTC, weight_CW, initial_state_BCW)
    x, hist, taps, zeros = _operands(x_BTC, weight_CW, initial_state_BCW)
    B, T, C = x.shape
    W = taps.shape[0]
    y = torch.empty_like(x)
    native.function("k3_short_conv", _FWD)(x, hist, taps, y, zeros, B, T, C, W, native.threads())
    if T >= W - 1:
        state = x_BTC[:, T - (W - 1):].transpose(1, 2)
    else:
        history = x_BTC.new_zeros(B, W - 1, C) if hist is None else initial_state_BCW.transpose(1, 2)
        state = torch.cat([history.to(x_BTC.dtype), x_BTC], dim=1)[:, T:].transpose(1, 2)
    return y.to(x_BTC.dtype), state.contiguous()


def short_conv_bwd(
    grads: list[Tensor], x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None
) -> list[Tensor | None]:
    """[dx, dweight, d initial_state (None without one)] of `short_conv` for grads = [dy, dstate]."""
    if _uses_reference(x_BTC, weight_CW, initial_state_BCW, *grads):
        return ref.short_conv_bwd_ref(grads, x_BTC, weight_CW, initial_state_BCW)
    _check_shapes("k3_short_conv_bwd", x_BTC, weight_CW, initial_state_BCW)
    native.expect_numel("k3_short_conv_bwd", "dy", grads[0], x_BTC.numel())
    x, hist, taps, zeros = _operands(x_BTC, weight_CW, initial_state_BCW)
    B, T, C = x.shape
    W, threads = taps.shape[0], native.threads()
    dy = native.f32(grads[0])
    dstate = native.f32(grads[1].transpose(1, 2)) if len(grads) > 1 and grads[1] is not None else None
    if dstate is not None:
        native.expect_numel("k3_short_conv_bwd", "dstate", dstate, B * C * (W - 1))
    da, dx = torch.empty_like(x), torch.empty_like(x)
    dhist = None if hist is None else torch.empty_like(hist)
    dw = torch.zeros(threads, W, C, dtype=torch.float32)
    native.function("k3_short_conv_bwd", _BWD)(x, hist, taps, dy, dstate, da, dx, dhist, dw, zeros, B, T, C, W, threads)
    dinit = None if dhist is None else dhist.transpose(1, 2).to(initial_state_BCW.dtype)
    return [dx.to(x_BTC.dtype), dw.sum(dim=0).T.to(weight_CW.dtype), dinit]
