"""Triton absorbed MLA decoding (reference `mla_decode_absorbed_ref`): flash-decoding over the latent cache.

W_uk folds into the query (q_lat = q_nope W_uk, a small batched matmul in torch), then one program per
(head block, S split, query token) streams its part of the cache [c_kv | k_pe] in BLOCK_S rows:
scores = q_lat . c_kv + q_pe . k_pe, causal online softmax, and P @ c_kv accumulated in the latent space [L].
All heads of a token read the same latent rows, so BLOCK_H heads share each loaded block: with a half cache on
Hopper or later a block holds 64 heads (all of K3's), wgmma's minimum, so each cache row is read once per query
token, and 8 warps split the [64, L] accumulator (the score block and P@c_kv both run on wgmma). A few queries
over a long cache give too few programs for the GPU, so the cache is split over S (split-K flash decoding) into
as many splits as fill the SMs in whole waves (one program per SM: the pipelined cache tiles and the query take
most of the shared memory); each split writes its normalized partial and log2-sum-exp, and a second kernel
merges them. Finally o = o_lat W_uv^T (torch). Half-precision caches run the two dots on tensor cores in the
cache's dtype with fp32 accumulation; fp32 caches use IEEE fp32 dots (so results match fp32 references).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import capability, fit_shared, interpreting, launch_config, shared_limit, sm_count

LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite start for running maxima: a fully masked block then gives p = 0, not NaN

# SPLITS = 0 picks the split count from the shapes (whole waves of PER_SM programs per SM); n > 0 forces at most n.
# Half caches on sm_90: 64 heads x 64 rows, 8 warps, 2 stages: 216 KiB of shared memory (the query 72 KiB, a
# stage of cache rows 72 KiB), one program per SM. A 64-row block reads the query once per 64 cache rows from
# shared memory (the wgmma A operand): under 6 bytes of shared-memory traffic per byte of cache, within the
# SM's shared-memory bandwidth at full HBM rate. Before sm_90 (mma.sync) 16 heads, 4 warps. fp32 caches
# (CUDA-core dots) take fewer rows per block so the tiles stay in registers.
_DEFAULTS = {"BLOCK_H": 64, "BLOCK_S": 64, "SPLITS": 0, "PER_SM": 1, "num_warps": 8, "num_stages": 2}
# Blackwell (tcgen05) stages P and more in shared memory: 32-row blocks (208 KiB with Triton 3.6, 141 with 3.9).
_DEFAULTS_TCGEN05 = {**_DEFAULTS, "BLOCK_S": 32}
_DEFAULTS_MMA = {"BLOCK_H": 16, "BLOCK_S": 32, "SPLITS": 0, "PER_SM": 2, "num_warps": 4, "num_stages": 3}
_DEFAULTS_FP32 = {**_DEFAULTS_MMA, "BLOCK_S": 16, "num_stages": 2}
_MIN_SPLIT_BLOCKS = 8
_FULL_WAVES = 0.9  # the fewest splits whose programs fill at least this share of their waves
_REDUCE_DEFAULTS = {"num_warps": 4}

TUNABLE = {
    "mla_decode_absorbed": {
        "BLOCK_H": [16, 32, 64],
        "BLOCK_S": [16, 32, 64],
        "SPLITS": [0, 1, 2, 4, 8, 16, 32],
        "PER_SM": [1, 2],
        "num_warps": [4, 8],
        "num_stages": [1, 2, 3],
    },
    "mla_decode_reduce": {"num_warps": [1, 2, 4, 8]},
}


@triton.jit
def _dot(a, b, LOW: tl.constexpr):
    """a @ b with fp32 accumulation: tensor cores in b's half dtype when LOW, else IEEE fp32."""
    if LOW:
        return tl.dot(a.to(b.dtype), b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _mla_decode_kernel(
    qlat_ptr, q_ptr, lat_ptr, opart_ptr, lse_ptr, len_ptr,
    qk_scale, T, S, H, L, R, N, split_len,
    s_qb, s_qt, s_qh,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    LOW: tl.constexpr, HAS_LENGTHS: tl.constexpr,
):  # fmt: skip
    """Program (head block, split, b*T + t): partial attention of BLOCK_H heads over one split of the cache."""
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    bt = tl.program_id(2)
    n_splits = tl.num_programs(1)
    b = (bt // T).to(tl.int64)
    t = bt % T

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_l = offs_l < L
    mask_r = offs_r < R

    # q_lat [BLOCK_H, BLOCK_L] (contiguous [B*T, H, L]) and q_pe [BLOCK_H, BLOCK_R] (the last R of q's head dim)
    mask_hl = mask_h[:, None] & mask_l[None, :]
    q_lat = tl.load(qlat_ptr + bt.to(tl.int64) * H * L + offs_h[:, None] * L + offs_l[None, :], mask=mask_hl, other=0.0)
    q_pe = tl.load(
        q_ptr + b * s_qb + t * s_qt + offs_h[:, None] * s_qh + N + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )

    if HAS_LENGTHS:  # a preallocated cache: sequence b's valid rows are 0 .. lengths[b] - 1
        last = tl.load(len_ptr + b) - T + t
    else:
        last = S - T + t  # the query's position: it sees keys 0..last
    lo = split * split_len
    hi = tl.minimum(lo + split_len, last + 1)
    C = L + R
    lat_base = lat_ptr + b * S * C

    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        mask_s = offs_s < hi
        rows = lat_base + offs_s[:, None] * C
        c_kv = tl.load(rows + offs_l[None, :], mask=mask_s[:, None] & mask_l[None, :], other=0.0)
        k_pe = tl.load(rows + L + offs_r[None, :], mask=mask_s[:, None] & mask_r[None, :], other=0.0)
        scores = _dot(q_lat, tl.trans(c_kv), LOW) + _dot(q_pe, tl.trans(k_pe), LOW)
        scores = tl.where(mask_s[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, c_kv, LOW)
        m_i = m_new

    # Normalized partial and its log2-sum-exp (-inf for a split the query cannot see); one split = the answer.
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = bt.to(tl.int64) * n_splits + split
    tl.store(opart_ptr + row * H * L + offs_h[:, None] * L + offs_l[None, :], o, mask=mask_hl)
    tl.store(lse_ptr + row * H + offs_h, lse, mask=mask_h)


@triton.jit
def _mla_decode_reduce_kernel(
    opart_ptr, lse_ptr, out_ptr, H, L, n_splits,
    BLOCK_L: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (b*T + t, h): merge the splits' normalized partials, weighted by their softmax mass."""
    bt = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_j = tl.arange(0, BLOCK_SPLITS)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    lse_row = lse_ptr + bt * n_splits * H + h
    lse = tl.load(lse_row + offs_j * H, mask=offs_j < n_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    total = tl.sum(tl.exp2(lse - m), axis=0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for j in range(n_splits):
        w = tl.exp2(tl.load(lse_row + j * H) - m)
        part = tl.load(opart_ptr + ((bt * n_splits + j) * H + h) * L + offs_l, mask=mask_l, other=0.0)
        acc += w * part
    tl.store(out_ptr + (bt * H + h) * L + offs_l, acc / total, mask=mask_l)


def shared_bytes(name: str, cfg: dict, sizes: dict, dtype: torch.dtype) -> int | None:
    """Shared memory of the decode kernel under `cfg`: the query block [BLOCK_H, L + R] and num_stages cache tiles
    [BLOCK_S, L + R] (bench/tune_gpu.py rejects a candidate over the device's limit before timing it)."""
    if name != "mla_decode_absorbed":
        return None
    row = (triton.next_power_of_2(sizes["L"]) + 64) * sizes.get("ELEM", torch.empty((), dtype=dtype).element_size())
    return (cfg["BLOCK_H"] + cfg["num_stages"] * cfg["BLOCK_S"]) * row


def split_count(programs: int, sms: int, max_splits: int) -> int:
    """Splits of the cache for `programs` (head blocks x queries) programs on `sms` program slots: the fewest
    whose programs fill at least _FULL_WAVES of their waves (the best filling when none does), at most
    max_splits."""
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, max_splits) + 1):
        total = programs * splits
        fill = total / (triton.cdiv(total, sms) * sms)
        if fill >= _FULL_WAVES:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The inputs' shared half dtype (cuBLAS accumulates in fp32), else fp32."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16}:
        return dtypes.pop()
    return torch.float32


def mla_decode_absorbed(
    q_BTHK: Tensor, latent_BSC: Tensor, w_kvb: Tensor, scale: float, lengths_B: Tensor | None = None
) -> Tensor:
    """Absorbed MLA over the latent cache [c_kv | k_pe]: causal attention of the last T positions -> o [B, T, H, V].

    lengths_B (int64 [B]): valid rows of each sequence's cache; None means all S.
    """
    B, T, H, K = q_BTHK.shape
    S = latent_BSC.shape[1]
    L = w_kvb.shape[1]
    R = latent_BSC.shape[-1] - L
    N = K - R
    cd = _compute_dtype(q_BTHK, latent_BSC, w_kvb)
    w = w_kvb.to(cd).view(H, -1, L)
    w_uk, w_uv = w[:, :N], w[:, N:]
    q = q_BTHK.to(cd)
    q_lat = torch.einsum("bthn,hnl->bthl", q[..., :N], w_uk).contiguous()
    lat = latent_BSC.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()

    low = lat.dtype in (torch.bfloat16, torch.float16)
    wgmma = low and capability(lat.device) >= 90
    if wgmma:
        defaults = _DEFAULTS_TCGEN05 if capability(lat.device) >= 100 else _DEFAULTS
    else:
        defaults = _DEFAULTS_MMA if low else _DEFAULTS_FP32
    sizes = dict(B=B, T=T, H=H, S=S, L=L, ELEM=lat.element_size())
    cfg = launch_config("mla_decode_absorbed", lat.device, defaults, dtype=lat.dtype, **sizes)
    cfg = fit_shared(cfg, shared_limit(lat.device), lambda c: shared_bytes("mla_decode_absorbed", c, sizes, lat.dtype),
                     ("BLOCK_S",))
    block_h = max(64 if wgmma else 16, min(cfg["BLOCK_H"], triton.next_power_of_2(H)))
    block_s = cfg["BLOCK_S"]
    head_blocks = triton.cdiv(H, block_h)
    s_blocks = triton.cdiv(S, block_s)
    # Auto: whole waves of programs, but no split shorter than _MIN_SPLIT_BLOCKS blocks (each split writes an
    # fp32 partial of H * L per query, which must stay small next to its cache slice).
    slots = cfg["PER_SM"] * sm_count(lat.device)
    auto = split_count(B * T * head_blocks, slots, triton.cdiv(s_blocks, _MIN_SPLIT_BLOCKS))
    blocks_per_split = triton.cdiv(s_blocks, max(1, min(cfg["SPLITS"] or auto, s_blocks)))
    split_len = blocks_per_split * block_s
    splits = triton.cdiv(S, split_len)

    o_part = torch.empty(B * T, splits, H, L, dtype=torch.float32, device=lat.device)
    lse = torch.empty(B * T, splits, H, dtype=torch.float32, device=lat.device)
    _mla_decode_kernel[(head_blocks, splits, B * T)](
        q_lat, q, lat, o_part, lse, lat if lengths_B is None else lengths_B.contiguous(),
        float(scale) * LOG2E, T, S, H, L, R, N, split_len,
        q.stride(0), q.stride(1), q.stride(2),
        BLOCK_H=block_h, BLOCK_S=block_s,
        BLOCK_L=max(16, triton.next_power_of_2(L)), BLOCK_R=max(16, triton.next_power_of_2(R)),
        LOW=low and not interpreting(), HAS_LENGTHS=lengths_B is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if splits == 1:
        o_lat = o_part.view(B, T, H, L)
    else:
        o_lat = torch.empty(B, T, H, L, dtype=torch.float32, device=lat.device)
        rcfg = launch_config("mla_decode_reduce", lat.device, _REDUCE_DEFAULTS, dtype=lat.dtype, B=B, T=T, H=H, L=L)
        _mla_decode_reduce_kernel[(B * T, H)](
            o_part, lse, o_lat, H, L, splits,
            BLOCK_L=triton.next_power_of_2(L), BLOCK_SPLITS=triton.next_power_of_2(splits),
            num_warps=rcfg["num_warps"],
        )  # fmt: skip
    o = torch.einsum("bthl,hvl->bthv", o_lat.to(cd), w_uv)
    return o.to(q_BTHK.dtype).contiguous()
