"""expert_rows_ffn: the routed experts' whole FFN on their rows equals the chain of ops it replaces, bit for bit."""

from __future__ import annotations

import pytest
import torch

import k3compile.kernels.experts.rows_ffn as ffn_module
from k3compile.ops import expert_rows_ffn, expert_rows_matmul, glu_train, mx_fake_quantize

COUNTS = torch.tensor([5, 0, 40, 3, 0, 17])  # experts without rows among them
E, I, H = 6, 64, 96


def operands(dtype: torch.dtype, seed: int = 0):
    """(x [N, I] with 7 zero rows past the experts' rows, gate, up [E, H, I], down [E, I, H])."""
    g = torch.Generator().manual_seed(seed)
    used = int(COUNTS.sum())
    x = torch.randn(used + 7, I, generator=g, dtype=torch.float64)
    x[used:] = 0
    ws = [torch.randn(E, H, I, generator=g, dtype=torch.float64) * 0.1 for _ in range(2)]
    ws.append(torch.randn(E, I, H, generator=g, dtype=torch.float64) * 0.1)
    return [t.to(dtype) for t in (x, *ws)]


def chain(x, wg, wu, wd, kind, act_fmt):
    """The ops group_experts leaves before fusing: gate and up matmuls, glu_train, the activation's fake
    quantisation, the down matmul."""
    y = glu_train(expert_rows_matmul(x, wg, COUNTS), expert_rows_matmul(x, wu, COUNTS), kind, 4.0, 25.0)[0]
    if act_fmt is not None:
        y = mx_fake_quantize(y, act_fmt, 32)
    return expert_rows_matmul(y, wd, COUNTS)


def fused(x, wg, wu, wd, kind, act_fmt):
    return expert_rows_ffn(x, wg, wu, wd, COUNTS, kind, 4.0, 25.0, act_fmt, 32 if act_fmt else 0)


def step(f, tensors, kind, act_fmt):
    """(output, the gradients of x and the three weights) for a fixed cotangent."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = f(*leaves, kind, act_fmt)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape))
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("chunk", [ffn_module.CHUNK, 2048], ids=["one-batch", "a-batch-per-expert"])
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
@pytest.mark.parametrize(("dtype", "act_fmt"), [(torch.float32, "e4m3"), (torch.float32, None), (torch.bfloat16, "e4m3")])
def test_equals_the_chain_it_replaces(monkeypatch, chunk, kind, dtype, act_fmt):
    """Output and every gradient, bit for bit, whether the experts run in one batch or one at a time; the rows
    past the experts' come out zero."""
    monkeypatch.setattr(ffn_module, "CHUNK", chunk)
    tensors = operands(dtype)
    got, want = step(fused, tensors, kind, act_fmt), step(chain, tensors, kind, act_fmt)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert not got[0][int(COUNTS.sum()):].any() and not got[1][int(COUNTS.sum()):].any()
    for dw in got[2:]:
        assert not dw[COUNTS == 0].any() and dw[COUNTS > 0].abs().sum(dim=(1, 2)).gt(0).all()


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_gradcheck_float64(kind):
    """Small enough for finite differences: 3 experts (one without rows) of width 4 and 5."""
    counts = torch.tensor([2, 0, 3])
    g = torch.Generator().manual_seed(1)
    x, wg, wu, wd = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                     for shape in ((6, 4), (3, 5, 4), (3, 5, 4), (3, 4, 5)))  # fmt: skip
    f = lambda *ts: expert_rows_ffn(*ts, counts, kind, 4.0, 25.0, None, 0)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, wg, wu, wd))


def test_saves_what_its_backward_reads():
    """The outputs beside the result: the activation's derivatives (compute dtype) and the down projection's
    input (fake-quantised, x's dtype)."""
    x, wg, wu, wd = operands(torch.bfloat16)
    out, jg, ju, yq = torch.ops.k3.expert_rows_ffn.default(x, wg, wu, wd, COUNTS, "situ_glu", 4.0, 25.0, "e4m3", 32)
    assert out.dtype == yq.dtype == torch.bfloat16 and jg.dtype == ju.dtype == torch.float32
    assert torch.equal(yq.float(), mx_fake_quantize(yq, "e4m3", 32).float())  # on the e4m3 grid already
    assert out.shape == x.shape and jg.shape == ju.shape == yq.shape == (x.shape[0], H)


def test_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="expert_rows_ffn kind must be one of"):
        fused(*operands(torch.float32), "relu", None)
