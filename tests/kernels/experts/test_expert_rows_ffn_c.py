"""expert_rows_ffn's C form (the activation and its quantisation in one C pass) against the reference."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels._common.compare import rel_rms
from k3compile.kernels.experts.rows_ffn import expert_rows_ffn_ref
from k3compile.kernels.experts.c import expert_rows_ffn


def _inputs(counts, I=64, H=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    E, n = len(counts), sum(counts) + 3  # three padding rows past the filled ones
    x = torch.randn(n, I, generator=g).to(dtype)
    ws = [(torch.randn(E, H, I, generator=g) * 0.2).to(dtype), (torch.randn(E, H, I, generator=g) * 0.2).to(dtype),
          (torch.randn(E, I, H, generator=g) * 0.2).to(dtype)]
    return x, *ws, torch.tensor(counts)


@pytest.mark.parametrize("act_fmt", [None, "e4m3"])
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_matches_the_reference(act_fmt, kind):
    args = (*_inputs([5, 0, 17, 1, 40]), kind, 4.0, 25.0, act_fmt, 32)
    got, want = expert_rows_ffn(*args), expert_rows_ffn_ref(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_rms(a, b) <= (1e-6 if act_fmt is None else 1e-3)  # an MX rounding flip moves a value a whole step
    assert torch.equal(got[0][-3:], torch.zeros(3, got[0].shape[1]))  # rows past the filled ones stay zero
    if act_fmt is not None:  # the quantised activation sits on the e4m3 grid
        assert (got[3] != want[3]).float().mean() <= 1e-3


def test_bf16_keeps_the_reference_activation():
    args = (*_inputs([3, 4], dtype=torch.bfloat16), "situ_glu", 4.0, 25.0, "e4m3", 32)
    for a, b in zip(expert_rows_ffn(*args), expert_rows_ffn_ref(*args)):
        assert torch.equal(a, b)
