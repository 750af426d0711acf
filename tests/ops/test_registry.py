"""The op registry: fake impls, generic recompute and hand-written backwards, multi-output and optional inputs."""

import pytest
import torch
from torch import Tensor

from k3compile.kernels._common.registry import k3_op


def _scale_fake(x, w, eps):
    return torch.empty_like(x)


@k3_op("test_scale_norm", fake=_scale_fake, differentiable=("x", "w"))
def scale_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _multi_fake(x, s):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.long), torch.empty_like(x)


@k3_op("test_multi", fake=_multi_fake, differentiable=("x", "s"))
def multi(x: Tensor, s: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    y = x.sin() if s is None else x.sin() * s
    return y, x.argmax(-1), x.exp()


@k3_op("test_identity_pair", fake=lambda a, b: torch.empty_like(a), differentiable=("a", "b"))
def identity_pair(a: Tensor, b: Tensor) -> Tensor:
    return a + b  # both gradients are the incoming gradient itself: must not alias


def test_gradcheck_single_and_multi_output():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    s = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: scale_norm(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: multi(a, b)[0], (x, s))
    assert torch.autograd.gradcheck(lambda a: multi(a, None)[2], (x,))
    assert torch.autograd.gradcheck(lambda a, b: (lambda r: r[0] * 2 + r[2])(multi(a, b)), (x, s))
    assert torch.autograd.gradcheck(identity_pair, (x, x.detach().clone().requires_grad_()))


def test_meta_fx_and_compile():
    out = multi(torch.empty(2, 3, device="meta"), None)
    assert out[1].dtype == torch.int64 and out[0].device.type == "meta"
    gm = torch.fx.symbolic_trace(lambda a, b: scale_norm(a, b, 1e-5))
    assert any(n.target is torch.ops.k3.test_scale_norm.default for n in gm.graph.nodes)
    f = torch.compile(lambda a, b: multi(a, b)[0].sum(), fullgraph=True, backend="aot_eager")
    x, s = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    f(x, s).backward()
    torch.testing.assert_close(s.grad, x.detach().sin().sum(0))


_hand_calls = []


def _square_sum_bwd(grads, x, w):
    _hand_calls.append(len(grads))
    (gy,) = grads
    return [gy[..., None] * 2 * x * w, (gy[..., None] * x * x).reshape(-1, x.shape[-1]).sum(0)]


@k3_op(
    "test_square_sum",
    fake=lambda x, w: x.new_empty(x.shape[:-1]),
    differentiable=("x", "w"),
    backward=_square_sum_bwd,
)
def square_sum(x: Tensor, w: Tensor) -> Tensor:
    return (x * x * w).sum(-1)


def test_a_hand_written_backward_replaces_the_recompute(monkeypatch):
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def no_recompute(*args, **kwargs):
        raise AssertionError("the backward recomputed the forward")

    assert torch.autograd.gradcheck(square_sum, (x, w))
    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    _hand_calls.clear()
    gx, gw = torch.autograd.grad(square_sum(x, w).sum(), (x, w))
    assert _hand_calls == [1]
    torch.testing.assert_close(gx, 2 * x.detach() * w.detach())
    torch.testing.assert_close(gw, x.detach().pow(2).sum(0))
    with pytest.raises(ValueError, match="differentiable"):
        k3_op("test_bad_backward", fake=lambda x: x, backward=_square_sum_bwd)


def _saving_bwd(grads, outputs, x):
    return [grads[0] * outputs[1]]  # dy/dx saved by the forward


@k3_op(
    "test_saving_sin", fake=lambda x: (torch.empty_like(x), torch.empty_like(x)), differentiable=("x",),
    backward=_saving_bwd, saves_outputs=True,
)
def saving_sin(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.sin(), x.cos()


def test_a_backward_reading_saved_outputs():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: saving_sin(a)[0], (x,))
    with pytest.raises(ValueError, match="saves_outputs needs"):
        k3_op("test_saving_without_bwd", fake=lambda x: torch.empty_like(x), differentiable=("x",), saves_outputs=True)


@pytest.mark.parametrize("dtype", [None, torch.float64])
@pytest.mark.parametrize("make", [lambda: torch.empty(3, 4, 5), lambda: torch.empty(5, 4, 3).transpose(0, 2),
                                  lambda: torch.empty(3, 8, 5)[:, ::2]], ids=["contiguous", "transposed", "strided"])
def test_fake_empty_like_gives_torch_empty_like_metadata(make, dtype):
    from k3compile.kernels._common.registry import empty_like

    x = make().to("meta")
    got, want = empty_like(x, dtype=dtype), torch.empty_like(x, dtype=dtype)
    assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype, want.device)


def test_the_fake_table_holds_each_op_and_its_backward_and_their_backend_dependence():
    from k3compile.kernels._common.registry import BACKEND_FREE, FAKES

    assert {torch.ops.k3.test_scale_norm.default, torch.ops.k3.test_scale_norm_bwd.default} <= FAKES.keys()
    x = torch.empty(2, 3, device="meta")
    y = FAKES[torch.ops.k3.test_scale_norm.default](x, x[0], 1e-6, backend="triton")
    assert y.shape == x.shape and y.device.type == "meta"
    assert torch.ops.k3.test_scale_norm.default in BACKEND_FREE
