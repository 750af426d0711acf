"""Kimi Delta Attention (KDA): PyTorch references for the recurrence, its chunked form and the layer gates.

Shapes: q_BTHK, k_BTHK, v_BTHV, g_BTHK (log decay, <= 0), beta_BTH, state_BHKV.
The recurrence per head (reference section 2), with S decayed first and then corrected by the delta rule:

    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t

Three independent forms live here: `kda_naive` (the literal matrix recurrence, float64-capable, for tests),
`kda_recurrent_ref` (token-by-token in fp32, built on the decode step `kda_step_ref`) and `kda_chunk_ref`
(the chunkwise-parallel UT-transform form used for training and prefill). Decays and states are fp32 (bf16
rounds a decay of 0.998 to 1.0; float64 inputs stay float64, for gradchecks); outputs take v's dtype.
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
    if initial_state_BHKV is None:
        S = q.new_zeros(B, H, K, v.shape[-1])
    else:
        S = initial_state_BHKV.to(dtype)
    eye = torch.eye(K, dtype=dtype, device=q.device)
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


# Diagonal 8x8 blocks factor exp(G_i - G_j) through the block's middle, a span of at most 4 steps, so a
# per-step floor of -21 (fp32) keeps every factor inside exp's range (4 * 21 < 88). The floor only bites
# where a decay exp(g) is below exp(-21) ~ 8e-10, and then moves a product that small by less than it.
_BASE = 8
_BASE_G_FLOOR = {torch.float32: -21.0, torch.float64: -170.0}


def _intra_chunk_scores(q_NCK: Tensor, k_NCK: Tensor, g_NCK: Tensor, G_NCK: Tensor) -> tuple[Tensor, Tensor]:
    """A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, and A_kk (k in place of q) for j < i.

    exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j) across a chunk: that overflows for strong
    decays. Instead, by halving: the lower-left quadrant of every diagonal block of size b (16, 32, 64)
    factors through the first row r of its lower half, exp(G_i - G_r) * exp(G_r - G_j), both in (0, 1];
    the 8x8 diagonal blocks factor through their middle with floored per-step decays (see _BASE_G_FLOOR).
    The reference points are detached: the products do not depend on them, so neither do the gradients.
    C must be a power of two. Leading dims are batch dims; returns two [..., C, C] matrices.
    """
    C = q_NCK.shape[-2]
    base = min(C, _BASE)
    n0 = C // base

    q_blk, k_blk = q_NCK.unflatten(-2, (n0, base)), k_NCK.unflatten(-2, (n0, base))
    D = g_NCK.clamp_min(_BASE_G_FLOOR[g_NCK.dtype]).unflatten(-2, (n0, base)).cumsum(-2)
    D = D - D[..., base // 2 : base // 2 + 1, :].detach()
    k_down = (k_blk * torch.exp(-D)).transpose(-1, -2)
    up = torch.exp(D)
    tri = torch.ones(base, base, dtype=torch.bool, device=q_NCK.device).tril()
    # where, not a multiply: entries above the diagonal may overflow to inf and must not make NaNs.
    A_qk = torch.where(tri, (q_blk * up) @ k_down, 0.0)  # [..., n0, base, base]
    A_kk = torch.where(tri.tril(-1), (k_blk * up) @ k_down, 0.0)

    b = 2 * base
    while b <= C:
        nb, h = C // b, b // 2
        G_lo, G_hi = G_NCK.unflatten(-2, (nb, b)).chunk(2, dim=-2)
        _, q_hi = q_NCK.unflatten(-2, (nb, b)).chunk(2, dim=-2)
        k_lo, k_hi = k_NCK.unflatten(-2, (nb, b)).chunk(2, dim=-2)
        G_r = G_hi[..., :1, :].detach()
        row_decay = _decay(G_hi - G_r)
        cols = (k_lo * _decay(G_r - G_lo)).transpose(-1, -2)
        zeros = q_NCK.new_zeros(*q_NCK.shape[:-2], nb, h, h)

        def merge(A: Tensor, rows: Tensor) -> Tensor:  # [[A_0, 0], [rows @ cols, A_1]] per block of size b
            A_0, A_1 = A.unflatten(-3, (nb, 2)).unbind(-3)
            lower = torch.cat([(rows * row_decay) @ cols, A_1], dim=-1)
            return torch.cat([torch.cat([A_0, zeros], dim=-1), lower], dim=-2)

        A_qk, A_kk = merge(A_qk, q_hi), merge(A_kk, k_hi)
        b *= 2
    return A_qk.squeeze(-3), A_kk.squeeze(-3)


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
    """Chunkwise-parallel KDA (UT transform): (o_BTHV in v's dtype, final state in the compute dtype).

    Per chunk (C tokens, Gamma = exp of the in-chunk cumulative log decay G):
      X = [W | U] = (I + A_kk)^-1 Diag(beta) [Gamma*K | V]   (A_kk strictly lower, rows scaled by beta)
      pseudo-values V' = U - W S;  O = (Gamma*Q) S + A_qk V';  S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V'.
    Everything that does not depend on the carried state is computed for all chunks at once; the chunk
    loop is a single matmul-add per chunk, S <- (Diag(gamma_C) - Kc^T W) S + Kc^T U. T is zero-padded
    to a multiple of C inside (padded tokens have k = 0, g = 0, so they leave the state alone).
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
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

    A_qk, A_kk = _intra_chunk_scores(q, k, g, G)
    decay_in = _decay(G)  # Gamma: decay from the chunk start to each token
    eye = torch.eye(C, dtype=dtype, device=q.device).expand_as(A_kk)
    # (I + Diag(beta) A_kk)^-1 through one batched triangular solve against I (faster on CPU than
    # solving against the wide right-hand side), then X = [W | U] = M Diag(beta) [Gamma*K | V].
    inverse = torch.linalg.solve_triangular(beta * A_kk, eye, upper=False, unitriangular=True)
    X = inverse @ (beta * torch.cat([k * decay_in, v], dim=-1))

    k_to_end = (k * _decay(G_last - G)).transpose(-1, -2)  # (Gamma_{i->C} * K)^T, [B, H, N, K, C]
    kW, inject = (k_to_end @ X).split([K, V], dim=-1)  # Kc^T W, Kc^T U: [B, H, N, K, K], [B, H, N, K, V]
    transition = torch.diag_embed(_decay(G_last[..., 0, :])) - kW

    S = _initial_state(q_BTHK, v_BTHV, initial_state_BHKV, dtype)
    starts = []
    # unbind once (not inject[:, :, n]): its backward is one stack, not N full-size zero-filled grads.
    for inject_n, transition_n in zip(inject.flatten(0, 1).unbind(1), transition.flatten(0, 1).unbind(1)):
        starts.append(S)
        S = torch.baddbmm(inject_n, transition_n, S.flatten(0, 1)).unflatten(0, (B, H))
    S_start = torch.stack(starts, dim=2)

    AW, AU = (A_qk @ X).split([K, V], dim=-1)  # O = (Gamma*Q - A_qk W) S + A_qk U
    o = scale * ((q * decay_in - AW) @ S_start + AU)
    o = o.flatten(2, 3)[:, :, :T].permute(0, 2, 1, 3)
    return o.to(v_BTHV.dtype), S


def gate_dtype(f: Tensor) -> torch.dtype:
    """The decay gate is fp32 whatever the activations are (float64 stays float64 for gradchecks)."""
    return torch.promote_types(f.dtype, torch.float32)


def kda_gate_ref(
    f_BTHK: Tensor, A_log_H: Tensor, dt_bias_P: Tensor, form: str, lower_bound: float
) -> Tensor:
    """Log decay g (<= 0, fp32; float64 for float64 f) from the gate projection f, in one of two forms.

    lower_bounded_sigmoid (K3): g = lower_bound * sigmoid(exp(A_log_h) * (f + dt_bias))
    softplus (Kimi Linear):     g = -exp(A_log_h) * softplus(f + dt_bias)     (lower_bound unused)
    """
    H, K = f_BTHK.shape[-2:]
    dtype = gate_dtype(f_BTHK)
    x = f_BTHK.to(dtype) + dt_bias_P.to(dtype).view(H, K)
    a = torch.exp(A_log_H.to(dtype))[:, None]
    if form == "lower_bounded_sigmoid":
        return lower_bound * torch.sigmoid(a * x)
    if form == "softplus":
        return -a * F.softplus(x)
    raise ValueError(f"unknown KDA decay form {form!r}; expected one of {DECAY_FORMS}")

