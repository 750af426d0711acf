"""Kimi Delta Attention (KDA): PyTorch references for the recurrence, its chunked form and the layer gates.

Shapes: q_BTHK, k_BTHK, v_BTHV, g_BTHK (log decay, <= 0), beta_BTH, state_BHKV.
The recurrence per head (reference section 2), with S decayed first and then corrected by the delta rule:

    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t

Three independent forms live here: `kda_naive` (the literal matrix recurrence, float64-capable, for tests),
`kda_recurrent_ref` (token-by-token in fp32, built on the decode step `kda_step_ref`) and `kda_chunk_ref`
(the chunkwise-parallel UT-transform form used for training and prefill). Decays and states are fp32 (bf16
rounds a decay of 0.998 to 1.0); outputs take v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DECAY_FORMS = ("lower_bounded_sigmoid", "softplus")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32, or float64 when the inputs are float64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _initial_state(q_BTHK: Tensor, v_BTHV: Tensor, state_BHKV: Tensor | None, dtype: torch.dtype) -> Tensor:
    B, _, H, K = q_BTHK.shape
    if state_BHKV is None:
        return q_BTHK.new_zeros(B, H, K, v_BTHV.shape[-1], dtype=dtype)
    return state_BHKV.to(dtype)


def kda_naive(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Literal recurrence S_t = (I - beta k k^T) Diag(alpha) S + beta k v^T, one Python step per token.

    Computes in the inputs' precision (at least fp32) and returns (o in that precision, final state).
    Written from the matrix form on purpose, so it shares no code with the other two forms.
    """
    dtype = torch.promote_types(q_BTHK.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    S = torch.zeros(B, H, K, v.shape[-1], dtype=dtype) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    eye = torch.eye(K, dtype=dtype)
    outs = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        transition = eye - bt * kt[..., :, None] * kt[..., None, :]
        S = transition @ (torch.exp(g[:, t])[..., None] * S) + bt * kt[..., :, None] * v[:, t, :, None, :]
        outs.append(scale * (S.transpose(-1, -2) @ q[:, t, ..., None])[..., 0])
    return torch.stack(outs, dim=1), S


def kda_step_ref(
    q_BHK: Tensor,
    k_BHK: Tensor,
    v_BHV: Tensor,
    g_BHK: Tensor,
    beta_BH: Tensor,
    state_BHKV: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One decode step in the compute dtype: returns (o_BHV, new state). Inputs must already be upcast."""
    S = state_BHKV * torch.exp(g_BHK)[..., None]
    residual_BHV = v_BHV - torch.einsum("bhk,bhkv->bhv", k_BHK, S)
    S = S + (beta_BH[..., None] * k_BHK)[..., :, None] * residual_BHV[..., None, :]
    o_BHV = torch.einsum("bhk,bhkv->bhv", q_BHK * scale, S)
    return o_BHV, S


def kda_decode_step_ref(
    q_BHK: Tensor,
    k_BHK: Tensor,
    v_BHV: Tensor,
    g_BHK: Tensor,
    beta_BH: Tensor,
    state_BHKV: Tensor,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused single-token KDA step for decoding: (o_BHV in v's dtype, new fp32 state)."""
    dtype = _compute_dtype(q_BHK)
    scale = q_BHK.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH))
    o, S = kda_step_ref(q, k, v, g, beta, state_BHKV.to(dtype), scale)
    return o.to(v_BHV.dtype), S


