"""KDAMixer: weight names and shapes, init, prefill + decode == one full forward, meta / fx / compile."""

import math

import pytest
import torch

from k3compile.modules.kda import KDAMixer, KDAState
from k3compile.kernels._common.compare import rel_rms as _rel

D, H, K, W = 32, 2, 8, 4
P = H * K


def _mixer(form="lower_bounded_sigmoid", gate_rank=None, seed=0, **kw):
    torch.manual_seed(seed)
    lower_bound = -5.0 if form == "lower_bounded_sigmoid" else None
    return KDAMixer(D, H, K, W, form, lower_bound, decay_rank=4, gate_rank=gate_rank, **kw)


def _x(B=2, T=23, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_parameter_names_and_shapes_full_rank_gate():
    shapes = {n: tuple(p.shape) for n, p in _mixer().named_parameters()}
    assert shapes == {
        "q_proj.weight": (P, D), "k_proj.weight": (P, D), "v_proj.weight": (P, D),
        "q_conv.weight": (P, W), "k_conv.weight": (P, W), "v_conv.weight": (P, W),
        "f_down.weight": (4, D), "f_up.weight": (P, 4), "A_log": (H,), "dt_bias": (P,),
        "b_proj.weight": (H, D), "g_proj.weight": (P, D), "o_norm.weight": (K,), "o_proj.weight": (D, P),
    }


def test_parameter_names_low_rank_gate_and_default_decay_rank():
    m = KDAMixer(D, H, K, W, "softplus", None, decay_rank=None, gate_rank=3)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert "g_proj.weight" not in shapes
    assert shapes["g_down.weight"] == (3, D) and shapes["g_up.weight"] == (P, 3)
    assert shapes["f_down.weight"] == (K, D) and shapes["f_up.weight"] == (P, K)


def test_init():
    m = _mixer()
    assert torch.all((m.A_log >= 0) & (m.A_log <= math.log(16)))
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert torch.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))
    assert torch.equal(m.o_norm.weight, torch.ones(K))
    assert abs(m.q_proj.weight.std().item() - 0.02) < 0.005


def _prefill_then_decode(m, x):
    """(full forward, prefill of 15 tokens then one decode step per token): outputs and final states."""
    y_full, s_full = m(x)
    y, state = m(x[:, :15])
    ys = [y]
    for t in range(15, x.shape[1]):
        y, state = m(x[:, t : t + 1], state)
        ys.append(y)
    return (y_full, s_full), (torch.cat(ys, 1), state)


@pytest.mark.parametrize("form,gate_rank", [("lower_bounded_sigmoid", None), ("softplus", 3)])
def test_prefill_then_decode_equals_full_forward(form, gate_rank):
    m = _mixer(form, gate_rank)
    x = _x()
    (y_full, s_full), (y_steps, state) = _prefill_then_decode(m, x)
    assert _rel(y_steps, y_full) < 1e-5
    assert _rel(state.recurrent, s_full.recurrent) < 1e-5
    for a, b in zip(state[1:], s_full[1:]):
        assert a.shape == (2, P, W - 1) and _rel(a, b) < 1e-5


def test_chunked_prefill_in_pieces_and_recurrent_mode():
    m = _mixer()
    x = _x(T=40)
    y_full, _ = m(x)
    y1, st = m(x[:, :17])
    y2, _ = m(x[:, 17:], st)
    assert _rel(torch.cat([y1, y2], 1), y_full) < 1e-5
    assert _rel(m(x, mode="recurrent")[0], y_full) < 1e-5


def test_state_types_and_mode_errors():
    m = _mixer()
    _, st = m(_x(T=3))
    assert isinstance(st, KDAState) and st.recurrent.shape == (2, H, K, K) and st.recurrent.dtype == torch.float32
    with pytest.raises(ValueError, match="one token"):
        m(_x(T=3), mode="decode")
    with pytest.raises(ValueError, match="mode"):
        m(_x(T=3), mode="fast")


def test_bf16_forward():
    m = _mixer().to(torch.bfloat16)
    y, st = m(_x(T=9).bfloat16())
    assert y.dtype == torch.bfloat16 and st.recurrent.dtype == torch.float32 and torch.isfinite(y.float()).all()


def test_meta_device():
    with torch.device("meta"):
        m = _mixer()
    y, st = m(torch.empty(2, 70, D, device="meta"))
    assert y.shape == (2, 70, D) and y.device.type == "meta" and st.q_conv.shape == (2, P, W - 1)


class _Prefill(torch.nn.Module):
    """fx cannot branch on a traced T, so the trace fixes the mode."""

    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        return self.mixer(x, mode="chunk")[0]


def test_symbolic_trace_and_compile_with_backward():
    m = _mixer()
    x = _x(T=6)
    gm = torch.fx.symbolic_trace(_Prefill(m))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("kda_chunk", "kda_gate", "short_conv", "l2_norm", "rms_norm_gate"):
        assert getattr(torch.ops.k3, name).default in targets
    torch.testing.assert_close(gm(x), m(x)[0])
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y, state = compiled(x)
    torch.testing.assert_close(y, m(x)[0])
    y_step, _ = compiled(x[:, :1], state)
    torch.testing.assert_close(y_step, m(x[:, :1], state)[0])
    y.sum().backward()
    assert m.A_log.grad is not None and torch.isfinite(m.dt_bias.grad).all()


def test_zero_tokens_give_an_empty_output_and_the_same_state():
    mixer = _mixer()
    _, state = mixer(_x(T=5))
    out, after = mixer(_x(T=0), state)
    assert out.shape == (2, 0, D)
    assert all(torch.equal(a, b) for a, b in zip(after, state))


def test_ablations_no_delta_rule_and_head_decay():
    """delta_rule=False drops b_proj and runs gated linear attention; per-head decay shrinks f_up and dt_bias.
    Both keep prefill + decode equal to one full forward."""
    m = _mixer(delta_rule=False, decay_granularity="head")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert "b_proj.weight" not in shapes and shapes["f_up.weight"] == (H, 4) and shapes["dt_bias"] == (H,)
    x = _x()
    (y_full, s_full), (y_steps, state) = _prefill_then_decode(m, x)
    assert _rel(y_steps, y_full) < 1e-5 and _rel(state.recurrent, s_full.recurrent) < 1e-5
    head = _mixer(decay_granularity="head")  # the delta rule with one decay per head
    assert _rel(head(x)[0], head(x, mode="recurrent")[0]) < 1e-5
