"""Triton kernels for KDA's decay gate g = gate(f + dt_bias, exp(A_log)) and its backward.

The gate is elementwise over f viewed as [N = B*T, P = H*K]; column p belongs to head p // K. Forward and
backward are single passes over f (bandwidth-bound). The parameter gradients reduce over the N tokens in two
deterministic stages: each (row-block, column-block) program writes per-column partial sums, then one
program per head adds the row blocks in a fixed order and also sums its K columns into dA_log.
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

FORMS = {"lower_bounded_sigmoid": 0, "softplus": 1}

TUNABLE = {
    "kda_gate_fwd": {"BLOCK_N": [4, 8, 16, 32], "BLOCK_P": [256, 512, 1024], "num_warps": [2, 4, 8]},
    "kda_gate_bwd": {
        "BLOCK_N": [64, 128, 256, 512],
        "SUB_N": [4, 8, 16],
        "BLOCK_P": [256, 512, 1024],
        "num_warps": [2, 4, 8],
    },
    "kda_gate_bwd_reduce": {"BLOCK_R": [8, 16, 32, 64], "num_warps": [1, 2, 4]},
}


def _form_id(form: str) -> int:
    if form not in FORMS:
        raise ValueError(f"unknown KDA decay form {form!r}; expected one of {tuple(FORMS)}")
    return FORMS[form]


@triton.jit
def _softplus(x):
    """log(1 + e^x): x itself above torch's threshold 20, and the log1p trick keeps very negative x exact."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    # log1p(u) = log(w) * u / (w - 1) recovers the bits of u lost when rounding 1 + u.
    rounded_away = w == 1.0
    log1p_u = tl.where(rounded_away, u, tl.log(w) * (u / tl.where(rounded_away, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, log1p_u)


@triton.jit
def _gate_params(a_log_ptr, dt_bias_ptr, cols, P, K):
    """Per column: dt_bias and a = exp(A_log[head]) in fp32."""
    col_ok = cols < P
    bias = tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(a_log_ptr + cols // K, mask=col_ok, other=0.0).to(tl.float32))
    return bias, a


@triton.jit
def _gate_input(f_ptr, bias, rows, cols, N, P):
    """The fp32 tile x = f + dt_bias, its element offsets and its mask."""
    mask = (rows[:, None] < N) & (cols[None, :] < P)
    offs = rows[:, None].to(tl.int64) * P + cols[None, :]
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return f + bias[None, :], offs, mask


@triton.jit
def _kda_gate_fwd_kernel(
    f_ptr, a_log_ptr, dt_bias_ptr, g_ptr, N, P, K, lower_bound,
    FORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """g (fp32) for a [BLOCK_N, BLOCK_P] tile: lower_bound sigmoid(a x) (FORM 0) or -a softplus(x) (FORM 1)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    bias, a = _gate_params(a_log_ptr, dt_bias_ptr, cols, P, K)
    x, offs, mask = _gate_input(f_ptr, bias, rows, cols, N, P)
    if FORM == 0:
        g = lower_bound * tl.sigmoid(a[None, :] * x)
    else:
        g = -a[None, :] * _softplus(x)
    tl.store(g_ptr + offs, g, mask=mask)


@triton.jit
def _kda_gate_bwd_kernel(
    dg_ptr, f_ptr, a_log_ptr, dt_bias_ptr, df_ptr, part_dx_ptr, part_da_ptr, N, P, K, lower_bound,
    FORM: tl.constexpr, BLOCK_N: tl.constexpr, SUB_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """df for BLOCK_N rows (in SUB_N-row steps) and this block's per-column partial sums of dx and dA_log."""
    pid_n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    acc_dx = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc_da = tl.zeros([BLOCK_P], dtype=tl.float32)
    bias, a = _gate_params(a_log_ptr, dt_bias_ptr, cols, P, K)
    for r0 in range(0, BLOCK_N, SUB_N):
        rows = pid_n * BLOCK_N + r0 + tl.arange(0, SUB_N)
        x, offs, mask = _gate_input(f_ptr, bias, rows, cols, N, P)
        dg = tl.load(dg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FORM == 0:
            s = tl.sigmoid(a[None, :] * x)
            ds = dg * (lower_bound * s * (1.0 - s))  # d g / d(a x)
            dx = ds * a[None, :]
            da = ds * x * a[None, :]  # chain through a = exp(A_log)
        else:
            sp = _softplus(x)
            dx = -dg * a[None, :] * tl.sigmoid(x)
            da = -dg * a[None, :] * sp
        tl.store(df_ptr + offs, dx.to(df_ptr.dtype.element_ty), mask=mask)
        acc_dx += tl.sum(dx, axis=0)
        acc_da += tl.sum(da, axis=0)
    col_ok = cols < P
    tl.store(part_dx_ptr + pid_n * P + cols, acc_dx, mask=col_ok)
    tl.store(part_da_ptr + pid_n * P + cols, acc_da, mask=col_ok)


@triton.jit
def _kda_gate_bwd_reduce_kernel(
    part_dx_ptr, part_da_ptr, ddt_bias_ptr, da_log_ptr, R, P, K,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One head: ddt_bias[h*K:(h+1)*K] = sum of the row-block partials, dA_log[h] = their sum over K too."""
    h = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    acc_dx = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    acc_da = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        mask = (rs[:, None] < R) & k_ok[None, :]
        offs = rs[:, None] * P + h * K + ks[None, :]
        acc_dx += tl.load(part_dx_ptr + offs, mask=mask, other=0.0)
        acc_da += tl.load(part_da_ptr + offs, mask=mask, other=0.0)
    dbias = tl.sum(acc_dx, axis=0)
    tl.store(ddt_bias_ptr + h * K + ks, dbias.to(ddt_bias_ptr.dtype.element_ty), mask=k_ok)
    tl.store(da_log_ptr + h, tl.sum(tl.sum(acc_da, axis=1), axis=0).to(da_log_ptr.dtype.element_ty))


def kda_gate(f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str, lower_bound: float) -> Tensor:
    """Log decay g (fp32, [B, T, H, K]) from the gate projection f; same contract as `kda.kda_gate_ref`."""
    form_id = _form_id(form)
    H, K = f_BTHK.shape[-2:]
    P = H * K
    f = f_BTHK.contiguous()
    N = f.numel() // P
    g = torch.empty(f.shape, dtype=torch.float32, device=f.device)
    cfg = launch_config("kda_gate_fwd", f.device, {"BLOCK_N": 8, "BLOCK_P": 512, "num_warps": 4}, dtype=f.dtype,
                        N=N, P=P)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(P, cfg["BLOCK_P"]))
    _kda_gate_fwd_kernel[grid](
        f, A_log_H.contiguous(), dt_bias_P.contiguous(), g, N, P, K, float(lower_bound),
        FORM=form_id, BLOCK_N=cfg["BLOCK_N"], BLOCK_P=cfg["BLOCK_P"], num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 1),
    )
    return g


def kda_gate_bwd(
    grads: list[Tensor], f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str, lower_bound: float
) -> list[Tensor | None]:
    """[df (f's dtype), dA_log [H], ddt_bias [H*K]] from grads = [dg]; parameter sums are deterministic."""
    form_id = _form_id(form)
    H, K = f_BTHK.shape[-2:]
    P = H * K
    f = f_BTHK.contiguous()
    N = f.numel() // P
    dg = grads[0].contiguous()
    df = torch.empty_like(f)
    cfg = launch_config(
        "kda_gate_bwd", f.device, {"BLOCK_N": 256, "SUB_N": 8, "BLOCK_P": 512, "num_warps": 4}, dtype=f.dtype,
        N=N, P=P,
    )
    R = triton.cdiv(N, cfg["BLOCK_N"])
    part_dx = torch.empty(R, P, dtype=torch.float32, device=f.device)
    part_da = torch.empty(R, P, dtype=torch.float32, device=f.device)
    _kda_gate_bwd_kernel[(R, triton.cdiv(P, cfg["BLOCK_P"]))](
        dg, f, A_log_H.contiguous(), dt_bias_P.contiguous(), df, part_dx, part_da, N, P, K, float(lower_bound),
        FORM=form_id, BLOCK_N=cfg["BLOCK_N"], SUB_N=cfg["SUB_N"], BLOCK_P=cfg["BLOCK_P"],
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
    )
    dA_log = torch.empty(H, dtype=A_log_H.dtype, device=f.device)
    ddt_bias = torch.empty(P, dtype=dt_bias_P.dtype, device=f.device)
    rcfg = launch_config("kda_gate_bwd_reduce", f.device, {"BLOCK_R": 16, "num_warps": 2}, R=R, K=K)
    _kda_gate_bwd_reduce_kernel[(H,)](
        part_dx, part_da, ddt_bias, dA_log, R, P, K,
        BLOCK_R=rcfg["BLOCK_R"], BLOCK_K=triton.next_power_of_2(K), num_warps=rcfg["num_warps"],
        num_stages=rcfg.get("num_stages", 1),
    )
    return [df, dA_log, ddt_bias.view(dt_bias_P.shape)]
