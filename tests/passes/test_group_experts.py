"""group_experts: CPU training graphs run the routed experts on the rows they hold, with the capacity path's numbers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3compile.build import pipeline
from k3compile.modules.model import K3Model

K3 = torch.ops.k3
NAMES = [p.name for p in pipeline()]
WITH = NAMES[: NAMES.index("group_experts") + 1]
WITHOUT = NAMES[: NAMES.index("group_experts")]


def count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def step(gm, inputs, weight):
    """(logits, gradients by parameter name, the routers' load and dropped counters) of one forward + backward."""
    for p in gm.parameters():
        p.grad = None
    for name, b in gm.named_buffers():
        if name.endswith((".load", ".dropped")):
            b.zero_()
    logits = gm(*inputs)
    (logits * weight).sum().backward()
    counters = {n: b.clone() for n, b in gm.named_buffers() if n.endswith((".load", ".dropped"))}
    return logits.detach(), {n: p.grad for n, p in gm.named_parameters()}, counters


@pytest.fixture(scope="module", params=[("moe.capacity_factor=1.5",), ("moe.capacity_factor=0.5",),
                                        ("quantization.qat=false",)], ids=["spec-capacity", "dropping", "no-qat"])
def graphs(request, load, run_passes):
    """(spec, the train graph with group_experts, the same graph without it, example inputs, the pass record)."""
    spec = load("k3-tiny.yaml", *request.param)
    grouped, inputs, records = run_passes(spec, WITH)
    capacity, _, _ = run_passes(spec, WITHOUT)
    capacity.load_state_dict(grouped.state_dict(), strict=True)
    return spec, grouped, capacity, inputs, records[-1]


def test_every_moe_runs_on_its_rows(graphs):
    spec, grouped, capacity, _, record = graphs
    layers = sum(1 for i in range(spec.num_layers) if i not in spec.dense_ffn.layers)
    assert record.statistics["grouped"] == layers == count(capacity, K3.moe_dispatch.default)
    assert count(grouped, K3.moe_dispatch_rows.default) == layers
    assert count(grouped, K3.moe_dispatch.default) == count(grouped, K3.expert_matmul.default) == 0
    # each expert FFN (gate, up, GLU, the activation's fake quantisation, down) is one op on the rows
    assert count(capacity, K3.expert_matmul.default) == 3 * layers and count(grouped, K3.expert_rows_matmul.default) == 0
    assert record.statistics["ffn"] == count(grouped, K3.expert_rows_ffn.default) == layers
    # with QAT the buffer's activation fake quantisation moved before the dispatch: on the T tokens, not the rows
    qat = spec.quantization.qat
    for n in grouped.graph.nodes:
        if n.target is K3.moe_dispatch_rows.default:
            x, indices = n.args[:2]
            assert (x.target is K3.mx_fake_quantize.default) == qat
            assert x.meta["val"].shape[0] == indices.meta["val"].shape[0]  # [T, w]
            assert n.meta["val"][0].shape[0] == indices.meta["val"].numel()  # rows [T * K, w]
        if n.target is K3.expert_rows_ffn.default:
            assert n.args[5:8] == (spec.activation.kind, spec.activation.beta1, spec.activation.beta2)
            assert n.args[8:] == (("e4m3", spec.quantization.block_size) if qat else (None, 0))
            assert all((w.target is K3.mx_fake_quantize.default) == qat for w in n.args[1:4])
    absorbed = layers if qat else 0  # the activation's, inside expert_rows_ffn
    assert count(grouped, K3.mx_fake_quantize.default) == count(capacity, K3.mx_fake_quantize.default) - absorbed


def test_outputs_gradients_and_counters_equal_the_capacity_path(graphs):
    _, grouped, capacity, inputs, _ = graphs
    torch.manual_seed(1)
    weight = torch.randn(capacity(*inputs).shape)
    logits, grads, counters = step(grouped, inputs, weight)
    want_logits, want_grads, want_counters = step(capacity, inputs, weight)
    assert rel(logits, want_logits) <= 1e-6
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert (grads[name] is None) == (g is None), name
        if g is not None and g.norm() > 0:
            assert rel(grads[name], g) <= 1e-5, name
    assert counters.keys() == want_counters.keys() and counters
    for name, c in want_counters.items():
        assert torch.equal(counters[name], c), name  # the same choices kept and dropped


def test_dropping_spec_drops_choices(graphs):
    """Both capacities drop choices of the example input, so the comparison above covers dropped choices."""
    _, grouped, _, inputs, _ = graphs
    _, _, counters = step(grouped, inputs, 0.0)
    dropped = sum(int(c) for n, c in counters.items() if n.endswith(".dropped"))
    assert dropped > 0


def test_train_loss_equals_the_eager_definition(load, run_passes):
    """The grouped train graph's loss and gradients are the eager model definition's (QAT as trained, the
    spec's capacity: the same tokens dropped)."""
    spec = load("k3-tiny.yaml", "moe.capacity_factor=0.75")
    gm, inputs, _ = run_passes(spec, NAMES)
    eager = K3Model(spec, init=False)
    eager.load_state_dict(gm.state_dict(), strict=True)
    eager.quantize_as_trained().train()
    (tokens,) = inputs
    labels = tokens[:, 1:].flatten()
    losses, grads = [], []
    for logits in (gm(tokens), eager(tokens)):
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[1]
    want = dict(eager.named_parameters())
    for name, p in gm.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel(p.grad, want[name].grad) <= 1e-4, name


@pytest.mark.parametrize(("graph", "target", "overrides"), [
    ("prefill", "cpu", ()), ("decode", "cpu", ()), ("train", "h100", ()), ("train", "cpu", ("parallel.ep=2",)),
])  # fmt: skip
def test_untouched_elsewhere(load, run_passes, graph, target, overrides):
    """Inference graphs (drop-free), GPU targets (grouped Triton GEMMs over the buffers), expert parallelism."""
    spec = load("k3-tiny.yaml", *overrides)
    mode = "train" if graph == "train" else "infer"
    gm, _, records = run_passes(spec, WITH, device="meta", mode=mode, target=target, graph=graph)
    assert records[-1].statistics["grouped"] == 0
    if overrides:  # the experts were sharded: the buffers go to their owners, which run them at capacity
        assert records[NAMES.index("shard_experts")].statistics["ranks"] == 2
    assert count(gm, K3.moe_dispatch_rows.default) == count(gm, K3.expert_rows_ffn.default) == 0
    assert records[-1].statistics["ffn"] == 0


def test_numerics_checked_in_the_build(record):
    r = record("train", "group_experts")
    assert r.statistics["grouped"] > 0 and r.max_rel_diff is not None and r.max_rel_diff <= 1e-5
    assert record("decode", "group_experts").statistics["grouped"] == 0
