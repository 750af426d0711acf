"""The short conv's hand-written backward (kernels/short_conv/reference.py) against autograd of its reference and gradcheck."""

import pytest
import torch

from k3compile.kernels._common.compare import autograd_grads, rel_rms
from k3compile.kernels.short_conv.reference import short_conv_bwd_ref, short_conv_ref
from k3compile.kernels.short_conv.op import short_conv


def _inputs(B, T, C, W, with_state, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    weight = (torch.randn(C, W, generator=g) / W**0.5).to(dtype)
    h = torch.randn(B, C, W - 1, generator=g).to(dtype) if with_state else None
    return x, weight, h


@pytest.mark.parametrize(("T", "W", "with_state", "dtype"), [
    (1, 4, True, torch.float32), (2, 4, True, torch.float32), (13, 3, False, torch.float32),
    (13, 4, True, torch.float32), (9, 4, True, torch.bfloat16),
])
def test_hand_written_backward_equals_autograd_of_the_reference(T, W, with_state, dtype):
    # T = 1, 2 < W - 1: part of the initial state stays in the new state, and so does its gradient.
    x, weight, h = _inputs(2, T, 24, W, with_state, dtype)
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(2, T, 24, generator=g).to(dtype), torch.randn(2, 24, W - 1, generator=g).to(dtype)]
    got = short_conv_bwd_ref(grads, x, weight, h)
    want = autograd_grads(short_conv_ref, (x, weight, h), grads)
    assert (got[2] is None) == (h is None)
    for a, b, arg in zip(got, want, (x, weight, h), strict=True):
        if arg is None:
            continue
        assert a.shape == arg.shape and a.dtype == arg.dtype
        assert rel_rms(a, b) <= (1e-5 if dtype == torch.float32 else 8e-3)


def test_gradcheck_float64_does_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("short_conv's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    for T in (2, 7):
        x, weight, h = (t.requires_grad_() for t in _inputs(2, T, 5, 4, True, torch.float64, seed=T))
        assert torch.autograd.gradcheck(lambda a, b, c: short_conv(a, b, c, output_final_state=True), (x, weight, h))
        assert torch.autograd.gradcheck(lambda a, b: short_conv(a, b)[0], (x, weight))
