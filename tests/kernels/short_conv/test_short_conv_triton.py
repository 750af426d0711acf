"""Triton short convolution (forward and backward) against `short_conv_ref`, autograd and the per-token loop."""

import pytest
import torch

from k3compile.kernels.short_conv import triton as sct
from k3compile.kernels.short_conv.reference import short_conv_bwd_ref, short_conv_naive, short_conv_ref
from k3compile.kernels._common.compare import rel_rms as _rel_rms

# Small blocks so a short sequence spans several T-blocks, C-blocks and dweight partial rows.
SMALL = {
    "short_conv_fwd": {"BLOCK_T": 8, "BLOCK_C": 32},
    "short_conv_bwd": {"BLOCK_T": 16, "SUB_T": 8, "BLOCK_C": 32},
    "short_conv_bwd_dx": {"BLOCK_T": 8, "BLOCK_C": 32},
    "short_conv_bwd_reduce": {"BLOCK_R": 2, "BLOCK_Q": 32},
}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(sct, "launch_config", lambda name, device, defaults, **sizes: {**defaults, **SMALL[name]})


def _inputs(B, T, C, W, with_state, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).to(dtype)
    weight = (torch.randn(C, W, generator=g) / W**0.5).to(dtype)
    h = torch.randn(B, C, W - 1, generator=g).to(dtype) if with_state else None
    return x, weight, h


def _check_against_autograd(x, weight, h, seed=1):
    """Forward vs the reference (<= 1e-6) and backward vs autograd of the reference (<= 1e-5)."""
    y, state = sct.short_conv(x, weight, h)
    leaves = [t.clone().requires_grad_() for t in (x, weight) + ((h,) if h is not None else ())]
    y_ref, state_ref = short_conv_ref(*leaves[:2], leaves[2] if h is not None else None)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and y.is_contiguous()
    assert state.shape == state_ref.shape and state.dtype == state_ref.dtype
    assert _rel_rms(y, y_ref) <= 1e-6
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)  # the state is a copy of inputs

    g = torch.Generator().manual_seed(seed)
    g_y, g_state = torch.randn(y.shape, generator=g), torch.randn(state.shape, generator=g)
    want = torch.autograd.grad((y_ref * g_y).sum() + (state_ref * g_state).sum(), leaves)
    got = sct.short_conv_bwd([g_y, g_state], x, weight, h)
    assert len(got) == 3 and (got[2] is None) == (h is None)
    for grad, ref, arg in zip(got, want, (x, weight, h)):
        assert grad.shape == arg.shape and grad.dtype == arg.dtype
        assert _rel_rms(grad, ref) <= 1e-5


@pytest.mark.parametrize("W", [3, 4])
@pytest.mark.parametrize("T", [1, 2, 13])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_reference_and_autograd(T, W, with_state):
    # T = 1 and T = 2 < W - 1 (W = 4) keep part of the initial state in the new state and its gradient.
    _check_against_autograd(*_inputs(2, T, 40, W, with_state))


@pytest.mark.parametrize(("T", "with_state"), [(2, True), (13, False), (37, True)])
def test_backward_matches_the_hand_written_reference_backward(T, with_state):
    x, weight, h = _inputs(2, T, 40, 4, with_state, seed=2)
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(2, T, 40, generator=g), torch.randn(2, 40, 3, generator=g)]
    for a, b in zip(sct.short_conv_bwd(grads, x, weight, h), short_conv_bwd_ref(grads, x, weight, h), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype
            assert _rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("W", [3, 4])
def test_many_blocks_ragged(small_blocks, W):
    # T = 29 over 8-row forward / 16-position backward blocks of 8-row steps; C = 40 over 32-channel blocks.
    _check_against_autograd(*_inputs(2, 29, 40, W, True, seed=W))


def test_many_blocks_without_state(small_blocks):
    _check_against_autograd(*_inputs(1, 11, 24, 4, False, seed=5))


def test_matches_per_token_loop():
    x, weight, h = _inputs(2, 9, 40, 4, True, seed=2)
    y, state = sct.short_conv(x, weight, h)
    y_loop, state_loop = short_conv_naive(x, weight, h)
    assert _rel_rms(y, y_loop) <= 1e-6
    torch.testing.assert_close(state, state_loop, rtol=0, atol=0)


def test_prefill_then_continuation_equals_one_call(small_blocks):
    x, weight, h = _inputs(2, 14, 40, 4, True, seed=3)
    y_all, state_all = sct.short_conv(x, weight, h)
    y_a, state_a = sct.short_conv(x[:, :9], weight, h)
    y_b, state_b = sct.short_conv(x[:, 9:11], weight, state_a)  # 2 tokens: shorter than the window
    y_c, state_c = sct.short_conv(x[:, 11:12], weight, state_b)  # one decode step
    y_d, state_d = sct.short_conv(x[:, 12:], weight, state_c)
    torch.testing.assert_close(torch.cat([y_a, y_b, y_c, y_d], dim=1), y_all, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state_d, state_all, rtol=0, atol=0)


def test_no_state_means_zero_history():
    x, weight, _ = _inputs(1, 5, 40, 3, False, seed=4)
    y_none, _ = sct.short_conv(x, weight, None)
    y_zero, _ = sct.short_conv(x, weight, torch.zeros(1, 40, 2))
    torch.testing.assert_close(y_none, y_zero, rtol=0, atol=0)


def test_non_contiguous_inputs():
    x, weight, h = _inputs(2, 7, 40, 4, True, seed=6)
    x_nc = x.transpose(0, 1).contiguous().transpose(0, 1)
    w_nc = weight.t().contiguous().t()
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    y, state = sct.short_conv(x_nc, w_nc, h)
    y_ref, state_ref = short_conv_ref(x, weight, h)
    assert _rel_rms(y, y_ref) <= 1e-6
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)


def test_bf16():
    x, weight, h = _inputs(2, 13, 40, 4, True, dtype=torch.bfloat16, seed=7)
    y, state = sct.short_conv(x, weight, h)
    leaves = [t.clone().requires_grad_() for t in (x, weight, h)]
    y_ref, state_ref = short_conv_ref(*leaves)
    assert y.dtype == state.dtype == torch.bfloat16
    # Both compute in fp32 and differ only in the final bf16 rounding (the interpreter truncates, GPUs round).
    assert _rel_rms(y, y_ref) <= 1e-2
    torch.testing.assert_close(state, state_ref, rtol=0, atol=0)
    g_y, g_state = torch.randn_like(y_ref), torch.randn_like(state_ref)
    loss = (y_ref.float() * g_y.float()).sum() + (state_ref.float() * g_state.float()).sum()
    want = torch.autograd.grad(loss, leaves)
    got = sct.short_conv_bwd([g_y, g_state], x, weight, h)
    for grad, ref in zip(got, want):
        assert grad.dtype == torch.bfloat16
        assert _rel_rms(grad, ref) <= 2e-2


def test_deterministic_weight_gradient():
    x, weight, h = _inputs(2, 5, 40, 3, True, seed=8)
    grads = [torch.randn(2, 5, 40), torch.randn(2, 40, 2)]
    first = sct.short_conv_bwd(grads, x, weight, h)
    second = sct.short_conv_bwd(grads, x, weight, h)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
