"""glu_train: the GLU and its elementwise derivatives, against the activations' references and autograd."""

import pytest
import torch

import k3compile.ops  # noqa: F401  (registers k3::glu_train)
from k3compile.kernels.glu_train import reference as gt
from k3compile.kernels.activations.reference import situ_glu_ref, swiglu_ref

K3 = torch.ops.k3
KINDS = (("situ_glu", 4.0, 25.0), ("swiglu", 0.0, 0.0))


def _act(g, u, kind, b1, b2):
    return situ_glu_ref(g, u, b1, b2) if kind == "situ_glu" else swiglu_ref(g, u)


@pytest.mark.parametrize("kind,b1,b2", KINDS)
def test_values_and_derivatives_match_autograd_of_the_reference(kind, b1, b2, monkeypatch):
    monkeypatch.setattr(gt, "CHUNK", 100)  # several chunks and a ragged last one
    g = (torch.randn(3, 7, 33, dtype=torch.float64) * 4).requires_grad_()
    u = (torch.randn(3, 7, 33, dtype=torch.float64) * 30).requires_grad_()
    y, jg, ju = gt.glu_train_ref(g.detach(), u.detach(), kind, b1, b2)
    want = _act(g, u, kind, b1, b2)
    dg, du = torch.autograd.grad(want.sum(), (g, u))  # elementwise: the gradient of the sum is the derivative
    torch.testing.assert_close(y, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jg, dg, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ju, du, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind,b1,b2", KINDS)
def test_op_gradcheck_float64(kind, b1, b2):
    g = (torch.randn(2, 5, 8, dtype=torch.float64) * 3).requires_grad_()
    u = (torch.randn(2, 5, 8, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: K3.glu_train(a, b, kind, b1, b2)[0], (g, u))


def test_fp32_equals_the_situ_glu_op_and_its_backward():
    g = (torch.randn(4, 64, 96) * 3).requires_grad_()
    u = (torch.randn(4, 64, 96) * 3).requires_grad_()
    gy = torch.randn(4, 64, 96)
    y = K3.glu_train(g, u, "situ_glu", 4.0, 25.0)[0]
    want = K3.situ_glu(g, u, 4.0, 25.0)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    got = torch.autograd.grad(y, (g, u), gy)
    ref = torch.autograd.grad(want, (g, u), gy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_returns_the_input_dtype_and_fp32_derivatives():
    g, u = torch.randn(8, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    y, jg, ju = K3.glu_train(g, u, "situ_glu", 4.0, 25.0)
    assert y.dtype == torch.bfloat16 and jg.dtype == ju.dtype == torch.float32
    torch.testing.assert_close(y, situ_glu_ref(g, u, 4.0, 25.0), rtol=1e-2, atol=1e-2)


def test_unknown_kind():
    with pytest.raises(ValueError, match="glu_train kind"):
        gt.glu_train_ref(torch.zeros(2), torch.zeros(2), "gelu", 0.0, 0.0)
