"""Gated linear attention reference: the chunked form and the decode step against the literal recurrence."""

import pytest
import torch

from k3compile.kernels.gla import reference as ref


def _inputs(B=2, T=37, H=3, K=8, V=5, dtype=torch.float64, strong=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * (60.0 if strong else 0.5)  # strong: decays to e^-60
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, S0


@pytest.mark.parametrize("T,C", [(37, 16), (16, 16), (5, 4), (1, 16)])
def test_chunk_equals_naive_recurrence(T, C):
    q, k, v, g, S0 = _inputs(T=T)
    o, S = ref.gla_chunk_ref(q, k, v, g, None, S0, C)
    o_ref, S_ref = ref.gla_naive(q, k, v, g, None, S0)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)


def test_chunk_is_exact_under_strong_decay_in_fp32():
    """Log decays down to -60 per step (exp(-960) over a chunk) neither overflow nor lose the recent tokens."""
    q, k, v, g, S0 = _inputs(strong=True, dtype=torch.float32)
    o, S = ref.gla_chunk_ref(q, k, v, g, 0.5, S0)
    o_ref, S_ref = ref.gla_naive(*(t.double() for t in (q, k, v, g)), 0.5, S0.double())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, rtol=1e-4, atol=1e-5)


def test_decode_steps_equal_naive_recurrence():
    q, k, v, g, S = _inputs(T=6)
    o_ref, S_ref = ref.gla_naive(q, k, v, g, None, S)
    outs = []
    for t in range(6):
        o, S = ref.gla_decode_step_ref(q[:, t], k[:, t], v[:, t], g[:, t], S)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), o_ref)
    torch.testing.assert_close(S, S_ref)


def test_zero_tokens_keep_the_state_without_returning_it():
    q, k, v, g, S0 = _inputs(T=0)
    o, S = ref.gla_chunk_ref(q, k, v, g, None, S0)
    assert o.shape == v.shape and torch.equal(S, S0) and S is not S0
