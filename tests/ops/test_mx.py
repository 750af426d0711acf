"""k3 MX ops: registration, fakes on meta, fx tracing, torch.compile, straight-through and mx_linear."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels.mx import reference as ref
from k3compile.kernels.mx import op as M

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_ops_match_reference(fmt):
    x = torch.randn(2, 3, 64)
    data, scale = M.mx_quantize(x, fmt)
    want_data, want_scale = ref.mx_quantize_ref(x, fmt, 32)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert torch.equal(M.mx_dequantize(data, scale, fmt), ref.mx_dequantize_ref(data, scale, fmt))
    assert torch.equal(M.mx_fake_quantize(x, fmt), ref.mx_fake_quantize_ref(x, fmt))


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ops_give_reference_bits_with_specials(fmt, dtype):
    # The ops run the fast path: same bits as the float64 reference, -0, subnormals and NaN blocks included.
    torch.manual_seed(1)
    x = (torch.randn(4, 4, 32) * torch.exp2(torch.randint(-12, 8, (4, 4, 1)).float())).reshape(4, 128).to(dtype)
    x[0, 3], x[1, 40], x[2, 70], x[3, :32] = float("nan"), float("-inf"), -0.0, 1e-42
    data, scale = M.mx_quantize(x, fmt)
    want_data, want_scale = ref.mx_quantize_ref(x, fmt, 32)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(scale, want_scale)
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    nan = torch.zeros_like(x, dtype=torch.bool)
    nan[0, :32] = nan[1, 32:64] = True
    for got, want in (
        (M.mx_fake_quantize(x, fmt), ref.mx_fake_quantize_ref(x, fmt)),
        (M.mx_dequantize(data, scale, fmt, 32, dtype), ref.mx_dequantize_ref(data, scale, fmt, 32, dtype)),
    ):
        assert torch.equal(got.isnan(), nan) and torch.equal(want.isnan(), nan)
        assert torch.equal(got.masked_fill(nan, 0).view(bits), want.masked_fill(nan, 0).view(bits))


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_meta_shapes_and_dtypes(fmt):
    x = torch.empty(2, 5, 64, device="meta", dtype=torch.bfloat16)
    data, scale = M.mx_quantize(x, fmt, 16)
    assert data.device.type == "meta" and scale.shape == (2, 5, 4) and scale.dtype == torch.uint8
    assert (data.shape, data.dtype) == (((2, 5, 32), torch.uint8) if fmt == "e2m1" else ((2, 5, 64), FP8[fmt]))
    back = M.mx_dequantize(data, scale, fmt, 16, torch.bfloat16)
    assert back.shape == x.shape and back.dtype == torch.bfloat16
    assert M.mx_fake_quantize(x, fmt, 16).shape == x.shape
    w_data, w_scale = M.mx_quantize(torch.empty(7, 64, device="meta"), fmt, 16)
    y = M.mx_linear(x, w_data, w_scale, fmt, 16, act_fmt="e4m3")
    assert y.shape == (2, 5, 7) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_meta_rejects_bad_block():
    with pytest.raises(ValueError, match="multiple of the block"):
        M.mx_quantize(torch.empty(4, 48, device="meta"), "e2m1", 32)


def test_fake_quantize_gradient_is_identity():
    # Straight-through: saturated elements, NaN blocks and rounded ones all pass the gradient unchanged.
    x = torch.tensor([[7.0, 0.3, -2.6, 1.0], [float("nan"), 1.0, 2.0, 3.0]], requires_grad=True)
    g = torch.randn(2, 4)
    M.mx_fake_quantize(x, "e2m1", 4).backward(g)
    assert torch.equal(x.grad, g)
    xb = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    M.mx_fake_quantize(xb, "e4m3").sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and (xb.grad == 1).all()


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_linear_equals_matmul_with_dequantized_weight(fmt, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 64).to(dtype), torch.randn(5, 64)
    data, scale = M.mx_quantize(w, fmt)
    w_deq = M.mx_dequantize(data, scale, fmt)
    y = M.mx_linear(x, data, scale, fmt)
    assert y.dtype == dtype
    torch.testing.assert_close(y, (x.float() @ w_deq.T).to(dtype), rtol=0, atol=0)
    y_act = M.mx_linear(x, data, scale, fmt, act_fmt="e4m3")
    x_q = M.mx_fake_quantize(x.float(), "e4m3")
    torch.testing.assert_close(y_act, (x_q @ w_deq.T).to(dtype), rtol=0, atol=0)


def test_mx_linear_gradients():
    x = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)
    data, scale = M.mx_quantize(torch.randn(4, 32), "e2m1")
    torch.autograd.gradcheck(lambda t: M.mx_linear(t, data, scale, "e2m1"), (x,))
    # With activation fake-quant the gradient is straight-through: grad_y @ dequant(W).
    xf = x.detach().float().requires_grad_()
    g = torch.randn(3, 4)
    M.mx_linear(xf, data, scale, "e2m1", act_fmt="e4m3").backward(g)
    torch.testing.assert_close(xf.grad, g @ M.mx_dequantize(data, scale, "e2m1"))


class _MXBlock(torch.nn.Module):
    def __init__(self, data, scale):
        super().__init__()
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)

    def forward(self, x):
        d, s = M.mx_quantize(x, "e5m2")
        x = M.mx_dequantize(d, s, "e5m2") + M.mx_fake_quantize(x, "e2m1")
        return M.mx_linear(x, self.data, self.scale, "e2m1", act_fmt="e4m3")


def test_symbolic_trace_keeps_ops_as_call_functions():
    data, scale = M.mx_quantize(torch.randn(6, 64), "e2m1")
    gm = torch.fx.symbolic_trace(_MXBlock(data, scale))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("mx_quantize", "mx_dequantize", "mx_fake_quantize", "mx_linear"):
        assert getattr(torch.ops.k3, name).default in targets
    x = torch.randn(2, 64)
    assert torch.equal(gm(x), _MXBlock(data, scale)(x))


def test_torch_compile_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    data, scale = M.mx_quantize(torch.randn(6, 64), "e2m1")
    block = _MXBlock(data, scale)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 6)
    y, y2 = block(x), compiled(x2)
    assert torch.equal(y, y2)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)


def test_opcheck_registrations():
    x = torch.randn(2, 64)
    data, scale = M.mx_quantize(torch.randn(3, 64), "e2m1")
    torch.library.opcheck(torch.ops.k3.mx_fake_quantize.default, (x.requires_grad_(), "e4m3", 32))
    torch.library.opcheck(torch.ops.k3.mx_linear.default, (x, data, scale, "e2m1", 32, None))
    torch.library.opcheck(torch.ops.k3.mx_quantize.default, (x.detach(), "e5m2", 32))
    torch.library.opcheck(torch.ops.k3.mx_dequantize.default, (data, scale, "e2m1", 32, torch.float32))
