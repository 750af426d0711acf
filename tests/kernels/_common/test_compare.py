"""kernels/_common/compare.py: a NaN or an infinity anywhere in an output is a failure, never a small error."""

from __future__ import annotations

import math

import torch

from k3compile.kernels._common.compare import max_error, rel_rms


def test_non_finite_outputs_compare_as_infinitely_wrong():
    want_N = torch.ones(8)
    for bad in (math.nan, math.inf, -math.inf):
        all_bad_N = torch.full((8,), bad)
        one_bad_N = want_N.clone()
        one_bad_N[3] = bad
        assert rel_rms(all_bad_N, want_N) == math.inf and rel_rms(one_bad_N, want_N) == math.inf
        assert max_error(all_bad_N, want_N) == math.inf
        # after a correct first output, so `max(worst, nan)` cannot keep the earlier worst
        assert max_error((want_N, one_bad_N), (want_N, want_N)) == math.inf
        assert max_error(want_N, one_bad_N) == math.inf  # a reference that overflowed proves nothing


def test_finite_outputs_keep_their_relative_rms():
    want_N = torch.tensor([3.0, 4.0])
    got_N = torch.tensor([3.0, 4.5])
    want = math.sqrt((0.25 / 2) / (25 / 2))  # mean squared error over mean squared reference: 0.1
    assert math.isclose(max_error(got_N, want_N), want, rel_tol=1e-12)
    assert math.isclose(max_error((want_N, got_N), (want_N, want_N)), want, rel_tol=1e-12)
