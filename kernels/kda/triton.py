"""Triton kernels for chunked Kimi Delta Attention (KDA): forward and backward of the UT-transform form.

Reference: `kda_chunk_fwd` / `kda_chunk_bwd` in kernels/kda/reference.py. Per head, per chunk of C tokens, with G the
in-chunk cumulative log decay (fp32 cumsum), Gamma = exp(G) and S the state entering the chunk:

    A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) (j <= i),  A_kk the same with k for q (j < i)
    M = (I + Diag(beta) A_kk)^-1,  W = M Diag(beta) (Gamma*K),  U = M Diag(beta) V
    V' = U - W S;  O = scale ((Gamma*Q) S + A_qk V');  S <- Diag(exp(G_C)) S + (exp(G_C - G)*K)^T V'

Forward, four kernels after the cumsum: scores (A_qk, A_kk; parallel over chunks), UT transform (M, W, U and
the keys seen from the chunk end, exp(G_C - G)*K; parallel over chunks), state passing (sequential over
chunks, parallel over (b, h, V-block)) and the output (parallel over chunks and V-blocks). Backward: the state
gradient backwards through the chunks (sequential, like the forward's state pass), then one kernel per chunk
for everything that goes through V', M and the state, then one for the score matrices and the suffix sums
that turn dG into dg. The forward saves what the backward reads (chunk_saved_shapes), so nothing reruns.

Decays are only ever applied as exp of a difference G_i - G_j with j <= i, never exp(-G): score blocks
between different 16-row sub-chunks go through the first row of the later sub-chunk (both factors in
(0, 1]); the diagonal 16 x 16 blocks take exp(G_i - G_j) exactly, one column at a time.

fp32 inputs use IEEE fp32 dots by default (results match the fp32 reference; DOT_FP32 = "tf32x3" is the
tensor-core alternative a tuner may pick); 16-bit inputs use TF32 dots. An IEEE dot runs on FMA units and
holds its whole reduction in registers, so dots reduce over blocks of at most SPLIT (see _dot).
Chunk tensors that the forward saves are chunk-major [N, B, H, C, X] fp32, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3compile.kernels._common.launch import launch_config

SUB = 16  # rows of a sub-chunk: the diagonal blocks of the score matrices (tl.dot needs >= 16)

_DEFAULTS = {
    "kda_cumsum": {"num_warps": 4, "num_stages": 1},
    "kda_fwd_scores": {"BLOCK_K": 32, "DOT_FP32": "ieee", "num_warps": 4, "num_stages": 1},
    "kda_fwd_ut": {"BLOCK_K": 32, "BLOCK_V": 32, "SPLIT": 32, "DOT_FP32": "ieee", "num_warps": 8, "num_stages": 1},
    "kda_fwd_state": {"BLOCK_V": 32, "SPLIT": 32, "DOT_FP32": "ieee", "num_warps": 16, "num_stages": 2},
    "kda_fwd_o": {"BLOCK_K": 32, "BLOCK_C": 32, "BLOCK_V": 64, "DOT_FP32": "ieee", "num_warps": 4, "num_stages": 2},
    "kda_bwd_state": {"BLOCK_V": 32, "SPLIT": 32, "DOT_FP32": "ieee", "num_warps": 16, "num_stages": 2},
    "kda_bwd_chunk": {"BLOCK_K": 16, "BLOCK_V": 16, "SPLIT": 16, "DOT_FP32": "ieee", "num_warps": 8, "num_stages": 1},
    "kda_bwd_scores": {"BLOCK_K": 32, "SPLIT": 16, "DOT_FP32": "ieee", "num_warps": 4, "num_stages": 1},
}

# Every block is a power of two >= 16 (tl.dot). DOT_FP32 is the tl.dot precision for fp32 inputs: "ieee"
# matches the fp32 reference to ~1e-7; "tf32x3" (three TF32 products) runs on tensor cores at about 1e-6,
# still inside the 1e-4 bar, and a tuner should keep it only where its outputs pass. 16-bit inputs use TF32.
_FP32 = ["ieee", "tf32x3"]
_SPLIT = [16, 32, 64]
TUNABLE = {
    "kda_cumsum": {"num_warps": [1, 2, 4, 8], "num_stages": [1]},
    "kda_fwd_scores": {"BLOCK_K": [16, 32, 64], "DOT_FP32": _FP32, "num_warps": [2, 4, 8], "num_stages": [1, 2]},
    "kda_fwd_ut": {"BLOCK_K": [16, 32, 64], "BLOCK_V": [16, 32, 64], "SPLIT": _SPLIT, "DOT_FP32": _FP32,
                   "num_warps": [4, 8, 16], "num_stages": [1, 2]},
    "kda_fwd_state": {"BLOCK_V": [16, 32, 64], "SPLIT": _SPLIT, "DOT_FP32": _FP32, "num_warps": [4, 8, 16],
                      "num_stages": [1, 2, 3]},
    "kda_fwd_o": {"BLOCK_K": [16, 32, 64], "BLOCK_C": [16, 32, 64], "BLOCK_V": [32, 64, 128], "DOT_FP32": _FP32,
                  "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]},
    "kda_bwd_state": {"BLOCK_V": [16, 32, 64], "SPLIT": _SPLIT, "DOT_FP32": _FP32, "num_warps": [4, 8, 16],
                      "num_stages": [1, 2, 3]},
    "kda_bwd_chunk": {"BLOCK_K": [16, 32, 64], "BLOCK_V": [16, 32, 64], "SPLIT": _SPLIT, "DOT_FP32": _FP32,
                      "num_warps": [4, 8, 16], "num_stages": [1, 2]},
    "kda_bwd_scores": {"BLOCK_K": [16, 32, 64], "SPLIT": _SPLIT, "DOT_FP32": _FP32, "num_warps": [2, 4, 8, 16],
                       "num_stages": [1, 2]},
}


# ---------------------------------------------------------------------------------------------------------
# Forward kernels. Program ids: n = chunk, bh = b * H + h. Inputs are [B, T, H, X] contiguous: token t of
# head (b, h) starts at ((b * T + t) * H + h) * X. Chunk tensors start at ((n * BH + bh) * C + i) * X.


@triton.jit
def _dot(a, b, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """a [M, R] @ b [R, N] in fp32; a reduction longer than SPLIT runs as a batched dot over blocks of SPLIT,
    summed. An fp32 FMA dot holds its whole reduction in registers: short ones keep it out of spills (and
    they spill less on tensor cores too)."""
    M: tl.constexpr = a.shape[0]
    R: tl.constexpr = a.shape[1]
    if R > SPLIT:
        a3 = tl.permute(tl.reshape(a, [M, R // SPLIT, SPLIT]), [1, 0, 2])
        out = tl.sum(tl.dot(a3, tl.reshape(b, [R // SPLIT, SPLIT, b.shape[1]]), input_precision=PREC), 0)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _kda_cumsum_kernel(g_ptr, G_ptr, T, H, K, C: tl.constexpr, BK: tl.constexpr):
    """Program (chunk, b*H + h): G = cumsum of g along the chunk (padded tokens add 0)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    cols = tl.arange(0, BK)
    t = n * C + rows
    tok = ((b * T + n * C).to(tl.int64) * H + h) * K
    chk = (n * tl.num_programs(1) + bh).to(tl.int64) * C
    kmask = (cols < K)[None, :]
    g = tl.load(g_ptr + tok + rows[:, None] * (H * K) + cols[None, :], mask=(t < T)[:, None] & kmask, other=0.0)
    G = tl.cumsum(g.to(tl.float32), 0)
    tl.store(G_ptr + (chk + rows[:, None]) * K + cols[None, :], G, mask=kmask)


