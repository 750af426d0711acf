"""MLA ops: expanded attention vs a float64 loop, absorbed == expanded, RoPE, gradchecks, meta/fx/compile."""

import math

import torch

from k3compile.kernels.mla.op import mla_attention, mla_decode_absorbed, mla_rope

F64 = torch.float64


def _naive_attention(q, k_nope, k_pe, v, scale):
    """Loop over batch, head and query: keys 0..S-T+t, softmax in Python floats."""
    B, T, H, _ = q.shape
    S, N = k_nope.shape[1], k_nope.shape[-1]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = range(S - T + t + 1)
                s = [scale * (float(q[b, t, h, :N] @ k_nope[b, j, h]) + float(q[b, t, h, N:] @ k_pe[b, j]))
                     for j in keys]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                for j, ej in zip(keys, e):
                    out[b, t, h] += ej / sum(e) * v[b, j, h].double()
    return out


def _inputs(B=2, T=3, S=5, H=2, N=4, R=2, V=3, L=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, N + R, generator=g, dtype=dtype)
    c_kv = torch.randn(B, S, L, generator=g, dtype=dtype)
    k_pe = torch.randn(B, S, R, generator=g, dtype=dtype)
    w_kvb = torch.randn(H * (N + V), L, generator=g, dtype=dtype) / math.sqrt(L)
    kv = (c_kv @ w_kvb.T).view(B, S, H, N + V)
    return q, c_kv, k_pe, w_kvb, kv[..., :N], kv[..., N:]


def test_expanded_matches_naive_loop_with_offset():
    q, _, k_pe, _, k_nope, v = _inputs()
    o = mla_attention(q, k_nope, k_pe, v, 6**-0.5)
    assert o.shape == (2, 3, 2, 3) and o.is_contiguous()
    torch.testing.assert_close(o.double(), _naive_attention(q, k_nope, k_pe, v, 6**-0.5), rtol=1e-5, atol=1e-6)


def test_first_query_sees_only_first_key():
    q, _, k_pe, _, k_nope, v = _inputs(T=4, S=4)
    o = mla_attention(q, k_nope, k_pe, v, 0.5)
    torch.testing.assert_close(o[:, 0], v[:, 0])


def test_absorbed_equals_expanded_float64():
    q, c_kv, k_pe, w_kvb, k_nope, v = _inputs(dtype=F64)
    latent = torch.cat([c_kv, k_pe], dim=-1)
    want = mla_attention(q, k_nope, k_pe, v, 0.4)
    got = mla_decode_absorbed(q, latent, w_kvb, 0.4)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_absorbed_single_token_decode_fp32():
    q, c_kv, k_pe, w_kvb, k_nope, v = _inputs(T=1, S=7)
    got = mla_decode_absorbed(q, torch.cat([c_kv, k_pe], -1), w_kvb, 0.4)
    want = _naive_attention(q, k_nope, k_pe, v, 0.4)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def test_bf16_in_bf16_out():
    q, c_kv, k_pe, w_kvb, k_nope, v = (t.bfloat16() for t in _inputs())
    o = mla_attention(q, k_nope, k_pe, v, 0.4)
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, mla_attention(q.float(), k_nope.float(), k_pe.float(), v.float(), 0.4).bfloat16())
    assert mla_decode_absorbed(q, torch.cat([c_kv, k_pe], -1), w_kvb, 0.4).dtype == torch.bfloat16


