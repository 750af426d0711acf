"""k3 MoE ops: router, dispatch/combine and expert MLP against naive per-token loops; meta, fx, compile, grads."""

import pytest
import torch
import torch.fx

from k3compile.kernels.moe.op import expert_mlp, moe_combine, moe_dispatch, route

T, E, K, W, I = 12, 5, 2, 4, 6


def _expert_weights(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) * 0.5 for s in ((E, I, W), (E, I, W), (E, W, I))]


def _naive_moe(x, indices, weights, gate, up, down, capacity=None):
    """Per token, per choice: run that expert's SiTU-GLU MLP on the token; experts keep their first `capacity`."""
    y = torch.zeros_like(x)
    taken = [0] * E
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = indices[t, j].item()
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                continue
            g, u = gate[e] @ x[t], up[e] @ x[t]
            h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
            y[t] += weights[t, j] * (down[e] @ h)
    return y


def _moe(x, logits, gate, up, down, cf):
    weights, indices, _ = route(logits, None, K)
    buffer, slots, load, dropped = moe_dispatch(x, indices, E, cf)
    return moe_combine(expert_mlp(buffer, gate, up, down, "situ_glu", 4.0, 25.0), weights, slots), dropped


def test_dispatch_combine_equal_naive_loop_when_nothing_dropped():
    torch.manual_seed(0)
    x, logits = torch.randn(T, W), torch.randn(T, E)
    weights, indices, _ = route(logits, None, K)
    expected = _naive_moe(x, indices, weights, *_expert_weights())
    for cf in (None, 2.5):  # dense (C = T) and a static capacity large enough for this routing
        y, dropped = _moe(x, logits, *_expert_weights(), cf)
        assert dropped.item() == 0
        torch.testing.assert_close(y, expected)


def test_small_capacity_drops_later_tokens_and_counts_them():
    torch.manual_seed(1)
    x, logits = torch.randn(T, W), torch.randn(T, E)
    logits[:, 0] += 5.0  # everyone wants expert 0
    weights, indices, _ = route(logits, None, K)
    cap = 3  # ceil(0.6 * 12 * 2 / 5) = 3
    y, dropped = _moe(x, logits, *_expert_weights(), 0.6)
    counts = torch.bincount(indices.reshape(-1), minlength=E)
    assert dropped.item() == sum(max(0, c - cap) for c in counts.tolist()) > 0
    torch.testing.assert_close(y, _naive_moe(x, indices, weights, *_expert_weights(), capacity=cap))


def test_route_bias_chooses_but_never_weights():
    torch.manual_seed(2)
    logits = torch.randn(T, E)
    bias = torch.zeros(E)
    bias[3] = 5.0
    weights, indices, scores = route(logits, bias, K, "sigmoid", True, 2.0)
    assert (indices == 3).any(-1).all()
    chosen = torch.sigmoid(logits).gather(-1, indices)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.0)
    with pytest.raises(ValueError):
        route(logits, bias, K, "relu")


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_mlp_other_activations(activation):
    torch.manual_seed(3)
    gate, up, down = _expert_weights()
    buf = torch.randn(E, 3, W)
    out = expert_mlp(buf, gate if activation == "swiglu" else None, up, down, activation)
    for e in range(E):
        u = buf[e] @ up[e].T
        h = torch.nn.functional.silu(buf[e] @ gate[e].T) * u if activation == "swiglu" else torch.nn.functional.gelu(u)
        torch.testing.assert_close(out[e], h @ down[e].T)
    with pytest.raises(ValueError):
        expert_mlp(buf, None, up, down, "swiglu")


def test_gradcheck_float64():
    torch.manual_seed(4)
    logits = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0], dtype=torch.float64)
    for scoring in ("sigmoid", "softmax"):
        torch.autograd.gradcheck(lambda z: route(z, bias, 2, scoring, True, 1.5)[0], (logits,))
        torch.autograd.gradcheck(lambda z: route(z, bias, 2, scoring)[2], (logits,))
    indices = route(logits.detach(), bias, 2)[1]
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: moe_dispatch(v, indices, 4, 1.0)[0], (x,))
    buffer, slots, _, _ = moe_dispatch(x.detach(), indices, 4, 1.0)
    out = torch.randn(buffer.shape, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda o, p: moe_combine(o, p, slots), (out, w))


def test_meta_shapes():
    x, logits = torch.empty(T, W, device="meta"), torch.empty(T, E, device="meta", dtype=torch.bfloat16)
    weights, indices, scores = route(logits, torch.empty(E, device="meta"), K)
    assert (weights.shape, indices.shape, scores.shape) == ((T, K), (T, K), (T, E))
    assert weights.dtype == torch.float32 and indices.dtype == torch.int64
    buffer, slots, load, dropped = moe_dispatch(x, indices, E, 1.25)
    assert buffer.shape == (E, 6, W) and slots.shape == (T, K) and load.shape == (E,) and dropped.shape == ()
    gate, up, down = (w.to("meta") for w in _expert_weights())
    assert moe_combine(expert_mlp(buffer, gate, up, down), weights, slots).shape == (T, W)


def _pipeline(x, logits, bias, gate, up, down):
    weights, indices, _ = route(logits, bias, K)
    buffer, slots, _, _ = moe_dispatch(x, indices, E, 1.25)
    return moe_combine(expert_mlp(buffer, gate, up, down, "situ_glu", 4.0, 25.0), weights, slots)


def test_symbolic_trace_and_compile_fullgraph():
    torch.manual_seed(5)
    args = [torch.randn(T, W), torch.randn(T, E), torch.randn(E) * 0.1, *_expert_weights()]
    gm = torch.fx.symbolic_trace(_pipeline)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    ops = {"k3.moe_route.default", "k3.moe_dispatch.default", "k3.situ_glu.default", "k3.moe_combine.default"}
    assert ops <= targets
    torch.testing.assert_close(gm(*args), _pipeline(*args))

    leaves = [a.clone().requires_grad_(i != 2) for i, a in enumerate(args)]
    eager = _pipeline(*leaves)
    eager.square().sum().backward()
    grads = [a.grad for a in leaves if a.grad is not None]
    for a in leaves:
        a.grad = None
    compiled = torch.compile(_pipeline, fullgraph=True, backend="aot_eager")(*leaves)
    torch.testing.assert_close(compiled, eager)
    compiled.square().sum().backward()
    for a, g in zip([a for a in leaves if a.grad is not None], grads):
        torch.testing.assert_close(a.grad, g)


def test_combine_without_slots_is_the_identity_slotted_combine():
    """slots None (the decode graph's rows in (token, choice) order) equals the combine through the slots
    0..T*K-1 of the same rows, in fp32 and bf16, with the same gradients."""
    torch.manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.randn(T * K, 1, W, dtype=dtype, requires_grad=True)
        w = torch.rand(T, K, requires_grad=True)
        identity = torch.arange(T * K).view(T, K)
        got, want = moe_combine(out, w, None), moe_combine(out, w, identity)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        g = torch.randn_like(got)
        torch.testing.assert_close(torch.autograd.grad(got, (out, w), g), torch.autograd.grad(want, (out, w), g))
