"""Triton chunked KDA (kernels/kda/triton.py) against the PyTorch references: the chunked forward and its
hand-written backward (kda_chunk_fwd / kda_chunk_bwd), autograd through the token-by-token recurrence, and
autograd through the float64 matrix recurrence under strong decays. Inputs as the layer makes them: q, k
L2-normalised per head, g = -5 sigmoid(x) (lower-bounded sigmoid gate), beta = sigmoid(x)."""

import pytest
import torch
import torch.nn.functional as F

import k3compile.kernels.kda.triton as kt
from k3compile.kernels.kda.reference import kda_chunk_bwd, kda_chunk_fwd, kda_naive, kda_recurrent_ref
from k3compile.kernels._common.compare import rel_rms as _rel

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def _inputs(B, T, H, K, V, *, h0=True, dtype=torch.float32, lower_bound=-5.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, generator=gen).to(dtype)
    g = lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to(dtype)
    S0 = torch.randn(B, H, K, V, generator=gen) if h0 else None
    return q, k, v, g, beta, S0


def _cotangents(o, S, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(S.shape, generator=gen)


def _check_grads(got, want, tol, h0):
    for name, x, y in zip(GRAD_NAMES, got, want):
        if name == "dinitial_state" and not h0:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert _rel(x, y) <= tol, (name, _rel(x, y))


@pytest.mark.parametrize(
    "B,T,H,K,V,C,h0",
    [
        (2, 37, 2, 24, 20, 16, True),  # ragged T, K and V, several chunks
        (1, 40, 2, 32, 32, 32, False),  # two sub-chunks per chunk, no initial state
        (1, 40, 1, 20, 24, 64, True),  # one padded chunk of four sub-chunks
    ],
)
def test_matches_chunk_reference(B, T, H, K, V, C, h0):
    q, k, v, g, beta, S0 = _inputs(B, T, H, K, V, h0=h0)
    o, S, saved = kt.kda_chunk_fwd(q, k, v, g, beta, None, S0, C)
    ro, rS, rsaved = kda_chunk_fwd(q, k, v, g, beta, None, S0, C)
    assert o.dtype == v.dtype and S.dtype == torch.float32
    assert [tuple(x.shape) for x in saved] == kt.chunk_saved_shapes(B, T, H, K, V, C)
    assert all(x.dtype == torch.float32 for x in saved)
    assert _rel(o, ro) <= 1e-4 and _rel(S, rS) <= 1e-4
    # The state entering each chunk agrees with the reference's.
    assert _rel(saved[-1], rsaved.S) <= 1e-4

    do, dS = _cotangents(o, S)
    got = kt.kda_chunk_bwd(do, dS, saved, q, k, v, g, beta, None, S0)
    want = kda_chunk_bwd(do, dS, rsaved, q, k, v, g, beta, None, S0)
    _check_grads(got, want, 1e-4, h0)


def test_backward_matches_autograd_of_recurrence_small_blocks(monkeypatch):
    """Blocks of 16 split K = 24 and V = 20 into a full and a ragged block in every kernel that loops over them,
    and dots over the padded K = 32 into two batched halves."""
    real = kt.launch_config
    small = {"BLOCK_K": 16, "BLOCK_V": 16, "BLOCK_C": 16, "SPLIT": 16}
    monkeypatch.setattr(kt, "launch_config", lambda *a, **s: {**real(*a, **s), **small})
    q, k, v, g, beta, S0 = _inputs(1, 37, 2, 24, 20, seed=2)
    scale = 0.3
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    ro, rS = kda_recurrent_ref(*args[:5], scale, args[5])
    o, S, saved = kt.kda_chunk_fwd(q, k, v, g, beta, scale, S0, 16)
    assert _rel(o, ro) <= 1e-4 and _rel(S, rS) <= 1e-4
    do, dS = _cotangents(o, S)
    want = torch.autograd.grad((ro * do).sum() + (rS * dS).sum(), args)
    got = kt.kda_chunk_bwd(do, dS, saved, q, k, v, g, beta, scale, S0)
    _check_grads(got, want, 1e-4, True)


def test_strong_decays_against_float64_recurrence():
    """Decays down to exp(-40) per step: exact relative decays in the diagonal blocks, nothing overflows."""
    q, k, v, g, beta, S0 = (x.double() for x in _inputs(1, 40, 1, 32, 16, lower_bound=-40.0, seed=3))
    g[..., :4] = -1e-3  # some channels barely decay
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    ro, rS = kda_naive(*args[:5], None, args[5])
    do, dS = _cotangents(ro, rS)
    want = torch.autograd.grad((ro * do).sum() + (rS * dS.double()).sum(), args)
    f32 = [x.float() for x in (q, k, v, g, beta, S0)]
    o, S, saved = kt.kda_chunk_fwd(*f32[:5], None, f32[5], 32)
    assert _rel(o, ro) <= 1e-4 and _rel(S, rS) <= 1e-4
    got = kt.kda_chunk_bwd(do.float(), dS, saved, *f32[:5], None, f32[5])
    for name, x, y in zip(GRAD_NAMES, got, want):
        assert torch.isfinite(x).all() and _rel(x, y) <= 1e-4, (name, _rel(x, y))


def test_bf16_inputs():
    q, k, v, g, beta, S0 = _inputs(1, 37, 2, 32, 32, dtype=torch.bfloat16, seed=4)
    o, S, saved = kt.kda_chunk_fwd(q, k, v, g, beta, None, S0, 16)
    ro, rS, rsaved = kda_chunk_fwd(q, k, v, g, beta, None, S0, 16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert _rel(o, ro) <= 1e-2 and _rel(S, rS) <= 1e-3
    do, dS = _cotangents(o, S)
    got = kt.kda_chunk_bwd(do, dS, saved, q, k, v, g, beta, None, S0)
    want = kda_chunk_bwd(do, dS, rsaved, q, k, v, g, beta, None, S0)
    _check_grads(got, want, 1e-2, True)


def test_rejects_bad_chunk_size():
    q, k, v, g, beta, _ = _inputs(1, 8, 1, 16, 16)
    for C in (8, 24):
        with pytest.raises(ValueError, match="chunk_size"):
            kt.kda_chunk_fwd(q, k, v, g, beta, None, None, C)


def test_op_adapters_pack_outputs_as_lists():
    q, k, v, g, beta, _ = _inputs(1, 9, 1, 16, 16)
    out = kt.kda_chunk(q, k, v, g, beta, None, None, 16)
    o, S, saved = kt.kda_chunk_fwd(q, k, v, g, beta, None, None, 16)
    assert len(out) == 2 + len(saved) and torch.equal(out[0], o) and torch.equal(out[1], S)
    grads = kt.kda_chunk_bwd_op(o, S, out[2:], q, k, v, g, beta, None, None)
    want = kt.kda_chunk_bwd(o, S, saved, q, k, v, g, beta, None, None)
    assert all(torch.equal(a, b) for a, b in zip(grads[:5], want[:5]))
    assert grads[5].numel() == 0
