"""The C kernels of short_conv (kernels/short_conv/short_conv.c) against the per-token loop and autograd through it."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels.short_conv import reference as ref
from k3compile.kernels._common.compare import rel_rms
from k3compile.kernels.short_conv.c import short_conv, short_conv_bwd


def _inputs(B, T, C, W, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    w = (torch.randn(C, W, generator=g) * 0.5).to(dtype)
    state = torch.randn(B, C, W - 1, generator=g).to(dtype)
    return x, w, state


# T shorter than the window, equal to it and longer; one and several sequences; channels not a multiple of 8
@pytest.mark.parametrize(("B", "T", "C", "W"), [(2, 2, 24, 4), (1, 4, 16, 4), (3, 37, 20, 4), (2, 9, 8, 2)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_per_token_loop_and_autograd(B, T, C, W, with_state, threads):
    x, w, state = _inputs(B, T, C, W)
    init = state if with_state else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y, new_state = short_conv(x, w, init)
        y_naive, state_naive = ref.short_conv_naive(x, w, init)
        assert rel_rms(y, y_naive) <= 1e-6 and torch.equal(new_state, state_naive)
        assert new_state.shape == (B, C, W - 1) and new_state.is_contiguous()
        g = torch.Generator().manual_seed(1)
        dy, dstate = torch.randn(B, T, C, generator=g), torch.randn(B, C, W - 1, generator=g)
        leaves = [t.double().requires_grad_() for t in (x, w, *((state,) if with_state else ()))]
        outs = ref.short_conv_naive(leaves[0], leaves[1], leaves[2] if with_state else None)
        want = torch.autograd.grad(outs, leaves, (dy.double(), dstate.double()))
        got = short_conv_bwd([dy, dstate], x, w, init)
        assert (got[2] is None) == (not with_state)
        for a, b in zip([t for t in got if t is not None], want):
            assert a.dtype == torch.float32 and rel_rms(a, b) <= 1e-5
    finally:
        torch.set_num_threads(before)


def test_decoding_step_bf16_and_float64_paths():
    x, w, state = _inputs(2, 1, 16, 4)
    y, s = short_conv(x, w, state)  # one token with a state: the reference's decoding form
    y_ref, s_ref = ref.short_conv_ref(x, w, state)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
    xb, wb, _ = _inputs(2, 10, 16, 4, dtype=torch.bfloat16)
    yb, sb = short_conv(xb, wb)
    assert yb.dtype == sb.dtype == torch.bfloat16 and rel_rms(yb, ref.short_conv_ref(xb, wb)[0]) <= 1e-2
    x64, w64, _ = _inputs(2, 10, 16, 4, dtype=torch.float64)
    assert torch.equal(short_conv(x64, w64)[0], ref.short_conv_ref(x64, w64)[0])
