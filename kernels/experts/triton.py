"""Triton grouped GEMMs for the MoE experts on fixed-capacity buffers [E, C, ...], forward and backward.

The kernels are kernels/_common/gemm_triton.py's grouped GEMM cores (TMA-fed wgmma on Hopper and Blackwell); this module
holds the expert ops' wrappers and their launch configurations. The GLU forward keeps two fp32 accumulators
(gate and up) that share each loaded x tile and applies SiTU-GLU / SwiGLU in the epilogue
(kernels/_common/triton_math.py's `glu`, the elementwise kernels' math), so gate and up never reach memory. The MXFP4
variants decode the packed e2m1 weight tiles in registers as the register operand of a transposed product
(y^T = W x^T), overlapped with the tensor cores. The backward recomputes the gate/up tiles to get dgate/dup
through the activation's derivative, then runs plain grouped GEMMs: dx = dgate W_gate + dup W_up (its own
launch configuration, "expert_matmul_dual": two K loops into one accumulator) and dW = d^T x per expert.
fp32 inputs (CPU-sized training graphs) run on TF32 tensor cores on GPUs. References: kernels/experts/reference.py.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from k3compile.kernels.activations.reference import check_glu_kind
from k3compile.kernels._common.gemm_triton import glu_mm, grouped_mm, mx_mm
from k3compile.kernels._common.launch import capability, gemm_shared, launch_config
from k3compile.kernels.mx.reference import mx_dequant_meta

# Defaults until bench/tune_gpu.py tunes them, per kernel, for Hopper / Blackwell (TMA + wgmma) and for the
# rest (A100's mma.sync, the interpreter), each for 2-byte and 4-byte (TF32) operands: BLOCK_M x BLOCK_N x
# BLOCK_K, warps, stages. They fit 227 KiB (163 KiB on A100) of shared memory and the register file without
# spills, and keep the wgmma pipeline overlapped with both Triton 3.6's ptxas (CUDA 12.8: it serialises
# 128 x 256 tiles of x W^T over 8 warps, and the GLU backward's 128 x 128) and 3.9's
# (tests/kernels/test_gpu_structure.py compiles them); `gemm_triton.fit` clamps a tuned one that would not fit.
_TILES = {  # (hopper 2-byte, hopper 4-byte, other 2-byte, other 4-byte)
    "gemm": ((256, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 128, 32, 8, 4), (64, 128, 32, 4, 3)),
    "glu": ((128, 128, 64, 8, 3), (64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (64, 64, 32, 4, 2)),
    "glu_bwd": ((128, 64, 64, 8, 4), (64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (64, 64, 32, 4, 2)),
    # MXFP4 (BLOCK_M tokens, BLOCK_N weight rows, BLOCK_K one 32-block of scales a step): 8 warps split the weight
    # rows in two 64-row wgmma halves, each decoding 16 values a thread and step for 256 tokens
    "mx": ((256, 128, 32, 8, 4), (128, 128, 32, 8, 4), (128, 64, 32, 4, 3), (64, 64, 32, 4, 3)),
    "mx_glu": ((128, 64, 32, 4, 4), (64, 64, 32, 4, 4), (64, 64, 32, 4, 3), (64, 64, 32, 4, 3)),
}
_SHAPE = {"expert_glu": "glu", "expert_glu_bwd": "glu_bwd", "mx_expert_glu": "mx_glu", "mx_expert_matmul": "mx",
          "expert_matmul": "gemm", "expert_matmul_dual": "gemm", "expert_weight_grad": "gemm"}
_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_BLOCKS = {"BLOCK_M": [64, 128, 256], "BLOCK_N": [64, 128, 256], "BLOCK_K": [32, 64, 128]}
_STEPS = {"num_warps": [4, 8], "num_stages": [2, 3, 4, 5]}
TUNABLE = {
    **{name: {**_BLOCKS, **_STEPS} for name in ("expert_matmul", "expert_matmul_dual", "expert_weight_grad")},
    **{name: {**_BLOCKS, "BLOCK_N": [64, 128], **_STEPS} for name in ("expert_glu", "expert_glu_bwd")},
    "mx_expert_matmul": {"BLOCK_N": [64, 128, 256], "BLOCK_M": [64, 128, 256], "BLOCK_K": [32, 64], **_STEPS},
    "mx_expert_glu": {"BLOCK_N": [64, 128], "BLOCK_M": [64, 128, 256], "BLOCK_K": [32, 64], **_STEPS},
}


def shared_bytes(name: str, cfg: dict, sizes: dict, dtype: torch.dtype) -> int:
    """Shared memory of kernel `name` under `cfg` for operands of `dtype`: its pipelined tiles (bench/tune_gpu.py
    rejects a candidate over the device's limit before timing it; the launchers clamp with the same sums)."""
    e = torch.empty((), dtype=dtype).element_size()
    BM, BN, BK, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"]
    if name.startswith("mx_"):  # x tile, packed weight tiles, one scale word a weight row
        weights = 2 if name == "mx_expert_glu" else 1
        return stages * (BK * (BM * e + weights * BN // 2) + 4 * weights * BN)
    if name in ("expert_glu", "expert_glu_bwd"):  # one x tile, two weight tiles
        return stages * BK * (BM + 2 * BN) * e
    return gemm_shared(BM, BN, BK, stages, e, e)


def defaults(name: str, dtype: torch.dtype, device: torch.device | str) -> dict:
    """The built-in configuration of kernel `name` for operands of `dtype` on `device`."""
    fast = capability(device) >= 90
    tiles = _TILES[_SHAPE[name]][(0 if fast else 2) + (torch.empty((), dtype=dtype).element_size() > 2)]
    return dict(zip(_KEYS, tiles))


def _config(name: str, x: Tensor, E: int, M: int, N: int, K: int) -> dict:
    return launch_config(name, x.device, defaults(name, x.dtype, x.device), dtype=x.dtype, E=E, M=M, N=N, K=K)


def _launch_glu(
    name: str, x: Tensor, wg: Tensor, wu: Tensor, kind: str, beta1: float, beta2: float, dy: Tensor | None = None
) -> list[Tensor]:
    check_glu_kind(kind, "expert GLU")
    E, M, K = x.shape
    cfg = _config(name, x, E, M, wg.shape[1], K)
    return glu_mm(x, wg, wu, kind == "situ_glu", beta1, beta2, cfg, dy)


def _launch_mx(
    name: str, x: Tensor, data: Tensor, scale: Tensor, block: int, data2: Tensor | None = None,
    scale2: Tensor | None = None, kind: str = "swiglu", beta1: float = 1.0, beta2: float = 1.0,
) -> Tensor:
    E, M, K = x.shape
    cfg = _config(name, x, E, M, data.shape[1], K)
    cfg["BLOCK_M"] = min(cfg["BLOCK_M"], max(16, triton.next_power_of_2(M)))  # few tokens (decode): a narrow tile
    return mx_mm(x, data.contiguous(), scale.contiguous(), block, cfg,
                 None if data2 is None else data2.contiguous(), None if scale2 is None else scale2.contiguous(),
                 kind == "situ_glu", beta1, beta2)


def _mm(name: str, out: Tensor, K: int, a: Tensor, b: Tensor, a_t: bool, b_t: bool, a2=None, b2=None) -> Tensor:
    E, M, N = out.shape
    return grouped_mm(out, K, a, b, a_t, b_t, _config(name, a, E, M, N, K), a2, b2)


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
    return _launch_glu("expert_glu", x_ECw.contiguous(), w_gate_EIw.contiguous(), w_up_EIw.contiguous(), kind, beta1,
                       beta2)[0]


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
    """`expert_glu` with MXFP4 gate/up weights ([E, I, w/2] uint8 + [E, I, w/block] E8M0), decoded in registers."""
    E, _, K = x_ECw.shape
    for data, scale in ((gate_data, gate_scale), (up_data, up_scale)):
        if tuple(mx_dequant_meta(data.shape, scale.shape, "e2m1", block)) != (E, gate_data.shape[1], K):
            raise ValueError(f"MXFP4 weight {tuple(data.shape)} does not match x {tuple(x_ECw.shape)}")
    check_glu_kind(kind, "expert GLU")
    return _launch_mx("mx_expert_glu", x_ECw.contiguous(), gate_data, gate_scale, block, up_data, up_scale, kind,
                      beta1, beta2)


@_any_expert_dims
def expert_matmul(x_ECI: Tensor, w_EwI: Tensor) -> Tensor:
    """x @ w^T per expert: [E, C, I] x [E, w, I] -> [E, C, w] in x's dtype."""
    x, w = x_ECI.contiguous(), w_EwI.contiguous()
    E, C, I = x.shape
    out = torch.empty(E, C, w.shape[1], dtype=x.dtype, device=x.device)
    return _mm("expert_matmul", out, I, x, w, False, True)


@_any_expert_dims
def mx_expert_matmul(x_ECI: Tensor, data: Tensor, scale: Tensor, block: int) -> Tensor:
    """`expert_matmul` with an MXFP4 weight ([E, w, I/2] uint8 + [E, w, I/block] E8M0), decoded in registers."""
    x = x_ECI.contiguous()
    E, C, I = x.shape
    W = data.shape[1]
    if tuple(mx_dequant_meta(data.shape, scale.shape, "e2m1", block)) != (E, W, I):
        raise ValueError(f"MXFP4 weight {tuple(data.shape)} does not match x {tuple(x.shape)}")
    return _launch_mx("mx_expert_matmul", x, data, scale, block)


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
    dg, du = _launch_glu("expert_glu_bwd", x, wg, wu, kind, beta1, beta2, dy)
    dx = _mm("expert_matmul_dual", torch.empty_like(x), I, dg, wg, False, False, du, wu)
    dwg, dwu = (_mm("expert_weight_grad", torch.empty(E, I, W, dtype=w.dtype, device=w.device), C, d, x, True, False)
                for w, d in ((wg, dg), (wu, du)))
    return [dx, dwg, dwu]


@_any_expert_dims
def expert_matmul_bwd(grads: list[Tensor], x_ECI: Tensor, w_EwI: Tensor) -> list[Tensor | None]:
    """[dx, dw] of `expert_matmul` for the output cotangent grads[0] [E, C, w]: dx = dy w, dw = dy^T x per expert."""
    x, w = x_ECI.contiguous(), w_EwI.contiguous()
    dy = grads[0].contiguous()
    E, C, I = x.shape
    W = w.shape[1]
    dx = _mm("expert_matmul", torch.empty_like(x), W, dy, w, False, False)
    dw = _mm("expert_weight_grad", torch.empty_like(w), C, dy, x, True, False)
    return [dx, dw]