def test_rope_hand_value_and_offset():
    # R = 2, position 1: angle = 1 rad (inv_freq = theta^0 = 1).
    x = torch.tensor([[[0.0, 0.0], [3.0, 4.0]]], dtype=F64)  # [B=1, T=2, R=2]
    y = mla_rope(x, 0, 10000.0)
    want = [3 * math.cos(1) - 4 * math.sin(1), 4 * math.cos(1) + 3 * math.sin(1)]
    torch.testing.assert_close(y[0, 1], torch.tensor(want, dtype=F64))
    xs = torch.randn(1, 6, 2, 8, dtype=F64)
    torch.testing.assert_close(mla_rope(xs, 0, 500.0)[:, 4:], mla_rope(xs[:, 4:], 4, 500.0))
    torch.testing.assert_close(mla_rope(xs, 7, 500.0).norm(dim=-1), xs.norm(dim=-1))


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 8, dtype=F64), torch.randn(1, 1, 8, dtype=F64)

    def score(m, n):
        return float((mla_rope(q, m, 100.0) * mla_rope(k, n, 100.0)).sum())

    assert math.isclose(score(5, 2), score(13, 10), rel_tol=1e-10)
    assert not math.isclose(score(5, 2), score(5, 3), rel_tol=1e-3)


def test_gradchecks_float64():
    q, c_kv, k_pe, w_kvb, k_nope, v = (t.requires_grad_() for t in _inputs(B=1, T=2, S=3, H=2, N=2, R=2, V=2, L=3,
                                                                          dtype=F64))
    lat = torch.cat([c_kv, k_pe], -1).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: mla_attention(*a, 0.5), (q, k_nope, k_pe, v))
    assert torch.autograd.gradcheck(lambda a, b, c: mla_decode_absorbed(a, b, c, 0.5), (q, lat, w_kvb))
    assert torch.autograd.gradcheck(lambda a: mla_rope(a, 3, 100.0), (q,))


def test_meta_shapes():
    m = dict(device="meta", dtype=torch.bfloat16)
    q, k_nope, k_pe = torch.empty(1, 1, 96, 192, **m), torch.empty(1, 9, 96, 128, **m), torch.empty(1, 9, 64, **m)
    assert mla_attention(q, k_nope, k_pe, torch.empty(1, 9, 96, 128, **m), 0.1).shape == (1, 1, 96, 128)
    o = mla_decode_absorbed(q, torch.empty(1, 9, 576, **m), torch.empty(96 * 256, 512, **m), 0.1)
    assert o.shape == (1, 1, 96, 128) and o.dtype == torch.bfloat16
    assert mla_rope(k_pe, 3, 1e4).shape == k_pe.shape


def _all_ops(q, lat, w, k_nope, v):
    k_pe = mla_rope(lat[..., 6:], 0, 100.0)
    return mla_attention(q, k_nope, k_pe, v, 0.4) + mla_decode_absorbed(q, lat, w, 0.4)


def test_symbolic_trace_and_compile():
    q, c_kv, k_pe, w_kvb, k_nope, v = _inputs()
    lat = torch.cat([c_kv, k_pe], -1)
    gm = torch.fx.symbolic_trace(_all_ops)
    targets = {n.target for n in gm.graph.nodes}
    for name in ("mla_attention", "mla_decode_absorbed", "mla_rope"):
        assert getattr(torch.ops.k3, name).default in targets
    q.requires_grad_()
    out = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")(q, lat, w_kvb, k_nope, v)
    torch.testing.assert_close(out, _all_ops(q, lat, w_kvb, k_nope, v))
    out.sum().backward()
    assert q.grad is not None


def test_rope_at_positions_equals_rope_at_each_start():
    """The decode step's rotary embedding (one token per sequence, positions a tensor) is rope at that start."""
    from k3compile.kernels.mla.op import mla_rope, mla_rope_at

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1, 4, 16, generator=g)
    positions = torch.tensor([0, 7, 300])
    got = mla_rope_at(x, positions, 10000.0)
    want = torch.cat([mla_rope(x[b : b + 1], int(p), 10000.0) for b, p in enumerate(positions)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    k = torch.randn(3, 1, 16, generator=g)  # k_pe: no head dim
    torch.testing.assert_close(mla_rope_at(k, positions, 500.0),
                               torch.cat([mla_rope(k[b : b + 1], int(p), 500.0) for b, p in enumerate(positions)]))
