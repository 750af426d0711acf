"""MLP module: parameter names and shapes, the three activations against hand-written math."""

import math

import pytest
import torch

from k3compile.modules.mlp import MLP


def _names(m):
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


def test_parameter_names_and_shapes():
    assert _names(MLP(8, 12, "swiglu")) == {
        "gate_proj.weight": (12, 8),
        "up_proj.weight": (12, 8),
        "down_proj.weight": (8, 12),
    }
    assert _names(MLP(8, 12, "gelu")) == {"up_proj.weight": (12, 8), "down_proj.weight": (8, 12)}
    for m in (MLP(8, 12, "situ_glu", 4.0, 25.0), MLP(8, 12, "swiglu"), MLP(8, 12, "gelu")):
        assert all(p.dim() == 2 for p in m.parameters())  # no biases


def test_bad_configs_raise():
    with pytest.raises(ValueError):
        MLP(8, 12, "relu")
    with pytest.raises(ValueError):
        MLP(8, 12, "situ_glu", beta1=4.0)
    with pytest.raises(ValueError):
        MLP(8, 12, "swiglu", beta1=4.0, beta2=25.0)


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu", "gelu"])
def test_forward_matches_hand_math(kind):
    torch.manual_seed(0)
    m = MLP(8, 12, kind, *((4.0, 25.0) if kind == "situ_glu" else ())).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    up = x @ m.up_proj.weight.T
    if kind == "gelu":
        h = 0.5 * up * (1 + torch.erf(up / math.sqrt(2)))
    else:
        g = x @ m.gate_proj.weight.T
        if kind == "swiglu":
            h = g * torch.sigmoid(g) * up
        else:
            h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(up / 25)
    torch.testing.assert_close(m(x), h @ m.down_proj.weight.T, rtol=1e-12, atol=1e-12)


def test_meta_bf16_trace_and_compile():
    m = MLP(8, 12, "situ_glu", 4.0, 25.0)
    with torch.device("meta"):
        mm = MLP(8, 12, "situ_glu", 4.0, 25.0).bfloat16()
    y = mm(torch.empty(2, 3, 8, device="meta", dtype=torch.bfloat16))
    assert y.shape == (2, 3, 8) and y.dtype == torch.bfloat16
    gm = torch.fx.symbolic_trace(m)
    assert torch.ops.k3.situ_glu.default in {n.target for n in gm.graph.nodes}
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(torch.compile(m, fullgraph=True, backend="aot_eager")(x), m(x))
    torch.testing.assert_close(gm(x), m(x))
