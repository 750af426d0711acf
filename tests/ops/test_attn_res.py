"""k3::attn_res against a float64 naive loop; zero query averages; gradcheck and the hand-written backward
against autograd of the reference; meta, fx, compile."""

import math

import pytest
import torch

from k3compile.kernels.attn_res.reference import attn_res_bwd_ref, attn_res_ref
from k3compile.kernels._common.compare import autograd_grads, rel_rms
from k3compile.kernels.attn_res.op import attn_res


def _naive(v_SBTD, w, g, eps):
    """Token by token in Python floats: logits, softmax over sources, weighted sum."""
    S, B, T, D = v_SBTD.shape
    v = v_SBTD.double().tolist()
    w, g = w.double().tolist(), g.double().tolist()
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            logits = []
            for i in range(S):
                row = v[i][b][t]
                inv = 1.0 / math.sqrt(sum(x * x for x in row) / D + eps)
                logits.append(sum(wd * gd * x * inv for wd, gd, x in zip(w, g, row)))
            m = max(logits)
            e = [math.exp(z - m) for z in logits]
            p = [x / sum(e) for x in e]
            for d in range(D):
                out[b, t, d] = sum(p[i] * v[i][b][t][d] for i in range(S))
    return out


def test_matches_naive_loop_fp32():
    torch.manual_seed(0)
    v, w, g = torch.randn(4, 2, 3, 8) * 2, torch.randn(8), torch.rand(8) + 0.5
    h = attn_res(v, w, g, 1e-5)
    assert h.shape == (2, 3, 8) and h.dtype == torch.float32
    torch.testing.assert_close(h.double(), _naive(v, w, g, 1e-5), rtol=1e-5, atol=1e-6)


def test_zero_query_is_plain_average():
    torch.manual_seed(1)
    v = torch.randn(5, 2, 3, 8)
    torch.testing.assert_close(attn_res(v, torch.zeros(8), torch.randn(8)), v.mean(dim=0))


def test_one_source_is_identity_and_weights_pick_the_aligned_source():
    v = torch.randn(1, 2, 3, 8)
    torch.testing.assert_close(attn_res(v, torch.randn(8), torch.ones(8)), v[0])
    # Two sources e0 and e1 (unit rows, RMSNorm -> sqrt(2) e_i); query 10 * e1 gives logits 0 and 10*sqrt(2).
    v = torch.zeros(2, 1, 1, 2)
    v[0, ..., 0], v[1, ..., 1] = 1.0, 1.0
    p1 = 1 / (1 + math.exp(-10 * math.sqrt(2)))
    h = attn_res(v, torch.tensor([0.0, 10.0]), torch.ones(2), 0.0)
    torch.testing.assert_close(h.flatten(), torch.tensor([1 - p1, p1]))


def test_bf16_in_bf16_out_fp32_inside():
    torch.manual_seed(2)
    v, w, g = torch.randn(3, 2, 4, 16).bfloat16(), torch.randn(16).bfloat16(), torch.ones(16).bfloat16()
    h = attn_res(v, w, g)
    assert h.dtype == torch.bfloat16
    assert torch.equal(h, attn_res(v.float(), w.float(), g.float()).bfloat16())


def test_gradcheck_float64():
    torch.manual_seed(3)
    kw = dict(dtype=torch.float64, requires_grad=True)
    v, w, g = torch.randn(3, 2, 2, 5, **kw), torch.randn(5, **kw), torch.randn(5, **kw)
    assert torch.autograd.gradcheck(lambda a, b, c: attn_res(a, b, c, 1e-5), (v, w, g))


def test_gradcheck_float64_does_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("attn_res's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    kw = dict(dtype=torch.float64, requires_grad=True)
    v = (torch.randn(4, 2, 3, 6, dtype=torch.float64) * torch.tensor([0.5, 1, 2, 4]).view(4, 1, 1, 1)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: attn_res(a, b, c, 1e-5), (v, torch.randn(6, **kw),
                                                                               torch.randn(6, **kw)))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_hand_written_backward_equals_autograd_of_the_reference(dtype, tol):
    g = torch.Generator().manual_seed(4)
    v = (torch.randn(5, 2, 7, 48, generator=g) * torch.rand(5, 1, 1, 1, generator=g).mul(3)).to(dtype)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous sources
    query, norm_weight = torch.randn(48, generator=g).to(dtype), (torch.rand(48, generator=g) + 0.5).to(dtype)
    dh = torch.randn(2, 7, 48, generator=g).to(dtype)
    got = attn_res_bwd_ref([dh], v, query, norm_weight, 1e-5)
    want = autograd_grads(attn_res_ref, (v, query, norm_weight, 1e-5), [dh])[:3]
    for a, b, arg in zip(got, want, (v, query, norm_weight), strict=True):
        assert a.shape == arg.shape and a.dtype == arg.dtype
        assert rel_rms(a, b) <= tol


def test_meta_trace_compile():
    h = attn_res(torch.empty(4, 2, 3, 8, device="meta", dtype=torch.bfloat16), torch.empty(8, device="meta"),
                 torch.empty(8, device="meta"))
    assert h.shape == (2, 3, 8) and h.dtype == torch.bfloat16 and h.device.type == "meta"

    def f(v, w, g):
        return attn_res(v, w, g) * 2

    gm = torch.fx.symbolic_trace(f)
    assert torch.ops.k3.attn_res.default in {n.target for n in gm.graph.nodes}
    v, w, g = torch.randn(3, 2, 4, 8, requires_grad=True), torch.randn(8, requires_grad=True), torch.ones(8)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(v, w, g)
    torch.testing.assert_close(out, f(v, w, g))
    out.sum().backward()
    assert v.grad is not None and w.grad is not None
