"""Kimi Delta Attention (KDA): PyTorch references for the recurrence, its chunked form and the layer gates.

Shapes: q_BTHK, k_BTHK, v_BTHV, g_BTHK (log decay, <= 0), beta_BTH, state_BHKV.
The recurrence per head (reference section 2), with S decayed first and then corrected by the delta rule:

    S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t

Three independent forms live here: `kda_naive` (the literal matrix recurrence, float64-capable, for tests),
`kda_recurrent_ref` (token-by-token in fp32, built on the decode step `kda_step_ref`) and `kda_chunk_ref`
(the chunkwise-parallel UT-transform form used for training and prefill). The chunked form comes as a
forward that keeps the costly part of what its backward needs (`kda_chunk_fwd`) and a hand-derived backward
(`kda_chunk_bwd`) that recomputes the rest, in parallel over chunks. The forward runs block by block of
chunks with its intermediates in a per-thread `Workspace`, so its time is linear in T and a long sequence
maps no fresh memory for them. Decays and states are fp32 (bf16 rounds a decay of 0.998 to 1.0; float64
inputs stay float64, for gradchecks); outputs take v's dtype.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from k3compile.kernels._common.consts import const

DECAY_FORMS = ("lower_bounded_sigmoid", "softplus")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32, or float64 when the inputs are float64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t.to(dtype) without dispatching the no-op cast."""
    return t if t.dtype == dtype else t.to(dtype)


def _shaped(t: Tensor, *shape: int) -> Tensor:
    """t.reshape(shape), as the one view it is for a contiguous t."""
    return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def _initial_state(q_BTHK: Tensor, v_BTHV: Tensor, state_BHKV: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The state before the first token in `dtype`: zeros, or a copy of the given one (never the input itself:
    over zero tokens it is the final state, and an op may not return its input)."""
    B, _, H, K = q_BTHK.shape
    if state_BHKV is None:
        return q_BTHK.new_zeros(B, H, K, v_BTHV.shape[-1], dtype=dtype)
    return state_BHKV.to(dtype, copy=True)


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
    return (torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)), S


def kda_step_ref(
    q_BHK: Tensor,
    k_BHK: Tensor,
    v_BHV: Tensor,
    g_BHK: Tensor,
    beta_BH: Tensor,
    state_BHKV: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One decode step in the compute dtype: returns (o_BHV, new state). Inputs must already be upcast.

    The two contractions over K are batched matrix-vector products, one bmm each over the B*H heads
    (what einsum("bhk,bhkv->bhv") runs, without its permutes).
    """
    B, H, K = k_BHK.shape
    V, n = v_BHV.shape[-1], B * H
    # the heads flattened (n = (b, h)) and views, not unsqueezes: one call each
    S_nKV = _shaped(state_BHKV, n, K, V) * _shaped(torch.exp(g_BHK), n, K, 1)
    k_n1K = _shaped(k_BHK, n, 1, K)
    residual_n1V = _shaped(v_BHV, n, 1, V) - torch.bmm(k_n1K, S_nKV)
    S_nKV = torch.addcmul(S_nKV, (_shaped(beta_BH, n, 1, 1) * k_n1K).view(n, K, 1), residual_n1V)
    o_n1V = torch.bmm(_shaped(q_BHK * const(scale, q_BHK), n, 1, K), S_nKV)
    return o_n1V.view(B, H, V), S_nKV.view(B, H, K, V)


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
    q, k, v, g, beta, state = (_as(t, dtype) for t in (q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV))
    o, S = kda_step_ref(q, k, v, g, beta, state, scale)
    return _as(o, v_BHV.dtype), S


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


# ---------------------------------------------------------------------------------------------------------
# Chunked form. All chunk tensors are chunk-major, [N, B, H, C, X]: one strided copy in and out, the leading
# dims fold into one bmm batch, and each chunk of the sequential state loop is one contiguous slice.

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E); exp2 is about 3x faster than exp on CPU

# The diagonal 8x8 blocks of the score matrices factor exp(G_i - G_j) through the block's middle, a span
# of at most 4 steps; a per-step floor on g keeps those factors (and the backward's products of them with
# gradients) inside the exponent range: fp32 4 * 18 * LOG2E = 104 < 127, float64 4 * 170 * LOG2E < 1023.
# The floor only bites where a decay exp(g) is below exp(-18) ~ 1.5e-8 (fp32), and then moves a product
# that small by less than it.
_BASE = 8
_BASE_G_FLOOR = {torch.float32: -18.0, torch.float64: -170.0}


