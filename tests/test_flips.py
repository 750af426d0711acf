"""The claims of tests/flips.py on constructed cases: flips, a router near-tie, a route change nothing explains."""

from __future__ import annotations

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from flips import E4M3_STEP, RouteRecorder, assert_flip_aware, assert_tight, near_ties, route_changes

B, T, D, E, K = 1, 4, 8, 6, 2


def _router(x_BTD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor):
    """Routes of one linear_route call per forward of x over its time chunks (3 tokens, then one at a time)."""
    with RouteRecorder() as rec:
        for x in (x_BTD[:, :3], x_BTD[:, 3:]):
            torch.ops.k3.linear_route.default(x.reshape(-1, D), weight_ED, bias_E, K, "sigmoid", True, 1.0)
    return rec.layers(B, 1)


@pytest.fixture
def tie():
    """Experts 1 and 2 differ only in the weight of x's last feature, which is +-1e-6 at token 1 in the two runs:
    their scores, the 2nd and 3rd of 6 there, are 1e-6 apart and swap; the inputs differ by 2e-6 / ||x|| ~ 1e-6."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(E, D, generator=gen) * 0.3
    weight[0] = 0.0
    weight[0, 0] = 4.0  # expert 0 is first
    weight[2] = weight[1]
    weight[1, -1] = 1.0
    x = torch.randn(B, T, D, generator=gen)
    x[..., 0] = 1.0
    x[..., -1] = 0.5  # expert 1 clearly ahead of 2 at the other tokens
    bias = torch.zeros(E)
    xa, xb = x.clone(), x.clone()
    xa[0, 1, -1], xb[0, 1, -1] = 1e-6, -1e-6
    return weight, bias, xa, xb


def test_routes_of_prefill_and_decode_chunks_lay_out_as_one_forward(tie):
    weight, bias, xa, _ = tie
    (chunked,) = _router(xa, weight, bias)
    with RouteRecorder() as rec:
        torch.ops.k3.linear_route.default(xa.reshape(-1, D), weight, bias, K, "sigmoid", True, 1.0)
    (whole,) = rec.layers(B, 1)
    assert torch.equal(chunked.indices_BTK, whole.indices_BTK) and torch.equal(chunked.x_BTD, xa)
    assert torch.allclose(chunked.choice_BTE, whole.choice_BTE)


def test_a_swap_at_a_near_tie_is_excused_from_the_token_on(tie):
    weight, bias, xa, xb = tie
    a, b = _router(xa, weight, bias), _router(xb, weight, bias)
    assert set(a[0].indices_BTK[0, 1].tolist()) == {0, 1} and set(b[0].indices_BTK[0, 1].tolist()) == {0, 2}
    assert route_changes(a, b).tolist() == [[False, True, True, True]]
    assert route_changes(a, a).tolist() == [[False] * T]
    assert near_ties(a).tolist() == [[False, True, True, True]]  # a 1e-6 gap: another fp32 computation may swap it


def test_a_swap_the_inputs_do_not_explain_fails(tie):
    """The same inputs and a different expert at token 2 (a wrong kernel, not a tie): not excused."""
    weight, bias, xa, _ = tie
    a = _router(xa, weight, bias)
    b = _router(xa, weight, bias)
    picked = b[0].indices_BTK[0, 2]
    unpicked = next(e for e in range(E) if e not in picked.tolist())
    b[0].indices_BTK[0, 2, 1] = unpicked
    with pytest.raises(AssertionError, match="token 2: experts .* beyond the near-tie slack"):
        route_changes(a, b)


def test_flip_aware_takes_a_few_flips_and_no_whole_step():
    want = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(1))
    got = want.clone()
    got[0, 7] *= 1 + E4M3_STEP / 2  # one token half a step off: a flip
    assert_flip_aware(got, want)
    with pytest.raises(AssertionError, match="worst token's relative error"):
        assert_tight(got, want)
    got[1, 3] *= 1 + 2 * E4M3_STEP  # a whole step: not a flip
    with pytest.raises(AssertionError, match="worst relative error"):
        assert_flip_aware(got, want)
    excused = torch.zeros(2, 12, dtype=torch.bool)
    excused[1, 3:] = True  # a route change at token 3 of sequence 1
    assert_flip_aware(got, want, excused_BT=excused)
    got[:, :8] *= 1.001  # most tokens off: not flips
    with pytest.raises(AssertionError, match="median relative error"):
        assert_flip_aware(got, want, excused_BT=excused)
