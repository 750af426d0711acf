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


# Floor for fp32 decay exponents. exp(-40) ~ 4e-18 is zero next to the O(1) terms it is added to (fp32
# resolves 1e-7), and flooring keeps exp and later products out of the slow underflow / subnormal paths.
_EXP_FLOOR = -40.0


def _decay(log_decay: Tensor) -> Tensor:
    """exp of a log decay (<= 0); in fp32 the argument is floored at _EXP_FLOOR (float64 is left exact)."""
    if log_decay.dtype == torch.float64:
        return torch.exp(log_decay)
    return torch.exp(log_decay.clamp_min(_EXP_FLOOR))


# Per-token log decays below this are treated as this value inside the diagonal blocks only: a decay of
# exp(-87) is already below fp32's smallest normal number, so nothing representable changes.
_DIAG_G_FLOOR = -87.0


def _sub_chunk(chunk_size: int) -> int:
    """Diagonal block size of `_intra_chunk_scores`: 16, or the whole chunk when 16 does not divide it."""
    return 16 if chunk_size % 16 == 0 else chunk_size


def _intra_chunk_scores(
    q_NCK: Tensor, k_NCK: Tensor, g_NCK: Tensor, G_NCK: Tensor, sub: int
) -> tuple[Tensor, Tensor]:
    """A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, and A_kk (k in place of q) for j < i.

    exp(G_i - G_j) is never formed from exp(G_i) * exp(-G_j) over a whole chunk, which overflows fp32
    for strong decays. Blocks below the diagonal factor it through the first position r of the row block,
    exp(G_i - G_r) * exp(G_r - G_j), both factors in (0, 1]. Diagonal blocks (size `sub`) factor through
    the block's middle in float64, where a span of sub/2 steps of at most 87 each cannot overflow.
    Leading dims are batch dims; returns two masked [..., C, C] matrices in the compute dtype.
    """
    C = q_NCK.shape[-2]
    ns = C // sub
    dtype = q_NCK.dtype
    tri = torch.ones(sub, sub, dtype=torch.bool, device=q_NCK.device).tril()

    D = g_NCK.clamp_min(_DIAG_G_FLOOR).double().unflatten(-2, (ns, sub)).cumsum(-2)
    D = D - D[..., sub // 2 : sub // 2 + 1, :]
    q_up, k_up = q_NCK.double().unflatten(-2, (ns, sub)), k_NCK.double().unflatten(-2, (ns, sub))
    k_down = (k_up * torch.exp(-D)).transpose(-1, -2)
    decay_up = torch.exp(D)
    # where, not a multiply: entries above the diagonal may overflow to inf and must not make NaNs.
    diag_qk = torch.where(tri, (q_up * decay_up) @ k_down, 0.0).to(dtype)
    diag_kk = torch.where(tri.tril(-1), (k_up * decay_up) @ k_down, 0.0).to(dtype)

    G_blk = G_NCK.unflatten(-2, (ns, sub))
    row_decay = _decay(G_blk - G_blk[..., :1, :])  # exp(G_i - G_r) <= 1, r = first of the row block
    rows_qk, rows_kk = [], []
    for a in range(ns):
        lo, hi = a * sub, (a + 1) * sub
        right = q_NCK.new_zeros(*q_NCK.shape[:-2], sub, C - hi)
        if a == 0:
            rows_qk.append(torch.cat([diag_qk[..., 0, :, :], right], dim=-1))
            rows_kk.append(torch.cat([diag_kk[..., 0, :, :], right], dim=-1))
            continue
        cols = (k_NCK[..., :lo, :] * _decay(G_NCK[..., lo : lo + 1, :] - G_NCK[..., :lo, :])).transpose(-1, -2)
        off_qk = (q_NCK[..., lo:hi, :] * row_decay[..., a, :, :]) @ cols
        off_kk = (k_NCK[..., lo:hi, :] * row_decay[..., a, :, :]) @ cols
        rows_qk.append(torch.cat([off_qk, diag_qk[..., a, :, :], right], dim=-1))
        rows_kk.append(torch.cat([off_kk, diag_kk[..., a, :, :], right], dim=-1))
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
        return x.permute(0, 2, 1, 3).unflatten(2, (N, C)).contiguous()

    q, k, v, g = chunks(q_BTHK), chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    beta = chunks(beta_BTH[..., None])  # [B, H, N, C, 1]
    G = g.cumsum(-2)
    G_last = G[..., -1:, :]  # [B, H, N, 1, K]

    A_qk, A_kk = _intra_chunk_scores(q, k, g, G, _sub_chunk(C))
    decay_in = _decay(G)  # Gamma: decay from the chunk start to each token
    rhs = beta * torch.cat([k * decay_in, v], dim=-1)
    X = torch.linalg.solve_triangular(beta * A_kk, rhs, upper=False, unitriangular=True)
    W, U = X[..., :K], X[..., K:]

    k_to_end = k * _decay(G_last - G)  # Gamma_{i->C} * K
    transition = torch.diag_embed(_decay(G_last[..., 0, :])) - k_to_end.transpose(-1, -2) @ W  # [B,H,N,K,K]
    inject = k_to_end.transpose(-1, -2) @ U  # [B, H, N, K, V]

    S = _initial_state(q_BTHK, v_BTHV, initial_state_BHKV, dtype)
    starts = []
    for n in range(N):
        starts.append(S)
        S = torch.baddbmm(inject[:, :, n].flatten(0, 1), transition[:, :, n].flatten(0, 1), S.flatten(0, 1))
        S = S.unflatten(0, (B, H))
    S_start = torch.stack(starts, dim=2) if starts else q.new_zeros(B, H, 0, K, V)

    q_in = q * decay_in - A_qk @ W  # O = (Gamma*Q - A_qk W) S + A_qk U
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
