"""Load balancing ops: exact and histogram Quantile Balancing, sign update, aux loss; convergence on skewed routers.

The convergence runs print, per update, max over experts of (load / mean load); run with `-s` to see them.
Router model: 32-dim Gaussian token features x, logits = x @ W (W ~ N(0, 1/32), so a unit-variance
per-token part) plus a per-expert offset ~ N(0, 2^2) that skews the load; sigmoid scores; a fresh batch
of 65,536 tokens per update, routed with the bias from the previous update.
"""

import pytest
import torch
import torch.fx

from k3compile.kernels.balancing.op import (
    attach_aux_loss,
    aux_balance_loss,
    qb_histogram,
    qb_update_from_histogram,
    quantile_balance_update,
    quantile_balance_update_hist,
    sign_balance_update,
)


def _naive_qb(scores, bias, k):
    """The QB formula spelled out: cutoff = (k+1)-th of s + b; b_j = -quantile_{1-k/n}(s_j - cutoff); centre."""
    n = scores.shape[1]
    alpha = torch.tensor([sorted((scores[t] + bias).tolist(), reverse=True)[k] for t in range(scores.shape[0])])
    b = torch.stack([-torch.quantile(scores[:, j] - alpha, 1 - k / n) for j in range(n)])
    return b - b.mean()


def test_exact_qb_matches_the_formula():
    torch.manual_seed(0)
    scores, bias = torch.rand(203, 7), torch.randn(7) * 0.2
    for k in (1, 2, 6):
        torch.testing.assert_close(quantile_balance_update(scores, bias, k), _naive_qb(scores, bias, k))
    assert quantile_balance_update(scores, bias, 7).abs().max() == 0  # k = n: nothing to balance


def test_qb_lowers_the_bias_of_popular_experts():
    torch.manual_seed(1)
    scores = torch.sigmoid(torch.randn(500, 6) + torch.tensor([3.0, 0, 0, 0, 0, -3.0]))
    b = quantile_balance_update(scores, torch.zeros(6), 2)
    assert b[0] < b[1:5].min() and b[5] > b[1:5].max() and abs(b.sum()) < 1e-5


def test_histogram_counts_and_all_reduce_by_summing():
    torch.manual_seed(2)
    scores, bias = torch.rand(300, 8), torch.randn(8) * 0.3
    counts = qb_histogram(scores, bias, 2, 50)
    assert counts.dtype == torch.int64 and counts.shape == (8, 50) and counts.sum(-1).tolist() == [300] * 8
    halves = qb_histogram(scores[:100], bias, 2, 50) + qb_histogram(scores[100:], bias, 2, 50)
    assert torch.equal(halves, counts)  # per-rank histograms sum to the global one
    from_counts = qb_update_from_histogram(counts, bias, 2)
    torch.testing.assert_close(from_counts, quantile_balance_update_hist(scores, bias, 2, 50))


def test_histogram_estimate_is_close_to_exact():
    torch.manual_seed(3)
    scores = torch.sigmoid(torch.randn(8192, 16) + torch.randn(16))
    bias = torch.randn(16) * 0.1
    exact = quantile_balance_update(scores, bias, 2)
    assert (quantile_balance_update_hist(scores, bias, 2, 1000) - exact).abs().max() < 1e-3


def test_sign_update_by_hand():
    b = sign_balance_update(torch.tensor([1, 2, 3, 6]), torch.tensor([0.5, 0.0, 0.0, 0.0]), 0.01)
    torch.testing.assert_close(b, torch.tensor([0.51, 0.01, 0.0, -0.01]))


def test_aux_loss_by_hand_and_gradient():
    scores = torch.tensor([[0.6, 0.2], [0.3, 0.3]])
    indices = torch.tensor([[0], [0]])
    # f = [1, 0]; P = mean([0.75, 0.25], [0.5, 0.5]) = [0.625, 0.375]; 2 * (1 * 0.625)
    torch.testing.assert_close(aux_balance_loss(scores, indices), torch.tensor(1.25))
    even = aux_balance_loss(torch.full((4, 4), 0.3), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]))
    torch.testing.assert_close(even, torch.tensor(1.0))
    s = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [0, 1]])
    torch.autograd.gradcheck(lambda z: aux_balance_loss(z, idx), (s,))


