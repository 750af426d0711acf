"""LatentMoE module: weight inventory, a per-token reference, capacity, balancing state, meta, fx and compile."""

import pytest
import torch
import torch.fx

from k3compile.modules.moe import LatentMoE
from k3compile.kernels.balancing.op import aux_balance_loss, qb_histogram, qb_update_from_histogram, quantile_balance_update

D, N, K, I, S, IS, WL = 16, 6, 2, 12, 2, 5, 8


def _moe(**kw):
    cfg = dict(num_shared_experts=S, shared_intermediate_size=IS, latent_size=WL)
    cfg.update(kw)
    return LatentMoE(D, N, K, I, **cfg)


def _shapes(m):
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


def test_weight_inventory():
    assert _shapes(_moe()) == {
        "router.weight": (N, D),
        "latent_down.weight": (WL, D),
        "latent_norm.weight": (WL,),
        "latent_up.weight": (D, WL),
        "experts.gate_proj.weight": (N, I, WL),
        "experts.up_proj.weight": (N, I, WL),
        "experts.down_proj.weight": (N, WL, I),
        "shared_experts.gate_proj.weight": (S * IS, D),
        "shared_experts.up_proj.weight": (S * IS, D),
        "shared_experts.down_proj.weight": (D, S * IS),
    }
    assert _shapes(LatentMoE(D, N, K, I, activation="gelu")) == {
        "router.weight": (N, D),
        "experts.up_proj.weight": (N, I, D),
        "experts.down_proj.weight": (N, D, I),
    }
    assert "latent_norm.weight" not in _shapes(_moe(latent_norm=False))
    m = _moe()
    assert "router.bias" in m.state_dict() and m.router.bias.dtype == torch.float32
    assert set(m.state_dict()) == set(_shapes(m)) | {"router.bias"}  # statistics are not checkpointed


def _situ_mlp(gate_w, up_w, down_w, h):
    g, v = gate_w @ h, up_w @ h
    return down_w @ (4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(v / 25))


def _reference(m, x):
    """Token by token: biased top-k choice, unbiased renormalised weights, experts at latent width."""
    ex, sh = m.experts, m.shared_experts
    out = []
    for xt in x.reshape(-1, D):
        s = torch.sigmoid(m.router.weight @ xt)
        chosen = torch.argsort(s + m.router.bias.to(s.dtype), descending=True)[:K]
        p = s[chosen] / s[chosen].sum() * m.router.routed_scaling
        h = m.latent_down.weight @ xt
        u = torch.zeros(WL, dtype=x.dtype)
        for pi, e in zip(p, chosen):
            u += pi * _situ_mlp(ex.gate_proj.weight[e], ex.up_proj.weight[e], ex.down_proj.weight[e], h)
        u = u / torch.sqrt(u.pow(2).mean() + 1e-5) * m.latent_norm.weight
        shared = _situ_mlp(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, xt)
        out.append(m.latent_up.weight @ u + shared)
    return torch.stack(out).view_as(x)


def test_forward_matches_per_token_reference_dense():
    torch.manual_seed(0)
    m = _moe(capacity_factor=None, routed_scaling=1.7).double().eval()
    m.router.bias.copy_(torch.randn(N) * 0.3)
    with torch.no_grad():
        m.latent_norm.weight.copy_(torch.rand(WL) + 0.5)
    x = torch.randn(3, 4, D, dtype=torch.float64)
    torch.testing.assert_close(m(x), _reference(m, x))
    torch.testing.assert_close(m.train()(x), _reference(m, x))
    assert m.router.dropped.item() == 0 and m.router.load.sum().item() == 12 * K


