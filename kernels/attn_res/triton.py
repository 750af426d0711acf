"""Triton kernels for Attention Residuals: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i, forward and backward.

Legend: S sources, N = B*T tokens, D hidden size. Everything is computed in fp32. With u = norm_weight * query
and r_i = rsqrt(mean(v_i^2) + eps), the logit of source i is z_i = r_i (v_i . u), so one read of a source row
gives its logit. The forward keeps a whole row per token in registers when BLOCK_D >= D and then reads every
source once (online softmax over the sources); otherwise it reads each source twice (logits, then the mix).
The backward computes three per-(token, source) coefficients, then dsources with per-group partial sums of
d(norm_weight * query), reduced in a fixed order (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

TUNABLE = {
    "attn_res": {
        "BLOCK_T": [1, 2, 4, 8],
        "BLOCK_D": [1024, 2048, 4096, 8192],
        "num_warps": [4, 8, 16],
        "num_stages": [1, 2, 3],
    },
    "attn_res_bwd_coef": {
        "BLOCK_T": [1, 2, 4, 8],
        "BLOCK_D": [1024, 2048, 4096, 8192],
        "num_warps": [4, 8, 16],
        "num_stages": [1, 2, 3],
    },
    "attn_res_bwd_dsrc": {
        "BLOCK_T": [1, 2, 4],
        "BLOCK_D": [256, 512, 1024, 2048, 4096],
        "PROGRAMS": [512, 1024, 2048, 4096],
        "num_warps": [2, 4, 8],
        "num_stages": [1, 2, 3],
    },
    "attn_res_bwd_reduce": {"BLOCK_D": [256, 512, 1024], "num_warps": [2, 4, 8], "num_stages": [1]},
}

_MAX_ROW = 8192  # the longest row the default configs keep whole in registers (one-pass forward)
_TILE = 4096  # [BLOCK_T, BLOCK_D] elements per program the default configs aim for when rows are short


def _block_s(num_sources: int) -> int:
    return max(2, triton.next_power_of_2(num_sources))


def _tile_defaults(d: int) -> dict:
    """One row per token in registers up to D = 8192 (16 fp32 per thread); more tokens when rows are short."""
    block_d = min(triton.next_power_of_2(d), _MAX_ROW)
    block_t = max(1, min(16, _TILE // block_d))
    return {"BLOCK_T": block_t, "BLOCK_D": block_d, "num_warps": max(4, min(16, block_t * block_d // 512)),
            "num_stages": 1}


@triton.jit
def _query_u(query_ptr, normw_ptr, cols, cmask):
    """u = norm_weight * query on these columns, fp32 (0 outside cmask): z_i = r_i (v_i . u)."""
    q = tl.load(query_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    return tl.load(normw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * q


@triton.jit
def _attn_res_fwd_kernel(
    src_ptr, query_ptr, normw_ptr, out_ptr, S, N, D, src_stride, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """One program per BLOCK_T tokens: logits z_i = r_i (v_i . u), softmax over sources, mix of the raw rows."""
    row0 = tl.program_id(0) * BLOCK_T
    lrows = tl.arange(0, BLOCK_T)
    rmask = row0 + lrows < N
    src = src_ptr + row0.to(tl.int64) * D  # scalar bases; tile offsets stay small int32
    out = out_ptr + row0.to(tl.int64) * D
    cols0 = tl.arange(0, BLOCK_D)
    if ONE_PASS:
        # BLOCK_D >= D, the whole row fits: online softmax over the sources, each row read once,
        # the next source's load issued before this one's math.
        cmask = cols0 < D
        mask = rmask[:, None] & cmask[None, :]
        offs = lrows[:, None] * D + cols0[None, :]
        u = _query_u(query_ptr, normw_ptr, cols0, cmask)
        m = tl.full([BLOCK_T], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_T], tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        v_next = tl.load(src + offs, mask=mask, other=0.0)
        for s in range(S):
            v = v_next.to(tl.float32)
            src += src_stride
            more = (row0 + lrows < N * (s + 1 < S))[:, None] & cmask[None, :]  # all-false past the last source
            v_next = tl.load(src + offs, mask=more, other=0.0)
            z = tl.sum(v * u[None, :], axis=1) * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            m_new = tl.maximum(m, z)
            alpha = tl.exp(m - m_new)
            beta = tl.exp(z - m_new)
            acc = acc * alpha[:, None] + beta[:, None] * v
            den = den * alpha + beta
            m = m_new
        h = acc / den[:, None]
        tl.store(out + offs, h.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows longer than a block: accumulate sum(v^2) and v . u per source, then mix chunk by chunk.
        scol = tl.arange(0, BLOCK_S)
        sumsq = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
        dot = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + cols0
            cmask = cols < D
            mask = rmask[:, None] & cmask[None, :]
            offs = lrows[:, None] * D + cols[None, :]
            u = _query_u(query_ptr, normw_ptr, cols, cmask)
            src_s = src  # stepped by pointer: s * src_stride overflows int32 once S*N*D >= 2^31
            for s in range(S):
                v = tl.load(src_s + offs, mask=mask, other=0.0).to(tl.float32)
                src_s += src_stride
                sel = scol[None, :] == s
                sumsq += tl.where(sel, tl.sum(v * v, axis=1)[:, None], 0.0)
                dot += tl.where(sel, tl.sum(v * u[None, :], axis=1)[:, None], 0.0)
        z = dot * tl.rsqrt(sumsq / D + eps)
        z = tl.where(scol[None, :] < S, z, float("-inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = e / tl.sum(e, axis=1)[:, None]
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + cols0
            mask = rmask[:, None] & (cols < D)[None, :]
            offs = lrows[:, None] * D + cols[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
            src_s = src
            for s in range(S):
                v = tl.load(src_s + offs, mask=mask, other=0.0)
                src_s += src_stride
                p_s = tl.sum(tl.where(scol[None, :] == s, p, 0.0), axis=1)
                acc += p_s[:, None] * v.to(tl.float32)
            tl.store(out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_res_bwd_coef_kernel(
    src_ptr, dout_ptr, query_ptr, normw_ptr, coef_ptr, S, N, D, src_stride, eps,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Per token and source, the three coefficients of dv_i = c1 dh + c2 u + c3 v_i (c2 also weights du).

    p = softmax(z), dz_i = p_i (dh . v_i - dh . h); c1 = p_i, c2 = dz_i r_i, c3 = -dz_i (v_i . u) r_i^3 / D.
    Stored as coef[3, S, N] in fp32.
    """
    row0 = tl.program_id(0) * BLOCK_T
    lrows = tl.arange(0, BLOCK_T)
    rows = row0 + lrows
    rmask = rows < N
    src0 = src_ptr + row0.to(tl.int64) * D
    dout = dout_ptr + row0.to(tl.int64) * D
    cols0 = tl.arange(0, BLOCK_D)
    scol = tl.arange(0, BLOCK_S)
    sumsq = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    dot = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    dp = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + cols0
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        offs = lrows[:, None] * D + cols[None, :]
        u = _query_u(query_ptr, normw_ptr, cols, cmask)
        dh = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
        src = src0
        v_next = tl.load(src + offs, mask=mask, other=0.0)
        for s in range(S):
            v = v_next.to(tl.float32)
            src += src_stride
            more = (rows < N * (s + 1 < S))[:, None] & cmask[None, :]  # all-false past the last source
            v_next = tl.load(src + offs, mask=more, other=0.0)
            sel = scol[None, :] == s
            sumsq += tl.where(sel, tl.sum(v * v, axis=1)[:, None], 0.0)
            dot += tl.where(sel, tl.sum(v * u[None, :], axis=1)[:, None], 0.0)
            dp += tl.where(sel, tl.sum(v * dh, axis=1)[:, None], 0.0)
    r = tl.rsqrt(sumsq / D + eps)
    z = tl.where(scol[None, :] < S, dot * r, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    dz = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    c2 = dz * r
    c3 = -c2 * dot * r * r / D
    ptrs = coef_ptr + scol[None, :] * N + rows[:, None]
    smask = rmask[:, None] & (scol[None, :] < S)
    plane = S * N
    tl.store(ptrs, p, mask=smask)
    tl.store(ptrs + plane, c2, mask=smask)
    tl.store(ptrs + 2 * plane, c3, mask=smask)


@triton.jit
def _attn_res_bwd_dsrc_kernel(
    src_ptr, dout_ptr, query_ptr, normw_ptr, coef_ptr, dsrc_ptr, part_ptr, S, N, D, src_stride, BLOCKS_PER_PROGRAM,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (token groups, D blocks): dv_i = c1 dh + c2 u + c3 v_i, and this group's share of du = sum c2 v_i.

    Each program keeps its du share in registers over its tokens and writes it once to part[group, D]
    (reduced in a fixed order afterwards: deterministic, no atomics).
    """
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    lrows = tl.arange(0, BLOCK_T)
    offs = lrows[:, None] * D + cols[None, :]
    u = _query_u(query_ptr, normw_ptr, cols, cmask)
    plane = S * N
    du = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for b in range(BLOCKS_PER_PROGRAM):
        row0 = (group * BLOCKS_PER_PROGRAM + b) * BLOCK_T
        rows = row0 + lrows
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        base = row0.to(tl.int64) * D
        dh = tl.load(dout_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        src = src_ptr + base
        dsrc = dsrc_ptr + base
        for s in range(S):
            v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            cptr = coef_ptr + s * N + rows
            c1 = tl.load(cptr, mask=rmask, other=0.0)
            c2 = tl.load(cptr + plane, mask=rmask, other=0.0)
            c3 = tl.load(cptr + 2 * plane, mask=rmask, other=0.0)
            dv = c1[:, None] * dh + c2[:, None] * u[None, :] + c3[:, None] * v
            tl.store(dsrc + offs, dv.to(dsrc_ptr.dtype.element_ty), mask=mask)
            du += c2[:, None] * v
            src += src_stride
            dsrc += src_stride
    tl.store(part_ptr + group * D + cols, tl.sum(du, axis=0), mask=cmask)


@triton.jit
def _attn_res_bwd_reduce_kernel(
    part_ptr, query_ptr, normw_ptr, dquery_ptr, dnormw_ptr, G, D, BLOCK_D: tl.constexpr
):
    """du = sum over groups of part[g] in group order; dquery = du * norm_weight, dnorm_weight = du * query."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    du = tl.zeros([BLOCK_D], tl.float32)
    for g in range(G):
        du += tl.load(part_ptr + g * D + cols, mask=cmask, other=0.0)
    q = tl.load(query_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w = tl.load(normw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(dquery_ptr + cols, (du * w).to(dquery_ptr.dtype.element_ty), mask=cmask)
    tl.store(dnormw_ptr + cols, (du * q).to(dnormw_ptr.dtype.element_ty), mask=cmask)


def attn_res(sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float) -> Tensor:
    """h [B, T, D] in the sources' dtype: the softmax-over-depth mix of the S sources [S, B, T, D]."""
    src = sources_SBTD.contiguous()
    S, D = src.shape[0], src.shape[-1]
    N = src[0].numel() // D
    out = torch.empty(src.shape[1:], dtype=src.dtype, device=src.device)
    if N == 0:
        return out
    cfg = launch_config("attn_res", src.device, _tile_defaults(D), dtype=src.dtype, S=S, N=N, D=D)
    grid = (triton.cdiv(N, cfg["BLOCK_T"]),)
    _attn_res_fwd_kernel[grid](
        src, query_D.contiguous(), norm_weight_D.contiguous(), out, S, N, D, N * D, float(eps),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_S=_block_s(S), ONE_PASS=cfg["BLOCK_D"] >= D,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def attn_res_bwd(
    grads: list[Tensor], sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float
) -> list[Tensor | None]:
    """[dsources, dquery, dnorm_weight] for the cotangent grads[0] of h.

    Three launches: per-token coefficients (rows read once for z, dh . v), then dsources with per-group
    partial sums of du = sum c2 v over D blocks, then a fixed-order reduction of the partials.
    """
    src = sources_SBTD.contiguous()
    dout = grads[0].contiguous()
    query, normw = query_D.contiguous(), norm_weight_D.contiguous()
    S, D = src.shape[0], src.shape[-1]
    N = src[0].numel() // D
    dev = src.device
    if N == 0:
        return [torch.empty_like(src), torch.zeros_like(query), torch.zeros_like(normw)]
    coef = torch.empty((3, S, N), dtype=torch.float32, device=dev)
    cfg = launch_config("attn_res_bwd_coef", dev, _tile_defaults(D), dtype=src.dtype, S=S, N=N, D=D)
    _attn_res_bwd_coef_kernel[(triton.cdiv(N, cfg["BLOCK_T"]),)](
        src, dout, query, normw, coef, S, N, D, N * D, float(eps),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], BLOCK_S=_block_s(S),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )

    # One token per step (wider token tiles cost registers on sm_90 for nothing: du stays in registers anyway).
    defaults = {"BLOCK_T": 1, "BLOCK_D": min(triton.next_power_of_2(D), 1024), "PROGRAMS": 1024,
                "num_warps": 4, "num_stages": 1}
    cfg = launch_config("attn_res_bwd_dsrc", dev, defaults, dtype=src.dtype, S=S, N=N, D=D)
    d_blocks = triton.cdiv(D, cfg["BLOCK_D"])
    t_blocks = triton.cdiv(N, cfg["BLOCK_T"])
    per_program = triton.cdiv(t_blocks, max(1, min(t_blocks, cfg["PROGRAMS"] // d_blocks)))
    groups = triton.cdiv(t_blocks, per_program)
    dsrc = torch.empty_like(src)
    part = torch.empty((groups, D), dtype=torch.float32, device=dev)
    _attn_res_bwd_dsrc_kernel[(groups, d_blocks)](
        src, dout, query, normw, coef, dsrc, part, S, N, D, N * D, per_program,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )

    cfg = launch_config("attn_res_bwd_reduce", dev, {"BLOCK_D": min(triton.next_power_of_2(D), 512),
                                                      "num_warps": 4, "num_stages": 1}, G=groups, D=D)
    dquery, dnormw = torch.empty_like(query), torch.empty_like(normw)
    _attn_res_bwd_reduce_kernel[(triton.cdiv(D, cfg["BLOCK_D"]),)](
        part, query, normw, dquery, dnormw, groups, D,
        BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return [dsrc, dquery, dnormw]
