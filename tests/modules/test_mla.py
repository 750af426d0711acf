"""MLAMixer: weight names, an SDPA float64 reference, prefill + absorbed decode == full forward, cache size."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from k3compile.kernels.mla.reference import rope_ref
from k3compile.modules.mla import MLAMixer
from k3compile.kernels._common.compare import rel_rms as _rel

# Tiny dims: D 16, H 2, q_lora 6, kv_lora 8, nope 4, rope 4, v 6.
DIMS = dict(hidden_size=16, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
COMBOS = list(itertools.product([None, 6], [False, True], [False, True]))  # q_lora, rope, output_gate


def _mixer(q_lora, rope, gate, seed=0):
    torch.manual_seed(seed)
    m = MLAMixer(**DIMS, q_lora_rank=q_lora, rope=rope, rope_theta=100.0, output_gate=gate)
    with torch.no_grad():  # non-trivial norm weights so the norms are exercised
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


def test_parameter_names_and_shapes():
    names = {n: tuple(p.shape) for n, p in _mixer(6, False, True).named_parameters()}
    assert names == {
        "q_a_proj.weight": (6, 16), "q_a_norm.weight": (6,), "q_b_proj.weight": (16, 6),
        "kv_a_proj.weight": (12, 16), "kv_a_norm.weight": (8,), "kv_b_proj.weight": (20, 8),
        "g_proj.weight": (12, 16), "o_proj.weight": (16, 12),
    }
    names = {n: tuple(p.shape) for n, p in _mixer(None, False, False).named_parameters()}
    assert names == {
        "q_proj.weight": (16, 16), "kv_a_proj.weight": (12, 16), "kv_a_norm.weight": (8,),
        "kv_b_proj.weight": (20, 8), "o_proj.weight": (16, 12),
    }


def _sdpa_reference(m, x):
    """The section-3 formulas in float64 with torch's own causal SDPA: an independent path."""
    m = m.double()
    x = x.double()
    B, T, _ = x.shape
    H, N, R, V, L = 2, 4, 4, 6, 8

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    q = m.q_b_proj(rms(m.q_a_proj(x), m.q_a_norm.weight)) if m.q_lora_rank else m.q_proj(x)
    q = q.view(B, T, H, N + R)
    c_kv, k_pe = m.kv_a_proj(x).split([L, R], -1)
    kv = m.kv_b_proj(rms(c_kv, m.kv_a_norm.weight)).view(B, T, H, N + V)
    if m.rope:
        q = torch.cat([q[..., :N], rope_ref(q[..., N:], 0, 100.0)], -1)
        k_pe = rope_ref(k_pe, 0, 100.0)
    k = torch.cat([kv[..., :N], k_pe[:, :, None].expand(B, T, H, R)], -1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., N:].transpose(1, 2),
                                       is_causal=True, scale=(N + R) ** -0.5).transpose(1, 2).reshape(B, T, H * V)
    if m.output_gate:
        o = o * torch.sigmoid(m.g_proj(x))
    return m.o_proj(o)


@pytest.mark.parametrize("q_lora,rope,gate", COMBOS)
def test_full_forward_matches_sdpa_reference(q_lora, rope, gate):
    m = _mixer(q_lora, rope, gate)
    x = torch.randn(2, 5, 16)
    y, cache = m(x)
    assert y.shape == (2, 5, 16) and cache.shape == (2, 5, 12)
    assert _rel(y.double(), _sdpa_reference(m, x)) < 1e-5


@pytest.mark.parametrize("q_lora,rope,gate", COMBOS)
def test_prefill_then_absorbed_decode_equals_full_forward(q_lora, rope, gate):
    m = _mixer(q_lora, rope, gate)
    x = torch.randn(2, 7, 16)
    full, _ = m(x)
    y, cache = m(x[:, :3])
    outs = [y]
    for t in range(3, 7):
        y, cache = m(x[:, t : t + 1], cache, t)
        outs.append(y)
    assert cache.shape == (2, 7, 12)
    assert _rel(torch.cat(outs, 1), full) < 1e-5


