"""The fused ops' references (kernels/fused/reference.py): linear_glu's and linear_route's hand-written backwards against
autograd and gradcheck."""

import pytest
import torch

from k3compile.kernels._common.compare import autograd_grads, rel_rms
from k3compile.kernels.fused.reference import linear_glu_bwd_ref, linear_glu_ref, linear_route_bwd_ref, linear_route_ref
from k3compile.kernels.fused.op import linear_glu


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_linear_glu_backward_equals_autograd_of_the_reference(kind, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 32, generator=g).to(dtype)
    w_gate, w_up = (torch.randn(24, 32, generator=g).div_(3).to(dtype) for _ in range(2))
    dy = torch.randn(3, 7, 24, generator=g).to(dtype)
    got = linear_glu_bwd_ref([dy], x, w_gate, w_up, kind, 4.0, 25.0)
    want = autograd_grads(lambda *t: linear_glu_ref(*t, kind, 4.0, 25.0), (x, w_gate, w_up), [dy])
    for a, b, arg in zip(got, want, (x, w_gate, w_up), strict=True):
        assert a.shape == arg.shape and a.dtype == arg.dtype
        assert rel_rms(a, b) <= tol


def test_linear_glu_gradcheck_does_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("linear_glu's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    kw = dict(dtype=torch.float64, requires_grad=True)
    x, w_gate, w_up = torch.randn(2, 3, 6, **kw), torch.randn(5, 6, **kw), torch.randn(5, 6, **kw)
    for kind in ("situ_glu", "swiglu"):
        assert torch.autograd.gradcheck(lambda *t: linear_glu(*t, kind, 4.0, 25.0), (x, w_gate, w_up))
    with pytest.raises(ValueError, match="kind"):
        linear_glu_bwd_ref([torch.ones(2, 3, 5)], x.detach(), w_gate.detach(), w_up.detach(), "gelu", 0.0, 0.0)


@pytest.mark.parametrize(("scoring", "renormalize", "scale", "biased"), [
    ("sigmoid", True, 1.0, True), ("sigmoid", False, 2.5, False), ("softmax", True, 1.0, False),
    ("softmax", False, 2.5, True),
])  # fmt: skip
def test_linear_route_backward_equals_autograd_of_the_reference(scoring, renormalize, scale, biased, monkeypatch):
    """The hand-written backward against autograd of linear_route_ref (both float outputs' cotangents), and the
    op's gradcheck without a recompute under torch.func.vjp."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    w = torch.randn(12, 16, generator=g, dtype=torch.float64).div_(4)
    bias = torch.randn(12, generator=g, dtype=torch.float64).div_(10) if biased else None
    args = (bias, 4, scoring, renormalize, scale)
    gw, gs = torch.randn(18, 4, generator=g, dtype=torch.float64), torch.randn(18, 12, generator=g, dtype=torch.float64)
    got = linear_route_bwd_ref([gw, gs], x, w, *args)
    want = autograd_grads(lambda x, w: (lambda o: (o[0], o[2]))(linear_route_ref(x.reshape(-1, 16), w, *args)),
                          (x, w), [gw, gs])  # fmt: skip
    for a, b, arg in zip(got, want, (x, w), strict=True):
        assert a.shape == arg.shape and a.dtype == arg.dtype
        assert rel_rms(a, b) <= 1e-12
    monkeypatch.setattr(torch.func, "vjp", lambda *a, **k: pytest.fail("linear_route's backward recomputed under vjp"))
    x2 = x.reshape(-1, 16).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: (lambda o: (o[0], o[2]))(torch.ops.k3.linear_route.default(x, w, *args)),
                                    (x2, w.requires_grad_()))  # fmt: skip
