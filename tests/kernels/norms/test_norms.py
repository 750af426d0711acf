"""RMSNorm, L2 norm and the fused norm ops against float64 hand formulas; meta, fx and compile."""

import math

import pytest
import torch

from k3compile.kernels.norms.reference import rms_norm_ref
from k3compile.modules.norms import RMSNorm
from k3compile.kernels.norms.op import add_rms_norm, l2_norm, rms_norm, rms_norm_gate


def _hand_rms(x, w, eps):
    """Row by row in Python floats: x_i / sqrt(sum(x^2)/n + eps) * w_i."""
    rows = x.double().reshape(-1, x.shape[-1]).tolist()
    out = []
    for r in rows:
        inv = 1.0 / math.sqrt(sum(v * v for v in r) / len(r) + eps)
        out.append([v * inv * wi for v, wi in zip(r, w.double().tolist())])
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def test_rms_norm_matches_float64_hand_formula():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 16) * 3, torch.randn(16)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _hand_rms(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_hand_table():
    # x = [3, 4]: mean square 12.5, rms sqrt(12.5); eps 0.
    y = rms_norm(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 2.0]), 0.0)
    r = math.sqrt(12.5)
    torch.testing.assert_close(y, torch.tensor([3 / r, 8 / r]))


def test_rms_norm_bf16_uses_fp32_statistics():
    torch.manual_seed(1)
    x, w = torch.randn(4, 64), torch.randn(64)
    xb = x.bfloat16()
    y = rms_norm(xb, w.bfloat16(), 1e-5)
    assert y.dtype == torch.bfloat16
    want = _hand_rms(xb.double(), w.bfloat16().double(), 1e-5)
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2)
    # The single rounding at the end is the only error: matches the fp32 result rounded once.
    assert torch.equal(y, rms_norm(xb.float(), w.bfloat16().float(), 1e-5).bfloat16())


def test_l2_norm_unit_rows():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8)
    y = l2_norm(x, 0.0)
    torch.testing.assert_close(y.norm(dim=-1), torch.ones(3, 5))
    torch.testing.assert_close(l2_norm(torch.tensor([3.0, 4.0]), 0.0), torch.tensor([0.6, 0.8]))


def test_fused_norms_equal_unfused():
    torch.manual_seed(3)
    x, r, g, w = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(8)
    torch.testing.assert_close(rms_norm_gate(x, w, g, 1e-5), rms_norm(x, w, 1e-5) * torch.sigmoid(g))
    xb, rb, wb = x.bfloat16(), r.bfloat16(), w.bfloat16()
    normed, s = add_rms_norm(xb, rb, wb, 1e-5)
    assert torch.equal(s, xb + rb)
    assert torch.equal(normed, rms_norm(xb + rb, wb, 1e-5))


def test_gradchecks_float64():
    torch.manual_seed(4)
    kw = dict(dtype=torch.float64, requires_grad=True)
    x, r, g, w = (
        torch.randn(2, 3, 6, **kw),
        torch.randn(2, 3, 6, **kw),
        torch.randn(2, 3, 6, **kw),
        torch.randn(6, **kw),
    )
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a: l2_norm(a, 1e-6), (x,))
    assert torch.autograd.gradcheck(lambda a, b, c: rms_norm_gate(a, b, c, 1e-5), (x, w, g))
    assert torch.autograd.gradcheck(lambda a, b, c: add_rms_norm(a, b, c, 1e-5), (x, r, w))


def test_meta_device():
    x, w = torch.empty(2, 3, 8, device="meta", dtype=torch.bfloat16), torch.empty(8, device="meta")
    assert rms_norm(x, w).shape == x.shape and rms_norm(x, w).dtype == torch.bfloat16
    assert l2_norm(x).device.type == "meta"
    assert rms_norm_gate(x, w, x).shape == x.shape
    n, s = add_rms_norm(x, x, w)
    assert n.shape == s.shape == x.shape


class _AllNorms(torch.nn.Module):
    def forward(self, x, r, w):
        n, s = add_rms_norm(x, r, w)
        return rms_norm(n, w) + l2_norm(s) + rms_norm_gate(s, w, n)


def test_symbolic_trace_has_op_nodes():
    gm = torch.fx.symbolic_trace(_AllNorms())
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("rms_norm", "l2_norm", "rms_norm_gate", "add_rms_norm"):
        assert getattr(torch.ops.k3, name).default in targets