def test_attach_aux_loss_passes_x_and_adds_coef_times_loss_gradient():
    x = torch.randn(3, 2, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y = attach_aux_loss(x, (w**2).sum(), 0.5)
    torch.testing.assert_close(y, x)
    (3 * y).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 2), 3.0))
    torch.testing.assert_close(w.grad, 0.5 * 2 * w.detach())


def _all_ops(scores, indices, bias, x):
    counts = qb_histogram(scores, bias, 2, 16)
    b = quantile_balance_update(scores, bias, 2) + qb_update_from_histogram(counts, bias, 2)
    b = b + sign_balance_update(counts.sum(-1), bias, 0.1)
    return attach_aux_loss(x, aux_balance_loss(scores, indices), 0.1), b


def test_meta_fx_and_compile():
    torch.manual_seed(4)
    scores, bias, x = torch.rand(20, 6), torch.randn(6) * 0.1, torch.randn(3)
    indices = torch.topk(scores, 2).indices
    y, b = _all_ops(*(t.to("meta") for t in (scores, indices, bias, x)))
    assert y.shape == (3,) and b.shape == (6,) and b.dtype == torch.float32
    gm = torch.fx.symbolic_trace(_all_ops)
    k3 = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("k3.")]
    assert len(k3) == 6
    expected = _all_ops(scores, indices, bias, x)
    compiled = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(gm(scores, indices, bias, x), expected)
    torch.testing.assert_close(compiled(scores, indices, bias, x), expected)


def _skewed_router_runs(n, k, updates, steps=10, tokens=65_536, dim=32, seed=0):
    """Max/mean load of a fresh batch per step for each bias update rule, all seeing the same batches."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, n, generator=g) / dim**0.5
    offset = torch.randn(n, generator=g) * 2.0
    bias = {name: torch.zeros(n) for name in updates}
    ratios = {name: [] for name in updates}
    for step in range(steps + 1):
        scores = torch.sigmoid(torch.addmm(offset, torch.randn(tokens, dim, generator=g), w))
        for name, update in updates.items():
            chosen = torch.topk(scores + bias[name], k).indices.reshape(-1)
            load = torch.zeros(n).scatter_add_(0, chosen, torch.ones(chosen.shape))
            ratios[name].append(round((load.max() / load.mean()).item(), 3))
            if step < steps:  # the new bias is for the next batch
                bias[name] = update(scores, bias[name], load)
    for name, r in ratios.items():
        print(f"n={n} top-{k} {name:>10}: max load / mean load per update {r}")
    return ratios


UPDATES = {
    "quantile": lambda s, b, load, k: quantile_balance_update(s, b, k),
    "hist-1000": lambda s, b, load, k: quantile_balance_update_hist(s, b, k, 1000),
    "sign-1e-3": lambda s, b, load, k: sign_balance_update(load, b, 1e-3),
    "none": lambda s, b, load, k: b,
}


def _rules(k, names):
    return {name: (lambda s, b, load, f=UPDATES[name]: f(s, b, load, k)) for name in names}


def test_quantile_balancing_converges_64_experts_top4():
    r = _skewed_router_runs(64, 4, _rules(4, UPDATES))
    assert all(v[0] > 10 for v in r.values())
    assert r["quantile"][-1] < 1.15
    assert r["hist-1000"][-1] < 1.2
    assert r["none"][-1] > 10


@pytest.mark.slow
def test_quantile_balancing_converges_896_experts_top16():
    r = _skewed_router_runs(896, 16, _rules(16, ("quantile", "sign-1e-3", "none")))
    assert all(v[0] > 10 for v in r.values())
    assert r["quantile"][-1] < 1.30