@triton.jit
def _kda_fwd_scores_kernel(
    q_ptr, k_ptr, G_ptr, Aqk_ptr, Akk_ptr,
    T, H, K,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (chunk, b*H + h): A_qk (j <= i) and A_kk (j < i), one block of BC rows at a time, summed over
    blocks of BK channels.

    Columns of earlier sub-chunks: one dot through the block's first row r0, exp(G_i - G_r0) exp(G_r0 - G_j).
    The diagonal BC x BC block: exp(G_i - G_j) per column j, exact whatever the decay."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    sub = tl.arange(0, BC)
    tok = ((b * T + n * C).to(tl.int64) * H + h) * K
    chk = (n * tl.num_programs(1) + bh).to(tl.int64) * C
    n_valid = T - n * C  # rows at or past this are padding
    for blk in range(C // BC):
        r0 = blk * BC
        ri = r0 + sub
        a_qk = tl.zeros([BC, C], dtype=tl.float32)
        a_kk = tl.zeros([BC, C], dtype=tl.float32)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            kmask = (cols < K)[None, :]
            in_mask = (ri < n_valid)[:, None] & kmask
            io = tok + ri[:, None] * (H * K) + cols[None, :]
            q_r = tl.load(q_ptr + io, mask=in_mask, other=0.0).to(tl.float32)
            k_r = tl.load(k_ptr + io, mask=in_mask, other=0.0).to(tl.float32)
            G_r = tl.load(G_ptr + (chk + ri[:, None]) * K + cols[None, :], mask=kmask, other=0.0)
            G_ref = tl.load(G_ptr + (chk + r0) * K + cols, mask=cols < K, other=0.0)
            k_all = tl.load(k_ptr + tok + rows[:, None] * (H * K) + cols[None, :],
                            mask=(rows < n_valid)[:, None] & kmask, other=0.0).to(tl.float32)
            G_all = tl.load(G_ptr + (chk + rows[:, None]) * K + cols[None, :], mask=kmask, other=0.0)
            row_decay = tl.exp(G_r - G_ref[None, :])
            k_col = k_all * tl.exp(tl.where((rows < r0)[:, None], G_ref[None, :] - G_all, float("-inf")))
            a_qk = tl.dot(q_r * row_decay, tl.trans(k_col), acc=a_qk, input_precision=PREC)
            a_kk = tl.dot(k_r * row_decay, tl.trans(k_col), acc=a_kk, input_precision=PREC)
            for jj in range(BC):
                j = r0 + jj
                k_j = tl.load(k_ptr + tok + j * (H * K) + cols, mask=cols < tl.where(j < n_valid, K, 0), other=0.0)
                G_j = tl.load(G_ptr + (chk + j) * K + cols, mask=cols < K, other=0.0)
                e = tl.exp(tl.where((ri >= j)[:, None], G_r - G_j[None, :], float("-inf")))
                k_e = k_j.to(tl.float32)[None, :] * e
                at_j = (rows == j)[None, :]
                a_qk = tl.where(at_j, a_qk + tl.sum(q_r * k_e, 1)[:, None], a_qk)
                a_kk = tl.where(at_j & (ri > j)[:, None], a_kk + tl.sum(k_r * k_e, 1)[:, None], a_kk)
        offs = (chk + ri[:, None]) * C + rows[None, :]
        tl.store(Aqk_ptr + offs, a_qk)
        tl.store(Akk_ptr + offs, a_kk)


@triton.jit
def _kda_fwd_ut_kernel(
    k_ptr, v_ptr, beta_ptr, G_ptr, Akk_ptr, M_ptr, W_ptr, U_ptr, kout_ptr,
    T, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (chunk, b*H + h): M = (I + Diag(beta) A_kk)^-1 by forward substitution on the whole chunk in
    registers, then W = M (beta Gamma K), U = M (beta V) and the keys seen from the chunk end exp(G_C - G) K."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    cc = tl.arange(0, C)
    chk = (n * tl.num_programs(1) + bh).to(tl.int64) * C
    valid = (rows < T - n * C)[:, None]
    beta = tl.load(beta_ptr + (b * T + n * C + rows).to(tl.int64) * H + h, mask=rows < T - n * C, other=0.0)
    beta = beta.to(tl.float32)[:, None]

    # N = M - I is strictly lower: row i of N is -L[i,:] - sum_{j<i} L[i,j] N[j,:], L = Diag(beta) A_kk.
    inv = -beta * tl.load(Akk_ptr + (chk + rows[:, None]) * C + cc[None, :])
    for i in range(1, C):
        at_i = (rows == i)[:, None]
        a = tl.sum(tl.where(at_i, inv, 0.0), 0)
        a = a + tl.sum(a[:, None] * inv, 0)
        inv = tl.where(at_i, a[None, :], inv)
    M = inv + tl.where(rows[:, None] == cc[None, :], 1.0, 0.0)
    tl.store(M_ptr + (chk + rows[:, None]) * C + cc[None, :], M)

    tok_k = ((b * T + n * C).to(tl.int64) * H + h) * K
    for k0 in range(0, K, BK):
        kc = k0 + tl.arange(0, BK)
        kmask = (kc < K)[None, :]
        ch = (chk + rows[:, None]) * K + kc[None, :]
        k = tl.load(k_ptr + tok_k + rows[:, None] * (H * K) + kc[None, :], mask=valid & kmask, other=0.0)
        k = k.to(tl.float32)
        G = tl.load(G_ptr + ch, mask=kmask, other=0.0)
        G_last = tl.load(G_ptr + (chk + C - 1) * K + kc, mask=kc < K, other=0.0)
        tl.store(W_ptr + ch, _dot(M, k * tl.exp(G) * beta, SPLIT, PREC), mask=kmask)
        tl.store(kout_ptr + ch, k * tl.exp(G_last[None, :] - G), mask=kmask)
    tok_v = ((b * T + n * C).to(tl.int64) * H + h) * V
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        vmask = (vc < V)[None, :]
        v = tl.load(v_ptr + tok_v + rows[:, None] * (H * V) + vc[None, :], mask=valid & vmask, other=0.0)
        U = _dot(M, v.to(tl.float32) * beta, SPLIT, PREC)
        tl.store(U_ptr + (chk + rows[:, None]) * V + vc[None, :], U, mask=vmask)


@triton.jit
def _kda_fwd_state_kernel(
    G_ptr, W_ptr, U_ptr, kout_ptr, h0_ptr, S_ptr, vnew_ptr, ht_ptr,
    K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Program (b*H + h, V-block): the state through the chunks in order. Saves the state entering each
    chunk and the pseudo-values V' = U - W S; S <- Diag(exp(G_C)) S + (exp(G_C - G) K)^T V'."""
    bh = tl.program_id(0)
    BH = tl.num_programs(0)
    rows = tl.arange(0, C)
    kr = tl.arange(0, BK)
    vc = tl.program_id(1) * BV + tl.arange(0, BV)
    kmask = (kr < K)[None, :]
    vmask = (vc < V)[None, :]
    s_mask = (kr < K)[:, None] & vmask
    s_offs = kr[:, None] * V + vc[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + bh.to(tl.int64) * K * V + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(N):
        chk = (n * BH + bh).to(tl.int64)
        tl.store(S_ptr + chk * K * V + s_offs, S, mask=s_mask)
        W = tl.load(W_ptr + (chk * C + rows[:, None]) * K + kr[None, :], mask=kmask, other=0.0)
        U = tl.load(U_ptr + (chk * C + rows[:, None]) * V + vc[None, :], mask=vmask, other=0.0)
        v_new = U - _dot(W, S, SPLIT, PREC)
        tl.store(vnew_ptr + (chk * C + rows[:, None]) * V + vc[None, :], v_new, mask=vmask)
        k_out = tl.load(kout_ptr + (chk * C + rows[:, None]) * K + kr[None, :], mask=kmask, other=0.0)
        G_last = tl.load(G_ptr + (chk * C + C - 1) * K + kr, mask=kr < K, other=0.0)
        S = S * tl.exp(G_last)[:, None] + _dot(tl.trans(k_out), v_new, SPLIT, PREC)
    tl.store(ht_ptr + bh.to(tl.int64) * K * V + s_offs, S, mask=s_mask)


@triton.jit
def _kda_fwd_o_kernel(
    q_ptr, G_ptr, Aqk_ptr, S_ptr, vnew_ptr, o_ptr,
    scale, T, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BCD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (chunk, b*H + h, V-block): O = scale ((Gamma Q) S + A_qk V'), over blocks of K and of C."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    vc = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = (vc < V)[None, :]
    chk = (n * tl.num_programs(1) + bh).to(tl.int64)
    valid = (rows < T - n * C)[:, None]
    tok_q = ((b * T + n * C).to(tl.int64) * H + h) * K
    o = tl.zeros([C, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kc = k0 + tl.arange(0, BK)
        kmask = (kc < K)[None, :]
        q = tl.load(q_ptr + tok_q + rows[:, None] * (H * K) + kc[None, :], mask=valid & kmask, other=0.0)
        G = tl.load(G_ptr + (chk * C + rows[:, None]) * K + kc[None, :], mask=kmask, other=0.0)
        S = tl.load(S_ptr + chk * K * V + kc[:, None] * V + vc[None, :], mask=(kc < K)[:, None] & vmask, other=0.0)
        o = tl.dot(q.to(tl.float32) * tl.exp(G), S, acc=o, input_precision=PREC)
    for c0 in range(0, C, BCD):
        cc = c0 + tl.arange(0, BCD)
        A = tl.load(Aqk_ptr + (chk * C + rows[:, None]) * C + cc[None, :])
        v_new = tl.load(vnew_ptr + (chk * C + cc[:, None]) * V + vc[None, :], mask=vmask, other=0.0)
        o = tl.dot(A, v_new, acc=o, input_precision=PREC)
    tok_v = ((b * T + n * C).to(tl.int64) * H + h) * V
    o_ptrs = o_ptr + tok_v + rows[:, None] * (H * V) + vc[None, :]
    tl.store(o_ptrs, (o * scale).to(o_ptr.dtype.element_ty), mask=valid & vmask)


# ---------------------------------------------------------------------------------------------------------
# Backward kernels. dO' = scale dO; dS_out[n] is the gradient w.r.t. the state leaving chunk n.


@triton.jit
def _kda_bwd_state_kernel(
    q_ptr, do_ptr, G_ptr, Aqk_ptr, W_ptr, kout_ptr, dht_ptr, dS_ptr, dvnew_ptr, dh0_ptr,
    scale, T, H, K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Program (b*H + h, V-block): the state gradient through the chunks in reverse. Saves dS_out[n] and
    dV' = A_qk^T dO' + (exp(G_C - G) K) dS_out; dS_in = exp(G_C) dS_out + (Gamma Q)^T dO' - W^T dV'."""
    bh = tl.program_id(0)
    BH = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    cc = tl.arange(0, C)
    kr = tl.arange(0, BK)
    vc = tl.program_id(1) * BV + tl.arange(0, BV)
    kmask = (kr < K)[None, :]
    vmask = (vc < V)[None, :]
    s_mask = (kr < K)[:, None] & vmask
    s_offs = kr[:, None] * V + vc[None, :]
    dS = tl.load(dht_ptr + bh.to(tl.int64) * K * V + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    for i in range(N):
        n = N - 1 - i
        chk = (n * BH + bh).to(tl.int64)
        tl.store(dS_ptr + chk * K * V + s_offs, dS, mask=s_mask)
        valid = (rows < T - n * C)[:, None]
        tok_k = ((b * T + n * C).to(tl.int64) * H + h) * K
        tok_v = ((b * T + n * C).to(tl.int64) * H + h) * V
        do = tl.load(do_ptr + tok_v + rows[:, None] * (H * V) + vc[None, :], mask=valid & vmask, other=0.0)
        do = do.to(tl.float32) * scale
        A = tl.load(Aqk_ptr + (chk * C + rows[:, None]) * C + cc[None, :])
        k_out = tl.load(kout_ptr + (chk * C + rows[:, None]) * K + kr[None, :], mask=kmask, other=0.0)
        dv_new = _dot(k_out, dS, SPLIT, PREC) + _dot(tl.trans(A), do, SPLIT, PREC)
        tl.store(dvnew_ptr + (chk * C + rows[:, None]) * V + vc[None, :], dv_new, mask=vmask)
        G = tl.load(G_ptr + (chk * C + rows[:, None]) * K + kr[None, :], mask=kmask, other=0.0)
        G_last = tl.load(G_ptr + (chk * C + C - 1) * K + kr, mask=kr < K, other=0.0)
        q = tl.load(q_ptr + tok_k + rows[:, None] * (H * K) + kr[None, :], mask=valid & kmask, other=0.0)
        W = tl.load(W_ptr + (chk * C + rows[:, None]) * K + kr[None, :], mask=kmask, other=0.0)
        dS = dS * tl.exp(G_last)[:, None] + _dot(tl.trans(q.to(tl.float32) * tl.exp(G)), do, SPLIT, PREC)
        dS = dS - _dot(tl.trans(W), dv_new, SPLIT, PREC)
    if HAS_H0:
        tl.store(dh0_ptr + bh.to(tl.int64) * K * V + s_offs, dS.to(dh0_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _kda_bwd_chunk_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, do_ptr, G_ptr, Akk_ptr, M_ptr, W_ptr, U_ptr, vnew_ptr, S_ptr, dS_ptr, dvnew_ptr,
    dv_ptr, dbeta_ptr, dAqk_ptr, dAkk_ptr, dqp_ptr, dkp_ptr, dGp_ptr,
    scale, T, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (chunk, b*H + h): everything but the score matrices' own backward.

    With X = [W | U] = M Y, Y = Diag(beta) [Gamma K | V], dX = [-dV' S^T | dV']: dY = M^T dX, dL = -dY X^T
    (L = Diag(beta) A_kk). Writes dv and dbeta, dA_qk = dO' V'^T and dA_kk = Diag(beta) dL (masked), and
    the partial dq, dk, dG (log-decay gradient before the suffix sum) of Gamma Q, Y, exp(G_C - G) K, exp(G_C)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    cc = tl.arange(0, C)
    chk = (n * tl.num_programs(1) + bh).to(tl.int64)
    n_valid = T - n * C
    valid = rows < n_valid
    tok_k = ((b * T + n * C).to(tl.int64) * H + h) * K
    tok_v = ((b * T + n * C).to(tl.int64) * H + h) * V
    beta = tl.load(beta_ptr + (b * T + n * C + rows).to(tl.int64) * H + h, mask=valid, other=0.0).to(tl.float32)
    M_t = tl.trans(tl.load(M_ptr + (chk * C + rows[:, None]) * C + cc[None, :]))
    cv = tl.arange(0, BV)
    ck = tl.arange(0, BK)

    # V' and U side: dA_qk, dY_v = M^T dV' (-> dv, dbeta), dL -= dY_v U^T.
    dA_qk = tl.zeros([C, C], dtype=tl.float32)
    dL = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vc = v0 + cv
        vmask = (vc < V)[None, :]
        io = tok_v + rows[:, None] * (H * V) + vc[None, :]
        ch = (chk * C + rows[:, None]) * V + vc[None, :]
        do = tl.load(do_ptr + io, mask=valid[:, None] & vmask, other=0.0).to(tl.float32) * scale
        v = tl.load(v_ptr + io, mask=valid[:, None] & vmask, other=0.0).to(tl.float32)
        v_new = tl.load(vnew_ptr + ch, mask=vmask, other=0.0)
        dv_new = tl.load(dvnew_ptr + ch, mask=vmask, other=0.0)
        U = tl.load(U_ptr + ch, mask=vmask, other=0.0)
        dA_qk = tl.dot(do, tl.trans(v_new), acc=dA_qk, input_precision=PREC)
        dY = _dot(M_t, dv_new, SPLIT, PREC)
        tl.store(dv_ptr + io, (beta[:, None] * dY).to(dv_ptr.dtype.element_ty), mask=valid[:, None] & vmask)
        dbeta += tl.sum(dY * v, 1)
        dL -= tl.dot(dY, tl.trans(U), input_precision=PREC)

    # K side, one block of K columns at a time: reductions over V of S and dS_out first.
    for k0 in range(0, K, BK):
        kc = k0 + ck
        kmask = (kc < K)[None, :]
        dq = tl.zeros([C, BK], dtype=tl.float32)  # dO' S^T
        dW = tl.zeros([C, BK], dtype=tl.float32)  # -dV' S^T
        dk_out = tl.zeros([C, BK], dtype=tl.float32)  # V' dS_out^T
        dS_dot = tl.zeros([BK], dtype=tl.float32)  # sum_v S dS_out
        for v0 in range(0, V, BV):
            vc = v0 + cv
            vmask = (vc < V)[None, :]
            ch = (chk * C + rows[:, None]) * V + vc[None, :]
            s_offs = chk * K * V + kc[:, None] * V + vc[None, :]
            s_mask = (kc < K)[:, None] & vmask
            S = tl.load(S_ptr + s_offs, mask=s_mask, other=0.0)
            dS = tl.load(dS_ptr + s_offs, mask=s_mask, other=0.0)
            do = tl.load(do_ptr + tok_v + rows[:, None] * (H * V) + vc[None, :],
                         mask=valid[:, None] & vmask, other=0.0).to(tl.float32) * scale
            v_new = tl.load(vnew_ptr + ch, mask=vmask, other=0.0)
            dv_new = tl.load(dvnew_ptr + ch, mask=vmask, other=0.0)
            dq = tl.dot(do, tl.trans(S), acc=dq, input_precision=PREC)
            dW -= tl.dot(dv_new, tl.trans(S), input_precision=PREC)
            dk_out = tl.dot(v_new, tl.trans(dS), acc=dk_out, input_precision=PREC)
            dS_dot += tl.sum(S * dS, 1)
        io = tok_k + rows[:, None] * (H * K) + kc[None, :]
        ch = (chk * C + rows[:, None]) * K + kc[None, :]
        q = tl.load(q_ptr + io, mask=valid[:, None] & kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + io, mask=valid[:, None] & kmask, other=0.0).to(tl.float32)
        G = tl.load(G_ptr + ch, mask=kmask, other=0.0)
        W = tl.load(W_ptr + ch, mask=kmask, other=0.0)
        G_last = tl.load(G_ptr + (chk * C + C - 1) * K + kc, mask=kc < K, other=0.0)
        gamma = tl.exp(G)
        dq = dq * gamma
        dY = _dot(M_t, dW, SPLIT, PREC)
        dL -= tl.dot(dY, tl.trans(W), input_precision=PREC)
        dbeta += tl.sum(dY * gamma * k, 1)
        dk_y = beta[:, None] * gamma * dY
        dk_out = dk_out * tl.exp(G_last[None, :] - G)
        dG = q * dq + k * (dk_y - dk_out)
        dG_last = tl.sum(k * dk_out, 0) + tl.exp(G_last) * dS_dot
        dG = tl.where((rows == C - 1)[:, None], dG + dG_last[None, :], dG)
        tl.store(dqp_ptr + ch, dq, mask=kmask)
        tl.store(dkp_ptr + ch, dk_y + dk_out, mask=kmask)
        tl.store(dGp_ptr + ch, dG, mask=kmask)

    cc_offs = (chk * C + rows[:, None]) * C + cc[None, :]
    dL = tl.where(rows[:, None] > cc[None, :], dL, 0.0)
    dbeta += tl.sum(dL * tl.load(Akk_ptr + cc_offs), 1)
    tl.store(dAkk_ptr + cc_offs, beta[:, None] * dL)
    tl.store(dAqk_ptr + cc_offs, tl.where(rows[:, None] >= cc[None, :], dA_qk, 0.0))
    tl.store(dbeta_ptr + (b * T + n * C + rows).to(tl.int64) * H + h, dbeta.to(dbeta_ptr.dtype.element_ty),
             mask=valid)


@triton.jit
def _kda_bwd_scores_kernel(
    q_ptr, k_ptr, G_ptr, dAqk_ptr, dAkk_ptr, dqp_ptr, dkp_ptr, dGp_ptr, dq_ptr, dk_ptr, dg_ptr,
    T, H, K,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (chunk, b*H + h, K-block): the score matrices' backward, then dg = suffix sums of dG.

    Blocks of BC rows R from the last: R as rows (columns before R, through R's first row), R as columns
    (rows after R, through R's last row) and the diagonal block column by column. Every term
    x_i y_j exp(G_i - G_j) gives dG_i += x_i dx_i and dG_j -= y_j dy_j, so dG = q dq + k (dk_row - dk_col)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    sub = tl.arange(0, BC)
    kc = tl.program_id(2) * BK + tl.arange(0, BK)
    kmask = (kc < K)[None, :]
    chk = (n * tl.num_programs(1) + bh).to(tl.int64) * C
    n_valid = T - n * C
    tok = ((b * T + n * C).to(tl.int64) * H + h) * K

    io_all = tok + rows[:, None] * (H * K) + kc[None, :]
    q_all = tl.load(q_ptr + io_all, mask=(rows < n_valid)[:, None] & kmask, other=0.0).to(tl.float32)
    k_all = tl.load(k_ptr + io_all, mask=(rows < n_valid)[:, None] & kmask, other=0.0).to(tl.float32)
    G_all = tl.load(G_ptr + (chk + rows[:, None]) * K + kc[None, :], mask=kmask, other=0.0)
    carry = tl.zeros([BK], dtype=tl.float32)  # sum of dG over the rows after the current block
    for blk_rev in range(C // BC):
        r0 = C - BC - blk_rev * BC
        r1 = r0 + BC - 1
        ri = r0 + sub
        in_mask = (ri < n_valid)[:, None] & kmask
        io = tok + ri[:, None] * (H * K) + kc[None, :]
        ch = (chk + ri[:, None]) * K + kc[None, :]
        q_r = tl.load(q_ptr + io, mask=in_mask, other=0.0).to(tl.float32)
        k_r = tl.load(k_ptr + io, mask=in_mask, other=0.0).to(tl.float32)
        G_r = tl.load(G_ptr + ch, mask=kmask, other=0.0)
        G_first = tl.load(G_ptr + (chk + r0) * K + kc, mask=kc < K, other=0.0)
        G_lastr = tl.load(G_ptr + (chk + r1) * K + kc, mask=kc < K, other=0.0)
        a_rows = (chk + ri[:, None]) * C + rows[None, :]  # dA[R, :]
        a_cols = (chk + rows[:, None]) * C + ri[None, :]  # dA[:, R]
        # R as rows, columns j < r0.
        k_col = k_all * tl.exp(tl.where((rows < r0)[:, None], G_first[None, :] - G_all, float("-inf")))
        row_decay = tl.exp(G_r - G_first[None, :])
        dq_r = _dot(tl.load(dAqk_ptr + a_rows), k_col, SPLIT, PREC) * row_decay
        dk_row = _dot(tl.load(dAkk_ptr + a_rows), k_col, SPLIT, PREC) * row_decay
        # R as columns, rows i > r1.
        after = tl.exp(tl.where((rows > r1)[:, None], G_all - G_lastr[None, :], float("-inf")))
        dk_col = _dot(tl.trans(tl.load(dAqk_ptr + a_cols)), q_all * after, SPLIT, PREC)
        dk_col += _dot(tl.trans(tl.load(dAkk_ptr + a_cols)), k_all * after, SPLIT, PREC)
        dk_col = dk_col * tl.exp(G_lastr[None, :] - G_r)
        # The diagonal block, column j at a time (dA is zero above the diagonal).
        for jj in range(BC):
            j = r0 + jj
            k_j = tl.load(k_ptr + tok + j * (H * K) + kc, mask=kc < tl.where(j < n_valid, K, 0), other=0.0)
            k_j = k_j.to(tl.float32)
            G_j = tl.load(G_ptr + (chk + j) * K + kc, mask=kc < K, other=0.0)
            a_qk = tl.load(dAqk_ptr + (chk + ri) * C + j)
            a_kk = tl.load(dAkk_ptr + (chk + ri) * C + j)
            e = tl.exp(tl.where((ri >= j)[:, None], G_r - G_j[None, :], float("-inf")))
            dq_r += a_qk[:, None] * k_j[None, :] * e
            dk_row += a_kk[:, None] * k_j[None, :] * e
            col = tl.sum((a_qk[:, None] * q_r + a_kk[:, None] * k_r) * e, 0)
            dk_col = tl.where((sub == jj)[:, None], dk_col + col[None, :], dk_col)
        dG = tl.load(dGp_ptr + ch, mask=kmask, other=0.0) + q_r * dq_r + k_r * (dk_row - dk_col)
        dq = tl.load(dqp_ptr + ch, mask=kmask, other=0.0) + dq_r
        dk = tl.load(dkp_ptr + ch, mask=kmask, other=0.0) + dk_row + dk_col
        dg = tl.cumsum(dG, 0, reverse=True) + carry[None, :]
        carry += tl.sum(dG, 0)
        tl.store(dq_ptr + io, dq.to(dq_ptr.dtype.element_ty), mask=in_mask)
        tl.store(dk_ptr + io, dk.to(dk_ptr.dtype.element_ty), mask=in_mask)
        tl.store(dg_ptr + io, dg.to(dg_ptr.dtype.element_ty), mask=in_mask)


# ---------------------------------------------------------------------------------------------------------
# Wrappers.


def _config(kernel: str, device: torch.device, sizes: dict[str, int]) -> dict:
    return launch_config(kernel, device, _DEFAULTS[kernel], **sizes)


def _precision(cfg: dict, *xs: Tensor) -> str:
    """The tl.dot precision: the kernel's DOT_FP32 when any input is fp32 ("ieee": matches the fp32
    reference), TF32 for 16-bit inputs."""
    return cfg["DOT_FP32"] if any(x.dtype == torch.float32 for x in xs) else "tf32"


def _block(cfg: dict, key: str, size: int) -> int:
    """A configured block size, no larger than the padded dimension and at least 16 (tl.dot)."""
    return max(16, min(cfg[key], triton.next_power_of_2(size)))


def _launch(kernel, grid, cfg: dict, *args, **meta) -> None:
    kernel[grid](*args, **meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def chunk_saved_shapes(B: int, T: int, H: int, K: int, V: int, chunk_size: int) -> list[tuple[int, ...]]:
    """Shapes of what `kda_chunk_fwd` saves for `kda_chunk_bwd` (fp32, chunk-major, N = ceil(T / C)):
    G (in-chunk cumulative log decay), A_qk, A_kk, M = (I + Diag(beta) A_kk)^-1, W, U, exp(G_C - G) K,
    the pseudo-values V' and the state entering each chunk."""
    C = chunk_size
    lead = (-(-T // C), B, H)
    return [(*lead, C, K), (*lead, C, C), (*lead, C, C), (*lead, C, C), (*lead, C, K), (*lead, C, V), (*lead, C, K),
            (*lead, C, V), (*lead, K, V)]


def kda_chunk_fwd(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Chunked KDA forward: (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32, saved tensors)."""
    C = chunk_size
    if C < SUB or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two >= {SUB}, got {C}")
    q, k, v, g, beta = (x.contiguous() for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, BH = triton.cdiv(T, C), B * H
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    saved = [torch.empty(s, dtype=torch.float32, device=dev) for s in chunk_saved_shapes(B, T, H, K, V, C)]
    G, A_qk, A_kk, M, W, U, k_out, v_new, S = saved
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    final = torch.empty(B, H, K, V, dtype=torch.float32, device=dev)
    h0 = initial_state_BHKV.contiguous() if initial_state_BHKV is not None else final
    BK = max(16, triton.next_power_of_2(K))
    sizes = dict(K=K, V=V, C=C, T=T, BH=BH)

    cfg = _config("kda_cumsum", dev, sizes)
    _launch(_kda_cumsum_kernel, (N, BH), cfg, g, G, T, H, K, C=C, BK=BK)
    cfg = _config("kda_fwd_scores", dev, sizes)
    _launch(_kda_fwd_scores_kernel, (N, BH), cfg, q, k, G, A_qk, A_kk, T, H, K,
            C=C, BC=SUB, BK=_block(cfg, "BLOCK_K", K), PREC=_precision(cfg, q, k, v))
    cfg = _config("kda_fwd_ut", dev, sizes)
    _launch(_kda_fwd_ut_kernel, (N, BH), cfg, k, v, beta, G, A_kk, M, W, U, k_out, T, H, K, V,
            C=C, BK=_block(cfg, "BLOCK_K", K), BV=_block(cfg, "BLOCK_V", V), SPLIT=cfg["SPLIT"],
            PREC=_precision(cfg, q, k, v))
    cfg = _config("kda_fwd_state", dev, sizes)
    BV = _block(cfg, "BLOCK_V", V)
    _launch(_kda_fwd_state_kernel, (BH, triton.cdiv(V, BV)), cfg, G, W, U, k_out, h0, S, v_new, final, K, V, N,
            C=C, BK=BK, BV=BV, HAS_H0=initial_state_BHKV is not None, SPLIT=cfg["SPLIT"], PREC=_precision(cfg, q, k, v))
    cfg = _config("kda_fwd_o", dev, sizes)
    BV = _block(cfg, "BLOCK_V", V)
    _launch(_kda_fwd_o_kernel, (N, BH, triton.cdiv(V, BV)), cfg, q, G, A_qk, S, v_new, o, scale, T, H, K, V,
            C=C, BK=_block(cfg, "BLOCK_K", K), BCD=min(cfg["BLOCK_C"], C), BV=BV, PREC=_precision(cfg, q, k, v))
    return o, final, saved


def kda_chunk_bwd(
    do_BTHV: Tensor,
    dstate_BHKV: Tensor,
    saved: list[Tensor],
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients (dq, dk, dv, dg, dbeta, dinitial_state or None) of `kda_chunk_fwd` from what it saved;
    each in its input's shape and dtype. dstate is the gradient of the final state."""
    G, A_qk, A_kk, M, W, U, k_out, v_new, S = saved
    q, k, v, g, beta, do = (x.contiguous() for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, do_BTHV))
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, C = G.shape[0], G.shape[3]
    BH = B * H
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    dS = torch.empty(N, B, H, K, V, **f32)  # gradient w.r.t. the state leaving each chunk
    dv_new = torch.empty(N, B, H, C, V, **f32)
    dA_qk, dA_kk = torch.empty(2, N, B, H, C, C, **f32)
    dq_p, dk_p, dG_p = torch.empty(3, N, B, H, C, K, **f32)
    dq, dk, dv, dg, dbeta = (torch.empty_like(x) for x in (q, k, v, g, beta))
    has_h0 = initial_state_BHKV is not None
    dh0 = torch.empty(B, H, K, V, dtype=initial_state_BHKV.dtype, device=dev) if has_h0 else dS
    BK = max(16, triton.next_power_of_2(K))
    sizes = dict(K=K, V=V, C=C, T=T, BH=BH)

    cfg = _config("kda_bwd_state", dev, sizes)
    BV = _block(cfg, "BLOCK_V", V)
    _launch(_kda_bwd_state_kernel, (BH, triton.cdiv(V, BV)), cfg, q, do, G, A_qk, W, k_out,
            dstate_BHKV.contiguous(), dS, dv_new, dh0, scale, T, H, K, V, N,
            C=C, BK=BK, BV=BV, HAS_H0=has_h0, SPLIT=cfg["SPLIT"], PREC=_precision(cfg, q, k, v))
    cfg = _config("kda_bwd_chunk", dev, sizes)
    _launch(_kda_bwd_chunk_kernel, (N, BH), cfg, q, k, v, beta, do, G, A_kk, M, W, U, v_new, S, dS, dv_new,
            dv, dbeta, dA_qk, dA_kk, dq_p, dk_p, dG_p, scale, T, H, K, V,
            C=C, BK=_block(cfg, "BLOCK_K", K), BV=_block(cfg, "BLOCK_V", V), SPLIT=cfg["SPLIT"],
            PREC=_precision(cfg, q, k, v))
    cfg = _config("kda_bwd_scores", dev, sizes)
    BKS = _block(cfg, "BLOCK_K", K)
    _launch(_kda_bwd_scores_kernel, (N, BH, triton.cdiv(K, BKS)), cfg, q, k, G, dA_qk, dA_kk, dq_p, dk_p, dG_p,
            dq, dk, dg, T, H, K, C=C, BC=SUB, BK=BKS, SPLIT=cfg["SPLIT"], PREC=_precision(cfg, q, k, v))
    return dq, dk, dv, dg, dbeta, (dh0 if has_h0 else None)


def kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
    chunk_size: int,
) -> list[Tensor]:
    """The k3::kda_chunk op's Triton implementation: [o, final state, *saved] (kernels.binding names it)."""
    o, S, saved = kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, chunk_size)
    return [o, S, *saved]


def kda_chunk_bwd_op(
    do: Tensor,
    dstate: Tensor,
    saved: list[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None,
    initial_state: Tensor | None,
) -> list[Tensor]:
    """The k3::kda_chunk_bwd op's Triton implementation: [dq, dk, dv, dg, dbeta, dinitial_state (empty
    without one)]."""
    grads = kda_chunk_bwd(do, dstate, saved, q, k, v, g, beta, scale, initial_state)
    return [*grads[:5], q.new_empty(0) if grads[5] is None else grads[5]]
