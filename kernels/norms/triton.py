"""Triton kernels for the normalisations of kernels/norms/reference.py: RMSNorm, L2 norm, gated RMSNorm, add + RMSNorm.

Row-wise over the last dim: each program holds BLOCK_M whole rows (BLOCK_N = next power of two >= N) in
registers, reduces in fp32 and writes the input dtype (bf16 rounded to nearest-even on the bits, so
add_rms_norm's sum matches torch bit for bit in the interpreter too). One forward and one backward kernel serve all four
ops through constexpr flags, so each op still compiles to its own specialised kernel. The weight gradient
is deterministic: every backward program sums its rows into one fp32 partial row, and a second kernel adds
the partial rows column by column in a fixed order (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config, sm_count
from k3compile.kernels._common.triton_math import round_to, sigmoid

MAX_N = 65536  # a whole row lives in registers; the norms in K3 are at most a few thousand wide
MAX_TILE = 16384  # BLOCK_M * BLOCK_N cap: a tuned BLOCK_M is lowered to fit (wide rows take one row a program)

_FWD_OPS = ("rms_norm", "l2_norm", "rms_norm_gate", "add_rms_norm")
_ROW_SPACE = {"BLOCK_M": [1, 2, 4, 8, 16, 32, 64], "num_warps": [1, 2, 4, 8, 16, 32]}
TUNABLE = {
    **{op: dict(_ROW_SPACE) for op in _FWD_OPS},
    **{f"{op}_bwd": {**_ROW_SPACE, "PROGRAMS": [132, 264, 528, 1056, 2112]} for op in _FWD_OPS if op != "l2_norm"},
    "l2_norm_bwd": dict(_ROW_SPACE),
    "norm_col_sum": {"BLOCK_P": [8, 16, 32, 64], "BLOCK_N": [32, 64, 128, 256, 512], "num_warps": [1, 2, 4, 8]},
}

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _norm_fwd_kernel(x_ptr, res_ptr, w_ptr, gate_ptr, y_ptr, sum_ptr, M, N, eps,
                     HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr,
                     MEAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = [x (+ res, rounded)] * rsqrt(mean-or-sum(x^2) + eps) [* w] [* sigmoid(gate)] for BLOCK_M rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + r, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs, s, mask=mask)
        x = s.to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if MEAN:
        ss = ss / N
    y = x * tl.rsqrt(tl.where(rows < M, ss + eps, 1.0))[:, None]  # padded rows: no rsqrt(0) when eps == 0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_GATE:
        y = y * sigmoid(tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(y_ptr + offs, round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(gy_ptr, gs_ptr, x_ptr, res_ptr, w_ptr, gate_ptr, dx_ptr, dres_ptr, dgate_ptr, dw_part_ptr,
                     M, N, eps, SUM_DTYPE: tl.constexpr,
                     HAS_RES: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr,
                     MEAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Gradients of _norm_fwd_kernel's y (and of the sum) for the rows pid*BLOCK_M + k*programs*BLOCK_M.

    With xh = x * inv and gw = dy [* w] [* sigmoid(gate)]: dx = inv * (gw - xh * mean-or-sum(gw * xh)),
    dw = sum over rows of dy [* sigmoid(gate)] * xh (one fp32 partial row per program), and
    dgate = dy * xh * w * s * (1 - s) (a gate comes with a weight). With a residual the sum's own gradient
    is added to dx, = dres.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = round_to(x + r, SUM_DTYPE).to(tl.float32)
        gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=1)
        if MEAN:
            ss = ss / N
        inv = tl.rsqrt(tl.where(rows < M, ss + eps, 1.0))[:, None]
        xh = x * inv
        if HAS_GATE:
            sg = sigmoid(tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32))
            dgate = gy * xh * w * sg * (1.0 - sg)
            tl.store(dgate_ptr + offs, round_to(dgate, dgate_ptr.dtype.element_ty), mask=mask)
            gy = gy * sg
        if HAS_WEIGHT:
            dw_acc += gy * xh
            gw = gy * w
        else:
            gw = gy
        c = tl.sum(gw * xh, axis=1)
        if MEAN:
            c = c / N
        dx = inv * (gw - xh * c[:, None])
        if HAS_RES:
            dx += tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dres_ptr + offs, round_to(dx, dres_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + offs, round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@triton.jit
def _col_sum_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum over p of part[p, n] (fp32, fixed order), for one BLOCK_N slice of columns."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, round_to(tl.sum(acc, axis=0), out_ptr.dtype.element_ty), mask=cols < N)


def _row_config(kernel: str, x: Tensor, M: int, N: int, tile: int, per_thread: int,
                extra: dict | None = None) -> dict:
    """Launch config for a row kernel: whole rows of BLOCK_N, by default BLOCK_M rows to make about `tile`
    elements and enough warps for `per_thread` elements per thread (the backward holds more per element)."""
    if N > MAX_N:
        raise ValueError(f"{kernel}: last dim {N} exceeds {MAX_N}, the widest row a program holds")
    block_n = triton.next_power_of_2(max(N, 1))
    block_m = max(1, min(64, tile // block_n))
    warps = max(1, min(16, block_m * block_n // (32 * per_thread)))
    defaults = {"BLOCK_M": block_m, "num_warps": warps, "num_stages": 1, **(extra or {})}
    cfg = launch_config(kernel, x.device, defaults, dtype=x.dtype, M=M, N=N)
    return {**cfg, "BLOCK_M": min(cfg["BLOCK_M"], max(1, MAX_TILE // block_n)), "BLOCK_N": block_n}


def _forward(op: str, x: Tensor, residual: Tensor | None, weight: Tensor | None, gate: Tensor | None,
             eps: float, mean: bool) -> tuple[Tensor, Tensor | None]:
    """Launch the forward kernel over x viewed as [M, N]; returns (y, sum or None)."""
    N = x.shape[-1]
    xc = x.contiguous()
    M = xc.numel() // N if N else 0
    if weight is not None and weight.shape != (N,):
        raise ValueError(f"{op}: weight shape {tuple(weight.shape)} != ({N},)")
    s = None
    if residual is not None:
        residual = residual.contiguous()
        s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    y = torch.empty(x.shape, dtype=s.dtype if s is not None else x.dtype, device=x.device)
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"{op}: gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
        gate = gate.contiguous()
    if M == 0 or N == 0:
        if s is not None:
            s.copy_(x + residual)
        return y, s
    cfg = _row_config(op, x, M, N, tile=2048, per_thread=16)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]),)
    _norm_fwd_kernel[grid](
        xc, residual if residual is not None else xc, weight.contiguous() if weight is not None else xc,
        gate if gate is not None else xc, y, s if s is not None else y, M, N, eps,
        HAS_RES=residual is not None, HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None, MEAN=mean,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y, s


def _backward(op: str, g_y: Tensor, g_s: Tensor | None, x: Tensor, residual: Tensor | None,
              weight: Tensor | None, gate: Tensor | None, eps: float, mean: bool):
    """Launch the backward kernel (and the dweight column sum); returns (dx, dres, dweight, dgate)."""
    N = x.shape[-1]
    xc, gy = x.contiguous(), g_y.contiguous()
    M = xc.numel() // N if N else 0
    dx = torch.empty_like(xc)
    dres = torch.empty_like(residual, memory_format=torch.contiguous_format) if residual is not None else None
    dgate = torch.empty_like(gate, memory_format=torch.contiguous_format) if gate is not None else None
    dw = torch.zeros_like(weight, memory_format=torch.contiguous_format) if weight is not None else None
    if M == 0 or N == 0:
        for t in (dx, dres, dgate):
            if t is not None:
                t.zero_()
        if g_s is not None:
            dx.copy_(g_s)
            dres.copy_(g_s)
        return dx, dres, dw, dgate
    sum_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    extra = {"PROGRAMS": 4 * sm_count(x.device)} if weight is not None else {}  # 4 programs per SM
    cfg = _row_config(f"{op}_bwd", x, M, N, tile=1024, per_thread=8, extra=extra)
    row_blocks = triton.cdiv(M, cfg["BLOCK_M"])
    programs = min(row_blocks, cfg["PROGRAMS"]) if weight is not None else row_blocks
    part = torch.empty((programs, N), dtype=torch.float32, device=x.device) if weight is not None else dx
    _norm_bwd_kernel[(programs,)](
        gy, g_s.contiguous() if g_s is not None else gy, xc,
        residual.contiguous() if residual is not None else xc, weight.contiguous() if weight is not None else xc,
        gate.contiguous() if gate is not None else xc, dx, dres if dres is not None else dx,
        dgate if dgate is not None else dx, part, M, N, eps, SUM_DTYPE=_TL_DTYPES[sum_dtype],
        HAS_RES=residual is not None, HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None, MEAN=mean,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if weight is not None:
        csum = launch_config("norm_col_sum", x.device, {"BLOCK_P": 32, "BLOCK_N": 128, "num_warps": 4},
                             dtype=x.dtype, P=programs, N=N)
        _col_sum_kernel[(triton.cdiv(N, csum["BLOCK_N"]),)](
            part, dw, programs, N, BLOCK_P=csum["BLOCK_P"], BLOCK_N=csum["BLOCK_N"], num_warps=csum["num_warps"])
    return dx, dres, dw, dgate


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 statistics, in x's dtype."""
    return _forward("rms_norm", x, None, weight, None, eps, mean=True)[0]


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in x's dtype."""
    return _forward("l2_norm", x, None, None, None, eps, mean=False)[0]


