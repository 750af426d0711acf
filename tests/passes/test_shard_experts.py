"""shard_experts: a no-op at ep=1; at ep>1 expert exchanges in every graph that change no number."""

from __future__ import annotations

import operator

import pytest
import torch

from k3compile.ir.lower import lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.ops.expert_parallel import from_expert_owners, to_expert_owners
from k3compile.passes import attn_res, interleave, shard_experts

K3 = torch.ops.k3
PASSES = [interleave.PASS, attn_res.PASS, shard_experts.PASS]


def resolved(spec, device="cpu"):
    """Graph after interleave and attn_res, with the manager to run shard_experts next (start=2)."""
    lowered = lower(spec, device)
    pm = PassManager(PASSES)
    pm.run(lowered.gm, PassContext(spec), lowered.example_inputs, stop=2)
    return lowered.gm, lowered.example_inputs, pm


def forward_backward(gm, inputs):
    """Logits and the gradient of the routed expert weights of layer 1 for a fixed scalar loss."""
    gm.zero_grad()
    logits = gm(*inputs)
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in gm.named_parameters() if n.startswith("layers.1.moe.experts.")}
    return logits.detach(), grads


@pytest.fixture(scope="module")
def reference(load):
    """k3-tiny as shipped (ep=1): logits and expert gradients."""
    spec = load()
    gm, inputs, pm = resolved(spec)
    code = gm.code
    pm.run(gm, PassContext(spec), inputs, start=2)
    return spec, gm, inputs, pm.records[-1], code, forward_backward(gm, inputs)


def test_noop_at_ep_1(reference):
    spec, gm, _, record, code_before, _ = reference
    assert spec.parallel.ep == 1
    assert gm.code == code_before
    assert record.statistics == {"moe_layers": 0, "ranks": 1, "experts_per_rank": 0, "nodes_rewritten": 0}
    assert "expert_parallel" not in gm.meta


@pytest.fixture(scope="module", params=[4, 32], ids=["ep4", "ep32"])
def sharded(request, load):
    ep = request.param
    spec = load("k3-tiny.yaml", f"parallel.ep={ep}")
    gm, inputs, pm = resolved(spec)
    before = forward_backward(gm, inputs)
    pm.run(gm, PassContext(spec), inputs, start=2)
    return spec, gm, inputs, pm.records[-1], before, forward_backward(gm, inputs)


def test_outputs_unchanged_by_the_pass(sharded):
    _, _, _, _, (logits0, grads0), (logits, grads) = sharded
    assert torch.equal(logits, logits0)
    assert grads.keys() == grads0.keys() and len(grads) == 3
    for n in grads:
        torch.testing.assert_close(grads[n], grads0[n], rtol=1e-6, atol=1e-9)


def test_outputs_equal_ep_1(sharded, reference):
    """Same seeded weights (init depends on names, not on ep): the sharded model computes the ep=1 numbers."""
    _, _, _, _, _, (logits, grads) = sharded
    _, _, _, _, _, (logits1, grads1) = reference
    assert torch.equal(logits, logits1)
    for n in grads:
        torch.testing.assert_close(grads[n], grads1[n], rtol=1e-6, atol=1e-9)


def test_statistics_and_rank_plan(sharded):
    spec, gm, _, record, _, _ = sharded
    ep, E = spec.parallel.ep, spec.moe.num_experts
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    stats = record.statistics
    assert (stats["moe_layers"], stats["ranks"], stats["experts_per_rank"]) == (n_moe, ep, E // ep)
    plan = gm.meta["expert_parallel"]
    assert len(plan) == n_moe
    per = E // ep
    for ranks in plan.values():
        assert ranks == {r: [r * per, (r + 1) * per] for r in range(ep)}


def test_train_graph_exchanges_with_the_expert_owners(sharded):
    """Train graph: the dispatched buffer goes to_expert_owners, the outputs come back before the combine."""
    spec, gm, _, record, _, _ = sharded
    nodes = list(gm.graph.nodes)
    n_moe = record.statistics["moe_layers"]
    to = [n for n in nodes if n.target is to_expert_owners]
    back = [n for n in nodes if n.target is from_expert_owners]
    assert len(to) == len(back) == n_moe and record.statistics["nodes_rewritten"] == 2 * n_moe
    assert all(n.args[0].target is operator.getitem and n.args[0].args[0].target is K3.moe_dispatch.default for n in to)
    assert all(u.target is K3.moe_combine.default for n in back for u in n.users)
    assert not [n for n in nodes if n.target is torch.unflatten]  # the weights are the rank's own: no view
    local = [n for n in nodes if n.meta.get("expert_parallel") == "local experts"]
    assert len([n for n in local if n.target in (torch.matmul, operator.matmul)]) == 3 * n_moe


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_inference_graphs_exchange_with_the_expert_owners(load, graph):
    """Serving splits the experts too: each MoE's buffer goes to its owners and back, with no rank-major view."""
    spec = load("k3-tiny.yaml", "parallel.ep=4")
    lowered = lower(spec, "cpu", graph=graph)
    pm = PassManager(PASSES)
    pm.run(lowered.gm, PassContext(spec, mode="infer", graph=graph), lowered.example_inputs)
    record, nodes = pm.records[-1], list(lowered.gm.graph.nodes)
    n_moe = record.statistics["moe_layers"]
    to = [n for n in nodes if n.target is to_expert_owners]
    back = [n for n in nodes if n.target is from_expert_owners]
    assert n_moe and len(to) == len(back) == n_moe and record.statistics["nodes_rewritten"] == 2 * n_moe
    assert all(u.target is K3.moe_combine.default for n in back for u in n.users)
    assert not [n for n in nodes if n.target is torch.unflatten]


def test_numerics_checked_in_the_build(record):
    for graph in ("train", "prefill", "decode"):
        r = record(graph, "shard_experts")
        assert r.preserves_numerics and r.max_rel_diff is not None and r.max_rel_diff <= 1e-5
