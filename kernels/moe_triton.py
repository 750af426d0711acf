"""Triton grouped GEMMs for the MoE experts on fixed-capacity buffers [E, C, ...], forward and backward.

One program per (row tile, column tile) of one expert (grid axis 1 is the expert). The GLU forward keeps
two fp32 accumulators (gate and up) that share each loaded x tile and applies SiTU-GLU / SwiGLU in the
epilogue (kernels/triton_math.py's `glu`, the elementwise kernels' math), so gate and up never reach memory.
The MXFP4 variants read the packed e2m1 weight tiles and their E8M0 scales and dequantise them in registers.
The backward recomputes the gate/up tiles to get dgate/dup through the activation's derivative, then runs
plain grouped GEMMs: dx = dgate W_gate + dup W_up (one accumulator, two operand pairs) and dW = d^T x per
expert. References: kernels/experts.py.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
import torch
from torch import Tensor

from k3compile.kernels.activations import check_glu_kind
from k3compile.kernels.launch import interpreting, launch_config
from k3compile.kernels.mx import mx_dequant_meta
from k3compile.kernels.mx_tile_triton import dequant_e2m1_tile
from k3compile.kernels.triton_math import glu, glu_grad

_GEMM = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
_GLU = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}  # two accumulators
# Kernel defaults until bench/tune_gpu.py tunes them (module-level so tests can shrink the blocks).
DEFAULTS = {
    "expert_glu": dict(_GLU),
    "mx_expert_glu": dict(_GLU),
    "expert_glu_bwd": dict(_GLU),  # recompute gate/up, write dgate/dup
    "expert_matmul": dict(_GEMM),  # x W^T forward, and the backward's dx = d W (reduction over the feature dim)
    "mx_expert_matmul": dict(_GEMM),
    "expert_weight_grad": dict(_GEMM),  # dW = d^T x (reduction over the C capacity rows)
}
_BLOCKS = {"BLOCK_M": [64, 128], "BLOCK_N": [32, 64, 128], "BLOCK_K": [32, 64, 128]}
_STEPS = {"num_warps": [4, 8], "num_stages": [2, 3, 4]}
TUNABLE = {
    **{name: {**_BLOCKS, **_STEPS} for name in ("expert_glu", "mx_expert_glu", "expert_glu_bwd")},
    **{
        name: {**_BLOCKS, "BLOCK_N": [64, 128, 256], **_STEPS}
        for name in ("expert_matmul", "mx_expert_matmul", "expert_weight_grad")
    },
}


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b in fp32; operands go to fp32 under the interpreter (its bf16 dot is wrong) or when they differ."""
    if UPCAST or a.dtype != b.dtype:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _weight_tile(w_ptr, s_ptr, rn, k0, N, K, s_k, s_n, MX: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Rows rn, columns k0.. of one expert's weight W [N, K] as the dot's right operand W^T [BLOCK_K, BLOCK_N].

    MX: W is packed e2m1 [N, K/2] with E8M0 scales [N, K/BLOCK] (both contiguous), dequantised to fp32 here;
    padding lanes read code 0 with a finite scale, so they are exact zeros.
    Otherwise W[n, k] sits at n * s_n + k * s_k.
    """
    n_ok = rn < N
    if MX:
        kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + kp[None, :],
                         mask=n_ok[:, None] & (kp < K // 2)[None, :], other=0)
        scale = tl.load(s_ptr + rn[:, None] * (K // BLOCK) + ks[None, :],
                        mask=n_ok[:, None] & (ks < K // BLOCK)[None, :], other=127)
        w = tl.trans(dequant_e2m1_tile(packed, scale, BLOCK))
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + kk[:, None] * s_k + rn[None, :] * s_n, mask=(kk < K)[:, None] & n_ok[None, :], other=0.0)
    return w


@triton.jit
def _matched(w, a):
    """A dequantised fp32 weight tile in bf16 when the activations are bf16 (exact: e2m1 * 2^k fits bf16)."""
    if a.dtype == tl.bfloat16:
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def _glu_tiles(x_ptr, wg_ptr, wgs_ptr, wu_ptr, wus_ptr, rm, rn, M, N, K,
               MX: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (gate, up) tiles [BLOCK_M, BLOCK_N] = x[rm] @ W_gate[rn]^T, x[rm] @ W_up[rn]^T; x is [M, K] contiguous."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    m_ok = rm < M
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        wg = _weight_tile(wg_ptr, wgs_ptr, rn, k0, N, K, 1, K, MX, BLOCK, BLOCK_K)
        wu = _weight_tile(wu_ptr, wus_ptr, rn, k0, N, K, 1, K, MX, BLOCK, BLOCK_K)
        if MX:
            wg = _matched(wg, a)
            wu = _matched(wu, a)
        acc_g = _dot(a, wg, acc_g, UPCAST)
        acc_u = _dot(a, wu, acc_u, UPCAST)
    return acc_g, acc_u


@triton.jit
def _tile_ids(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, rows, cols) of this program; consecutive programs share a column (weight) tile."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(1).to(tl.int64), rm, rn


@triton.jit
def _expert_glu_kernel(
    x_ptr, wg_ptr, wgs_ptr, wu_ptr, wus_ptr, y_ptr, M, N, K, beta1, beta2,
    SITU: tl.constexpr, MX: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[e] = act(x[e] W_gate[e]^T, x[e] W_up[e]^T): x [E, M, K], weights [E, N, K] (or MX), y [E, M, N]."""
    e, rm, rn = _tile_ids(M, BLOCK_M, BLOCK_N)
    if MX:
        w_step = e * N * (K // 2)
        s_step = e * N * (K // BLOCK)
    else:
        w_step = e * N * K
        s_step = w_step
    g, u = _glu_tiles(x_ptr + e * M * K, wg_ptr + w_step, wgs_ptr + s_step, wu_ptr + w_step, wus_ptr + s_step,
                      rm, rn, M, N, K, MX, BLOCK, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    y = glu(g, u, beta1, beta2, SITU)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + e * M * N + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expert_glu_bwd_kernel(
    x_ptr, wg_ptr, wu_ptr, dy_ptr, dg_ptr, du_ptr, M, N, K, beta1, beta2,
    SITU: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Recompute the gate/up tiles and write dgate, dup [E, M, N] from the output cotangent dy [E, M, N]."""
    e, rm, rn = _tile_ids(M, BLOCK_M, BLOCK_N)
    w_step = e * N * K
    g, u = _glu_tiles(x_ptr + e * M * K, wg_ptr + w_step, wg_ptr, wu_ptr + w_step, wu_ptr,
                      rm, rn, M, N, K, False, 32, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = e * M * N + rm[:, None] * N + rn[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dg, du = glu_grad(g, u, dy, beta1, beta2, SITU)
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, bs_ptr, a2_ptr, b2_ptr, c_ptr, M, N, K,
    sa_e, sa_m, sa_k, sb_e, sb_k, sb_n,
    HAS2: tl.constexpr, MX: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[e] = a[e] @ b[e] (+ a2[e] @ b2[e]) -> c [E, M, N] contiguous, fp32 accumulation.

    a[e][m, k] at e * sa_e + m * sa_m + k * sa_k, b[e][k, n] at e * sb_e + k * sb_k + n * sb_n (a2, b2 alike).
    MX: b[e] = W[e]^T for a packed e2m1 W [E, N, K/2] (sb_e = N * K / 2) with E8M0 scales bs [E, N, K/BLOCK].
    """
    e, rm, rn = _tile_ids(M, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    m_ok = rm < M
    a_rows = e * sa_e + rm[:, None] * sa_m
    s_base = bs_ptr + e * N * (K // BLOCK)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a_offs = a_rows + kk[None, :] * sa_k
        a_mask = m_ok[:, None] & (kk < K)[None, :]
        a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
        b = _weight_tile(b_ptr + e * sb_e, s_base, rn, k0, N, K, sb_k, sb_n, MX, BLOCK, BLOCK_K)
        if MX:
            b = _matched(b, a)
        acc = _dot(a, b, acc, UPCAST)
        if HAS2:
            a2 = tl.load(a2_ptr + a_offs, mask=a_mask, other=0.0)
            b2 = _weight_tile(b2_ptr + e * sb_e, s_base, rn, k0, N, K, sb_k, sb_n, False, BLOCK, BLOCK_K)
            acc = _dot(a2, b2, acc, UPCAST)
    mask = m_ok[:, None] & (rn < N)[None, :]
    tl.store(c_ptr + e * M * N + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def _config(name: str, device: torch.device, E: int, M: int, N: int, K: int) -> dict:
    return launch_config(name, device, DEFAULTS[name], E=E, M=M, N=N, K=K)


def _grid(cfg: dict, E: int, M: int, N: int) -> tuple[int, int]:
    return triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), E


def _mx_block_k(cfg: dict, block: int) -> int:
    """BLOCK_K for an MX kernel: whole scale blocks per tile, a power of two of them."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"the MX Triton kernels need a power-of-two block size, got {block}")
    return max(cfg["BLOCK_K"], block)


def _grouped_mm(
    name: str, out: Tensor, K: int, a: Tensor, sa: tuple[int, int, int], b: Tensor, sb: tuple[int, int, int],
    a2: Tensor | None = None, b2: Tensor | None = None, scale: Tensor | None = None, block: int = 32,
) -> Tensor:
    """Launch `_grouped_mm_kernel` into out [E, M, N] (a2/b2: a second product summed in; scale: b is MXFP4)."""
    E, M, N = out.shape
    if out.numel() == 0:
        return out
    cfg = _config(name, out.device, E, M, N, K)
    mx = scale is not None
    block_k = _mx_block_k(cfg, block) if mx else cfg["BLOCK_K"]
    _grouped_mm_kernel[_grid(cfg, E, M, N)](
        a, b, scale if mx else b, a if a2 is None else a2, b if b2 is None else b2, out, M, N, K, *sa, *sb,
        HAS2=a2 is not None, MX=mx, BLOCK=block, UPCAST=interpreting(),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _launch_glu(
    name: str, x: Tensor, wg: Tensor, wgs: Tensor, wu: Tensor, wus: Tensor, N: int, mx: bool, block: int,
    kind: str, beta1: float, beta2: float,
) -> Tensor:
    check_glu_kind(kind, "expert GLU")
    E, M, K = x.shape
    y = torch.empty(E, M, N, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    cfg = _config(name, x.device, E, M, N, K)
    _expert_glu_kernel[_grid(cfg, E, M, N)](
        x, wg, wgs, wu, wus, y, M, N, K, float(beta1), float(beta2),
        SITU=kind == "situ_glu", MX=mx, BLOCK=block, UPCAST=interpreting(),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=_mx_block_k(cfg, block) if mx else cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y


def _any_expert_dims(fn):
    """Let a wrapper take [..., rows, cols] tensors: leading dims (experts, or ranks x experts after
    shard_experts' rank-major view) fold into the kernel's one expert dim and unfold in the results."""

    def fold(t):
        if isinstance(t, Tensor):
            return t.flatten(0, t.dim() - 3)
        if isinstance(t, list):
            return [fold(g) for g in t]
        return t

    @functools.wraps(fn)
    def wrapper(*args):
        lead = next(a for a in args if isinstance(a, Tensor)).shape[:-2]
        out = fn(*(fold(a) for a in args))
        if isinstance(out, list):
            return [g if g is None else g.reshape(*lead, *g.shape[-2:]) for g in out]
        return out.reshape(*lead, *out.shape[-2:])

    return wrapper


@_any_expert_dims
def expert_glu(x_ECw: Tensor, w_gate_EIw: Tensor, w_up_EIw: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    """act(x W_gate^T, x W_up^T) per expert -> [E, C, I] in x's dtype; gate/up stay in registers."""
    wg, wu = w_gate_EIw.contiguous(), w_up_EIw.contiguous()
    return _launch_glu("expert_glu", x_ECw.contiguous(), wg, wg, wu, wu, wg.shape[1], False, 32, kind, beta1, beta2)


@_any_expert_dims
def mx_expert_glu(
    x_ECw: Tensor,
    gate_data: Tensor,
    gate_scale: Tensor,
    up_data: Tensor,
    up_scale: Tensor,
    block: int,
    kind: str,
    beta1: float,
    beta2: float,
) -> Tensor:
    """`expert_glu` with MXFP4 gate/up weights ([E, I, w/2] uint8 + [E, I, w/block] E8M0), dequantised in registers."""
    E, _, K = x_ECw.shape
    for data, scale in ((gate_data, gate_scale), (up_data, up_scale)):
        if tuple(mx_dequant_meta(data.shape, scale.shape, "e2m1", block)) != (E, gate_data.shape[1], K):
            raise ValueError(f"MXFP4 weight {tuple(data.shape)} does not match x {tuple(x_ECw.shape)}")
    return _launch_glu(
        "mx_expert_glu", x_ECw.contiguous(), gate_data.contiguous(), gate_scale.contiguous(), up_data.contiguous(),
        up_scale.contiguous(), gate_data.shape[1], True, block, kind, beta1, beta2,
    )


@_any_expert_dims
def expert_matmul(x_ECI: Tensor, w_EwI: Tensor) -> Tensor:
    """x @ w^T per expert: [E, C, I] x [E, w, I] -> [E, C, w] in x's dtype."""
    x, w = x_ECI.contiguous(), w_EwI.contiguous()
    E, C, I = x.shape
    W = w.shape[1]
    out = torch.empty(E, C, W, dtype=x.dtype, device=x.device)
    return _grouped_mm("expert_matmul", out, I, x, (C * I, I, 1), w, (W * I, 1, I))


@_any_expert_dims
def mx_expert_matmul(x_ECI: Tensor, data: Tensor, scale: Tensor, block: int) -> Tensor:
    """`expert_matmul` with an MXFP4 weight ([E, w, I/2] uint8 + [E, w, I/block] E8M0), dequantised in registers."""
    x = x_ECI.contiguous()
    E, C, I = x.shape
    W = data.shape[1]
    if tuple(mx_dequant_meta(data.shape, scale.shape, "e2m1", block)) != (E, W, I):
        raise ValueError(f"MXFP4 weight {tuple(data.shape)} does not match x {tuple(x.shape)}")
    out = torch.empty(E, C, W, dtype=x.dtype, device=x.device)
    return _grouped_mm(
        "mx_expert_matmul", out, I, x, (C * I, I, 1), data.contiguous(), (W * (I // 2), 0, 0),
        scale=scale.contiguous(), block=block,
    )


@_any_expert_dims
def expert_glu_bwd(
    grads: list[Tensor], x_ECw: Tensor, w_gate_EIw: Tensor, w_up_EIw: Tensor, kind: str, beta1: float, beta2: float
) -> list[Tensor | None]:
    """[dx, dw_gate, dw_up] of `expert_glu` for the output cotangent grads[0] [E, C, I].

    Recomputes gate/up per tile for dgate/dup (stored in x's dtype), then dx = dgate W_gate + dup W_up and
    dW_gate = dgate^T x, dW_up = dup^T x per expert.
    """
    check_glu_kind(kind, "expert GLU")
    x, wg, wu = x_ECw.contiguous(), w_gate_EIw.contiguous(), w_up_EIw.contiguous()
    dy = grads[0].contiguous()
    E, C, W = x.shape
    I = wg.shape[1]
    dg = torch.empty(E, C, I, dtype=x.dtype, device=x.device)
    du = torch.empty_like(dg)
    if dg.numel():
        cfg = _config("expert_glu_bwd", x.device, E, C, I, W)
        _expert_glu_bwd_kernel[_grid(cfg, E, C, I)](
            x, wg, wu, dy, dg, du, C, I, W, float(beta1), float(beta2),
            SITU=kind == "situ_glu", UPCAST=interpreting(),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    dx = torch.empty_like(x)
    _grouped_mm("expert_matmul", dx, I, dg, (C * I, I, 1), wg, (I * W, W, 1), a2=du, b2=wu)
    dwg, dwu = (torch.empty(E, I, W, dtype=w.dtype, device=w.device) for w in (wg, wu))
    for dw, d in ((dwg, dg), (dwu, du)):
        _grouped_mm("expert_weight_grad", dw, C, d, (C * I, 1, I), x, (C * W, W, 1))
    return [dx, dwg, dwu]


@_any_expert_dims
def expert_matmul_bwd(grads: list[Tensor], x_ECI: Tensor, w_EwI: Tensor) -> list[Tensor | None]:
    """[dx, dw] of `expert_matmul` for the output cotangent grads[0] [E, C, w]: dx = dy w, dw = dy^T x per expert."""
    x, w = x_ECI.contiguous(), w_EwI.contiguous()
    dy = grads[0].contiguous()
    E, C, I = x.shape
    W = w.shape[1]
    dx = _grouped_mm("expert_matmul", torch.empty_like(x), W, dy, (C * W, W, 1), w, (W * I, I, 1))
    dw = _grouped_mm("expert_weight_grad", torch.empty_like(w), C, dy, (C * W, 1, W), x, (C * I, I, 1))
    return [dx, dw]