class ChunkSaved(NamedTuple):
    """Every intermediate of the chunked forward its backward reads: chunk-major, in the compute dtype,
    N = ceil(T / C). Kept whole when the sequence is one block (`keeps_everything`: a training step then runs
    the forward once); a longer one keeps ChunkStates, and the backward recomputes the rest (`_recompute`)."""

    q: Tensor  # [N, B, H, C, K], zero-padded to N*C tokens
    k: Tensor  # [N, B, H, C, K]
    v: Tensor  # [N, B, H, C, V]
    beta: Tensor  # [N, B, H, C, 1]
    decay: Tensor  # [F, N, B, H, C, K]: the decay factors of _decay_factors
    A: Tensor  # [2, N, B, H, C, C]: A_qk (j <= i) and A_kk (j < i), zero above
    M: Tensor  # [N, B, H, C, C]: (I + Diag(beta) A_kk)^-1
    X: Tensor  # [N, B, H, C, K + V]: [W | U] = M Diag(beta) [Gamma*K | V]
    v_new: Tensor  # [N, B, H, C, V]: pseudo-values U - W S
    transition: Tensor  # [N, B, H, K, K]: Diag(gamma_C) - Kc^T W
    S: Tensor  # [N, B, H, K, V]: the state entering each chunk


class ChunkStates(NamedTuple):
    """What the chunked forward keeps of a sequence longer than a block: the part of ChunkSaved that is
    sequential (S) or costly to recompute (M). The backward recomputes the rest from the inputs, in parallel
    over chunks. Freshly mapped memory costs the kernel about 0.4 ms per MiB to fault in and zero: keeping
    ChunkSaved whole at T = 16384 cost as much system time as the computation's user time."""

    M: Tensor  # [N, B, H, C, C]
    S: Tensor  # [N, B, H, K, V]


# Chunk-heads per block of the forward (B * H * chunks): big enough that each batched matmul amortises its
# call, small enough that a block's intermediates (about 40 of them, 1 MiB each at C = K = V = 64) stay in
# the caches and the workspace stays small.
_BLOCK_CHUNK_HEADS = 64


