"""Lowering: the skeleton graphs (train, prefill, decode) traced from the model definition, parameters equal to
the weight inventory for every shipped spec, seeded init."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from torch.utils import _pytree as pytree

from k3compile.analysis.params import param_counts
from k3compile.analysis.stats import spec_stats
from k3compile.ir.lower import EXAMPLE_BATCH, EXAMPLE_CACHE_LEN, EXAMPLE_TOKENS, build_model, lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.ir.verify import verify_graph
from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.modules.init import DT_MAX, DT_MIN, initial_value
from k3compile.modules.kda import KDAMixer
from k3compile.modules.mla import MLAMixer
from k3compile.modules.model import DEPTH_SITES, GRAPHS, cache_shapes
from k3compile.passes import attn_res, interleave
from k3compile.spec.load import load_spec
from k3compile.spec.schema import MIXER_KDA
from k3compile.spec.weights import weight_inventory

SPECS = Path(__file__).resolve().parents[2] / "specs"
ALL_SPECS = sorted(p for p in SPECS.rglob("*.yaml") if "studies" not in p.parts)  # studies are not specs
PARAM_PASSES = [interleave.PASS, attn_res.PASS]  # the passes that inline the kept mixer and depth-site calls


def resolve(spec, device: str):
    """Lower `spec` and inline its kept calls: the train graph's parameters are final here."""
    lowered = lower(spec, device)
    PassManager(PARAM_PASSES).run(lowered.gm, PassContext(spec), lowered.example_inputs)
    return lowered.gm


@pytest.fixture(scope="module", params=ALL_SPECS, ids=[str(p.relative_to(SPECS)) for p in ALL_SPECS])
def on_meta(request):
    """(spec, graph after interleave + attn_res on the meta device), once per shipped spec (K3 included)."""
    spec = load_spec(request.param)
    return spec, resolve(spec, "meta")


@pytest.fixture(scope="module")
def tiny():
    return load_spec(SPECS / "k3-tiny.yaml")


@pytest.fixture(scope="module")
def tiny_real(tiny):
    return resolve(tiny, "cpu")


# ---------------------------------------------------------------- every shipped spec


def test_parameter_count_equals_stats(on_meta):
    spec, gm = on_meta
    total = sum(p.numel() for p in gm.parameters())
    assert total == param_counts(spec)["total"] == spec_stats(spec)["params"]["total"]


def test_parameters_equal_the_weight_inventory_name_by_name(on_meta):
    spec, gm = on_meta
    graph = {name: tuple(p.shape) for name, p in gm.named_parameters()}
    inventory = {w.name: w.shape for w in weight_inventory(spec)}
    assert len(inventory) == len(weight_inventory(spec))  # names are unique
    assert sorted(set(inventory) - set(graph)) == [], "in the inventory, not in the graph"
    assert sorted(set(graph) - set(inventory)) == [], "in the graph, not in the inventory"
    assert [n for n in inventory if inventory[n] != graph[n]] == []


def test_meta_lowering_holds_no_real_memory(on_meta):
    spec, gm = on_meta
    tensors = list(gm.parameters()) + list(gm.buffers())
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert gm.meta.get("packed") is None  # nothing was materialised for packing either


# ---------------------------------------------------------------- the skeleton


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("name", ["k3-tiny.yaml", "kimi-linear-48b-a3b.yaml"])
def test_skeleton_has_one_mixer_call_per_layer_and_one_depth_site_per_site(name, graph):
    spec = load_spec(SPECS / name)
    lowered = lower(spec, graph=graph)
    gm = lowered.gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    mixers = [n for n in calls if isinstance(gm.get_submodule(n.target), (KDAMixer, MLAMixer))]
    mixes = [n for n in calls if isinstance(gm.get_submodule(n.target), DEPTH_SITES)]
    L = spec.num_layers
    assert [n.target for n in mixers] == [f"layers.{i}.attn" for i in range(L)]
    assert [type(gm.get_submodule(n.target)) for n in mixers] == [
        KDAMixer if kind == MIXER_KDA else MLAMixer for kind in spec.mixers
    ]
    assert [gm.get_submodule(n.target).site for n in mixes] == list(range(2 * L + 1))
    assert [len(n.args[0]) for n in mixes] == [site + 1 for site in range(2 * L + 1)]  # embedding + earlier outputs
    # Everything else is ops over the inventory's parameters; the kept calls hold the mixers' and AttnRes'.
    kept = {w.name for w in weight_inventory(spec) if w.component in ("kda", "mla", "attn_res")}
    expected = {w.name: w.shape for w in weight_inventory(spec) if w.name not in kept}
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert {n: tuple(p.shape) for n, p in gm.named_parameters() if n in read} == expected
    # ... and the graph's module tree holds every parameter of the inventory already, under its name.
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == {w.name: w.shape for w in weight_inventory(spec)}
    verify_graph(gm, lowered.example_inputs)  # no dangling nodes, shapes propagate
    assert gm.meta["graph"] == graph
    tokens = lowered.example_inputs[0]
    assert tokens.shape == (EXAMPLE_BATCH, 1 if graph == "decode" else EXAMPLE_TOKENS) and tokens.device.type == "meta"
    if graph != "train":  # prefill: (tokens, caches); decode: (tokens, positions, caches)
        caches = lowered.example_inputs[-1]
        assert {n: (tuple(c.shape), c.dtype) for n, c in caches.items()} == cache_shapes(
            spec, EXAMPLE_BATCH, EXAMPLE_CACHE_LEN
        )
        assert len(lowered.example_inputs) == (2 if graph == "prefill" else 3)
    assert type(gm).__name__ == "K3_" + spec.name.replace("-", "_")


