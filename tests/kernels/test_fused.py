"""The fused ops' references (kernels/fused.py): linear_glu's hand-written backward against autograd and gradcheck."""

import pytest
import torch

from k3compile.kernels.compare import autograd_grads, rel_rms
from k3compile.kernels.fused import linear_glu_bwd_ref, linear_glu_ref
from k3compile.ops.fused import linear_glu


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
