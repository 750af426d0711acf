"""The PyTorch references at decoding's shapes (one token, small batch): few aten calls, same results.

A decode step runs every k3 op once per layer on tiny tensors, so per-call overhead (wrapped Python
scalars, no-op casts, einsum's permutes) dominates; these tests pin the lean forms: cached scalar
constants that stay plain tensors under torch.func and dispatch modes, the one-token short conv against
the naive loop, and a generous budget of aten calls per op at k3-tiny's decode shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch._subclasses.fake_tensor import FakeTensorMode

import k3compile.ops  # noqa: F401  (registers torch.ops.k3)
from k3compile.kernels._common.consts import const
from k3compile.kernels.mx.reference import mx_quantize_fast
from k3compile.kernels.short_conv.reference import short_conv_naive, short_conv_ref


def test_const_is_cached_and_plain_under_torch_func():
    x = torch.randn(3)
    c = const(0.5, x)
    assert c.dim() == 0 and c.dtype == x.dtype and const(0.5, x) is c
    assert const(0.5, x.double()).dtype == torch.float64
    assert torch.signbit(const(-0.0, x)) and not torch.signbit(const(0.0, x))  # -0.0 and 0.0 kept apart
    assert torch.isnan(const(float("nan"), x)) and const(float("nan"), x) is const(float("nan"), x)

    def f(t):
        return t * const(0.25, t) * const(0.125, t)

    _, vjp = torch.func.vjp(f, torch.randn(3))
    torch.testing.assert_close(vjp(torch.ones(3))[0], torch.full((3,), 0.25 * 0.125))
    cached = const(0.125, x)  # first made inside the transform: still a plain tensor, usable outside it
    assert not torch._C._functorch.is_gradtrackingtensor(cached)
    assert torch.equal(x * cached, x * 0.125)


def test_const_first_made_under_inference_mode_serves_autograd_later():
    """Serving (inference_mode) then training in one process: the cached scalar is a normal tensor."""
    with torch.inference_mode():
        c = const(0.3125, torch.ones(2))
    assert not c.is_inference()
    x = torch.ones(3, requires_grad=True)
    (torch.tanh(x) * const(0.3125, x)).sum().backward()  # saving the scalar for backward must work
    assert torch.allclose(x.grad, 0.3125 * (1 - torch.tanh(torch.ones(3)) ** 2))


def test_const_under_fake_mode_is_fresh_and_never_cached():
    with FakeTensorMode():
        x = torch.empty(4)
        c = const(3.0, x)
        assert (x * c).shape == (4,) and const(3.0, x) is not c
    real = const(3.0, torch.empty(1))
    assert type(real) is torch.Tensor and real.item() == 3.0


def test_one_token_short_conv_is_the_naive_window_and_continues_prefill():
    torch.manual_seed(0)
    B, T, C, W = 2, 7, 16, 4
    x, w, s0 = torch.randn(B, T, C), torch.randn(C, W), torch.randn(B, C, W - 1)
    y_all, s_all = short_conv_ref(x, w, s0)
    state, ys = s0, []
    for t in range(T):
        y, state = short_conv_ref(x[:, t : t + 1], w, state)
        ys.append(y)
        assert state.is_contiguous() and state.shape == (B, C, W - 1)
    torch.testing.assert_close(torch.cat(ys, 1), y_all)
    assert torch.equal(state, s_all)
    y1, st1 = short_conv_ref(x[:, :1], w, s0)
    y1n, st1n = short_conv_naive(x[:, :1], w, s0)
    assert torch.equal(y1, y1n) and torch.equal(st1, st1n)


def _aten_calls(fn, *args) -> int:
    with torch.no_grad():
        fn(*args)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(*args)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def _decode_cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    gq = mx_quantize_fast(r(4, 128, 128), "e2m1", 32)
    uq = mx_quantize_fast(r(4, 128, 128), "e2m1", 32)
    k3 = torch.ops.k3
    # (name, op, args, budget): budgets are about 1.5x what the lean forms take (torch 2.13), far below
    # the 24 to 190 calls per op of the forms with Python scalars and einsum.
    return [
        ("rms_norm", k3.rms_norm.default, (r(1, 1, 256), r(256), 1e-5), 10),
        ("l2_norm", k3.l2_norm.default, (r(1, 1, 4, 64), 1e-6), 9),
        ("rms_norm_gate", k3.rms_norm_gate.default, (r(1, 1, 4, 64), r(64), r(1, 1, 4, 64), 1e-5), 13),
        ("attn_res", k3.attn_res.default, (r(3, 1, 1, 256), r(256), r(256), 1e-5), 27),
        ("short_conv", k3.short_conv.default, (r(1, 1, 256), r(256, 4), r(1, 256, 3)), 15),
        ("kda_gate", k3.kda_gate.default, (r(1, 1, 4, 64), r(4), r(256), "lower_bounded_sigmoid", -5.0), 11),
        (
            "kda_decode_step",
            k3.kda_decode_step.default,
            (r(1, 4, 64), r(1, 4, 64), r(1, 4, 64), -r(1, 4, 64).abs(), r(1, 4).sigmoid(), r(1, 4, 64, 64), None),
            33,
        ),
        ("mx_fake_quantize", k3.mx_fake_quantize.default, (r(4, 1, 128), "e4m3", 32), 36),
        ("mx_expert_glu", k3.mx_expert_glu.default, (r(4, 1, 128), *gq, *uq, 32, "situ_glu", 4.0, 25.0), 65),
        ("mx_expert_matmul", k3.mx_expert_matmul.default, (r(4, 1, 128), *gq, 32), 26),
        ("linear_glu", k3.linear_glu.default, (r(1, 1, 256), r(768, 256), r(768, 256), "situ_glu", 4.0, 25.0), 35),
        ("moe_combine", k3.moe_combine.default, (r(4, 1, 128), r(1, 4).abs(), torch.tensor([[0, 1, 2, 3]])), 23),
        ("moe_combine (no slots)", k3.moe_combine.default, (r(4, 1, 128), r(1, 4).abs(), None), 8),
        (
            "mla_decode_absorbed",
            k3.mla_decode_absorbed.default,
            (r(1, 1, 4, 64), r(1, 64, 96), r(384, 64), 0.125, torch.tensor([20])),
            86,
        ),
    ]


@pytest.mark.parametrize("case", _decode_cases(), ids=lambda c: c[0])
def test_decode_shapes_take_few_aten_calls(case):
    name, op, args, budget = case
    n = _aten_calls(lambda *a: op(*a, backend="torch"), *args)
    assert n <= budget, f"k3::{name} at decode shapes runs {n} aten calls (budget {budget})"
