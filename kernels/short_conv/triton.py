"""Triton kernels for KDA's causal depthwise short convolution with fused SiLU, forward and backward.

Both kernels index the padded input xp = [initial_state | x] along time (W-1 history columns, then T tokens):
y_t = SiLU(sum_w weight[w] * xp[t + w]). A program owns (c-block, T-block, b) and reads the W-1 halo rows
before its block through shifted loads (from x, or from the initial state at the start). The backward
walks padded positions j in [0, T + W - 1): dxp[j] = sum_w weight[w] * dpre[j - w] (+ g_state[j - T] for the
last W-1), so the first W-1 positions are d initial_state and the rest are dx; dweight reduces over the B*T
tokens in two deterministic stages (per-program partials, then a fixed-order sum). The backward runs in two
passes so that each keeps a few tiles live: the first recomputes the pre-activation and stores
dpre = g_y SiLU'(pre) (fp32, one write and one read of B*T*C values) with the dweight partials, the second
sums the W shifted dpre tiles into dxp.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

TUNABLE = {
    "short_conv_fwd": {"BLOCK_T": [16, 32, 64, 128], "BLOCK_C": [64, 128, 256], "num_warps": [2, 4, 8]},
    "short_conv_bwd": {
        "BLOCK_T": [64, 128, 256, 512],
        "SUB_T": [8, 16, 32],
        "BLOCK_C": [64, 128, 256],
        "num_warps": [2, 4, 8],
    },
    "short_conv_bwd_dx": {"BLOCK_T": [16, 32, 64], "BLOCK_C": [64, 128, 256], "num_warps": [2, 4, 8]},
    "short_conv_bwd_reduce": {"BLOCK_R": [8, 16, 32], "BLOCK_Q": [128, 256, 512], "num_warps": [1, 2, 4]},
}


@triton.jit
def _load_xp(x_ptr, hist_ptr, b, p, cols, T, C, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """fp32 tile xp[b, p, cols]: the history hist[b, p, c] (the initial state transposed to [B, W-1, C]) for
    p < W-1, x[b, p-(W-1), c] up to T+W-1, else 0. The positions p are consecutive; the history is read only by
    a tile that reaches into it."""
    c_ok = cols < C
    t = p - (W - 1)
    x_rows = (b * T + t).to(tl.int64)
    in_x = (t >= 0) & (t < T)
    xp = tl.load(x_ptr + x_rows[:, None] * C + cols[None, :], mask=in_x[:, None] & c_ok[None, :], other=0.0)
    xp = xp.to(tl.float32)
    if HAS_INIT and tl.min(p, axis=0) < W - 1:
        in_h = (p >= 0) & (p < W - 1)
        h_offs = (b * (W - 1) + p).to(tl.int64)[:, None] * C + cols[None, :]
        xp += tl.load(hist_ptr + h_offs, mask=in_h[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    return xp


@triton.jit
def _short_conv_fwd_kernel(
    x_ptr, w_ptr, hist_ptr, y_ptr, state_ptr, T, C,
    W: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (c-block, T-block, b): y = SiLU(conv) for BLOCK_T tokens; the last T-block also writes the state."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for w in tl.static_range(W):
        wt = tl.load(w_ptr + cols * W + w, mask=c_ok, other=0.0).to(tl.float32)
        pre += wt[None, :] * _load_xp(x_ptr, hist_ptr, b, ts + w, cols, T, C, W, HAS_INIT)
    y = pre * tl.sigmoid(pre)
    y_offs = (b * T + ts).to(tl.int64)[:, None] * C + cols[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=(ts[:, None] < T) & c_ok[None, :])
    if pid_t == tl.num_programs(1) - 1:
        # The new state is xp[T : T + W - 1], oldest first.
        js = tl.arange(0, BLOCK_S)
        s = _load_xp(x_ptr, hist_ptr, b, T + js, cols, T, C, W, HAS_INIT)
        s_offs = (b * C + cols[None, :]).to(tl.int64) * (W - 1) + js[:, None]
        tl.store(state_ptr + s_offs, s.to(state_ptr.dtype.element_ty), mask=(js[:, None] < W - 1) & c_ok[None, :])


@triton.jit
def _short_conv_dpre_kernel(
    gy_ptr, x_ptr, w_ptr, hist_ptr, dpre_ptr, part_ptr, T, C,
    W: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, SUB_T: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Backward pass 1, program (c-block, T-block, b): dpre = g_y SiLU'(pre) for output times [pid_t*BLOCK_T,
    +BLOCK_T) in SUB_T steps (pre recomputed from W shifted input tiles), stored in fp32, and this program's
    dweight partial sum_tau dpre[tau] xp[tau + w]."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    w_idx = tl.arange(0, BLOCK_W)
    acc_dw = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
    for t0 in range(pid_t * BLOCK_T, tl.minimum(pid_t * BLOCK_T + BLOCK_T, T), SUB_T):
        ts = t0 + tl.arange(0, SUB_T)
        pre = tl.zeros([SUB_T, BLOCK_C], dtype=tl.float32)
        for v in tl.static_range(W):
            wt = tl.load(w_ptr + cols * W + v, mask=c_ok, other=0.0).to(tl.float32)
            pre += wt[None, :] * _load_xp(x_ptr, hist_ptr, b, ts + v, cols, T, C, W, HAS_INIT)
        offs = (b * T + ts).to(tl.int64)[:, None] * C + cols[None, :]
        mask = (ts < T)[:, None] & c_ok[None, :]
        gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        dpre = gy * sig * (1.0 + pre * (1.0 - sig))
        tl.store(dpre_ptr + offs, dpre, mask=mask)
        for v in tl.static_range(W):
            xv = _load_xp(x_ptr, hist_ptr, b, ts + v, cols, T, C, W, HAS_INIT)
            acc_dw += tl.where(w_idx[:, None] == v, tl.sum(dpre * xv, axis=0)[None, :], 0.0)
    row = b * tl.num_programs(1) + pid_t
    p_offs = (row * W + w_idx[:, None]).to(tl.int64) * C + cols[None, :]
    tl.store(part_ptr + p_offs, acc_dw, mask=(w_idx[:, None] < W) & c_ok[None, :])


@triton.jit
def _short_conv_dx_kernel(
    dpre_ptr, gstate_ptr, w_ptr, dx_ptr, dinit_ptr, T, C,
    W: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Backward pass 2, program (c-block, block of padded positions, b): dxp[j] = sum_w weight[w] dpre[j - w]
    (+ g_state on the last W-1 positions), split into dx and d initial_state."""
    pid_c, pid_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    js = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    dxp = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for w in tl.static_range(W):
        tau = js - w
        wt = tl.load(w_ptr + cols * W + w, mask=c_ok, other=0.0).to(tl.float32)
        offs = (b * T + tau).to(tl.int64)[:, None] * C + cols[None, :]
        dp = tl.load(dpre_ptr + offs, mask=((tau >= 0) & (tau < T))[:, None] & c_ok[None, :], other=0.0)
        dxp += wt[None, :] * dp
    # The state output is xp[T : T + W - 1]: its gradient lands on those padded positions (the last tile's).
    if pid_t * BLOCK_T + BLOCK_T > T:
        i = js - T
        s_offs = (b * C + cols[None, :]).to(tl.int64) * (W - 1) + i[:, None]
        s_ok = ((i >= 0) & (i < W - 1))[:, None] & c_ok[None, :]
        dxp += tl.load(gstate_ptr + s_offs, mask=s_ok, other=0.0).to(tl.float32)
    t = js - (W - 1)
    dx_offs = (b * T + t).to(tl.int64)[:, None] * C + cols[None, :]
    tl.store(dx_ptr + dx_offs, dxp.to(dx_ptr.dtype.element_ty), mask=((t >= 0) & (t < T))[:, None] & c_ok[None, :])
    if HAS_INIT and pid_t * BLOCK_T < W - 1:  # the first W-1 positions are d initial_state [B, C, W-1]
        h_offs = (b * C + cols[None, :]).to(tl.int64) * (W - 1) + js[:, None]
        h_ok = (js >= 0) & (js < W - 1)
        tl.store(dinit_ptr + h_offs, dxp.to(dinit_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])


