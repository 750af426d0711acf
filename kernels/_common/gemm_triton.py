"""Grouped GEMM cores of the expert and MX-weight kernels: E independent products over [E, rows, cols] buffers.

Dense operands (`grouped_mm`, `glu_mm`): bf16 / fp16 / fp32 in, fp32 accumulation on tensor cores (fp32 as TF32
on GPUs, input_precision "tf32"; IEEE fp32 under the interpreter). On compute capability >= 9, and in the
interpreter, the operands stream through TMA tensor descriptors over the 3-D buffers: the hardware zero-fills
past each expert's rows and the reduction's tail, so a tile never mixes experts, and Triton's pipeline keeps
num_stages tiles in flight straight into wgmma's shared-memory operands. Elsewhere (A100), or where a stride is
not a multiple of 16 bytes, the same loop runs on masked pointer loads. A second product (a2 @ b2, the GLU
backward's dx) is a second K loop into the same accumulator, so it needs no more shared memory than one.
`glu_mm` holds two accumulators (gate and up) over one shared x tile and applies the GLU (forward) or its
derivative (backward: dgate, dup) in the epilogue.

MXFP4 weights (`mx_mm`): y[e] = x[e] W[e]^T (or the GLU of two weights) with W packed e2m1 [E, N, K/2] and E8M0
scales [E, N, K/block]. The kernel computes y^T = W x^T, so the dequantised weight tile is wgmma's register
operand A: each BLOCK_K step decodes BLOCK_N weight rows in registers (bit arithmetic and two exact multiplies,
kernels/mx/tile_triton.py) while the previous step's wgmma is still running (one group in flight), and x
streams through TMA as the shared-memory operand B. Tokens are wgmma's N dimension: a decode step with a few
tokens still fills the 64-row minimum with weight rows, and a tile of BLOCK_M tokens decodes each weight once
per BLOCK_M tokens (with 256, once per K3 expert capacity). The scales of a step come from one 4-byte load per
row (four E8M0 bytes a word) so they pipeline with the rest.

Every launcher takes its launch configuration from the caller (the op's own key in kernels/_common/configs/), clamped
to the device's shared memory by `fit`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from k3compile.kernels._common.launch import capability, fit_shared, gemm_shared, interpreting, shared_limit
from k3compile.kernels.mx.tile_triton import dequant_e2m1_tile
from k3compile.kernels._common.triton_math import glu, glu_grad


@triton.jit
def _load_tile(src, e, r0, c0, R, C, s_e, TMA: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Tile [ROWS, COLS] at (r0, c0) of expert e's [R, C] slice of a contiguous [E, R, C] operand (zeros outside):
    a TMA descriptor load, or masked pointer loads (src[e, r, c] at e * s_e + r * C + c)."""
    if TMA:
        tile = src.load([e, r0, c0]).reshape(ROWS, COLS)
    else:
        r = r0 + tl.arange(0, ROWS)
        c = c0 + tl.arange(0, COLS)
        offs = e.to(tl.int64) * s_e + r[:, None] * C + c[None, :]
        tile = tl.load(src + offs, mask=(r < R)[:, None] & (c < C)[None, :], other=0.0)
    return tile


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b with fp32 accumulation: fp32 operands under the interpreter (its bf16 dot is wrong) or when
    the two dtypes differ; fp32 operands at PREC ("tf32" on GPUs, "ieee" for exact fp32)."""
    if UPCAST or a.dtype != b.dtype:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _a_tile(a, e, m0, k0, M, K, s_e, A_T: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """Left operand tile [BLOCK_M, BLOCK_K]: a[e] stored [M, K], or [K, M] when A_T."""
    if A_T:
        t = tl.trans(_load_tile(a, e, k0, m0, K, M, s_e, TMA, BLOCK_K, BLOCK_M))
    else:
        t = _load_tile(a, e, m0, k0, M, K, s_e, TMA, BLOCK_M, BLOCK_K)
    return t


@triton.jit
def _b_tile(b, e, k0, n0, K, N, s_e, B_T: tl.constexpr, TMA: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Right operand tile [BLOCK_K, BLOCK_N]: b[e] stored [K, N], or [N, K] (a weight W, for x W^T) when B_T."""
    if B_T:
        t = tl.trans(_load_tile(b, e, n0, k0, N, K, s_e, TMA, BLOCK_N, BLOCK_K))
    else:
        t = _load_tile(b, e, k0, n0, K, N, s_e, TMA, BLOCK_K, BLOCK_N)
    return t


