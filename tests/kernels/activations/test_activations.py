"""SiTU-GLU, SwiGLU and GELU: hand formulas, SiTU-GLU's limits, gradchecks, meta, fx and compile."""

import math

import pytest
import torch

from k3compile.kernels.activations.op import gelu, situ_glu, swiglu


def _sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def test_hand_values():
    # g = 1, u = 2 with b1 = 4, b2 = 25, evaluated in Python floats.
    want_situ = 4 * math.tanh(1 / 4) * _sig(1.0) * 25 * math.tanh(2 / 25)
    got = situ_glu(torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64), 4.0, 25.0)
    assert got.item() == pytest.approx(want_situ, rel=1e-12)
    got = swiglu(torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64))
    assert got.item() == pytest.approx(1 * _sig(1.0) * 2, rel=1e-12)
    exact = 0.5 * 1.5 * (1 + math.erf(1.5 / math.sqrt(2)))
    tanh_form = 0.5 * 1.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (1.5 + 0.044715 * 1.5**3)))
    x = torch.tensor([1.5], dtype=torch.float64)
    assert gelu(x).item() == pytest.approx(exact, rel=1e-12)
    assert gelu(x, "tanh").item() == pytest.approx(tanh_form, rel=1e-12)
    with pytest.raises(ValueError):
        gelu(x, "fast")


def test_situ_matches_swiglu_to_first_order_near_zero():
    torch.manual_seed(0)
    g, u = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    errs = []
    for eps in (1e-1, 1e-2):
        gs, us = eps * g, eps * u
        s, w = situ_glu(gs, us, 4.0, 25.0), swiglu(gs, us)
        # 1 - z^2/3 <= tanh(z)/z <= 1, so |situ - swiglu| <= |swiglu| * ((g/b1)^2 + (u/b2)^2) / 3.
        bound = w.abs() * ((gs / 4) ** 2 + (us / 25) ** 2) / 3
        assert ((s - w).abs() <= bound * (1 + 1e-6) + 1e-18).all()
        errs.append(((s - w).abs().max() / w.abs().max()).item())
    # The gap is second order: shrinking the inputs 10x shrinks the relative gap about 100x.
    assert errs[0] / errs[1] == pytest.approx(100, rel=0.05)


def test_situ_bounded_by_b1_b2():
    x = torch.tensor([-1e4, -50.0, -3.0, 0.0, 3.0, 50.0, 1e4])
    g, u = x.repeat_interleave(7), x.repeat(7)
    y = situ_glu(g, u, 4.0, 25.0)
    assert y.abs().max() <= 100.0
    assert y.max().item() == pytest.approx(100.0, rel=1e-6)  # g, u -> +inf saturates at b1*b2
    assert situ_glu(torch.tensor([1e4]), torch.tensor([1e4]), 2.0, 3.0).item() == pytest.approx(6.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_kept(dtype):
    g, u = torch.randn(4, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
    for y in (situ_glu(g, u), swiglu(g, u), gelu(g)):
        assert y.dtype == dtype
    want = situ_glu(g.float(), u.float()).to(dtype)
    assert torch.equal(situ_glu(g, u), want)


def test_gradchecks_float64():
    torch.manual_seed(1)
    g = (torch.randn(3, 5, dtype=torch.float64) * 3).requires_grad_()
    u = (torch.randn(3, 5, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))
    assert torch.autograd.gradcheck(swiglu, (g, u))
    assert torch.autograd.gradcheck(gelu, (g,))
    assert torch.autograd.gradcheck(lambda a: gelu(a, "tanh"), (g,))


def test_meta_device():
    g = torch.empty(2, 3, 8, device="meta", dtype=torch.bfloat16)
    for y in (situ_glu(g, g), swiglu(g, g), gelu(g)):
        assert y.device.type == "meta" and y.shape == g.shape and y.dtype == torch.bfloat16


class _AllActs(torch.nn.Module):
    def forward(self, g, u):
        return situ_glu(g, u, 4.0, 25.0) + swiglu(g, u) + gelu(g, "tanh")


def test_symbolic_trace_has_op_nodes():
    gm = torch.fx.symbolic_trace(_AllActs())
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("situ_glu", "swiglu", "gelu"):
        assert getattr(torch.ops.k3, name).default in targets


def test_compile_fullgraph_forward_and_backward():
    g, u = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    eager = _AllActs()(g, u)
    compiled = torch.compile(_AllActs(), fullgraph=True, backend="aot_eager")(g, u)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert g.grad is not None and u.grad is not None


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_hand_written_backwards_equal_autograd_of_the_reference(dtype, tol):
    from k3compile.kernels.activations import reference as ref
    from k3compile.kernels._common.compare import autograd_grads, rel_rms

    g = torch.Generator().manual_seed(7)
    gate, up, dy = (torch.randn(6, 50, generator=g).mul_(6).to(dtype) for _ in range(3))
    gate, up = gate.T.contiguous().T, up[:, ::1]  # a non-contiguous gate
    for betas in ((4.0, 25.0), (1.0, 1.0)):  # K3's, and betas of 1 so tanh(u / b2) saturates
        cases = [(ref.situ_glu_bwd_ref, ref.situ_glu_ref, betas), (ref.swiglu_bwd_ref, ref.swiglu_ref, ())]
        for bwd, fwd, extra in cases:
            got = bwd([dy], gate, up, *extra)
            want = autograd_grads(fwd, (gate, up, *extra), [dy])[:2]
            for a, b, arg in zip(got, want, (gate, up), strict=True):
                assert a.shape == arg.shape and a.dtype == arg.dtype and torch.isfinite(a).all()
                assert rel_rms(a, b) <= tol


def test_glu_gradchecks_do_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("a GLU's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    g = (torch.randn(3, 5, dtype=torch.float64) * 3).requires_grad_()
    u = (torch.randn(3, 5, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))
    assert torch.autograd.gradcheck(swiglu, (g, u))