def test_preallocated_cache_and_chunked_prefill():
    m = _mixer(6, True, True)
    x = torch.randn(1, 8, 16)
    full, _ = m(x)
    cache = torch.zeros(1, 10, 12)  # room for 10 tokens, filled in place of a growing one
    y0, cache = m(x[:, :3], cache, 0)
    y1, cache = m(x[:, 3:5], cache, 3)  # a 2-token chunk through the absorbed form
    outs = [y0, y1]
    for t in range(5, 8):
        y, cache = m(x[:, t : t + 1], cache, t)
        outs.append(y)
    assert cache.shape == (1, 10, 12) and torch.equal(cache[:, 8:], torch.zeros(1, 2, 12))
    assert _rel(torch.cat(outs, 1), full) < 1e-5


def test_cache_holds_normed_latent_and_k_pe_only():
    m = _mixer(None, True, False)
    x = torch.randn(1, 4, 16)
    _, cache = m(x)
    c_kv, k_pe = m.kv_a_proj(x).split([8, 4], -1)
    torch.testing.assert_close(cache[..., :8], m.kv_a_norm(c_kv))
    torch.testing.assert_close(cache[..., 8:], rope_ref(k_pe, 0, 100.0))


def test_decode_uses_the_absorbed_op():
    m = _mixer(6, False, True)
    x = torch.randn(1, 4, 16)
    _, cache = m(x[:, :3])
    step = make_fx(lambda x_, c_: m(x_, c_, 3))(x[:, 3:], cache)
    targets = {n.target for n in step.graph.nodes}
    assert torch.ops.k3.mla_decode_absorbed.default in targets and torch.ops.k3.mla_attention.default not in targets
    torch.testing.assert_close(step(x[:, 3:], cache)[0], m(x[:, 3:], cache, 3)[0])


def test_bad_start_pos_raises():
    m = _mixer(None, False, False)
    with pytest.raises(ValueError):
        m(torch.randn(1, 1, 16), None, 2)
    with pytest.raises(ValueError):
        m(torch.randn(1, 1, 16), torch.zeros(1, 2, 12), 5)


def test_k3_cache_is_576_values_per_token():
    with torch.device("meta"):
        m = MLAMixer(7168, 96, 1536, 512, 128, 64, 128, rope=False, output_gate=True).bfloat16()
    assert m.cache_values_per_token == 576
    y, cache = m(torch.empty(1, 4, 7168, device="meta", dtype=torch.bfloat16))
    assert cache.shape == (1, 4, 576) and cache.dtype == torch.bfloat16
    assert cache[0, 0].numel() * cache.element_size() == 1152  # bytes per token per layer in bf16
    y, cache = m(torch.empty(1, 1, 7168, device="meta", dtype=torch.bfloat16), cache, 4)
    assert y.shape == (1, 1, 7168) and cache.shape == (1, 5, 576)


def test_trace_and_compile_prefill_and_decode():
    m = _mixer(6, True, True)
    gm = torch.fx.symbolic_trace(m, concrete_args={"cache": None, "start_pos": 0, "positions": None})
    assert torch.ops.k3.mla_attention.default in {n.target for n in gm.graph.nodes}
    x = torch.randn(1, 5, 16)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y, cache = compiled(x[:, :4])
    torch.testing.assert_close(y, m(x[:, :4])[0])
    y, _ = compiled(x[:, 4:], cache, 4)
    torch.testing.assert_close(y, m(x[:, 4:], cache, 4)[0])
    y.sum().backward()
    assert m.kv_b_proj.weight.grad is not None


def test_trace_and_compile_the_static_decode_step():
    """The decode graph's form: a preallocated cache, positions as a tensor; traces to the absorbed op and
    compiles with one graph for every step (NoPE, as the static step requires)."""
    m = _mixer(6, False, True)
    gm = torch.fx.symbolic_trace(m, concrete_args={"start_pos": 0})  # x, cache and positions are graph inputs
    assert torch.ops.k3.mla_decode_absorbed.default in {n.target for n in gm.graph.nodes}
    assert torch.ops.k3.mla_attention.default not in {n.target for n in gm.graph.nodes}
    x = torch.randn(2, 6, 16)
    _, prefilled = m(x[:, :4], torch.zeros(2, 8, m.cache_values_per_token))
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    cache, eager_cache = prefilled.clone(), prefilled.clone()
    for t in (4, 5):
        positions = torch.full((2,), t, dtype=torch.int64)
        y, cache = compiled(x[:, t : t + 1], cache, positions=positions)
        want, eager_cache = m(x[:, t : t + 1], eager_cache, positions=positions)
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(cache, eager_cache)
    torch.testing.assert_close(y, m(x)[0][:, 5:])  # the step equals the full forward at that position