def _block_chunks(B: int, H: int, N: int) -> int:
    """Chunks per block of the forward."""
    return max(1, min(N, _BLOCK_CHUNK_HEADS // (B * H)))


def _n_levels(C: int) -> int:
    """Number of halving levels above the base blocks (blocks of 16, 32, ..., C)."""
    return (C // min(C, _BASE)).bit_length() - 1


def _all_shapes(B: int, T: int, H: int, K: int, V: int, C: int) -> list[tuple[int, ...]]:
    """Shapes of the ChunkSaved fields, in order."""
    lead = (-(-T // C), B, H)
    return [(*lead, C, K), (*lead, C, K), (*lead, C, V), (*lead, C, 1), (4 + _n_levels(C), *lead, C, K),
            (2, *lead, C, C), (*lead, C, C), (*lead, C, K + V), (*lead, C, V), (*lead, K, K), (*lead, K, V)]


def chunk_for(T: int, chunk_size: int) -> int:
    """The chunk the forward runs for T tokens: chunk_size, or for a shorter sequence the smallest power of two
    holding it (at least the base block). Zero-padding a short sequence to a full chunk only adds work: the
    chunk's pairwise terms grow as C^2, so 16 tokens in a chunk of 64 cost several times those in one of 16.
    A symbolic T (torch.export's dynamic length) keeps chunk_size: choosing by it would specialise the length."""
    if not isinstance(T, int):
        return chunk_size
    return min(chunk_size, max(_BASE, 1 << max(T - 1, 0).bit_length()))


def keeps_everything(B: int, T: int, H: int, chunk_size: int) -> bool:
    """Whether the forward keeps ChunkSaved whole (else ChunkStates): when the sequence is one block."""
    N = -(-T // chunk_for(T, chunk_size))
    return _block_chunks(B, H, N) == N


def chunk_saved_shapes(B: int, T: int, H: int, K: int, V: int, chunk_size: int) -> list[tuple[int, ...]]:
    """Shapes of what the forward keeps, in order (for the op's fake impl): ChunkSaved's or ChunkStates'."""
    shapes = _all_shapes(B, T, H, K, V, chunk_for(T, chunk_size))
    return shapes if keeps_everything(B, T, H, chunk_size) else [shapes[6], shapes[10]]


def chunk_saved(tensors: Sequence[Tensor]) -> ChunkSaved | ChunkStates:
    """The forward's saved tensors (as the op returns them) as ChunkSaved or ChunkStates."""
    return (ChunkSaved if len(tensors) == len(ChunkSaved._fields) else ChunkStates)(*tensors)


class _Fresh:
    """Allocates every intermediate anew: for the backward, whose intermediates live until it returns."""

    @staticmethod
    def empty(name: str, shape: Sequence[int], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


class Workspace:
    """Buffers a long sequence's forward intermediates live in, kept from block to block and from call to call.

    The sequence is cut into blocks of chunks (`_block_chunks`), and every block reuses the same buffers:
    their size depends on B, H, K, V and the chunk size, not on T, and no call maps (and has the kernel zero)
    fresh memory for them. One flat buffer per (name, dtype, device), grown when a call needs more; one
    Workspace per thread.
    """

    def __init__(self) -> None:
        self._flat: dict[tuple, Tensor] = {}

    def empty(self, name: str, shape: Sequence[int], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A contiguous tensor of `shape` on `like`'s device, in `dtype` (default `like`'s), valid until `name`
        is asked for again."""
        n = math.prod(shape)
        key = (name, dtype or like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < n:
            flat = self._flat[key] = torch.empty(n, dtype=key[1], device=like.device)
        return flat[:n].view(shape)


_THREAD = threading.local()


def _workspace() -> Workspace:
    """This thread's Workspace."""
    if not hasattr(_THREAD, "workspace"):
        _THREAD.workspace = Workspace()
    return _THREAD.workspace


def _flat(x: Tensor) -> Tensor:
    """Leading dims folded into one bmm batch dim (a view for every chunk-major tensor here)."""
    return x.flatten(0, -3)


def _to_chunks(x_BTHX: Tensor, C: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """[B, T, H, X] -> chunk-major [N, B, H, C, X] in dtype, zero-padded to N*C tokens, in one strided copy
    (into `out` when given)."""
    B, T, H, X = x_BTHX.shape
    N, full = -(-T // C), T // C
    if out is None:
        out = torch.empty(N, B, H, C, X, dtype=dtype, device=x_BTHX.device)
    dst = out.permute(1, 0, 3, 2, 4)  # [B, N, C, H, X]
    if full:
        dst[:, :full].copy_(x_BTHX[:, : full * C].unflatten(1, (full, C)))
    if full < N:
        dst[:, full, : T - full * C].copy_(x_BTHX[:, full * C :])
        dst[:, full, T - full * C :].zero_()
    return out


def _from_chunks(x_NBHCX: Tensor, T: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """Chunk-major [N, B, H, C, X] -> [B, T, H, X] in dtype (padding dropped), in one strided copy (into `out`,
    a [B, T, H, X] view, when given; else a new contiguous tensor)."""
    N, B, H, C, X = x_NBHCX.shape
    full = T // C
    if out is None:
        out = torch.empty(B, T, H, X, dtype=dtype, device=x_NBHCX.device)
    src = x_NBHCX.permute(1, 0, 3, 2, 4)  # [B, N, C, H, X]
    if full:
        out[:, : full * C].unflatten(1, (full, C)).copy_(src[:, :full])
    if full < N:
        out[:, full * C :].copy_(src[:, full, : T - full * C])
    return out


def _suffix_sums(x: Tensor) -> Tensor:
    """Suffix sums along dim -2 (the backward of a cumsum), as one matmul with a triangle of ones."""
    n = x.shape[-2]
    return torch.ones(n, n, dtype=x.dtype, device=x.device).triu() @ x


def _diag_blocks(A: Tensor, b: int) -> Tensor:
    """View [..., C/b, b, b] of the b x b diagonal blocks of A [..., C, C]."""
    n = A.shape[-1] // b
    return A.unflatten(-1, (n, b)).unflatten(-3, (n, b)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _decay_factors(g2: Tensor, ws: Workspace | _Fresh = _Fresh) -> Tensor:
    """Every decay factor of the chunked form, from the per-step log2 decay g2 [..., C, K]: [F, ..., C, K] =
    Gamma = exp(G), Gamma_{i->C} = exp(G_C - G), the base blocks' 2^D and 2^-D, then one slot per halving
    level holding its row factors (lower halves) and column factors (upper halves), see _score_pieces.

    No exponent is a difference of two long sums (an fp32 cumsum over the chunk loses ~1e-5 of the decay
    between nearby tokens at |G| ~ 300): prefix sums and exclusive suffix sums within blocks of 8 grow
    level by level into those within blocks of 16, 32, ..., C by adding the other half's total (all terms
    share a sign), and each level takes its factors from them on the way. The base exponents, from the
    floored decays (see _BASE_G_FLOOR), are sums of at most 4 steps on either side of the block's middle.
    The result and the big temporaries come from `ws`.
    """
    C = g2.shape[-2]
    b = min(C, _BASE)
    F = ws.empty("decay", (4 + _n_levels(C), *g2.shape), g2)
    gb = g2.unflatten(-2, (C // b, b))
    prefix, suffix = F[0].unflatten(-2, (C // b, b)), F[1].unflatten(-2, (C // b, b))
    torch.cumsum(gb, -2, out=prefix)
    suffix[..., -1, :].zero_()
    for i in range(b - 2, -1, -1):
        torch.add(suffix[..., i + 1, :], gb[..., i + 1, :], out=suffix[..., i, :])

    floored = torch.clamp_min(g2, _BASE_G_FLOOR[g2.dtype] * LOG2E, out=ws.empty("floored", g2.shape, g2))
    floored = floored.unflatten(-2, (C // b, b))
    D, m = F[2].unflatten(-2, (C // b, b)), b // 2
    D[..., m, :].copy_(floored[..., m, :])  # lower half: the steps m..i
    for i in range(m + 1, b):
        torch.add(D[..., i - 1, :], floored[..., i, :], out=D[..., i, :])
    if m:  # upper half: minus the steps i+1..m-1
        D[..., m - 1, :].zero_()
    for i in range(m - 2, -1, -1):
        torch.sub(D[..., i + 1, :], floored[..., i + 1, :], out=D[..., i, :])
    torch.neg(F[2], out=F[3])

    for f in F[4:]:
        h, b = b, 2 * b
        prefix, suffix, fb = (x.unflatten(-2, (C // b, b)) for x in (F[0], F[1], f))
        fb[..., h:, :].copy_(prefix[..., h:, :])  # rows: exp(G_i - G_r), r the last row of the upper half
        fb[..., :h, :].copy_(suffix[..., :h, :])  # columns: exp(G_r - G_j)
        lower_total = prefix[..., -1:, :].clone()
        prefix[..., h:, :] += prefix[..., h - 1 : h, :]
        suffix[..., :h, :] += lower_total
    return F.exp2_()


def _score_pieces(F: Tensor) -> list[tuple[int, slice, slice, Tensor, Tensor, Tensor | None]]:
    """The pieces the score matrices are built from: (b, rows, cols, row_factor, col_factor, mask) per level.

    In every b x b diagonal block, entries rows x cols are A[i,j] = sum_d (x_id r_id) (k_jd c_jd), with
    x = q for A_qk and k for A_kk, and r_i c_j = exp(G_i - G_j) never formed as exp(G_i) exp(-G_j) (that
    overflows for strong decays). Base (b = 8): whole blocks, through the block's middle with floored
    per-step decays, masked to j <= i (qk) and j < i (kk). Levels b = 16, 32, ..., C: the lower-left
    quadrant of every block, through the last row r of its upper half: exp(G_i - G_r) and exp(G_r - G_j),
    both in (0, 1]. Factors come from _decay_factors, viewed [..., C/b, rows or cols, K].
    """
    C = F.shape[-2]
    b = min(C, _BASE)
    tri = torch.ones(b, b, dtype=torch.bool, device=F.device).tril()
    pieces = [(b, slice(None), slice(None), F[2].unflatten(-2, (C // b, b)), F[3].unflatten(-2, (C // b, b)),
               torch.stack([tri, tri.tril(-1)]))]
    for f in F[4:]:
        b *= 2
        fb = f.unflatten(-2, (C // b, b))
        pieces.append((b, slice(b // 2, None), slice(None, b // 2), fb[..., b // 2 :, :], fb[..., : b // 2, :], None))
    return pieces


def _operands(
    q: Tensor, k: Tensor, b: int, rows: slice, cols: slice, r: Tensor, c: Tensor, ws: Workspace | _Fresh = _Fresh
) -> tuple[Tensor, Tensor]:
    """Row operand [..., n, 2 * r, K] ([q; k] rows times r per block) and column operand [..., n, c, K]."""
    n = q.shape[-2] // b
    row_op = ws.empty(f"row_op{b}", (*r.shape[:-2], 2, *r.shape[-2:]), q)
    torch.mul(q.unflatten(-2, (n, b))[..., rows, :], r, out=row_op[..., 0, :, :])
    torch.mul(k.unflatten(-2, (n, b))[..., rows, :], r, out=row_op[..., 1, :, :])
    col_op = torch.mul(k.unflatten(-2, (n, b))[..., cols, :], c, out=ws.empty(f"col_op{b}", c.shape, q))
    return row_op.flatten(-3, -2), col_op


def _intra_chunk_scores(q: Tensor, k: Tensor, F: Tensor, ws: Workspace | _Fresh = _Fresh) -> Tensor:
    """[A_qk, A_kk] as one [2, ..., C, C] tensor, zero above the diagonal, from q, k [..., C, K] and the
    decay factors F of _decay_factors: A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, A_kk the
    same with k for q, for j < i. C must be a power of two. The result and temporaries come from `ws`."""
    C = q.shape[-2]
    A = ws.empty("scores", (2, *q.shape[:-1], C), q).zero_()
    for b, rows, cols, r, c, mask in _score_pieces(F):
        row_op, col_op = _operands(q, k, b, rows, cols, r, c, ws)
        out = ws.empty(f"piece{b}", (*row_op.shape[:-1], col_op.shape[-2]), q)
        out = torch.matmul(row_op, col_op.mT, out=out).unflatten(-2, (2, -1))  # [..., n, 2, rows, cols]
        if mask is not None:  # a fill, not a multiply: entries above the diagonal may overflow to inf
            out.masked_fill_(~mask, 0.0)
        _diag_blocks(A, b)[..., rows, cols].copy_(out.movedim(-3, 0))
    return A


def _score_piece_backward(
    q: Tensor, k: Tensor, piece: tuple, dA: Tensor, dq: Tensor, dk_row: Tensor, dk_col: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Adds one piece's share of the score gradients (dA = [dA_qk, dA_kk], read on and below the diagonal)
    to dq and dk, split by role: dk_row through exp(+G) (rows of A_kk), dk_col through exp(-G) (columns).
    Returns (row operand, its gradient, column operand, its gradient) for a caller that needs the log-decay
    gradient of the piece, rows minus columns."""
    b, rows, cols, r, c, mask = piece
    n = q.shape[-2] // b
    row_op, col_op = _operands(q, k, b, rows, cols, r, c)
    d_out = _diag_blocks(dA, b)[..., rows, cols].movedim(0, -3)  # [..., n, 2, rows, cols]
    d_out = (d_out.where(mask, 0.0) if mask is not None else d_out).flatten(-3, -2)
    d_row = d_out @ col_op  # [..., n, 2 * rows, K]
    d_col = d_out.mT @ row_op  # [..., n, cols, K]
    dq.unflatten(-2, (n, b))[..., rows, :].addcmul_(d_row.unflatten(-2, (2, -1))[..., 0, :, :], r)
    dk_row.unflatten(-2, (n, b))[..., rows, :].addcmul_(d_row.unflatten(-2, (2, -1))[..., 1, :, :], r)
    dk_col.unflatten(-2, (n, b))[..., cols, :].addcmul_(d_col, c)
    return row_op, d_row, col_op, d_col


def _unit_lower_inverse(L: Tensor, out: Tensor | None = None) -> Tensor:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C] (C a power of two), blockwise.

    8x8 diagonal blocks by the exact product (I - L)(I + L^2)(I + L^4) = sum_k (-L)^k (L^8 = 0 there);
    then blocks of 16, 32, ..., C by [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]].
    Batched matmuls only: a batched triangular solve is several times slower on CPU. Written into `out`
    (shaped like L) when given.
    """
    C = L.shape[-1]
    b = min(C, _BASE)
    M = torch.zeros_like(L) if out is None else out.zero_()
    power = _diag_blocks(L, b)
    inv = torch.eye(b, dtype=L.dtype, device=L.device) - power
    p = 2
    while p < b:
        power = power @ power
        inv = inv + inv @ power
        p *= 2
    _diag_blocks(M, b).copy_(inv)
    while b < C:
        b *= 2
        h = b // 2
        blocks = _diag_blocks(M, b)
        blocks[..., h:, :h] = -(blocks[..., h:, h:] @ _diag_blocks(L, b)[..., h:, :h] @ blocks[..., :h, :h])
    return M


def _chunk_scores(
    q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTHK: Tensor, beta_BTH: Tensor, C: int, dtype: torch.dtype,
    ws: Workspace | _Fresh,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, beta, decay factors, [A_qk, A_kk]) chunk-major, for the chunks of these tokens."""
    B, T, H, _ = q_BTHK.shape
    q, k, v = (_to_chunks(x, C, dtype, ws.empty(name, (-(-T // C), B, H, C, x.shape[-1]), x, dtype))
               for name, x in (("q", q_BTHK), ("k", k_BTHK), ("v", v_BTHV)))
    beta = _to_chunks(beta_BTH[..., None], C, dtype, ws.empty("beta", (*q.shape[:-1], 1), q))
    F = _decay_factors(_to_chunks(g_BTHK, C, dtype, ws.empty("g2", q.shape, q)).mul_(LOG2E), ws)
    return q, k, v, beta, F, _intra_chunk_scores(q, k, F, ws)


def _chunk_values(
    k: Tensor, v: Tensor, beta: Tensor, F: Tensor, M: Tensor, ws: Workspace | _Fresh
) -> tuple[Tensor, Tensor, Tensor]:
    """(X = [W | U], transition, inject) of these chunks, from their inverse M: see kda_chunk_fwd."""
    K = k.shape[-1]
    decay_in, decay_out = F[0], F[1]
    Y = ws.empty("Y", (*k.shape[:-1], K + v.shape[-1]), k)
    torch.mul(k, decay_in, out=Y[..., :K]).mul_(beta)
    torch.mul(v, beta, out=Y[..., K:])
    X = torch.matmul(M, Y, out=ws.empty("X", Y.shape, k))
    k_out = torch.mul(k, decay_out, out=ws.empty("k_out", k.shape, k))
    KX = torch.matmul(k_out.mT, X, out=ws.empty("KX", (*k.shape[:-2], K, Y.shape[-1]), k))  # [Kc^T W | Kc^T U]
    transition = torch.neg(KX[..., :K], out=ws.empty("transition", (*k.shape[:-2], K, K), k))
    transition.diagonal(dim1=-2, dim2=-1).add_(decay_in[..., -1, :])
    return X, transition, KX[..., K:]


def kda_chunk_fwd(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor, ChunkSaved | ChunkStates]:
    """Chunkwise-parallel KDA (UT transform): (o_BTHV in v's dtype, final state, what the backward needs).

    Per chunk (C = `chunk_for(T, chunk_size)` tokens, Gamma = exp of the in-chunk cumulative log decay G):
      X = [W | U] = (I + Diag(beta) A_kk)^-1 Diag(beta) [Gamma*K | V]   (A_kk strictly lower)
      pseudo-values V' = U - W S;  O = (Gamma*Q) S + A_qk V';  S <- Diag(gamma_C) S + (Gamma_{i->C} K)^T V'.
    Everything that does not depend on the carried state is computed for many chunks at once; the chunk
    loop is one matmul-add per chunk, S <- (Diag(gamma_C) - Kc^T W) S + Kc^T U. A sequence of one block
    (`keeps_everything`) goes at once and keeps ChunkSaved; a longer one goes block by block (`_block_chunks`)
    in this thread's Workspace and keeps ChunkStates, so that only o, the final state, M and S are new
    memory and the time is linear in T. T is zero-padded to a multiple of C inside (padded
    tokens have k = 0, g = 0, so they leave the state alone). Not differentiable by autograd: the op
    k3::kda_chunk pairs it with `kda_chunk_bwd`.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    dtype = _compute_dtype(q_BTHK)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_for(T, chunk_size)
    scale = K**-0.5 if scale is None else scale
    if T == 0:  # no chunk to run: no output, and the state passes through unchanged (as the recurrence)
        saved = chunk_saved([q_BTHK.new_empty(s, dtype=dtype) for s in chunk_saved_shapes(B, T, H, K, V, C)])
        return v_BTHV.new_empty(B, 0, H, V), _initial_state(q_BTHK, v_BTHV, initial_state_BHKV, dtype), saved
    N = -(-T // C)
    keep = keeps_everything(B, T, H, C)
    ws, G = (_Fresh, N) if keep else (_workspace(), _block_chunks(B, H, N))
    M = q_BTHK.new_empty(N, B, H, C, C, dtype=dtype)
    S = q_BTHK.new_empty(N, B, H, K, V, dtype=dtype)
    if initial_state_BHKV is None:
        S[0].zero_()
    else:
        S[0].copy_(initial_state_BHKV)
    o = v_BTHV.new_empty(B, T, H, V)
    for n0 in range(0, N, G):
        n1, t0, t1 = min(N, n0 + G), n0 * C, min(T, (n0 + G) * C)
        q, k, v, beta, F, A = _chunk_scores(*(x[:, t0:t1] for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)),
                                            C, dtype, ws)
        _unit_lower_inverse(torch.mul(beta, A[1], out=ws.empty("L", A[1].shape, A)), out=M[n0:n1])
        X, transition, inject = _chunk_values(k, v, beta, F, M[n0:n1], ws)
        for i, n in enumerate(range(n0, n1)):
            if n + 1 < N:
                torch.baddbmm(_flat(inject[i]), _flat(transition[i]), _flat(S[n]), out=_flat(S[n + 1]))
            else:
                S_final = torch.baddbmm(_flat(inject[i]), _flat(transition[i]), _flat(S[n])).unflatten(0, (B, H))
        W, U = _flat(X[..., :K]), _flat(X[..., K:])
        S_blk = _flat(S[n0:n1])
        v_new = torch.baddbmm(U, W, S_blk, alpha=-1, out=ws.empty("v_new", U.shape, U))
        q_in = torch.mul(q, F[0], out=ws.empty("q_in", q.shape, q))
        O = torch.bmm(_flat(q_in), S_blk, out=ws.empty("O", U.shape, U))
        O.baddbmm_(_flat(A[0]), v_new, beta=scale, alpha=scale)
        _from_chunks(O.view(n1 - n0, B, H, C, V), t1 - t0, v_BTHV.dtype, out=o[:, t0:t1])
    if keep:  # one block, of fresh tensors
        return o, S_final, ChunkSaved(q, k, v, beta, F, A, M, X, v_new.view(N, B, H, C, V), transition, S)
    return o, S_final, ChunkStates(M, S)


def _recompute(saved: ChunkStates, q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTHK: Tensor,
               beta_BTH: Tensor) -> ChunkSaved:
    """ChunkSaved for all chunks at once, from the inputs and ChunkStates (fresh memory)."""
    M, S = saved
    q, k, v, beta, F, A = _chunk_scores(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, M.shape[-1], M.dtype, _Fresh)
    X, transition, _ = _chunk_values(k, v, beta, F, M, _Fresh)
    K = k.shape[-1]
    v_new = torch.baddbmm(_flat(X[..., K:]), _flat(X[..., :K]), _flat(S), alpha=-1).view(*S.shape[:-2], -1, S.shape[-1])
    return ChunkSaved(q, k, v, beta, F, A, M, X, v_new, transition, S)


def kda_chunk_bwd(
    do_BTHV: Tensor,
    dstate_BHKV: Tensor,
    saved: ChunkSaved | ChunkStates,
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTHK: Tensor,
    beta_BTH: Tensor,
    scale: float | None = None,
    initial_state_BHKV: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients (dq, dk, dv, dg, dbeta, dinitial_state or None) of `kda_chunk_fwd`, from what it saved.

    From ChunkStates, the rest of ChunkSaved is recomputed first from the inputs, for all chunks at once
    (the scores and the products with the saved inverse; not the sequential state loop).
    The state gradient runs backward through the chunks, dS_in = T^T dS_out + ((Gamma*Q) - A_qk W)^T dO,
    one matmul-add per chunk; everything else is batched over all chunks. Every decay factor is exp(+G_i)
    or exp(-G_i) times q_i or k_i, so the gradient w.r.t. G is q dq + k (dk_plus - dk_minus), with dk split
    by the sign of the exponent it came through, and dg is its suffix sum along the chunk. Gradients come
    back contiguous, in the inputs' dtypes.
    """
    if q_BTHK.shape[1] == 0:  # zero tokens: the final state was the initial one, so its gradient passes through
        inputs = (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
        empty = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in inputs]
        dstate = None if initial_state_BHKV is None else dstate_BHKV.to(initial_state_BHKV.dtype, copy=True)
        return (*empty, dstate)
    s = saved if isinstance(saved, ChunkSaved) else _recompute(saved, q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)
    N, B, H, C, K = s.q.shape
    V = s.v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    decay_in, decay_out = s.decay[0], s.decay[1]
    dO = _to_chunks(do_BTHV, C, s.q.dtype).mul_(scale)
    A_qk, A_kk = s.A
    W = s.X[..., :K]

    # The state gradient, chunk by chunk backwards: dS[n] is w.r.t. the state leaving chunk n.
    aT_dO = A_qk.mT @ dO
    from_out = _flat(s.q * decay_in).mT @ _flat(dO)
    from_out.baddbmm_(_flat(W).mT, _flat(aT_dO), alpha=-1)
    from_out = from_out.unflatten(0, (N, B, H))
    dS = s.S.new_empty(N, B, H, K, V)
    dS[-1].copy_(dstate_BHKV)
    for n in range(N - 1, 0, -1):
        torch.baddbmm(_flat(from_out[n]), _flat(s.transition[n]).mT, _flat(dS[n]), out=_flat(dS[n - 1]))
    dS0 = torch.baddbmm(_flat(from_out[0]), _flat(s.transition[0]).mT, _flat(dS[0])).unflatten(0, (B, H))

    # Through V' = U - W S, O and the state update, for all chunks at once.
    d_vnew = torch.baddbmm(_flat(aT_dO), _flat(s.k * decay_out), _flat(dS)).unflatten(0, (N, B, H))
    dk_minus = (s.v_new @ dS.mT).mul_(decay_out)  # via Kc = k Gamma_{i->C}
    dG_last = (dk_minus * s.k).sum(-2) + (s.S * dS).sum(-1) * decay_in[..., -1, :]
    dA = s.A.new_empty(s.A.shape)
    torch.matmul(dO, s.v_new.mT, out=dA[0])
    dq = (dO @ s.S.mT).mul_(decay_in)
    # Through X = M Y, Y = Diag(beta) [Gamma*K | V]: dY = M^T dX, dL = -dY X^T (L = Diag(beta) A_kk).
    # dX = [-dV' S^T | dV'] and both products are taken with its negative, neg_dX.
    neg_dX = d_vnew.new_empty(N, B, H, C, K + V)
    torch.matmul(d_vnew, s.S.mT, out=neg_dX[..., :K])
    torch.neg(d_vnew, out=neg_dX[..., K:])
    neg_dY = s.M.mT @ neg_dX
    dL = neg_dY @ s.X.mT
    torch.mul(dL, s.beta, out=dA[1])
    neg_dY_k = neg_dY[..., :K].mul_(decay_in)  # minus the gradient w.r.t. Gamma*K, before beta
    dbeta = (dL * A_kk).sum(-1, keepdim=True) - (neg_dY_k * s.k).sum(-1, keepdim=True)
    dbeta -= (neg_dY[..., K:] * s.v).sum(-1, keepdim=True)
    dk_plus = neg_dY_k.mul_(s.beta).neg_()
    dv = neg_dY[..., K:].mul_(s.beta).neg_()

    base, *levels = _score_pieces(s.decay)
    for piece in levels:
        _score_piece_backward(s.q, s.k, piece, dA, dq, dk_plus, dk_minus)
    dG = dq * s.q
    dk_diff = dk_plus.sub_(dk_minus)  # in place: dk_plus is not needed on its own again
    dG.addcmul_(dk_diff, s.k)
    dG[..., -1, :] += dG_last
    dk = dk_diff.add_(dk_minus, alpha=2)
    # dg = suffix sums of dG along the chunk (G = cumsum(g)), as a matmul with a triangle of ones: much
    # faster than a reversed cumsum on CPU.
    dg = _suffix_sums(dG)
    # The base blocks go through D, the cumsum within each block: their share of dg is summed within the
    # block only (summed over the chunk it is the same in exact arithmetic, since rows and columns cancel
    # per block, but picks up the rounding of every later block). The floor's gradient is taken as 1: the
    # terms it would zero are below exp(floor) anyway.
    row_op, d_row, col_op, d_col = _score_piece_backward(s.q, s.k, base, dA, dq, dk, dk)
    dD = (row_op * d_row).unflatten(-2, (2, -1)).sum(-3).addcmul_(col_op, d_col, value=-1)
    dg.unflatten(-2, dD.shape[-3:-1]).add_(_suffix_sums(dD))

    T = q_BTHK.shape[1]
    grads = [_from_chunks(x, T, like.dtype) for x, like in ((dq, q_BTHK), (dk, k_BTHK), (dv, v_BTHV), (dg, g_BTHK))]
    grads.append(_from_chunks(dbeta, T, beta_BTH.dtype)[..., 0])
    grads.append(None if initial_state_BHKV is None else dS0.to(initial_state_BHKV.dtype))
    return tuple(grads)


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
    """Chunked KDA forward only: (o_BTHV in v's dtype, final state in the compute dtype); see kda_chunk_fwd."""
    o, S, _ = kda_chunk_fwd(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale, initial_state_BHKV, chunk_size)
    return o, S


def gate_dtype(f: Tensor) -> torch.dtype:
    """The decay gate is fp32 whatever the activations are (float64 stays float64 for gradchecks)."""
    if f.dtype == torch.float32 or f.dtype == torch.float64:
        return f.dtype
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
    x = _as(f_BTHK, dtype) + _as(dt_bias_P, dtype).view(H, K)
    a = torch.exp(_as(A_log_H, dtype)).view(H, 1)
    if form == "lower_bounded_sigmoid":
        return const(lower_bound, x) * torch.sigmoid(a * x)
    if form == "softplus":
        return -a * F.softplus(x)
    raise ValueError(f"unknown KDA decay form {form!r}; expected one of {DECAY_FORMS}")
