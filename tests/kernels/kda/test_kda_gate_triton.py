"""Triton KDA decay gate (forward and backward) against `kda_gate_ref` and autograd, both gate forms."""

import math

import pytest
import torch

from k3compile.kernels.kda import gate_triton as kgt
from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.kernels._common.compare import rel_rms as _rel_rms

FORMS = ["lower_bounded_sigmoid", "softplus"]
LOWER_BOUND = -5.0

# Small blocks so a few tokens span several row blocks, column blocks and parameter-gradient partial rows.
SMALL = {
    "kda_gate_fwd": {"BLOCK_N": 4, "BLOCK_P": 16},
    "kda_gate_bwd": {"BLOCK_N": 8, "SUB_N": 4, "BLOCK_P": 16},
    "kda_gate_bwd_reduce": {"BLOCK_R": 2},
}


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kgt, "launch_config", lambda name, device, defaults, **sizes: {**defaults, **SMALL[name]})


def _inputs(B, T, H, K, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = (torch.randn(B, T, H, K, generator=g) * scale).to(dtype)
    A_log = torch.randn(H, generator=g) * 0.5
    dt_bias = torch.randn(H * K, generator=g)
    return f, A_log, dt_bias


def _check_against_autograd(f, A_log, dt_bias, form, fwd_tol=1e-6, bwd_tol=1e-5):
    g = kgt.kda_gate(f, A_log, dt_bias, form, LOWER_BOUND)
    leaves = [t.clone().requires_grad_() for t in (f, A_log, dt_bias)]
    g_ref = kda_gate_ref(*leaves, form, LOWER_BOUND)
    assert g.dtype == torch.float32 and g.shape == f.shape and g.is_contiguous()
    assert _rel_rms(g, g_ref) <= fwd_tol

    cot = torch.randn(g.shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad((g_ref * cot).sum(), leaves)
    got = kgt.kda_gate_bwd([cot], f, A_log, dt_bias, form, LOWER_BOUND)
    assert len(got) == 3
    for grad, ref, arg in zip(got, want, (f, A_log, dt_bias)):
        assert grad.shape == arg.shape and grad.dtype == arg.dtype
        assert _rel_rms(grad, ref) <= bwd_tol


@pytest.mark.parametrize("form", FORMS)
def test_matches_reference_and_autograd(form):
    # K = 12 is not a power of two; H * K = 36 and 26 tokens do not fill the default blocks.
    _check_against_autograd(*_inputs(2, 13, 3, 12), form)


@pytest.mark.parametrize("form", FORMS)
def test_many_blocks_ragged(small_blocks, form):
    # 17 tokens over 4-row / 8-row blocks, 36 columns over 16-column blocks that straddle heads.
    _check_against_autograd(*_inputs(1, 17, 3, 12, seed=2), form)


@pytest.mark.parametrize("form", FORMS)
def test_single_token(form):
    _check_against_autograd(*_inputs(1, 1, 2, 16, seed=3), form)


def test_hand_values():
    # f + dt_bias = x, a = exp(A_log) = 2: sigmoid form lb * sigmoid(2x), softplus form -2 * log(1 + e^x).
    xs = [-3.0, 0.0, 0.5, 2.0]
    f = torch.tensor(xs).view(1, 1, 1, 4)
    A_log, dt_bias = torch.tensor([math.log(2.0)]), torch.zeros(4)
    sig = kgt.kda_gate(f, A_log, dt_bias, "lower_bounded_sigmoid", LOWER_BOUND).flatten().tolist()
    sp = kgt.kda_gate(f, A_log, dt_bias, "softplus", 0.0).flatten().tolist()
    for x, s, p in zip(xs, sig, sp):
        assert s == pytest.approx(LOWER_BOUND / (1.0 + math.exp(-2.0 * x)), rel=1e-6)
        assert p == pytest.approx(-2.0 * math.log1p(math.exp(x)), rel=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy sigmoid at x = -200
def test_softplus_is_stable_at_large_magnitudes():
    # softplus(x) = x beyond torch's threshold 20; e^x alone below it; no inf/nan in either direction.
    xs = torch.tensor([-200.0, -60.0, -25.0, -12.0, -1e-3, 19.0, 21.0, 80.0, 1e4])
    f = xs.view(1, 1, 1, -1)
    A_log, dt_bias = torch.zeros(1), torch.zeros(xs.numel())
    g = kgt.kda_gate(f, A_log, dt_bias, "softplus", 0.0).flatten()
    assert torch.isfinite(g).all()
    # Elementwise against torch's fp32 softplus (log1p-exact for negative x; -200 underflows to 0 in both).
    torch.testing.assert_close(g, -torch.nn.functional.softplus(xs), rtol=1e-6, atol=0)
    df, _, _ = kgt.kda_gate_bwd([torch.ones_like(f)], f, A_log, dt_bias, "softplus", 0.0)
    torch.testing.assert_close(df.flatten(), -torch.sigmoid(xs), rtol=1e-6, atol=0)


@pytest.mark.parametrize("form", FORMS)
def test_bf16(form):
    # f in bf16: g is still fp32 from the same bf16 values; df is rounded to bf16 (the interpreter truncates).
    f, A_log, dt_bias = _inputs(2, 5, 2, 24, dtype=torch.bfloat16, seed=4)
    g = kgt.kda_gate(f, A_log, dt_bias, form, LOWER_BOUND)
    assert _rel_rms(g, kda_gate_ref(f, A_log, dt_bias, form, LOWER_BOUND)) <= 1e-6
    _check_against_autograd(f, A_log, dt_bias, form, bwd_tol=1e-2)


def test_non_contiguous_f():
    f, A_log, dt_bias = _inputs(3, 4, 2, 8, seed=5)
    f_nc = f.transpose(0, 1).contiguous().transpose(0, 1)
    assert not f_nc.is_contiguous()
    g = kgt.kda_gate(f_nc, A_log, dt_bias, "lower_bounded_sigmoid", LOWER_BOUND)
    assert _rel_rms(g, kda_gate_ref(f, A_log, dt_bias, "lower_bounded_sigmoid", LOWER_BOUND)) <= 1e-6


def test_deterministic_parameter_gradients(small_blocks):
    f, A_log, dt_bias = _inputs(1, 17, 3, 12, seed=6)
    cot = torch.randn(f.shape)
    first = kgt.kda_gate_bwd([cot], f, A_log, dt_bias, "lower_bounded_sigmoid", LOWER_BOUND)
    second = kgt.kda_gate_bwd([cot], f, A_log, dt_bias, "lower_bounded_sigmoid", LOWER_BOUND)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_unknown_form_raises():
    f, A_log, dt_bias = _inputs(1, 1, 1, 4)
    with pytest.raises(ValueError, match="unknown KDA decay form"):
        kgt.kda_gate(f, A_log, dt_bias, "tanh", LOWER_BOUND)