@triton.jit
def _short_conv_bwd_reduce_kernel(
    part_ptr, dw_ptr, R, C, W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """dweight[c, w] = sum over the R partial rows of part[r, w, c] (viewed [R, W*C]), in a fixed order."""
    qs = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = qs < W * C
    acc = tl.zeros([BLOCK_R, BLOCK_Q], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        offs = rs.to(tl.int64)[:, None] * (W * C) + qs[None, :]
        acc += tl.load(part_ptr + offs, mask=(rs[:, None] < R) & q_ok[None, :], other=0.0)
    dw = tl.sum(acc, axis=0)
    tl.store(dw_ptr + (qs % C) * W + qs // C, dw.to(dw_ptr.dtype.element_ty), mask=q_ok)


def short_conv(x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(SiLU(causal depthwise conv(x)) [B, T, C], state [B, C, W-1]) in x's dtype; contract of `short_conv_ref`."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    x = x_BTC.contiguous()
    weight = weight_CW.contiguous()
    init = None if initial_state_BCW is None else initial_state_BCW.contiguous()
    hist = None if init is None else init.transpose(1, 2).contiguous()  # [B, W-1, C]: rows like x's
    y = torch.empty_like(x)
    state = torch.empty(B, C, W - 1, dtype=x.dtype, device=x.device)
    cfg = launch_config("short_conv_fwd", x.device, {"BLOCK_T": 64, "BLOCK_C": 128, "num_warps": 4}, dtype=x.dtype,
                        T=T, C=C)
    grid = (triton.cdiv(C, cfg["BLOCK_C"]), triton.cdiv(T, cfg["BLOCK_T"]), B)
    _short_conv_fwd_kernel[grid](
        x, weight, x if hist is None else hist, y, state, T, C,
        W=W, HAS_INIT=init is not None, BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"],
        BLOCK_S=triton.next_power_of_2(W - 1), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
    )
    return y, state


def short_conv_bwd(
    grads: list[Tensor], x_BTC: Tensor, weight_CW: Tensor, initial_state_BCW: Tensor | None = None
) -> list[Tensor | None]:
    """[dx, dweight, d initial_state (None without one)] from grads = [g_y, g_state]; dweight is deterministic."""
    B, T, C = x_BTC.shape
    W = weight_CW.shape[-1]
    x = x_BTC.contiguous()
    weight = weight_CW.contiguous()
    init = None if initial_state_BCW is None else initial_state_BCW.contiguous()
    hist = None if init is None else init.transpose(1, 2).contiguous()  # [B, W-1, C]
    g_y, g_state = (g.contiguous() for g in grads)
    dx = torch.empty_like(x)
    dinit = None if init is None else torch.empty_like(init)
    cfg = launch_config(
        "short_conv_bwd", x.device, {"BLOCK_T": 256, "SUB_T": 16, "BLOCK_C": 128, "num_warps": 4}, dtype=x.dtype,
        T=T, C=C,
    )
    sub_t = min(cfg["SUB_T"], cfg["BLOCK_T"])
    n_t = triton.cdiv(T, cfg["BLOCK_T"])
    R = B * n_t
    part = torch.empty(R, W, C, dtype=torch.float32, device=x.device)
    dpre = torch.empty(B, T, C, dtype=torch.float32, device=x.device)
    if T:
        _short_conv_dpre_kernel[(triton.cdiv(C, cfg["BLOCK_C"]), n_t, B)](
            g_y, x, weight, x if hist is None else hist, dpre, part, T, C,
            W=W, HAS_INIT=init is not None, BLOCK_T=cfg["BLOCK_T"], SUB_T=sub_t, BLOCK_C=cfg["BLOCK_C"],
            BLOCK_W=triton.next_power_of_2(W), num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
        )
    xcfg = launch_config("short_conv_bwd_dx", x.device, {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4},
                         dtype=x.dtype, T=T, C=C)
    _short_conv_dx_kernel[(triton.cdiv(C, xcfg["BLOCK_C"]), triton.cdiv(T + W - 1, xcfg["BLOCK_T"]), B)](
        dpre, g_state, weight, dx, dx if dinit is None else dinit, T, C,
        W=W, HAS_INIT=init is not None, BLOCK_T=xcfg["BLOCK_T"], BLOCK_C=xcfg["BLOCK_C"],
        num_warps=xcfg["num_warps"], num_stages=xcfg.get("num_stages", 1),
    )
    dweight = torch.empty_like(weight)
    rcfg = launch_config("short_conv_bwd_reduce", x.device, {"BLOCK_R": 16, "BLOCK_Q": 256, "num_warps": 2},
                         dtype=x.dtype, R=R, C=C)
    _short_conv_bwd_reduce_kernel[(triton.cdiv(W * C, rcfg["BLOCK_Q"]),)](
        part, dweight, R, C,
        W=W, BLOCK_R=rcfg["BLOCK_R"], BLOCK_Q=rcfg["BLOCK_Q"], num_warps=rcfg["num_warps"],
        num_stages=rcfg.get("num_stages", 1),
    )
    return [dx, dweight.view(weight_CW.shape), dinit]
