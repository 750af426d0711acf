"""Lowering: the skeleton graph, parameters equal to the weight inventory for every shipped spec, seeded init."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3compile.analysis.params import param_counts
from k3compile.analysis.stats import spec_stats
from k3compile.ir.generic_ops import DEPTH_MIX, TOKEN_MIXER
from k3compile.modules.init import initial_value
from k3compile.ir.lower import EXAMPLE_BATCH, EXAMPLE_TOKENS, lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.ir.verify import verify_graph
from k3compile.passes import attn_res, interleave
from k3compile.spec.load import load_spec
from k3compile.spec.weights import weight_inventory

SPECS = Path(__file__).resolve().parents[2] / "specs"
ALL_SPECS = sorted(SPECS.rglob("*.yaml"))
PARAM_PASSES = [interleave.PASS, attn_res.PASS]  # the passes that create parameters


def resolve(spec, device: str):
    """Lower `spec` and run the parameter-creating passes: the train graph's parameters are final here."""
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


@pytest.mark.parametrize("name", ["k3-tiny.yaml", "kimi-linear-48b-a3b.yaml"])
def test_skeleton_has_one_generic_mixer_per_layer_and_one_depth_mix_per_site(name):
    spec = load_spec(SPECS / name)
    lowered = lower(spec)
    gm = lowered.gm
    mixers = [n for n in gm.graph.nodes if n.target is TOKEN_MIXER]
    mixes = [n for n in gm.graph.nodes if n.target is DEPTH_MIX]
    L = spec.num_layers
    assert [n.args[1] for n in mixers] == list(range(L))
    assert [n.args[1] for n in mixes] == list(range(2 * L + 1))
    assert [len(n.args[0]) for n in mixes] == [site + 1 for site in range(2 * L + 1)]  # embedding + earlier outputs
    # The skeleton's parameters are the inventory's minus what the passes add (mixers, AttnRes).
    added = {w.name for w in weight_inventory(spec) if w.component in ("kda", "mla", "attn_res")}
    expected = {w.name: w.shape for w in weight_inventory(spec) if w.name not in added}
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == expected
    verify_graph(gm, lowered.example_inputs)  # no dangling nodes, shapes propagate
    (tokens,) = lowered.example_inputs
    assert tokens.shape == (EXAMPLE_BATCH, EXAMPLE_TOKENS) and tokens.device.type == "meta"
    assert type(gm).__name__ == "K3_" + spec.name.replace("-", "_")


def test_unresolved_skeleton_refuses_to_run(tiny):
    lowered = lower(tiny, "cpu")
    with pytest.raises(RuntimeError, match="unresolved token mixer"):
        lowered.gm(*lowered.example_inputs)


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
    for p in _params(gm, lambda n: n.endswith(".dt_bias")).values():
        assert torch.all(p == 0)
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