def test_compile_fullgraph_forward_and_backward():
    torch.manual_seed(5)
    x, r, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(2, 3, 8), torch.randn(8, requires_grad=True)
    eager = _AllNorms()(x, r, w)
    compiled = torch.compile(_AllNorms(), fullgraph=True, backend="aot_eager")(x, r, w)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module(dtype):
    m = RMSNorm(8, eps=1e-5).to(dtype)
    assert [n for n, _ in m.named_parameters()] == ["weight"]
    assert torch.equal(m.weight, torch.ones(8, dtype=dtype))
    x = torch.randn(2, 8, dtype=dtype)
    assert torch.equal(m(x), rms_norm_ref(x, m.weight, 1e-5))


def _norm_cases(shape, dtype, seed=5, transpose=False):
    """(name, hand-written backward, reference forward, args) per norm op."""
    from k3compile.kernels.norms import reference as ref

    g = torch.Generator().manual_seed(seed)
    x, gate, res = (torch.randn(shape, generator=g).mul_(2).to(dtype) for _ in range(3))
    if transpose:  # non-contiguous rows
        x, gate, res = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (x, gate, res))
    w = torch.randn(shape[-1], generator=g).to(dtype)
    return [
        ("rms_norm", ref.rms_norm_bwd_ref, ref.rms_norm_ref, (x, w, 1e-5)),
        ("l2_norm", ref.l2_norm_bwd_ref, ref.l2_norm_ref, (x, 1e-6)),
        ("rms_norm_gate", ref.rms_norm_gate_bwd_ref, ref.rms_norm_gate_ref, (x, w, gate, 1e-5)),
    ]


@pytest.mark.parametrize(("shape", "dtype", "transpose"), [
    ((3, 5, 40), torch.float32, False), ((6, 4, 64), torch.float32, True), ((7, 33), torch.bfloat16, False),
])
def test_hand_written_backwards_equal_autograd_of_the_reference(shape, dtype, transpose):
    from k3compile.kernels._common.compare import autograd_grads, rel_rms

    for name, bwd, fwd, args in _norm_cases(shape, dtype, transpose=transpose):
        dy = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(dtype)
        got = bwd([dy], *args)
        want = [w for w in autograd_grads(fwd, args, [dy]) if w is not None]
        assert len(got) == len(want), name
        for a, b, arg in zip(got, want, [t for t in args if isinstance(t, torch.Tensor)]):
            assert a.shape == arg.shape and a.dtype == arg.dtype, name
            assert rel_rms(a, b) <= (1e-5 if dtype == torch.float32 else 8e-3), name


def test_norm_backwards_do_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("a norm's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    kw = dict(dtype=torch.float64, requires_grad=True)
    x, r, g = (torch.randn(2, 3, 6, **kw) for _ in range(3))
    w = torch.randn(6, **kw)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a: l2_norm(a, 1e-6), (x,))
    assert torch.autograd.gradcheck(lambda a, b, c: rms_norm_gate(a, b, c, 1e-5), (x, w, g))
    assert torch.autograd.gradcheck(lambda a, b, c: add_rms_norm(a, b, c, 1e-5), (x, r, w))


def test_few_rows_take_the_one_call_norm_and_agree_with_many():
    """Up to FEW_ROWS rows (a decode step) the statistics come from one vector_norm: the same values as the
    square-and-sum form many rows take, to fp32 rounding, for RMSNorm, the gated norm and the L2 norm."""
    from k3compile.kernels.norms import reference as norms

    torch.manual_seed(3)
    x, w, g = torch.randn(64, 256) * 3, torch.randn(256), torch.randn(64, 256)
    few = slice(0, norms.FEW_ROWS)
    assert norms._few_rows(x[few]) and not norms._few_rows(x)
    pairs = [
        (norms.rms_norm_ref(x[few], w, 1e-5), norms.rms_norm_ref(x, w, 1e-5)[few]),
        (norms.rms_norm_gate_ref(x[few], w, g[few], 1e-5), norms.rms_norm_gate_ref(x, w, g, 1e-5)[few]),
        (norms.l2_norm_ref(x[few], 1e-6), norms.l2_norm_ref(x, 1e-6)[few]),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