def kda_recurrent_ref(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token KDA in fp32 (the naive step of fla's convention): (o_BTHV in v's dtype, final state)."""
    dtype = _compute_dtype(q_BTHK)
    scale = q_BTHK.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    S = _initial_state(q_BTHK, v_BTHV, initial_state_BHKV, dtype)
    outs = []
    for t in range(q.shape[1]):
        o_t, S = kda_step_ref(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, scale)
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.to(v_BTHV.dtype), S


def _sub_chunk(chunk_size: int) -> int:
    """Diagonal block size for the exact pairwise decay products (see `_intra_chunk_scores`)."""
    return 8 if chunk_size % 8 == 0 else chunk_size


def _intra_chunk_scores(q_NCK: Tensor, k_NCK: Tensor, G_NCK: Tensor, sub: int) -> tuple[Tensor, Tensor]:
    """A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, and A_kk (k in place of q) for j < i.

    exp(G_i - G_j) never overflows: blocks below the diagonal factor it through the first position r
    of the row block as exp(G_i - G_r) * exp(G_r - G_j), both factors in (0, 1]; the diagonal blocks
    of size `sub` take the exact pairwise products. Safe for any g <= 0 (also the unbounded softplus form).
    Leading dims are batch dims; returns two masked [..., C, C] matrices.
    """
    C = q_NCK.shape[-2]
    ns = C // sub
    G_blk, q_blk, k_blk = (t.unflatten(-2, (ns, sub)) for t in (G_NCK, q_NCK, k_NCK))
    # Diagonal blocks, exact: pair_k[a, i, j, d] = exp(G_id - G_jd) k_jd for i, j in block a.
    pair_k = torch.exp((G_blk[..., :, None, :] - G_blk[..., None, :, :]).clamp_max(0)) * k_blk[..., None, :, :]
    tri = torch.ones(sub, sub, dtype=torch.bool, device=q_NCK.device).tril()
    diag_qk = (pair_k @ q_blk[..., None])[..., 0] * tri
    diag_kk = (pair_k @ k_blk[..., None])[..., 0] * tri.tril(-1)
    rows_qk, rows_kk = [], []
    for a in range(ns):
        lo, hi = a * sub, (a + 1) * sub
        G_r = G_NCK[..., lo : lo + 1, :]
        row_decay = torch.exp(G_NCK[..., lo:hi, :] - G_r)  # exp(G_i - G_r) <= 1
        cols = k_NCK[..., :lo, :] * torch.exp(G_r - G_NCK[..., :lo, :])  # exp(G_r - G_j) <= 1 for j < r
        right = q_NCK.new_zeros(*q_NCK.shape[:-2], sub, C - hi)
        for rows, x_blk, diag in ((rows_qk, q_blk, diag_qk), (rows_kk, k_blk, diag_kk)):
            off = (x_blk[..., a, :, :] * row_decay) @ cols.transpose(-1, -2)
            rows.append(torch.cat([off, diag[..., a, :, :], right], dim=-1))
    return torch.cat(rows_qk, dim=-2), torch.cat(rows_kk, dim=-2)


def kda_chunk_ref(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel KDA (UT transform): (o_BTHV in v's dtype, final fp32 state).

    Per chunk (C tokens, Gamma = exp of the in-chunk cumulative log decay G):
      (I + A_kk) X = Diag(beta) [Gamma*K | V]  (unit lower triangular solve)  ->  W, U
      pseudo-values V' = U - W S;  O = (Gamma*Q) S + A_qk V';  S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V'.
    Everything that does not depend on the carried state is computed for all chunks at once; the chunk
    loop is a single matmul-add per chunk, S <- (Diag(gamma_C) - Kc^T W) S + Kc^T U. T is zero-padded
    to a multiple of C inside (padded tokens have k = 0, g = 0, so they leave the state alone).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    dtype = _compute_dtype(q_BTHK)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    scale = K**-0.5 if scale is None else scale

    def chunks(x: Tensor) -> Tensor:  # [B, T, H, X] -> [B, H, N, C, X]
        x = F.pad(x.to(dtype), (0, 0, 0, 0, 0, pad))
        return x.permute(0, 2, 1, 3).unflatten(2, (N, C))

    q, k, v, g = chunks(q_BTHK), chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    beta = chunks(beta_BTH[..., None])  # [B, H, N, C, 1]
    G = g.cumsum(-2)
    G_last = G[..., -1:, :]  # [B, H, N, 1, K]

    A_qk, A_kk = _intra_chunk_scores(q, k, G, _sub_chunk(C))
    gk = k * torch.exp(G)
    rhs = beta * torch.cat([gk, v], dim=-1)
    X = torch.linalg.solve_triangular(beta * A_kk, rhs, upper=False, unitriangular=True)
    W, U = X[..., :K], X[..., K:]

    k_to_end = k * torch.exp(G_last - G)  # Gamma_{i->C} * K
    transition = torch.diag_embed(torch.exp(G_last[..., 0, :])) - k_to_end.transpose(-1, -2) @ W  # [B,H,N,K,K]
    inject = k_to_end.transpose(-1, -2) @ U  # [B, H, N, K, V]

    S = _initial_state(q_BTHK, v_BTHV, initial_state_BHKV, dtype)
    starts = []
    for n in range(N):
        starts.append(S)
        S = torch.baddbmm(inject[:, :, n].flatten(0, 1), transition[:, :, n].flatten(0, 1), S.flatten(0, 1))
        S = S.unflatten(0, (B, H))
    S_start = torch.stack(starts, dim=2) if starts else q.new_zeros(B, H, 0, K, V)

    q_in = q * torch.exp(G) - A_qk @ W  # O = (Gamma*Q - A_qk W) S + A_qk U
    o = scale * (q_in @ S_start + A_qk @ U)
    o = o.flatten(2, 3)[:, :, :T].permute(0, 2, 1, 3)
    return o.to(v_BTHV.dtype), S


def kda_gate_ref(
    f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str, lower_bound: float
) -> Tensor:
    """Log decay g (fp32, <= 0) from the gate projection f, in one of the two published forms.

    lower_bounded_sigmoid (K3): g = lower_bound * sigmoid(exp(A_log_h) * (f + dt_bias))
    softplus (Kimi Linear):     g = -exp(A_log_h) * softplus(f + dt_bias)     (lower_bound unused)
    """
    H, K = f_BTHK.shape[-2:]
    x = f_BTHK.float() + dt_bias_P.float().view(H, K)
    a = torch.exp(A_log_H.float())[:, None]
    if form == "lower_bounded_sigmoid":
        return lower_bound * torch.sigmoid(a * x)
    if form == "softplus":
        return -a * F.softplus(x)
    raise ValueError(f"unknown KDA decay form {form!r}; expected one of {DECAY_FORMS}")


def l2_norm_ref(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (per head for q and k), computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
