"""Triton GLU kernels (the interpreter on CPU) against kernels/activations/reference.py, float64 tanh/sigmoid and autograd."""

import pytest
import torch

from k3compile.kernels.activations import reference as ref
from k3compile.kernels.activations import triton as tri
from k3compile.kernels._common.compare import rel_rms

SHAPES = [(3, 5, 100), (7, 256), (2, 37)]
BETAS = [(4.0, 25.0), (1.0, 1.0), (4.0, 25.0)]  # K3's betas, and betas of 1 so tanh(u/b2) saturates too


def _inputs(shape, dtype=torch.float32, seed=0):
    """gate, up, dy; gate/up spread over +-12 with zeros, tiny and huge values planted at the front."""
    g = torch.Generator().manual_seed(seed)
    gate, up, dy = (torch.randn(shape, generator=g) * 4 for _ in range(3))
    gate.view(-1)[:6] = torch.tensor([0.0, 1e-8, -1e-5, 80.0, -80.0, -200.0])
    up.view(-1)[:6] = torch.tensor([1e-30, 0.0, -300.0, 3e-3, -1e-4, 0.26])
    return gate.to(dtype), up.to(dtype), dy.to(dtype)


def _grads(fn, gate, up, dy):
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    return torch.autograd.grad(fn(g, u), [g, u], dy)


@pytest.mark.parametrize(("shape", "betas"), list(zip(SHAPES, BETAS)))
def test_forward_matches_reference_fp32(shape, betas):
    gate, up, _ = _inputs(shape)
    for got, want in ((tri.situ_glu(gate, up, *betas), ref.situ_glu_ref(gate, up, *betas)),
                      (tri.swiglu(gate, up), ref.swiglu_ref(gate, up))):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
        assert rel_rms(got, want) <= 1e-6
        # elementwise too, so small outputs (where tanh's 1 - e would cancel) are checked, not drowned out
        assert ((got.double() - want.double()).abs() <= 2e-6 * want.double().abs() + 1e-30).all()


@pytest.mark.parametrize(("shape", "betas"), list(zip(SHAPES, BETAS)))
def test_backward_matches_autograd_fp32(shape, betas):
    gate, up, dy = _inputs(shape, seed=1)
    for got, want in ((tri.situ_glu_bwd([dy], gate, up, *betas),
                       _grads(lambda g, u: ref.situ_glu_ref(g, u, *betas), gate, up, dy)),
                      (tri.swiglu_bwd([dy], gate, up), _grads(ref.swiglu_ref, gate, up, dy))):
        assert len(got) == 2
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.isfinite(a).all()
            assert rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize(("shape", "betas"), list(zip(SHAPES, BETAS)))
def test_backward_matches_the_hand_written_reference_backward(shape, betas):
    gate, up, dy = _inputs(shape, seed=2)
    for got, want in ((tri.situ_glu_bwd([dy], gate, up, *betas), ref.situ_glu_bwd_ref([dy], gate, up, *betas)),
                      (tri.swiglu_bwd([dy], gate, up), ref.swiglu_bwd_ref([dy], gate, up))):
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.isfinite(b).all()
            assert rel_rms(a, b) <= 1e-5


def test_tanh_and_sigmoid_against_float64():
    # With gate = 1e4 (sigmoid 1, tanh(g/b1) 1) and b1 = b2 = 1, situ_glu is tanh(up): both tanh branches
    # and their switch at |z| = 0.25 over a fine sweep.
    z = torch.cat([torch.linspace(-3, 3, 6001), torch.tensor([0.25, -0.25, 0.2499999, 1e-20, -1e-38])])
    y = tri.situ_glu(torch.full_like(z, 1e4), z, 1.0, 1.0)
    want = torch.tanh(z.double())
    assert ((y.double() - want).abs() <= 5e-7 * want.abs()).all()
    # swiglu(g, 1) = g * sigmoid(g): relative accuracy in both tails, no overflow for large |g|.
    g = torch.cat([torch.linspace(-80, 80, 4001), torch.tensor([-1e4, 1e4])])  # fp32 normals out
    y = tri.swiglu(g, torch.ones_like(g)).double()
    want = g.double() * torch.sigmoid(g.double())
    assert torch.isfinite(y).all()
    assert ((y - want).abs() <= 1e-6 * want.abs()).all()


def test_bf16_forward_and_backward():
    gate, up, dy = _inputs((5, 100), torch.bfloat16, seed=2)
    assert rel_rms(tri.situ_glu(gate, up, 4.0, 25.0), ref.situ_glu_ref(gate, up, 4.0, 25.0)) <= 1e-2
    assert rel_rms(tri.swiglu(gate, up), ref.swiglu_ref(gate, up)) <= 1e-2
    for got, want in ((tri.situ_glu_bwd([dy], gate, up, 4.0, 25.0),
                       _grads(lambda g, u: ref.situ_glu_ref(g, u, 4.0, 25.0), gate, up, dy)),
                      (tri.swiglu_bwd([dy], gate, up), _grads(ref.swiglu_ref, gate, up, dy))):
        for a, b in zip(got, want):
            assert a.dtype == torch.bfloat16 and rel_rms(a, b) <= 2e-2


def test_mixed_dtypes_non_contiguous_and_bad_shapes():
    gate, up, dy = _inputs((100, 6), seed=3)
    gate, dy = gate.t(), dy.t()
    up = up.t().bfloat16()  # output follows gate's dtype, dup follows up's
    y = tri.situ_glu(gate, up, 4.0, 25.0)
    assert y.dtype == torch.float32 and rel_rms(y, ref.situ_glu_ref(gate, up, 4.0, 25.0)) <= 1e-6
    dgate, dup = tri.swiglu_bwd([dy], gate, up)
    want = _grads(ref.swiglu_ref, gate, up.float(), dy)
    assert dup.dtype == torch.bfloat16 and rel_rms(dgate, want[0]) <= 1e-5 and rel_rms(dup, want[1]) <= 1e-2
    with pytest.raises(ValueError, match="shape"):
        tri.swiglu(torch.zeros(2, 3), torch.zeros(3, 2))
    assert tri.swiglu(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)
