"""Triton norm kernels (the interpreter on CPU) against kernels/norms/reference.py and autograd through it."""

import math

import pytest
import torch

from k3compile.kernels.norms import reference as ref
from k3compile.kernels.norms import triton as tri
from k3compile.kernels._common.compare import rel_rms

# Ragged last dims (100, 37: not powers of two) and 130 rows: more row blocks than backward programs,
# so the grid-stride loop and the dweight partial-row sum both run more than once.
SHAPES = [(3, 5, 100), (7, 256), (130, 37)]


def _inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, gate, res, dy, ds = (torch.randn(shape, generator=g) * 2 for _ in range(5))
    w = torch.randn(shape[-1], generator=g)
    return [t.to(dtype) for t in (x, w, gate, res, dy, ds)]


def _grads(fn, args, cotangents):
    """torch.autograd.grad of the reference `fn(*args)` with these cotangents."""
    leaves = [a.detach().clone().requires_grad_() for a in args]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    return torch.autograd.grad(outs, leaves, cotangents[: len(outs)])


def _cases(x, w, gate, res, eps):
    """(name, triton fwd, reference fwd, args, triton bwd) per op."""
    return [
        ("rms_norm", lambda *a: tri.rms_norm(*a, eps), lambda *a: ref.rms_norm_ref(*a, eps), (x, w),
         lambda gr, *a: tri.rms_norm_bwd(gr, *a, eps)),
        ("l2_norm", lambda *a: tri.l2_norm(*a, eps), lambda *a: ref.l2_norm_ref(*a, eps), (x,),
         lambda gr, *a: tri.l2_norm_bwd(gr, *a, eps)),
        ("rms_norm_gate", lambda *a: tri.rms_norm_gate(*a, eps), lambda *a: ref.rms_norm_gate_ref(*a, eps),
         (x, w, gate), lambda gr, *a: tri.rms_norm_gate_bwd(gr, *a, eps)),
        ("add_rms_norm", lambda *a: tri.add_rms_norm(*a, eps), lambda *a: ref.add_rms_norm_ref(*a, eps),
         (x, res, w), lambda gr, *a: tri.add_rms_norm_bwd(gr, *a, eps)),
    ]


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference_fp32(shape):
    x, w, gate, res, _, _ = _inputs(shape)
    for name, fwd, fwd_ref, args, _ in _cases(x, w, gate, res, 1e-5):
        got, want = fwd(*args), fwd_ref(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
            assert rel_rms(a, b) <= 1e-6, name


@pytest.mark.parametrize(("shape", "eps"), [(SHAPES[0], 1e-5), (SHAPES[1], 1e-6), (SHAPES[2], 0.0)])
def test_backward_matches_autograd_fp32(shape, eps):
    x, w, gate, res, dy, ds = _inputs(shape, seed=1)
    for name, _, fwd_ref, args, bwd in _cases(x, w, gate, res, eps):
        want = _grads(fwd_ref, args, [dy, ds])
        got = bwd([dy, ds] if name == "add_rms_norm" else [dy], *args)
        assert len(got) == len(want), name
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert rel_rms(a, b) <= 1e-5, name


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_the_hand_written_reference_backward(shape):
    x, w, gate, res, dy, _ = _inputs(shape, seed=4)
    hand = {"rms_norm": ref.rms_norm_bwd_ref, "l2_norm": ref.l2_norm_bwd_ref, "rms_norm_gate": ref.rms_norm_gate_bwd_ref}
    for name, _, _, args, bwd in _cases(x, w, gate, res, 1e-5):
        if name in hand:  # add_rms_norm's reference backward is rms_norm's, on the sum
            got, want = bwd([dy], *args), hand[name]([dy], *args, 1e-5)
            assert len(got) == len(want), name
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                assert rel_rms(a, b) <= 1e-5, name


def test_add_rms_norm_sum_is_bit_equal_to_unfused_add():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w, _, res, _, _ = _inputs((7, 100), dtype, seed=2)
        y, s = tri.add_rms_norm(x, res, w, 1e-5)
        assert s.dtype == dtype and torch.equal(s, x + res), dtype
        assert rel_rms(y, ref.rms_norm_ref(x + res, w, 1e-5)) <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_bf16_forward_and_backward():
    x, w, gate, res, dy, ds = _inputs((5, 100), torch.bfloat16, seed=3)
    for w_ in (w, w.float()):  # bf16 weights, and fp32 weights on bf16 activations
        for name, fwd, fwd_ref, args, bwd in _cases(x, w_, gate, res, 1e-5):
            got, want = fwd(*args), fwd_ref(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and rel_rms(a, b) <= 1e-2, name
            grads_want = _grads(fwd_ref, args, [dy, ds])
            grads_got = bwd([dy, ds] if name == "add_rms_norm" else [dy], *args)
            for a, b in zip(grads_got, grads_want):
                assert a.dtype == b.dtype and rel_rms(a, b) <= 2e-2, name


def test_hand_values():
    # x = [3, 4]: sum of squares 25, mean square 12.5; eps 0.
    x, w = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])
    r = math.sqrt(12.5)
    torch.testing.assert_close(tri.rms_norm(x, w, 0.0), torch.tensor([[3 / r, 8 / r]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(tri.l2_norm(x, 0.0), torch.tensor([[0.6, 0.8]]), rtol=1e-6, atol=0)
    # gate 0 halves the output; a gate of +-inf-like size passes it or zeroes it
    gate = torch.tensor([[0.0, 200.0]])
    torch.testing.assert_close(tri.rms_norm_gate(x, w, gate, 0.0), torch.tensor([[1.5 / r, 8 / r]]), rtol=1e-6, atol=0)
    # l2_norm's Jacobian at unit x = [0.6, 0.8] is I - x x^T: dy = [1, 0] -> dx = [1 - 0.36, -0.48]
    dx = tri.l2_norm_bwd([torch.tensor([[1.0, 0.0]])], torch.tensor([[0.6, 0.8]]), 0.0)[0]
    torch.testing.assert_close(dx, torch.tensor([[0.64, -0.48]]), rtol=1e-6, atol=1e-7)


def test_non_contiguous_inputs():
    x, _, gate, res, dy, ds = _inputs((100, 6), seed=4)
    x, gate, res, dy, ds = (t.t() for t in (x, gate, res, dy, ds))  # [6, 100], strided
    w = _inputs((6, 100), seed=4)[1]
    assert rel_rms(tri.rms_norm_gate(x, w, gate, 1e-5), ref.rms_norm_gate_ref(x, w, gate, 1e-5)) <= 1e-6
    got = tri.add_rms_norm_bwd([dy, ds], x, res, w, 1e-5)
    for a, b in zip(got, _grads(lambda *a: ref.add_rms_norm_ref(*a, 1e-5), (x, res, w), [dy, ds])):
        assert rel_rms(a, b) <= 1e-5


def test_add_rms_norm_bwd_returns_distinct_tensors_and_deterministic_dweight():
    x, w, _, res, dy, ds = _inputs((130, 37), seed=5)
    dx, dres, dw = tri.add_rms_norm_bwd([dy, ds], x, res, w, 1e-5)
    assert dx.data_ptr() != dres.data_ptr() and torch.equal(dx, dres)
    assert torch.equal(dw, tri.add_rms_norm_bwd([dy, ds], x, res, w, 1e-5)[2])


def test_empty_rows_and_too_wide_rows():
    x, w = torch.empty(0, 16), torch.ones(16)
    assert tri.rms_norm(x, w, 1e-5).shape == (0, 16)
    dx, dw = tri.rms_norm_bwd([x], x, w, 1e-5)
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))
    with pytest.raises(ValueError, match="exceeds"):
        tri.l2_norm(torch.empty(1, tri.MAX_N + 1), 1e-5)