def rms_norm_gate(x: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * sigmoid(gate) in one pass, in x's dtype (gate has x's shape)."""
    return _forward("rms_norm_gate", x, None, weight, gate, eps, mean=True)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual); the sum is rounded to its dtype before the norm, as unfused."""
    y, s = _forward("add_rms_norm", x, residual, weight, None, eps, mean=True)
    return y, s


def rms_norm_bwd(grads: list[Tensor], x: Tensor, weight: Tensor, eps: float) -> list[Tensor | None]:
    """[dx, dweight] of rms_norm for grads = [dy]."""
    dx, _, dw, _ = _backward("rms_norm", grads[0], None, x, None, weight, None, eps, mean=True)
    return [dx, dw]


def l2_norm_bwd(grads: list[Tensor], x: Tensor, eps: float) -> list[Tensor | None]:
    """[dx] of l2_norm for grads = [dy]."""
    return [_backward("l2_norm", grads[0], None, x, None, None, None, eps, mean=False)[0]]


def rms_norm_gate_bwd(grads: list[Tensor], x: Tensor, weight: Tensor, gate: Tensor,
                      eps: float) -> list[Tensor | None]:
    """[dx, dweight, dgate] of rms_norm_gate for grads = [dy]."""
    dx, _, dw, dgate = _backward("rms_norm_gate", grads[0], None, x, None, weight, gate, eps, mean=True)
    return [dx, dw, dgate]


def add_rms_norm_bwd(grads: list[Tensor], x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> list[Tensor | None]:
    """[dx, dresidual, dweight] of add_rms_norm for grads = [d normed, d sum]; dx and dresidual are equal values
    in two tensors (each in its argument's dtype)."""
    dx, dres, dw, _ = _backward("add_rms_norm", grads[0], grads[1], x, residual, weight, None, eps, mean=True)
    return [dx, dres, dw]