@pytest.mark.parametrize("graph", GRAPHS)
def test_moe_layers_are_inlined_from_one_trace_for_all_alike(tiny, graph, monkeypatch):
    from k3compile.ir import inline
    from k3compile.ir.lower import FlatTracer
    from k3compile.modules.moe import LatentMoE

    monkeypatch.setattr(inline, "_TRACES", {})  # traces are cached per process: start empty
    traced = []
    real = FlatTracer.trace
    monkeypatch.setattr(FlatTracer, "trace", lambda self, root, *a: traced.append(root) or real(self, root, *a))
    gm = lower(tiny, graph=graph).gm
    moe_layers = [i for i in range(tiny.num_layers) if tiny.is_moe_layer(i)]
    assert len(moe_layers) > 1
    assert not any(isinstance(gm.get_submodule(n.target), LatentMoE) for n in gm.graph.find_nodes(op="call_module"))
    assert sum(isinstance(getattr(r, "m", None), LatentMoE) for r in traced) == 1  # every MoE layer alike
    for i in moe_layers:  # ... and each reads its own weights
        assert gm.graph.find_nodes(op="get_attr", target=f"layers.{i}.moe.router.weight")


def _cloned(inputs):
    """Fresh copies of a graph's inputs: the decode step writes its MLA caches in place."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, inputs)


@pytest.mark.parametrize("graph", GRAPHS)
def test_unresolved_graph_runs_and_equals_the_model_definition(tiny, graph):
    """Before any pass, a lowered graph runs (the kept mixer and depth-site calls run their modules eagerly) and
    computes exactly what the model definition's entry point for that graph computes, on the same weights."""
    model = build_model(tiny, "cpu")
    lowered = lower(tiny, graph=graph, model=model)
    kept = [n for n in lowered.gm.graph.nodes if n.op == "call_module"]
    assert len(kept) == tiny.num_layers + 2 * tiny.num_layers + 1  # a mixer per layer, a depth site per site
    entry = {"train": model.forward, "prefill": model.prefill, "decode": model.decode}[graph]
    with torch.no_grad():
        got = pytree.tree_leaves(lowered.gm(*_cloned(lowered.example_inputs)))
        want = pytree.tree_leaves(entry(*_cloned(lowered.example_inputs)))
    assert len(got) == len(want) == (1 if graph == "train" else 1 + len(cache_shapes(tiny, 1, 1)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- real weights: seeded, deterministic, init rules


def test_real_weights_are_deterministic(tiny, tiny_real):
    again = resolve(tiny, "cpu").state_dict()
    first = tiny_real.state_dict()
    assert list(first) == list(again)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in tiny_real.parameters())


def test_each_weight_is_seeded_by_its_name(tiny, tiny_real):
    """Every parameter equals initial_value(name), so no value depends on build order."""
    for name, p in tiny_real.named_parameters():
        assert torch.equal(p, initial_value(name, tuple(p.shape), tiny)), name


def test_the_seed_changes_the_weights(tiny, tiny_real):
    other = lower(load_spec(SPECS / "k3-tiny.yaml", overrides=["training.seed=1"]), "cpu").gm
    assert not torch.equal(other.embed.weight, tiny_real.embed.weight)
    assert torch.equal(other.final_norm.weight, tiny_real.final_norm.weight)  # ones either way


def _check_published_decay(spec, dt_bias, a_log, name: str):
    """dt_bias follows the published KDA decay convention (k3compile.modules.init): at f = 0 each channel's log
    decay is g = -exp(A_log) * dt with dt log-uniform in [1e-3, 1e-1]. Returns the per-step retention exp(g)."""
    H, K = spec.kda.num_heads, spec.kda.head_dim
    d = spec.kda.decay
    assert dt_bias.shape == (H * K,), name
    g = kda_gate_ref(torch.zeros(H, K), a_log, dt_bias, d.form, d.lower_bound)
    dt = -g / a_log.exp()[:, None]
    assert dt.min() >= DT_MIN * (1 - 1e-4) and dt.max() <= DT_MAX * (1 + 1e-4), name
    log_dt = dt.log10().flatten()
    assert log_dt.median().item() == pytest.approx(-2.0, abs=0.25), name  # log-uniform over [-3, -1]
    assert log_dt.min() < -2.8 and log_dt.max() > -1.2, name  # spread over the whole range
    return g.exp().flatten()


@pytest.mark.parametrize(
    "overrides",
    [(), ("kda.decay.form=softplus", "kda.decay.lower_bound=null")],
    ids=["lower_bounded_sigmoid", "softplus"],
)
def test_dt_bias_follows_the_published_convention_in_both_forms(overrides):
    spec = load_spec(SPECS / "k3-tiny.yaml", overrides=list(overrides))
    H, K = spec.kda.num_heads, spec.kda.head_dim
    retention = []
    for i in [i for i, kind in enumerate(spec.mixers) if kind == MIXER_KDA]:
        a_log = initial_value(f"layers.{i}.attn.A_log", (H,), spec)
        dt_bias = initial_value(f"layers.{i}.attn.dt_bias", (H * K,), spec)
        retention.append(_check_published_decay(spec, dt_bias, a_log, f"layers.{i}"))
    assert torch.cat(retention).median().item() == pytest.approx(0.94, abs=0.05)


def _params(gm, pred):
    found = {n: p for n, p in gm.named_parameters() if pred(n)}
    assert found
    return found


def test_init_rules(tiny, tiny_real):
    gm, spec = tiny_real, tiny
    std, L = spec.init_std, spec.num_layers
    for n, p in _params(gm, lambda n: n.endswith("norm.weight")).items():
        assert torch.all(p == 1), n
    norms = {n.rsplit(".", 2)[-2] for n in _params(gm, lambda n: n.endswith("norm.weight"))}
    assert {"attn_norm", "ffn_norm", "final_norm", "norm", "o_norm", "q_a_norm", "kv_a_norm", "latent_norm"} <= norms
    queries = _params(gm, lambda n: n.endswith(".query"))
    assert len(queries) == 2 * L + 1 and all(torch.all(q == 0) for q in queries.values())
    assert "final_res.query" in queries
    retention = []
    for n, p in _params(gm, lambda n: n.endswith(".dt_bias")).items():
        a_log = dict(gm.named_parameters())[n.removesuffix("dt_bias") + "A_log"]
        retention.append(_check_published_decay(spec, p.detach(), a_log.detach(), n))
    # With dt_bias = 0 a channel would keep about 8% of its state per step; the published start keeps about 94%.
    assert torch.cat(retention).median().item() == pytest.approx(0.94, abs=0.05)
    for n, p in _params(gm, lambda n: n.endswith(".A_log")).items():
        a = p.exp()
        assert p.shape == (spec.kda.num_heads,) and torch.all((a >= 1) & (a <= 16)), n
    bound = 1 / math.sqrt(spec.kda.short_conv_size)
    for n, p in _params(gm, lambda n: n.endswith("_conv.weight")).items():
        assert p.abs().max() <= bound and p.std() > bound / 4, n
    residual_out = (".o_proj.weight", ".down_proj.weight", ".latent_up.weight")
    scaled = _params(gm, lambda n: n.endswith(residual_out))
    assert any(".experts." in n for n in scaled) and any(".shared_experts." in n for n in scaled)
    for n, p in scaled.items():
        assert p.mean().abs() < 3 * std / math.sqrt(p.numel())
        assert p.std().item() == pytest.approx(std / math.sqrt(2 * L), rel=0.1), n
    special = ("norm.weight", ".query", ".dt_bias", ".A_log", "_conv.weight") + residual_out
    for n, p in _params(gm, lambda n: not n.endswith(special)).items():
        if p.numel() >= 1024:
            assert p.std().item() == pytest.approx(std, rel=0.1), n
    for name, buf in gm.named_buffers():
        if name.endswith("router.bias"):
            assert torch.all(buf == 0)
