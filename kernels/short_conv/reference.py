"""Causal depthwise short convolution with a decoding state (KDA's ShortConv on q, k, v).

y_t[c] = SiLU( sum_{w < W} weight[c, w] * x_{t - (W-1) + w}[c] ): the last tap multiplies the current token.
The state is the last W-1 inputs, [B, C, W-1] (oldest first), so prefill and token-by-token decoding
give the same outputs. The SiLU is part of the op (the KDA layer always applies it right after the conv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def short_conv_ref(
    x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """SiLU(causal depthwise conv(x)) in fp32 (float64 for float64 inputs): (y_BTC in x's dtype, state_BC(W-1)).

    One decoding token (T = 1 with a state) is the window [state, x] times the taps, summed: no conv call.
    """
    dtype = torch.float64 if x_BTC.dtype == torch.float64 else torch.float32
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    if T == 1 and initial_state_BCW is not None and W > 1:
        history = _as(initial_state_BCW, dtype)
        x_BTC_ = _as(x_BTC, dtype)
        x_BC1 = x_BTC_.view(B, C, 1) if x_BTC_.is_contiguous() else x_BTC_.reshape(B, C, 1)
        window_BCW = torch.cat([history, x_BC1], dim=-1)  # [B, C, W]
        y_BTC = F.silu((window_BCW * _as(weight_CW, dtype)).sum(-1)).view(B, 1, C)
        state = torch.narrow_copy(window_BCW, -1, 1, W - 1)  # the last W-1 inputs, a fresh contiguous tensor
        return _as(y_BTC, x_BTC.dtype), _as(state, x_BTC.dtype)
    x_BCT = _as(x_BTC, dtype).transpose(1, 2)
    if initial_state_BCW is None:
        history = x_BCT.new_zeros(B, C, W - 1)
    else:
        history = _as(initial_state_BCW, dtype)
    xp_BCT = torch.cat([history, x_BCT], dim=-1)  # [B, C, W-1+T]
    # conv1d refuses an input shorter than its kernel, which zero tokens give: no token, no output
    y_BCT = F.conv1d(xp_BCT, _as(weight_CW, dtype)[:, None, :], groups=C) if T else xp_BCT[..., :0]
    state = _as(xp_BCT[..., xp_BCT.shape[-1] - (W - 1) :], x_BTC.dtype).contiguous()
    return _as(F.silu(y_BCT).transpose(1, 2), x_BTC.dtype), state


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype) without dispatching the no-op cast."""
    return t if t.dtype == dtype else t.to(dtype)


def short_conv_naive(
    x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token loop over a rolling window, for tests: same contract as `short_conv_ref`."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    window = x_BTC.new_zeros(B, C, W - 1) if initial_state_BCW is None else initial_state_BCW.clone()
    ys = []
    for t in range(T):
        window = torch.cat([window, x_BTC[:, t, :, None]], dim=-1)  # [B, C, W]
        ys.append(F.silu((window * weight_CW).sum(-1)))
        window = window[..., 1:]
    return torch.stack(ys, dim=1), window


def short_conv_bwd_ref(
    grads: list[Tensor], x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None
) -> list[Tensor | None]:
    """[dx, dweight, d initial_state (None without one)] of `short_conv_ref` for grads = [dy, dstate], hand-derived.

    Works on the history-padded input xp [B, W-1+T, C] in the tokens-major layout of x, with each tap a
    shifted view: the pre-activation a = sum_w weight[:, w] xp[:, w : w+T] is recomputed (W passes), then
    da = dy SiLU'(a), dxp[:, w : w+T] += weight[:, w] da and dweight[:, w] = sum over (b, t) of da xp[:, w : w+T];
    dstate lands on the last W-1 positions of xp, which split into dx and d initial_state.
    """
    dtype = torch.float64 if x_BTC.dtype == torch.float64 else torch.float32
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    taps_WC = weight_CW.to(dtype).T.contiguous()  # each tap's weights contiguous over the channels
    xp = x_BTC.new_empty(B, W - 1 + T, C, dtype=dtype)
    if initial_state_BCW is None:
        xp[:, : W - 1].zero_()
    else:
        xp[:, : W - 1].copy_(initial_state_BCW.transpose(1, 2))
    xp[:, W - 1 :].copy_(x_BTC)
    a = xp[:, W - 1 :] * taps_WC[W - 1]
    for w in range(W - 1):
        a.addcmul_(xp[:, w : w + T], taps_WC[w])
    da = torch.ops.aten.silu_backward(grads[0].to(dtype), a)
    dxp = torch.zeros_like(xp)
    for w in range(W):
        dxp[:, w : w + T].addcmul_(da, taps_WC[w])
    products = da.new_empty(W, B, T, C)  # da times each tap's inputs, summed over (b, t) in one reduction
    for w in range(W):
        torch.mul(da, xp[:, w : w + T], out=products[w])
    dweight = products.sum(dim=(1, 2)).T
    dxp[:, T:] += grads[1].transpose(1, 2)  # the state is xp's last W-1 positions
    dinit = None if initial_state_BCW is None else dxp[:, : W - 1].transpose(1, 2).to(initial_state_BCW.dtype)
    return [dxp[:, W - 1 :].to(x_BTC.dtype), dweight.to(weight_CW.dtype), dinit]