def test_no_latent_experts_run_at_full_width():
    torch.manual_seed(1)
    m = LatentMoE(D, N, K, I, activation="swiglu", capacity_factor=None)
    x = torch.randn(5, D)
    s = torch.sigmoid(x @ m.router.weight.T)
    idx = torch.topk(s, K).indices
    p = s.gather(-1, idx) / s.gather(-1, idx).sum(-1, keepdim=True)
    gate, up, down = m.experts.gate_proj.weight, m.experts.up_proj.weight, m.experts.down_proj.weight
    expected = torch.zeros(5, D)
    for t in range(5):
        for j, e in enumerate(idx[t].tolist()):
            expected[t] += p[t, j] * (down[e] @ (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    torch.testing.assert_close(m(x), expected)


def test_capacity_drops_and_counts():
    torch.manual_seed(2)
    m = _moe(capacity_factor=0.5).train()
    with torch.no_grad():
        m.router.weight.zero_()
    m.router.bias.copy_(torch.arange(N, dtype=torch.float32))  # all tokens pick experts 5 and 4
    m(torch.randn(10, D))
    cap = 2  # ceil(0.5 * 10 * 2 / 6)
    assert m.router.load.tolist() == [0, 0, 0, 0, 10, 10]
    assert m.router.dropped.item() == 2 * (10 - cap)
    stats = m.update_balance()
    assert stats["dropped"].item() == 16 and m.router.dropped.item() == 0 and m.router.load.sum().item() == 0


def _logits_scores(m, x):
    return torch.sigmoid(x.reshape(-1, D) @ m.router.weight.T)


def test_quantile_balancing_applies_from_the_next_step():
    torch.manual_seed(3)
    m = _moe().train()
    x = torch.randn(40, D)
    m(x)
    assert m.router.bias.abs().max() == 0  # not used on the batch it was measured on
    m.update_balance()
    torch.testing.assert_close(m.router.bias, quantile_balance_update(_logits_scores(m, x), torch.zeros(N), K))


def test_histogram_balancing_accumulates_over_forwards():
    torch.manual_seed(4)
    m = _moe(histogram_bins=64).train()
    x1, x2 = torch.randn(30, D), torch.randn(20, D)
    m(x1)
    m(x2)
    counts = qb_histogram(_logits_scores(m, torch.cat([x1, x2])), torch.zeros(N), K, 64)
    assert torch.equal(m.router.qb_counts, counts)
    m.update_balance()
    torch.testing.assert_close(m.router.bias, qb_update_from_histogram(counts, torch.zeros(N), K))
    assert m.router.qb_counts.sum() == 0


def test_sign_balancing_and_none():
    torch.manual_seed(5)
    m = _moe(balancing="bias_sign", bias_update_rate=0.01).train()
    m(torch.randn(30, D))
    load = m.router.load.float()
    m.update_balance()
    torch.testing.assert_close(m.router.bias, 0.01 * torch.sign(load.mean() - load))
    m = _moe(balancing="none").train()
    m(torch.randn(30, D))
    m.update_balance()
    assert m.router.bias.abs().max() == 0
    m.update_balance()  # nothing seen: bias untouched, no error
    with pytest.raises(ValueError):
        _moe(balancing="none", histogram_bins=10)


def test_aux_loss_gradient_reaches_the_router():
    torch.manual_seed(6)
    x = torch.randn(25, D)
    grads = {}
    for coef in (0.0, 0.3):
        torch.manual_seed(7)
        m = _moe(balancing="aux_loss", aux_loss_coef=coef).train()
        m(x).sum().backward()
        grads[coef] = m.router.weight.grad.clone()
    w = m.router.weight.detach().clone().requires_grad_(True)
    s = torch.sigmoid(x @ w.T)
    aux = aux_balance_loss(s, torch.topk(s, K).indices)
    aux.backward()
    torch.testing.assert_close(grads[0.3] - grads[0.0], 0.3 * w.grad)
    torch.testing.assert_close(m.router.aux_loss, aux.detach())


def test_eval_records_nothing_and_leaves_the_bias():
    m = _moe(histogram_bins=8).eval()
    m(torch.randn(9, D))
    assert m.router.load.sum().item() == 0 and m.router.qb_counts.sum().item() == 0
    m = _moe().train()
    m(torch.randn(9, D))
    m.update_balance()
    bias = m.router.bias.clone()
    m.eval()(torch.randn(9, D))
    m.update_balance()
    assert torch.equal(m.router.bias, bias)


def test_bf16_keeps_the_selection_bias_fp32():
    torch.manual_seed(8)
    m = _moe()
    m.router.bias.copy_(torch.tensor([1e-3, 1.0 + 1e-4, 0, 0, 0, 0]))
    before = m.router.bias.clone()
    m = m.to(torch.bfloat16)
    assert m.experts.up_proj.weight.dtype == torch.bfloat16
    assert m.router.bias.dtype == torch.float32 and torch.equal(m.router.bias, before)
    y = m(torch.randn(2, 3, D, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, D) and torch.isfinite(y.float()).all()


def test_meta_symbolic_trace_and_compile_fullgraph():
    with torch.device("meta"):
        m = _moe(histogram_bins=16)
        assert m(torch.empty(2, 5, D)).shape == (2, 5, D)
    torch.manual_seed(9)
    x = torch.randn(2, 5, D)
    for balancing in ("quantile", "aux_loss"):
        m = _moe(balancing=balancing).train()
        gm = torch.fx.symbolic_trace(m)
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert {"k3.moe_route.default", "k3.moe_dispatch.default", "k3.moe_combine.default"} <= targets
        torch.testing.assert_close(gm(x), m(x))
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
        eager = m(x)
        eager.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        out = compiled(x)
        torch.testing.assert_close(out, eager)
        out.square().sum().backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, grads[n])
        assert m.router.load.sum().item() == 4 * 10 * K  # two eager, one traced, one compiled forward
