"""KDA and short-conv references: hand values, the three KDA forms against each other in float64,
strong decays, the chunked form's hand-written backward against autograd (whole, and block by block with
its recomputing backward), the workspace, its blockwise inverse against a triangular solve, and the decay
gates."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3compile.kernels.kda import reference as kda_module
from k3compile.kernels.kda.reference import (
    LOG2E,
    ChunkSaved,
    ChunkStates,
    _decay_factors,
    _intra_chunk_scores,
    _unit_lower_inverse,
    kda_chunk_bwd,
    kda_chunk_fwd,
    chunk_for,
    kda_chunk_ref,
    kda_decode_step_ref,
    kda_gate_ref,
    kda_naive,
    kda_recurrent_ref,
    chunk_saved_shapes,
)
from k3compile.kernels.short_conv.reference import short_conv_naive, short_conv_ref
from k3compile.kernels._common.compare import rel_rms as _rel

F64 = torch.float64


def _inputs(B=2, T=9, H=2, K=8, V=4, dtype=F64, lower_bound=-5.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, S0


def test_naive_hand_values_two_steps():
    # K = 2, V = 1, one head. Step 1 from S0 = [[1], [2]]: decay [1/2, 1], k = e1, beta = 1/2, v = 3:
    #   decayed S = [[0.5], [2]]; S1 = (I - 1/2 e1 e1^T) S + 1/2 e1 * 3 = [[0.25 + 1.5], [2]] = [[1.75], [2]].
    #   o1 = scale * q1^T S1 with q1 = (1, 1), scale 1: 3.75.
    # Step 2: no decay, k = e2, beta = 1, v = -1: S2 = S1 with row 2 replaced by v: [[1.75], [-1]]; q2 = e2 -> -1.
    q = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=F64).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64).view(1, 2, 1, 2)
    v = torch.tensor([3.0, -1.0], dtype=F64).view(1, 2, 1, 1)
    g = torch.tensor([[math.log(0.5), 0.0], [0.0, 0.0]], dtype=F64).view(1, 2, 1, 2)
    beta = torch.tensor([0.5, 1.0], dtype=F64).view(1, 2, 1)
    S0 = torch.tensor([[1.0], [2.0]], dtype=F64).view(1, 1, 2, 1)
    want_o = torch.tensor([3.75, -1.0], dtype=F64).view(1, 2, 1, 1)
    want_S = torch.tensor([[1.75], [-1.0]], dtype=F64).view(1, 1, 2, 1)
    for fn in (kda_naive, kda_recurrent_ref, lambda *a: kda_chunk_ref(*a, chunk_size=2)):
        o, S = fn(q, k, v, g, beta, 1.0, S0)
        torch.testing.assert_close(o, want_o)
        torch.testing.assert_close(S, want_S)


def test_single_token_from_zero_state():
    # S1 = beta k v^T, so o = scale * beta * (q . k) v.
    q, k, v, g, beta, _ = _inputs(T=1)
    o, S = kda_naive(q, k, v, g, beta)
    want = 8**-0.5 * (beta * (q * k).sum(-1))[..., None] * v
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(S, (beta[:, 0, :, None, None] * k[:, 0, :, :, None] * v[:, 0, :, None, :]))


@pytest.mark.parametrize("T", [1, 7, 8, 9, 31, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [64, 16, 4, 1])
def test_chunk_and_recurrent_match_naive_float64(T, chunk_size):
    q, k, v, g, beta, S0 = _inputs(T=T)
    o_n, S_n = kda_naive(q, k, v, g, beta, None, S0)
    o_c, S_c = kda_chunk_ref(q, k, v, g, beta, None, S0, chunk_size)
    o_r, S_r = kda_recurrent_ref(q, k, v, g, beta, None, S0)
    for got, want in ((o_c, o_n), (S_c, S_n), (o_r, o_n), (S_r, S_n)):
        assert got.dtype == F64
        assert _rel(got, want) < 1e-12


@pytest.mark.parametrize("T, want", [(0, 8), (1, 8), (9, 16), (16, 16), (17, 32), (33, 64), (64, 64), (130, 64)])
def test_a_short_sequence_runs_the_smallest_chunk_that_holds_it(T, want):
    """chunk_for: a sequence shorter than chunk_size is one chunk of the next power of two (at least 8), not a
    zero-padded chunk of 64; the forward keeps that chunk's shapes and gives the chunk-64 result."""
    assert chunk_for(T, 64) == want and chunk_for(T, 4) == 4
    q, k, v, g, beta, S0 = _inputs(T=T)
    o, S, saved = kda_chunk_fwd(q, k, v, g, beta, None, S0, 64)
    o_w, S_w, _ = kda_chunk_fwd(q, k, v, g, beta, None, S0, want)
    assert torch.equal(o, o_w) and torch.equal(S, S_w)
    assert saved.M.shape[-1] == want and [tuple(t.shape) for t in saved] == chunk_saved_shapes(2, T, 2, 8, 4, 64)


