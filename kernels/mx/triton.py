"""Triton kernels for the OCP MX ops: quantise, dequantise, fake-quantise (QAT) and the MX-weight linear.

The quantisers give the bits of kernels/mx/reference.py's references (rounding by integer arithmetic on fp32 bits in
kernels/mx/tile_triton.py). They view x [..., n] as rows of one MX block each, [n_blocks, block], padded to
a power of two, so any block size that divides n works. Inputs: fp32 / bf16 / fp16.

`mx_linear` with an MXFP4 weight and bf16 operands (bf16 x, or x fake-quantised to an MX format, exact in bf16)
picks by the number of rows M (launch-config key BUFFER_M): a large M (training, prefill) dequantises W once
into a bf16 buffer and runs kernels/_common/gemm_triton.py's TMA-fed bf16 GEMM (the dequantisation costs a pass over
W, a few percent of a GEMM with thousands of rows); a small M (decoding) decodes W in registers inside the
GEMM, W x^T with the weight as wgmma's register operand (gemm_triton.mx_mm). fp32 or fp16 x, fp8 weights and
tl.dot_scaled (launch-config key DOT_SCALED: native MX tensor cores on compute capability >= 10, the default
there; needs block 32) run `_mx_linear_kernel`, which dequantises W in registers before a tl.dot. The
backward (dx = grad_y dequant(W)) takes the bf16 buffer for a large M too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.gemm_triton import grouped_mm, mx_mm
from k3compile.kernels._common.launch import capability, gemm_shared, interpreting, launch_config
from k3compile.kernels.mx.reference import _FP8_DTYPES, FAST_DTYPES, check_mx_shape, mx_dequant_meta, mx_format, mx_quant_meta
from k3compile.kernels.mx.tile_triton import (
    dequant_e2m1_tile,
    dequant_fp8_tile,
    fake_quantize_tile,
    mx_encode_tile,
    mx_format_constexprs,
    mx_scale_tile,
    pack_e2m1_tile,
    to_fp32,
)
from k3compile.kernels._common.triton_math import round_to

TUNABLE = {
    "mx_quantize": {"BLOCKS": [32, 64, 128, 256], "num_warps": [2, 4, 8]},
    "mx_fake_quantize": {"BLOCKS": [32, 64, 128, 256], "num_warps": [2, 4, 8]},
    "mx_dequantize": {"BLOCKS": [32, 64, 128, 256], "num_warps": [2, 4, 8]},
    "mx_linear": {
        "BUFFER_M": [256, 1024, 4096],
        "DOT_SCALED": [0, 1],
        "BLOCK_M": [64, 128, 256],
        "BLOCK_N": [64, 128, 256],
        "BLOCK_K": [32, 64],
        "GROUP_M": [8],
        "num_warps": [4, 8],
        "num_stages": [3, 4, 5],
    },
    "mx_linear_gemm": {
        "BLOCK_M": [64, 128],
        "BLOCK_N": [128, 256],
        "BLOCK_K": [32, 64],
        "num_warps": [4, 8],
        "num_stages": [3, 4],
    },
    "mx_linear_fp32": {
        "DOT_SCALED": [0, 1],
        "BLOCK_M": [32, 64, 128],
        "BLOCK_N": [32, 64, 128],
        "BLOCK_K": [32, 64],
        "GROUP_M": [8],
        "num_warps": [4, 8],
        "num_stages": [2, 3],
    },
    "mx_linear_bwd": {
        "BUFFER_M": [256, 1024, 4096],
        "BLOCK_M": [64, 128],
        "BLOCK_N": [32, 64, 128],
        "BLOCK_K": [64, 128, 256],
        "GROUP_M": [8],
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
    },
}

_ELEMWISE_DEFAULTS = {"BLOCKS": 64, "num_warps": 4}


def _check_dtype(x: Tensor) -> None:
    if x.dtype not in FAST_DTYPES:
        raise TypeError(f"the Triton MX kernels take fp32/bf16/fp16, got {x.dtype} (use the PyTorch reference)")


def _block_grid(n_blocks: int, block: int, kernel: str, device, dtype) -> tuple[dict, tuple, int]:
    """Launch config, grid and the padded block width for a per-block kernel over n_blocks blocks."""
    cfg = launch_config(kernel, device, _ELEMWISE_DEFAULTS, dtype=dtype, N=n_blocks * block)
    return cfg, (triton.cdiv(n_blocks, cfg["BLOCKS"]),), triton.next_power_of_2(block)


@triton.jit
def _block_tile(pid, N_BLOCKS, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BP2: tl.constexpr, WIDTH: tl.constexpr):
    """Row (block) ids [BLOCKS, 1], column ids [1, WIDTH] and the in-range mask of a tile of whole blocks."""
    rows = (pid * BLOCKS + tl.arange(0, BLOCKS))[:, None]
    cols = tl.arange(0, WIDTH)[None, :]
    return rows, cols, (rows < N_BLOCKS) & (cols < BLOCK * WIDTH // BP2)


@triton.jit
def _mx_quantize_kernel(x_ptr, data_ptr, scale_ptr, N_BLOCKS, BLOCK: tl.constexpr, E2M1: tl.constexpr,
                        MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr,
                        BLOCKS: tl.constexpr, BP2: tl.constexpr):
    """Payload (e2m1 codes packed in pairs, or fp8 bytes) and E8M0 bytes of BLOCKS blocks."""
    pid = tl.program_id(0)
    rows, cols, mask = _block_tile(pid, N_BLOCKS, BLOCK, BLOCKS, BP2, BP2)
    x = to_fp32(tl.load(x_ptr + rows.to(tl.int64) * BLOCK + cols, mask=mask, other=0.0))
    byte = mx_scale_tile(x, EMAX, BP2)
    code = mx_encode_tile(x, byte, 4 if E2M1 else 8, MBITS, EMIN, MAXV, BP2)
    if E2M1:
        prow, pcol, pmask = _block_tile(pid, N_BLOCKS, BLOCK, BLOCKS, BP2, BP2 // 2)
        tl.store(data_ptr + prow.to(tl.int64) * (BLOCK // 2) + pcol, pack_e2m1_tile(code), mask=pmask)
    else:
        tl.store(data_ptr + rows.to(tl.int64) * BLOCK + cols, code.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + rows, byte.to(tl.uint8), mask=rows < N_BLOCKS)


@triton.jit
def _mx_fake_quantize_kernel(x_ptr, out_ptr, N_BLOCKS, BLOCK: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                             EMAX: tl.constexpr, MAXV: tl.constexpr, BLOCKS: tl.constexpr, BP2: tl.constexpr):
    """dequant(quant(x)) of BLOCKS blocks in one pass, stored in the output's dtype (one rounding)."""
    rows, cols, mask = _block_tile(tl.program_id(0), N_BLOCKS, BLOCK, BLOCKS, BP2, BP2)
    offs = rows.to(tl.int64) * BLOCK + cols
    x = to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    y = fake_quantize_tile(x, MBITS, EMIN, EMAX, MAXV, BP2)
    tl.store(out_ptr + offs, round_to(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mx_dequantize_kernel(data_ptr, scale_ptr, out_ptr, N_BLOCKS, BLOCK: tl.constexpr, E2M1: tl.constexpr,
                          BLOCKS: tl.constexpr, BP2: tl.constexpr):
    """Values of BLOCKS blocks: payload decoded in registers times 2^(scale - 127), in the output's dtype."""
    pid = tl.program_id(0)
    rows, cols, mask = _block_tile(pid, N_BLOCKS, BLOCK, BLOCKS, BP2, BP2)
    scale = tl.load(scale_ptr + rows, mask=rows < N_BLOCKS, other=0)
    if E2M1:
        prow, pcol, pmask = _block_tile(pid, N_BLOCKS, BLOCK, BLOCKS, BP2, BP2 // 2)
        packed = tl.load(data_ptr + prow.to(tl.int64) * (BLOCK // 2) + pcol, mask=pmask, other=0)
        y = dequant_e2m1_tile(packed, scale, BP2)
    else:
        payload = tl.load(data_ptr + rows.to(tl.int64) * BLOCK + cols, mask=mask, other=0.0)
        y = dequant_fp8_tile(payload, scale, BP2)
    tl.store(out_ptr + rows.to(tl.int64) * BLOCK + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def mx_quantize(x: Tensor, fmt: str, block: int = 32) -> tuple[Tensor, Tensor]:
    """`mx_quantize_ref` on Triton: (payload, E8M0 scales uint8 [..., n/block]), the same bits."""
    _check_dtype(x)
    data_shape, data_dtype, scale_shape = mx_quant_meta(x.shape, fmt, block)
    data = torch.empty(data_shape, dtype=data_dtype, device=x.device)
    scale = torch.empty(scale_shape, dtype=torch.uint8, device=x.device)
    n_blocks = scale.numel()
    if n_blocks:
        cfg, grid, bp2 = _block_grid(n_blocks, block, "mx_quantize", x.device, x.dtype)
        _mx_quantize_kernel[grid](
            x.contiguous(), data.view(torch.uint8), scale, n_blocks, block, E2M1=fmt == "e2m1",
            **mx_format_constexprs(fmt), BLOCKS=cfg["BLOCKS"], BP2=bp2, num_warps=cfg["num_warps"],
        )
    return data, scale


def mx_dequantize(data: Tensor, scale: Tensor, fmt: str, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """`mx_dequantize_ref` on Triton: values [..., n] in `dtype` (fp32/bf16/fp16), NaN for 0xFF blocks."""
    shape = mx_dequant_meta(data.shape, scale.shape, fmt, block)
    if dtype not in FAST_DTYPES:
        raise TypeError(f"the Triton MX dequantise writes fp32/bf16/fp16, got {dtype}")
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if fmt != "e2m1" and data.dtype == torch.uint8:
        data = data.view(_FP8_DTYPES[fmt])
    n_blocks = scale.numel()
    if n_blocks:
        cfg, grid, bp2 = _block_grid(n_blocks, block, "mx_dequantize", data.device, dtype)
        _mx_dequantize_kernel[grid](
            data.contiguous(), scale.contiguous(), out, n_blocks, block, E2M1=fmt == "e2m1",
            BLOCKS=cfg["BLOCKS"], BP2=bp2, num_warps=cfg["num_warps"],
        )
    return out


def mx_fake_quantize(x: Tensor, fmt: str, block: int = 32) -> Tensor:
    """`mx_fake_quantize_ref` on Triton in one pass (no payload in memory): x's dtype, the same bits."""
    _check_dtype(x)
    check_mx_shape(x.shape[-1], fmt, block)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_blocks = x.numel() // block
    if n_blocks:
        cfg, grid, bp2 = _block_grid(n_blocks, block, "mx_fake_quantize", x.device, x.dtype)
        _mx_fake_quantize_kernel[grid](
            x.contiguous(), out, n_blocks, block, **mx_format_constexprs(fmt),
            BLOCKS=cfg["BLOCKS"], BP2=bp2, num_warps=cfg["num_warps"],
        )
    return out


# ---------------------------------------------------------------------------------------------
# Linear: y = x @ dequant(W)^T, W [N, K] in MX blocks along K; dx = grad_y @ dequant(W).


@triton.jit
def _swizzle(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in groups of GROUP_M row tiles, so neighbouring programs share W tiles in L2."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _below(idx, limit, ALWAYS: tl.constexpr):
    """idx < limit, or an all-true constant when ALWAYS (the tiles divide the extent), so loads stay vectorised."""
    if ALWAYS:
        ok = tl.full(idx.shape, 1, tl.int1)
    else:
        ok = idx < limit
    return ok


@triton.jit
def _load_w_tile(data_ptr, scale_ptr, n, nmask, k, K, E2M1: tl.constexpr, MX_BLOCK: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 W tile [R, BLOCK_K] for rows n [R, 1] (int64, in W where nmask) and columns k.., dequantised;
    zero outside W."""
    sc = k // MX_BLOCK + tl.arange(0, BLOCK_K // MX_BLOCK)[None, :]
    scale = tl.load(scale_ptr + n * (K // MX_BLOCK) + sc, mask=nmask & _below(sc, K // MX_BLOCK, EVEN_K), other=0)
    if E2M1:
        kc = k // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
        packed = tl.load(data_ptr + n * (K // 2) + kc, mask=nmask & _below(kc, K // 2, EVEN_K), other=0)
        w = dequant_e2m1_tile(packed, scale, MX_BLOCK)
    else:
        kc = k + tl.arange(0, BLOCK_K)[None, :]
        payload = tl.load(data_ptr + n * K + kc, mask=nmask & _below(kc, K, EVEN_K), other=0.0)
        w = dequant_fp8_tile(payload, scale, MX_BLOCK)
    return w


@triton.jit
def _mx_linear_kernel(x_ptr, data_ptr, scale_ptr, y_ptr, M, N, K, E2M1: tl.constexpr, W_FMT: tl.constexpr,
                      ACT: tl.constexpr, A_FMT: tl.constexpr, A_BITS: tl.constexpr, MBITS: tl.constexpr,
                      EMIN: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr, MX_BLOCK: tl.constexpr,
                      DOT_SCALED: tl.constexpr, DOT_BF16: tl.constexpr, SPLITS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """y tile [BLOCK_M, BLOCK_N] = x @ dequant(W)^T with fp32 accumulation, x optionally MX fake-quantised.

    Dequant path: W decoded to fp32 in registers, then a bf16 tl.dot when both operands are exact in bf16
    (DOT_BF16: bf16 x, or fake-quantised x, whose elements have <= 4 significant bits), else fp32 "ieee".
    dot_scaled path (MX_BLOCK 32): W goes in as its payload + scales; x as bf16, split into SPLITS bf16
    terms that sum to it (3 for fp32, 2 for fp16), or with ACT as its own MX payload + scales (A_FMT).
    """
    pid_m, pid_n = _swizzle(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
    m64 = m.to(tl.int64)
    n64 = n.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kx = k + tl.arange(0, BLOCK_K)[None, :]
        xa = tl.load(x_ptr + m64 * K + kx, mask=(m < M) & _below(kx, K, EVEN_K), other=0.0)
        if DOT_SCALED:
            sc = k // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
            w_scale = tl.load(scale_ptr + n64 * (K // 32) + sc, mask=(n < N) & _below(sc, K // 32, EVEN_K), other=0)
            kw = (k // (1 + E2M1) + tl.arange(0, BLOCK_K // (1 + E2M1)))[:, None]
            # rhs [K, N] (e2m1 packed along K); dot_scaled takes fp8 as its bits
            w_bytes = data_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
            w = tl.load(w_bytes + tl.trans(n64) * (K // (1 + E2M1)) + kw,
                        mask=(tl.trans(n) < N) & _below(kw, K // (1 + E2M1), EVEN_K), other=0)
            if ACT:
                xf = to_fp32(xa)
                byte = mx_scale_tile(xf, EMAX, 32)
                code = mx_encode_tile(xf, byte, A_BITS, MBITS, EMIN, MAXV, 32)
                if A_BITS == 4:
                    lhs = pack_e2m1_tile(code)
                else:
                    lhs = code.to(tl.uint8)
                acc = tl.dot_scaled(lhs, byte.to(tl.uint8), A_FMT, w, w_scale, W_FMT, acc)
            else:
                r = to_fp32(xa)
                for _ in tl.static_range(SPLITS):
                    part = r.to(tl.bfloat16)
                    acc = tl.dot_scaled(part, None, "bf16", w, w_scale, W_FMT, acc)
                    r = r - to_fp32(part)
        else:
            w = _load_w_tile(data_ptr, scale_ptr, n64, n < N, k, K, E2M1, MX_BLOCK, BLOCK_K, EVEN_K)
            if ACT:
                xa = fake_quantize_tile(to_fp32(xa), MBITS, EMIN, EMAX, MAXV, MX_BLOCK)
            if DOT_BF16:
                acc = tl.dot(xa.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(to_fp32(xa), tl.trans(w), acc, input_precision="ieee")
    nt = tl.trans(n)
    tl.store(y_ptr + m64 * N + nt, round_to(acc, y_ptr.dtype.element_ty), mask=(m < M) & (nt < N))


@triton.jit
def _mx_linear_bwd_kernel(g_ptr, data_ptr, scale_ptr, dx_ptr, M, N, K, E2M1: tl.constexpr, MX_BLOCK: tl.constexpr,
                          DOT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_N: tl.constexpr):
    """dx tile [BLOCK_M, BLOCK_K] = grad_y @ dequant(W), reducing over the N outputs; fp32 accumulation."""
    pid_m, pid_k = _swizzle(M, K, BLOCK_M, BLOCK_K, GROUP_M)
    m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    m64 = m.to(tl.int64)
    k = pid_k * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        nr = n0 + tl.arange(0, BLOCK_N)
        g = tl.load(g_ptr + m64 * N + nr[None, :], mask=(m < M) & _below(nr[None, :], N, EVEN_N), other=0.0)
        n_in = _below(nr[:, None], N, EVEN_N)
        w = _load_w_tile(data_ptr, scale_ptr, nr[:, None].to(tl.int64), n_in, k, K, E2M1, MX_BLOCK, BLOCK_K, False)
        if DOT_BF16:
            acc = tl.dot(g.to(tl.bfloat16), w.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(to_fp32(g), w, acc, input_precision="ieee")
    kx = k + tl.arange(0, BLOCK_K)[None, :]
    tl.store(dx_ptr + m64 * K + kx, round_to(acc, dx_ptr.dtype.element_ty), mask=(m < M) & (kx < K))


def _native_dot_scaled(device: torch.device) -> bool:
    """tl.dot_scaled has MX tensor cores on compute capability >= 10 (B200); elsewhere it upcasts."""
    return capability(device) >= 100


# Rows from which the weight is dequantised into a bf16 buffer once (the pass over W, ~4.5 bytes a weight, is then
# under ~10% of the GEMM's time on an H200), and the dense GEMM's tiles for it (as moe_triton's expert GEMMs).
_BUFFER_M = 1024
_GEMM_TILES = {True: (256, 128, 64, 8, 4), False: (128, 128, 32, 8, 4)}  # by compute capability >= 9
_SWAP_TILES = {True: (256, 128, 32, 8, 4), False: (128, 64, 32, 4, 3)}  # in-register MXFP4: tokens x weight rows
_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def shared_bytes(name: str, cfg: dict, sizes: dict, dtype: torch.dtype) -> int | None:
    """Shared memory of an MX linear kernel under `cfg` (bench/tune_gpu.py rejects a candidate over the device's
    limit before timing it): its pipelined x and weight tiles (MXFP4 weights half a byte a value)."""
    if name not in ("mx_linear", "mx_linear_gemm", "mx_linear_fp32", "mx_linear_bwd"):
        return None
    e = 2 if name in ("mx_linear", "mx_linear_gemm") else torch.empty((), dtype=dtype).element_size()
    w = 2 if name == "mx_linear_gemm" else 1  # the dense GEMM reads the bf16 buffer; the others, fp8 or e2m1 bytes
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if name == "mx_linear_bwd":  # dx tile [BLOCK_M, BLOCK_K] over BLOCK_N-wide steps
        return gemm_shared(BM, BK, BN, cfg["num_stages"], e, w)
    return gemm_shared(BM, BN, BK, cfg["num_stages"], e, w)


def _gemm_config(device: torch.device, M: int, N: int, K: int) -> dict:
    defaults = dict(zip(_TILE_KEYS, _GEMM_TILES[capability(device) >= 90]))
    return launch_config("mx_linear_gemm", device, defaults, dtype=torch.bfloat16, M=M, N=N, K=K)


def _bf16_weight(data: Tensor, scale: Tensor, block: int) -> Tensor:
    """dequant(W) [1, N, K] in bf16 (exact: an e2m1 value times a power of two)."""
    return mx_dequantize(data, scale, "e2m1", block, torch.bfloat16)[None]


def _linear_operands(x: Tensor, data: Tensor, scale: Tensor, fmt: str, block: int, act_fmt: str | None):
    """Checked (payload (fp8 viewed as its dtype), scale, N, K) for the linear kernels."""
    _check_dtype(x)
    n_out, k_in = mx_dequant_meta(data.shape, scale.shape, fmt, block)
    if data.dim() != 2 or x.shape[-1] != k_in:
        raise ValueError(f"mx_linear needs W [out, in], in = x's last dim; got x {tuple(x.shape)}, W {n_out}x{k_in}")
    if block & (block - 1):
        raise ValueError(f"the Triton mx_linear needs a power-of-two block, got {block}")
    if act_fmt is not None:
        check_mx_shape(k_in, act_fmt, block)
    if fmt != "e2m1" and data.dtype == torch.uint8:
        data = data.view(_FP8_DTYPES[fmt])
    return data.contiguous(), scale.contiguous(), n_out, k_in


def mx_linear(
    x: Tensor, data: Tensor, scale: Tensor, fmt: str = "e2m1", block: int = 32, act_fmt: str | None = None
) -> Tensor:
    """`mx_linear_ref` on Triton: y = x @ dequant(W)^T, W [out, in] MX along `in`, fp32 accumulation, x's dtype.

    act_fmt fake-quantises x's blocks first. The launch config picks the path (module docstring): BUFFER_M,
    DOT_SCALED (default on compute capability >= 10; only for block 32).
    """
    data, scale, n_out, k_in = _linear_operands(x, data, scale, fmt, block, act_fmt)
    x2 = x.reshape(-1, k_in).contiguous()
    m_rows = x2.shape[0]
    bf16_operands = x.dtype == torch.bfloat16 or act_fmt is not None  # x exact in bf16
    name = "mx_linear" if bf16_operands else "mx_linear_fp32"
    fast = capability(x.device) >= 90
    if bf16_operands:
        swap = fmt == "e2m1" and not _native_dot_scaled(x.device)
        tiles = _SWAP_TILES[fast] if swap else (128, 128, 64, 8, 3)
    else:
        tiles = (64, 64, 32, 8, 2)  # no register spills on sm_90/sm_100
    defaults = dict(zip(_TILE_KEYS, tiles))
    defaults.update(DOT_SCALED=int(_native_dot_scaled(x.device)), GROUP_M=8, BUFFER_M=_BUFFER_M)
    cfg = launch_config(name, x.device, defaults, dtype=x.dtype, M=m_rows, N=n_out, K=k_in)
    dot_scaled = bool(cfg["DOT_SCALED"]) and block == 32
    if bf16_operands and fmt == "e2m1" and not dot_scaled and m_rows and n_out:
        xb = x2 if act_fmt is None else mx_fake_quantize(x2, act_fmt, block)
        xb = xb.to(torch.bfloat16)  # exact: bf16 x, or at most 4 significant bits
        if m_rows >= cfg["BUFFER_M"]:
            y = torch.empty((1, m_rows, n_out), dtype=x.dtype, device=x.device)
            grouped_mm(y, k_in, xb[None], _bf16_weight(data, scale, block), False, True,
                       _gemm_config(x.device, m_rows, n_out, k_in))
        else:
            cfg["BLOCK_M"] = min(cfg["BLOCK_M"], max(16, triton.next_power_of_2(m_rows)))
            y = mx_mm(xb[None], data[None], scale[None], block, cfg, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], n_out)
    y = torch.empty((m_rows, n_out), dtype=x.dtype, device=x.device)
    block_k = max(cfg["BLOCK_K"], block)
    if m_rows and n_out:
        act = mx_format_constexprs(act_fmt or "e4m3")
        grid = (triton.cdiv(m_rows, cfg["BLOCK_M"]) * triton.cdiv(n_out, cfg["BLOCK_N"]),)
        _mx_linear_kernel[grid](
            x2, data, scale, y, m_rows, n_out, k_in, E2M1=fmt == "e2m1", W_FMT=fmt, ACT=act_fmt is not None,
            A_FMT=act_fmt or "e4m3", A_BITS=mx_format(act_fmt or "e4m3").bits, **act, MX_BLOCK=block,
            DOT_SCALED=dot_scaled, DOT_BF16=bf16_operands and not interpreting(),
            SPLITS={torch.float32: 3, torch.float16: 2, torch.bfloat16: 1}[x.dtype],
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
            EVEN_K=k_in % block_k == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return y.view(*x.shape[:-1], n_out)


def mx_linear_bwd(
    grads: list[Tensor], x: Tensor, data: Tensor, scale: Tensor, fmt: str = "e2m1", block: int = 32,
    act_fmt: str | None = None,
) -> list[Tensor | None]:
    """[dx] of `mx_linear`: dx = grad_y @ dequant(W) in x's dtype (straight-through for the activation quant)."""
    data, scale, n_out, k_in = _linear_operands(x, data, scale, fmt, block, act_fmt)
    g = grads[0].reshape(-1, n_out).contiguous()
    m_rows = g.shape[0]
    bf16 = g.dtype == torch.bfloat16
    tiles = (128, 64, 128, 8, 3) if bf16 else (64, 32, 64, 8, 2)
    defaults = dict(zip(_TILE_KEYS, tiles), GROUP_M=8, BUFFER_M=_BUFFER_M)
    cfg = launch_config("mx_linear_bwd", x.device, defaults, dtype=g.dtype, M=m_rows, N=n_out, K=k_in)
    if bf16 and fmt == "e2m1" and x.dtype == torch.bfloat16 and m_rows >= cfg["BUFFER_M"] and k_in:
        dx = torch.empty((1, m_rows, k_in), dtype=x.dtype, device=x.device)
        grouped_mm(dx, n_out, g[None], _bf16_weight(data, scale, block), False, False,
                   _gemm_config(x.device, m_rows, k_in, n_out))
        return [dx.view(x.shape)]
    dx = torch.empty((m_rows, k_in), dtype=x.dtype, device=x.device)
    block_k = max(cfg["BLOCK_K"], block)
    if m_rows and k_in:
        grid = (triton.cdiv(m_rows, cfg["BLOCK_M"]) * triton.cdiv(k_in, block_k),)
        _mx_linear_bwd_kernel[grid](
            g, data, scale, dx, m_rows, n_out, k_in, E2M1=fmt == "e2m1", MX_BLOCK=block,
            DOT_BF16=bf16 and not interpreting(), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
            GROUP_M=cfg["GROUP_M"], EVEN_N=n_out % cfg["BLOCK_N"] == 0, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return [dx.view(x.shape)]