@triton.jit
def _dense_loop(a, b, acc, e, m0, n0, M, N, K, sa_e, sb_e, A_T: tl.constexpr, B_T: tl.constexpr,
                TMA: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a[e][m0.., :] @ b[e][:, n0..] over the whole reduction, one pipelined K loop."""
    for k0 in range(0, K, BLOCK_K):
        at = _a_tile(a, e, m0, k0, M, K, sa_e, A_T, TMA, BLOCK_M, BLOCK_K)
        bt = _b_tile(b, e, k0, n0, K, N, sb_e, B_T, TMA, BLOCK_K, BLOCK_N)
        acc = _mma(at, bt, acc, UPCAST, PREC)
    return acc


@triton.jit
def _store_tile(c, tile, e, m0, n0, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the fp32 tile [BLOCK_M, BLOCK_N] at (m0, n0) of c[e] ([E, M, N] contiguous) in c's dtype.

    Masked pointer stores, also where the loads use TMA: with a TMA store in the epilogue, the ptxas of CUDA 12.8
    (Triton 3.6's) serialises the main loop's wgmma pipeline of an 8-warp kernel.
    """
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    offs = e.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(c + offs, tile.to(c.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tile_origin(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, m0, n0) of this program; consecutive programs share a column tile (the weight, in x W^T)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    return tl.program_id(1), (pid % num_m) * BLOCK_M, (pid // num_m) * BLOCK_N


@triton.jit
def _gemm_kernel(
    a, b, a2, b2, c, M, N, K, sa_e, sb_e,
    A_T: tl.constexpr, B_T: tl.constexpr, HAS2: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[e] = a[e] @ b[e] (+ a2[e] @ b2[e], same layouts and strides) -> c [E, M, N]."""
    e, m0, n0 = _tile_origin(M, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dense_loop(a, b, acc, e, m0, n0, M, N, K, sa_e, sb_e, A_T, B_T, TMA, UPCAST, PREC,
                      BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS2:
        acc = _dense_loop(a2, b2, acc, e, m0, n0, M, N, K, sa_e, sb_e, A_T, B_T, TMA, UPCAST, PREC,
                          BLOCK_M, BLOCK_N, BLOCK_K)
    _store_tile(c, acc, e, m0, n0, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def _halves(t):
    """(even columns, odd columns) of the tile t [R, C]."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    return tl.split(tl.reshape(t, (R, C // 2, 2)))


@triton.jit
def _interleave(even, odd):
    """The tile whose even columns are `even` and odd columns `odd` (the inverse of `_halves`)."""
    R: tl.constexpr = even.shape[0]
    C: tl.constexpr = even.shape[1]
    return tl.reshape(tl.join(even, odd), (R, 2 * C))


@triton.jit
def _glu_kernel(
    x, wg, wu, dy, y, y2, M, N, K, sx_e, sw_e, beta1, beta2,
    BWD: tl.constexpr, SITU: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """gate, up = x[e] W_gate[e]^T, x[e] W_up[e]^T ([E, M, K] x [E, N, K]) sharing each x tile; then
    y = act(gate, up) (forward) or, with the cotangent dy [E, M, N], (y, y2) = (dgate, dup) (BWD)."""
    e, m0, n0 = _tile_origin(M, BLOCK_M, BLOCK_N)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = _load_tile(x, e, m0, k0, M, K, sx_e, TMA, BLOCK_M, BLOCK_K)
        acc_g = _mma(xt, _b_tile(wg, e, k0, n0, K, N, sw_e, True, TMA, BLOCK_K, BLOCK_N), acc_g, UPCAST, PREC)
        acc_u = _mma(xt, _b_tile(wu, e, k0, n0, K, N, sw_e, True, TMA, BLOCK_K, BLOCK_N), acc_u, UPCAST, PREC)
    # The epilogue's activation runs on the even and the odd columns in turn (each thread holds column pairs, so the
    # split and join move no data): half the temporaries are live at once.
    g0, g1 = _halves(acc_g)
    u0, u1 = _halves(acc_u)
    if BWD:
        d0, d1 = _halves(_load_tile(dy, e, m0, n0, M, N, M * N, TMA, BLOCK_M, BLOCK_N).to(tl.float32))
        dg0, du0 = glu_grad(g0, u0, d0, beta1, beta2, SITU)
        dg1, du1 = glu_grad(g1, u1, d1, beta1, beta2, SITU)
        _store_tile(y, _interleave(dg0, dg1), e, m0, n0, M, N, BLOCK_M, BLOCK_N)
        _store_tile(y2, _interleave(du0, du1), e, m0, n0, M, N, BLOCK_M, BLOCK_N)
    else:
        y0 = glu(g0, u0, beta1, beta2, SITU)
        y1 = glu(g1, u1, beta1, beta2, SITU)
        _store_tile(y, _interleave(y0, y1), e, m0, n0, M, N, BLOCK_M, BLOCK_N)


@triton.jit
def _mx_weight_tile(w, s, w_rows, s_rows, n_ok, k0, K, BLOCK: tl.constexpr, SCALE_WORDS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """fp32 tile [BLOCK_N, BLOCK_K] of an MXFP4 weight: packed codes at w + w_rows (bytes, K/2 a row) and E8M0
    scales at s + s_rows (bytes, K/BLOCK a row; int32 words, K/(4 BLOCK) a row, when SCALE_WORDS)."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w + w_rows + kp[None, :], mask=n_ok[:, None] & (kp < K // 2)[None, :], other=0)
    kb = k0 // BLOCK
    if SCALE_WORDS:  # the step's scales sit in one word: a 4-byte load per row, bytes picked by shifts
        word = tl.load(s.to(tl.pointer_type(tl.int32), bitcast=True) + s_rows + kb // 4, mask=n_ok[:, None],
                       other=0x7F7F7F7F)
        scale = (word >> (8 * (kb % 4 + tl.arange(0, BLOCK_K // BLOCK))[None, :])) & 0xFF
    else:
        ks = kb + tl.arange(0, BLOCK_K // BLOCK)
        scale = tl.load(s + s_rows + ks[None, :], mask=n_ok[:, None] & (ks < K // BLOCK)[None, :], other=127)
    return dequant_e2m1_tile(packed, scale, BLOCK)


@triton.jit
def _like_bf16(w, x):
    """The decoded fp32 weight tile in bf16 when x is bf16 (exact: e2m1 times a power of two fits bf16's range and
    significand); other activations meet it in fp32 (IEEE products: an fp16 range cannot hold every scale)."""
    if x.dtype == tl.bfloat16:
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def _mx_kernel(
    x, wg, sg, wu, su, y, M, N, K, sx_e, beta1, beta2,
    GLU: tl.constexpr, SITU: tl.constexpr, BLOCK: tl.constexpr, SCALE_WORDS: tl.constexpr, TMA: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[e] = x[e] W[e]^T, or act(x W_gate^T, x W_up^T) when GLU, with MXFP4 weights ([E, N, K/2] codes and
    [E, N, K/BLOCK] scales), as the transposed tile acc [BLOCK_N weight rows, BLOCK_M tokens] = W x^T."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    m0 = (pid % num_m) * BLOCK_M  # consecutive programs share the weight rows: their tiles meet in L2
    n0 = (pid // num_m) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_rows = (e.to(tl.int64) * N + rn[:, None]) * (K // 2)
    if SCALE_WORDS:
        s_rows = (e.to(tl.int64) * N + rn[:, None]) * (K // (4 * BLOCK))
    else:
        s_rows = (e.to(tl.int64) * N + rn[:, None]) * (K // BLOCK)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.trans(_load_tile(x, e, m0, k0, M, K, sx_e, TMA, BLOCK_M, BLOCK_K))
        w = _mx_weight_tile(wg, sg, w_rows, s_rows, n_ok, k0, K, BLOCK, SCALE_WORDS, BLOCK_K)
        acc_g = _mma(_like_bf16(w, xt), xt, acc_g, UPCAST, "ieee")
        if GLU:
            w = _mx_weight_tile(wu, su, w_rows, s_rows, n_ok, k0, K, BLOCK, SCALE_WORDS, BLOCK_K)
            acc_u = _mma(_like_bf16(w, xt), xt, acc_u, UPCAST, "ieee")
    if GLU:  # on the even and the odd columns in turn, as in _glu_kernel
        g0, g1 = _halves(acc_g)
        u0, u1 = _halves(acc_u)
        acc_g = _interleave(glu(g0, u0, beta1, beta2, SITU), glu(g1, u1, beta1, beta2, SITU))
    _store_tile(y, tl.trans(acc_g), e, m0, n0, M, N, BLOCK_M, BLOCK_N)


def use_tma(device: torch.device, *tensors: Tensor) -> bool:
    """Whether operands can stream through TMA descriptors: compute capability >= 9 or the interpreter, every
    tensor contiguous with 16-byte aligned base and rows."""
    if not (interpreting() or capability(device) >= 90):
        return False
    for t in tensors:
        if not t.is_contiguous() or (t.shape[-1] * t.element_size()) % 16 or t.numel() == 0:
            return False
        if t.device.type != "meta" and t.data_ptr() % 16:
            return False
    return True


def _desc(t: Tensor, block: list[int], tma: bool):
    """A TMA descriptor over the contiguous 3-D tensor t with this block, or t itself for pointer loads."""
    return TensorDescriptor.from_tensor(t, block) if tma else t


def precision(dtype: torch.dtype) -> str:
    """input_precision of a dense product: TF32 tensor cores for fp32 on GPUs, IEEE fp32 in the interpreter."""
    return "ieee" if interpreting() or dtype != torch.float32 else "tf32"


def fit(cfg: dict, device: torch.device, elem_a: int, elem_b: int) -> dict:
    """cfg with stages, then BLOCK_K and BLOCK_N, reduced until the pipelined operand tiles of one product fit the
    device's shared memory (the epilogue's tile reuses the freed pipeline buffers)."""

    def need(c):
        return gemm_shared(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], elem_a, elem_b)

    return fit_shared(cfg, shared_limit(device), need, ("BLOCK_K", "BLOCK_N"))


def grouped_mm(
    out: Tensor, K: int, a: Tensor, b: Tensor, a_t: bool, b_t: bool, cfg: dict,
    a2: Tensor | None = None, b2: Tensor | None = None,
) -> Tensor:
    """out [E, M, N] = a[e] @ b[e] (+ a2[e] @ b2[e]): a contiguous [E, M, K] ([E, K, M] when a_t), b [E, K, N]
    ([E, N, K] when b_t); a2, b2 shaped as a, b."""
    E, M, N = out.shape
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = fit(cfg, out.device, a.element_size(), b.element_size())
    BM = min(cfg["BLOCK_M"], max(64, triton.next_power_of_2(M)))  # a few rows: no empty 256-row tiles
    BN, BK = cfg["BLOCK_N"], cfg["BLOCK_K"]
    operands = [t for t in (a, b, a2, b2) if t is not None]
    tma = use_tma(out.device, *operands)
    a_block, b_block = ([1, BK, BM] if a_t else [1, BM, BK]), ([1, BN, BK] if b_t else [1, BK, BN])
    a_d, b_d = _desc(a, a_block, tma), _desc(b, b_block, tma)
    has2 = a2 is not None
    _gemm_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), E)](
        a_d, b_d, _desc(a2, a_block, tma) if has2 else a_d, _desc(b2, b_block, tma) if has2 else b_d,
        out, M, N, K, a[0].numel(), b[0].numel(),
        A_T=a_t, B_T=b_t, HAS2=has2, TMA=tma, UPCAST=interpreting(), PREC=precision(a.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def glu_mm(
    x: Tensor, wg: Tensor, wu: Tensor, kind_situ: bool, beta1: float, beta2: float, cfg: dict,
    dy: Tensor | None = None,
) -> list[Tensor]:
    """[act(x W_gate^T, x W_up^T)] per expert ([E, M, N] in x's dtype), or [dgate, dup] for the output cotangent
    dy; x [E, M, K], weights [E, N, K], all contiguous."""
    E, M, K = x.shape
    N = wg.shape[1]
    outs = [torch.empty(E, M, N, dtype=x.dtype, device=x.device) for _ in range(1 if dy is None else 2)]
    if outs[0].numel() == 0:
        return outs
    if K == 0:  # act(0, 0) and its derivative times dy, computed by the kernel's epilogue over empty sums
        x = x.new_zeros(E, M, 1)
        wg, wu, K = wg.new_zeros(E, N, 1), wu.new_zeros(E, N, 1), 1
    limit = shared_limit(x.device)
    if limit is not None:  # one x tile and two weight tiles a stage

        def need(c):
            tiles = c["BLOCK_M"] * x.element_size() + 2 * c["BLOCK_N"] * wg.element_size()
            return c["num_stages"] * c["BLOCK_K"] * tiles

        cfg = fit_shared(cfg, limit, need, ("BLOCK_K", "BLOCK_N"))
    BM, BN, BK = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma = use_tma(x.device, x, wg, wu, *(() if dy is None else (dy,)))
    x_d = _desc(x, [1, BM, BK], tma)
    _glu_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), E)](
        x_d, _desc(wg, [1, BN, BK], tma), _desc(wu, [1, BN, BK], tma),
        x_d if dy is None else _desc(dy, [1, BM, BN], tma), outs[0], outs[-1], M, N, K, M * K, N * K,
        float(beta1), float(beta2),
        BWD=dy is not None, SITU=kind_situ, TMA=tma, UPCAST=interpreting(), PREC=precision(x.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return outs


def mx_block_k(cfg: dict, block: int) -> int:
    """BLOCK_K for an MX kernel: whole scale blocks per tile, a power of two of them."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"the MX Triton kernels need a power-of-two block size, got {block}")
    return max(cfg["BLOCK_K"], block)


def mx_mm(
    x: Tensor, w: Tensor, s: Tensor, block: int, cfg: dict, w2: Tensor | None = None, s2: Tensor | None = None,
    kind_situ: bool = False, beta1: float = 1.0, beta2: float = 1.0, out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x[e] W[e]^T ([E, M, K] x MXFP4 [E, N, K/2] + scales [E, N, K/block] -> [E, M, N] in out_dtype, by default
    x's), or with a second weight w2/s2 the GLU act(x W^T, x W2^T); everything contiguous."""
    E, M, K = x.shape
    N = w.shape[1]
    y = torch.empty(E, M, N, dtype=out_dtype or x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    if K == 0:
        return y.zero_()  # empty sums, and act(0, 0) = 0 for both GLUs
    block_k = mx_block_k(cfg, block)
    # Pipeline buffers: the x tile [BLOCK_M, BLOCK_K] and the packed weight tiles (half a byte a value).
    cfg = {**cfg, "BLOCK_K": block_k}
    limit = shared_limit(x.device)
    if limit is not None:
        glu_pairs = 1 if w2 is None else 2

        def need(c):
            per = c["BLOCK_K"] * (c["BLOCK_M"] * x.element_size() + glu_pairs * c["BLOCK_N"] // 2)
            return c["num_stages"] * per

        cfg = fit_shared(cfg, limit, need, ("BLOCK_M",))
    BN, BM, BK = cfg["BLOCK_N"], cfg["BLOCK_M"], cfg["BLOCK_K"]
    words = (K // block) % 4 == 0 and 4 % (BK // block) == 0 and all(
        t.device.type == "meta" or t.data_ptr() % 4 == 0 for t in (s, s if s2 is None else s2))
    tma = use_tma(x.device, x)
    glu_ = w2 is not None
    _mx_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN), E)](
        _desc(x, [1, BM, BK], tma), w, s, w2 if glu_ else w, s2 if glu_ else s, y,
        M, N, K, M * K, float(beta1), float(beta2),
        GLU=glu_, SITU=kind_situ, BLOCK=block, SCALE_WORDS=words, TMA=tma, UPCAST=interpreting(),
        BLOCK_N=BN, BLOCK_M=BM, BLOCK_K=BK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