def test_decode_step_is_one_recurrent_step():
    q, k, v, g, beta, S0 = _inputs(T=1, dtype=torch.float32)
    o, S = kda_decode_step_ref(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    o_r, S_r = kda_recurrent_ref(q, k, v, g, beta, None, S0)
    torch.testing.assert_close(o, o_r[:, 0])
    torch.testing.assert_close(S, S_r)


@pytest.mark.parametrize("scale_g", [8.0, 40.0])
def test_chunk_is_finite_and_exact_under_strong_decays(scale_g):
    # Unbounded decays (the softplus form can give g << -5): the whole-chunk factorisation
    # exp(G_i) exp(-G_j) would overflow fp32 here; the chunked form must still match float64.
    q, k, v, g, beta, S0 = _inputs(B=1, T=150, K=16, V=16, seed=3)
    g = g * scale_g
    g[:, ::7] = 0.0  # mix in tokens that keep everything
    o_n, S_n = kda_naive(q, k, v, g, beta, None, S0)
    o_c, S_c = kda_chunk_ref(*(t.float() for t in (q, k, v, g, beta)), None, S0.float())
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert _rel(o_c, o_n) < 1e-5 and _rel(S_c, S_n) < 1e-5


def test_intra_chunk_scores_match_direct_pairwise_sum():
    # A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) (j <= i), A_kk the same with k for q and j < i,
    # summed directly in float64 from a mix of mild and very strong decays.
    gen = torch.Generator().manual_seed(1)
    C, K = 64, 4
    q, k = torch.randn(2, C, K, generator=gen, dtype=F64), torch.randn(2, C, K, generator=gen, dtype=F64)
    g = -torch.rand(2, C, K, generator=gen, dtype=F64) * torch.tensor([0.1, 3.0, 30.0, 300.0], dtype=F64)
    G = g.cumsum(-2)
    A_qk, A_kk = _intra_chunk_scores(q.float(), k.float(), _decay_factors(g.float() * LOG2E))
    diff = (G[:, :, None, :] - G[:, None, :, :]).clamp_max(0)
    full_q = torch.einsum("bid,bjd,bijd->bij", q, k, diff.exp())
    full_k = torch.einsum("bid,bjd,bijd->bij", k, k, diff.exp())
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    torch.testing.assert_close(A_qk.double(), full_q * mask, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(A_kk.double(), full_k * mask.tril(-1), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("C", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("size", [0.1, 1.0])
def test_blockwise_inverse_matches_triangular_solve(C, size):
    # (I + L)^-1 for strictly lower L: float64 against LAPACK's solve to 1e-12; in fp32 no worse than an fp32
    # solve (both against float64). size 1.0 makes entries of the inverse grow to ~1e2.
    gen = torch.Generator().manual_seed(C)
    L = (size * torch.randn(3, 2, C, C, generator=gen, dtype=F64)).tril(-1)
    eye = torch.eye(C, dtype=F64)
    want = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    assert _rel(_unit_lower_inverse(L), want) < 1e-12
    solve32 = torch.linalg.solve_triangular((eye + L).float(), eye.float().expand_as(L), upper=False)
    assert _rel(_unit_lower_inverse(L.float()), want) < max(4 * _rel(solve32, want), 1e-6)


def _chunk_grads(xs, do, dS, scale, chunk_size):
    o, S, saved = kda_chunk_fwd(*xs[:5], scale, xs[5], chunk_size)
    return o, S, kda_chunk_bwd(do, dS, saved, *xs[:5], scale, xs[5])


@pytest.mark.parametrize("T,chunk_size", [(1, 64), (7, 4), (9, 1), (31, 16), (64, 64), (65, 16), (130, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_backward_matches_autograd_of_naive_float64(T, chunk_size, with_state):
    q, k, v, g, beta, S0 = _inputs(T=T)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0 if with_state else None) if t is not None]
    o, S = kda_naive(*leaves[:5], 0.7, leaves[5] if with_state else None)
    gen = torch.Generator().manual_seed(T)
    do, dS = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    _, _, got = _chunk_grads([q, k, v, g, beta, S0 if with_state else None], do, dS, 0.7, chunk_size)
    assert (got[5] is None) != with_state
    for a, b in zip([x for x in got if x is not None], want):
        assert a.dtype == F64 and a.shape == b.shape
        assert (a - b).norm() <= 1e-11 * b.norm() + 1e-15  # d/dg is exactly 0 with T = 1 and no state


@pytest.fixture
def one_chunk_blocks(monkeypatch):
    """The long-sequence path at test sizes: blocks of one chunk in the workspace, ChunkStates kept."""
    monkeypatch.setattr(kda_module, "_BLOCK_CHUNK_HEADS", 1)


@pytest.mark.parametrize("T,chunk_size", [(7, 4), (31, 16), (65, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_blockwise_forward_and_recomputing_backward_match_naive_float64(one_chunk_blocks, T, chunk_size, with_state):
    q, k, v, g, beta, S0 = _inputs(T=T)
    init = S0 if with_state else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, init) if t is not None]
    o, S = kda_naive(*leaves[:5], 0.7, leaves[5] if with_state else None)
    gen = torch.Generator().manual_seed(T)
    do, dS = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    o_c, S_c, saved = kda_chunk_fwd(q, k, v, g, beta, 0.7, init, chunk_size)
    assert isinstance(saved, ChunkStates)
    assert _rel(o_c, o) < 1e-12 and _rel(S_c, S) < 1e-12
    got = kda_chunk_bwd(do, dS, saved, q, k, v, g, beta, 0.7, init)
    for a, b in zip([x for x in got if x is not None], want, strict=True):
        assert a.dtype == F64 and a.shape == b.shape
        assert (a - b).norm() <= 1e-11 * b.norm()


def test_what_the_forward_keeps_follows_the_block_count(one_chunk_blocks):
    # One block (a training step's sizes): everything, so the backward recomputes nothing; more: M and S only.
    for T, kind in ((4, ChunkSaved), (9, ChunkStates)):
        q, k, v, g, beta, S0 = _inputs(T=T, dtype=torch.float32)
        *_, saved = kda_chunk_fwd(q, k, v, g, beta, None, S0, 8)
        assert isinstance(saved, kind)
        assert [tuple(t.shape) for t in saved] == chunk_saved_shapes(2, T, 2, 8, 4, 8)


def test_long_sequences_reuse_the_workspace(one_chunk_blocks):
    # After a first call, calls of the same or a shorter length take no new buffer, and nothing they return
    # lives in one.
    q, k, v, g, beta, S0 = _inputs(T=40, dtype=torch.float32)
    kda_chunk_fwd(q, k, v, g, beta, None, S0, 8)
    buffers = {key: t.data_ptr() for key, t in kda_module._workspace()._flat.items()}
    for T in (40, 17):
        o, S, saved = kda_chunk_fwd(*(x[:, :T] for x in (q, k, v, g, beta)), None, S0, 8)
        assert {key: t.data_ptr() for key, t in kda_module._workspace()._flat.items()} == buffers
        returned = {t.untyped_storage().data_ptr() for t in (o, S, *saved)}
        assert not returned & set(buffers.values())


@pytest.mark.parametrize("scale_g", [1.0, 8.0, 40.0])
def test_chunk_backward_fp32_under_strong_decays(scale_g):
    # fp32 chunked gradients against float64 autograd of the naive loop, with decays far beyond the
    # lower bound of -5 (the softplus form) and tokens that keep everything.
    q, k, v, g, beta, S0 = _inputs(B=1, T=150, K=16, V=16, seed=3)
    g = g * scale_g
    g[:, ::7] = 0.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, S0)]
    o, S = kda_naive(*leaves[:5], None, leaves[5])
    gen = torch.Generator().manual_seed(9)
    do, dS = torch.randn(o.shape, generator=gen, dtype=F64), torch.randn(S.shape, generator=gen, dtype=F64)
    want = torch.autograd.grad((o * do).sum() + (S * dS).sum(), leaves)
    o_c, S_c, got = _chunk_grads([t.float() for t in (q, k, v, g, beta, S0)], do.float(), dS.float(), None, 64)
    assert _rel(o_c, o) < 1e-6 and _rel(S_c, S) < 1e-6
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and _rel(a, b) < 1e-5


def test_chunk_fp32_state_keeps_accuracy_at_large_cumulative_decay():
    # One chunk of 63 tokens with g ~ -2.5: |G| reaches ~160 inside the chunk. The decay exponents are
    # accumulated in float64, so the state stays at fp32 rounding (an fp32 cumsum gave ~2e-6 here).
    q, k, v, g, beta, S0 = _inputs(B=2, T=63, H=2, K=16, V=16)
    _, S_n = kda_naive(q, k, v, g, beta, None, S0)
    _, S_c = kda_chunk_ref(*(t.float() for t in (q, k, v, g, beta)), None, S0.float())
    assert _rel(S_c, S_n) < 3e-7


def test_padding_tokens_leave_state_alone():
    # T = 65 pads 63 zero tokens inside the chunked form; its state must equal the naive one exactly in float64.
    q, k, v, g, beta, S0 = _inputs(T=65)
    _, S_c = kda_chunk_ref(q, k, v, g, beta, None, S0, 64)
    _, S_n = kda_naive(q, k, v, g, beta, None, S0)
    assert _rel(S_c, S_n) < 1e-13


def test_no_decay_no_write_keeps_state():
    q, k, v, g, beta, S0 = _inputs(T=5)
    o, S = kda_chunk_ref(q, k, v, torch.zeros_like(g), torch.zeros_like(beta), 0.5, S0, 4)
    torch.testing.assert_close(S, S0)
    torch.testing.assert_close(o, 0.5 * torch.einsum("bthk,bhkv->bthv", q, S0))


def test_bf16_inputs_fp32_state():
    q, k, v, g, beta, S0 = _inputs(T=20, dtype=torch.bfloat16)
    for o, S in (kda_chunk_ref(q, k, v, g, beta, None, S0.float(), 8), kda_recurrent_ref(q, k, v, g, beta)):
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32


def test_chunk_size_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        kda_chunk_ref(*_inputs()[:5], chunk_size=24)


def test_gate_forms_hand_values():
    # f + dt_bias = 0 and A_log = 0: K3 gives lower_bound * sigmoid(0) = lower_bound / 2,
    # Kimi Linear gives -softplus(0) = -log 2. With A_log = log 2 and f + dt_bias = 1:
    # K3: -5 * sigmoid(2); Kimi Linear: -2 * log(1 + e).
    f = torch.zeros(1, 1, 2, 3)
    dt = torch.zeros(6)
    A = torch.zeros(2)
    torch.testing.assert_close(kda_gate_ref(f, A, dt, "lower_bounded_sigmoid", -5.0), torch.full_like(f, -2.5))
    torch.testing.assert_close(kda_gate_ref(f, A, dt, "softplus", 0.0), torch.full_like(f, -math.log(2)))
    A = torch.tensor([0.0, math.log(2.0)])
    got = kda_gate_ref(f + 0.25, A, dt + 0.75, "lower_bounded_sigmoid", -5.0)
    torch.testing.assert_close(got[..., 1, :], torch.full((1, 1, 3), -5 / (1 + math.exp(-2))))
    got = kda_gate_ref(f, A, dt + 1.0, "softplus", 0.0)
    torch.testing.assert_close(got[..., 1, :], torch.full((1, 1, 3), -2 * math.log(1 + math.e)))
    assert kda_gate_ref(f.bfloat16(), A, dt, "softplus", 0.0).dtype == torch.float32
    with pytest.raises(ValueError):
        kda_gate_ref(f, A, dt, "exp", 0.0)


def test_short_conv_hand_value():
    # W = 2, weight [a, b] = [2, 3]: y_t = silu(2 x_{t-1} + 3 x_t); x = [1, -1], state = [0.5].
    x = torch.tensor([1.0, -1.0], dtype=F64).view(1, 2, 1)
    w = torch.tensor([[2.0, 3.0]], dtype=F64)
    y, state = short_conv_ref(x, w, torch.tensor([[[0.5]]], dtype=F64))
    pre = torch.tensor([2 * 0.5 + 3 * 1.0, 2 * 1.0 - 3.0], dtype=F64)
    torch.testing.assert_close(y.view(-1), pre * torch.sigmoid(pre))
    torch.testing.assert_close(state, torch.tensor([[[-1.0]]], dtype=F64))


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_short_conv_matches_loop_and_continues(W, T):
    gen = torch.Generator().manual_seed(W * 10 + T)
    x = torch.randn(2, T, 5, generator=gen, dtype=F64)
    w = torch.randn(5, W, generator=gen, dtype=F64)
    s0 = torch.randn(2, 5, W - 1, generator=gen, dtype=F64)
    for init in (None, s0):
        y, s = short_conv_ref(x, w, init)
        y_n, s_n = short_conv_naive(x, w, init)
        torch.testing.assert_close(y, y_n)
        torch.testing.assert_close(s, s_n)
        assert s.shape == (2, 5, W - 1)
    # Splitting the sequence and passing the state gives the same outputs.
    y_full, s_full = short_conv_ref(x, w, s0)
    cut = max(1, T - 1)
    y1, s1 = short_conv_ref(x[:, :cut], w, s0)
    y2, s2 = short_conv_ref(x[:, cut:], w, s1) if cut < T else (x[:, :0], s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full)
    torch.testing.assert_close(s2, s_full)
