"""interleave: each layer's kept mixer call becomes KDA or Gated MLA ops exactly as the spec's layout says,
in the graph's form (chunked KDA and expanded MLA in train/prefill, their one-token steps in decode)."""

from __future__ import annotations

import pytest
import torch

from k3compile.modules.kda import KDAMixer
from k3compile.modules.mla import MLAMixer
from k3compile.spec.weights import weight_inventory

K3 = torch.ops.k3
OPS = {  # graph -> (the KDA op, the MLA attention op) interleave inlines
    "train": (K3.kda_chunk.default, K3.mla_attention.default),
    "prefill": (K3.kda_chunk.default, K3.mla_attention.default),
    "decode": (K3.kda_decode_step.default, K3.mla_decode_absorbed.default),
}
GRAPHS = list(OPS)

LAYOUTS = {
    "k3-tiny": ("k3-tiny.yaml",),
    "all-kda": ("ablations/all-kda.yaml",),
    "all-mla": ("ablations/all-mla.yaml",),
    "pattern-KM": ("k3-tiny.yaml", "layout.pattern=KM", "layout.last_layer_full=false"),
    "explicit": ("k3-tiny.yaml", "layout.pattern=null", "layout.layers=[M, K, K, M, M, K, K, K]", "layout.last_layer_full=false"),
    "last-full": ("k3-tiny.yaml", "layout.pattern=K", "layout.last_layer_full=true"),
}


@pytest.fixture(
    scope="module",
    params=[(layout, graph) for layout in LAYOUTS for graph in GRAPHS],
    ids=[f"{layout}-{graph}" for layout in LAYOUTS for graph in GRAPHS],
)
def interleaved(request, load, run_passes):
    layout, graph = request.param
    spec = load(*LAYOUTS[layout])
    mode = "train" if graph == "train" else "infer"
    gm, _, records = run_passes(spec, ["interleave"], device="meta", mode=mode, graph=graph)
    return spec, gm, records[0], graph


def _mixer_calls(gm) -> list:
    """The token-mixer calls lowering keeps (`layers.<i>.attn`) that interleave has not inlined."""
    return [
        n for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), (KDAMixer, MLAMixer))
    ]


def _layer_ops(gm) -> dict[int, set]:
    """Per layer, the op targets the interleave pass inlined at `layers.<i>.attn`."""
    ops: dict[int, set] = {}
    for n in gm.graph.nodes:
        origin = n.meta.get("origin", "")
        if origin.startswith("layers.") and origin.endswith(".attn"):
            ops.setdefault(int(origin.split(".")[1]), set()).add(n.target)
    return ops


def test_layout_variants_are_what_they_claim(load):
    assert load(*LAYOUTS["pattern-KM"]).mixers == tuple("KMKMKMKM")
    assert load(*LAYOUTS["explicit"]).mixers == tuple("MKKMMKKK")
    assert load(*LAYOUTS["last-full"]).mixers == tuple("KKKKKKKM")


def test_lowering_keeps_one_mixer_call_per_layer(load):
    """Before interleave, each layer's mixer is a call of the layout's module at `layers.<i>.attn`, in every graph."""
    from k3compile.ir.lower import lower

    spec = load(*LAYOUTS["k3-tiny"])
    for graph in GRAPHS:
        gm = lower(spec, graph=graph).gm
        calls = _mixer_calls(gm)
        assert [n.target for n in calls] == [f"layers.{i}.attn" for i in range(spec.num_layers)], graph
        kinds = [type(gm.get_submodule(n.target)) for n in calls]
        assert kinds == [KDAMixer if k == "K" else MLAMixer for k in spec.mixers], graph


def test_kda_and_mla_counts_match_the_layout(interleaved):
    spec, gm, record, graph = interleaved
    KDA_OP, MLA_OP = OPS[graph]
    n_kda, n_mla = spec.mixers.count("K"), spec.mixers.count("M")
    nodes = list(gm.graph.nodes)
    assert sum(n.target is KDA_OP for n in nodes) == n_kda
    assert sum(n.target is MLA_OP for n in nodes) == n_mla
    other_kda, other_mla = OPS["decode" if graph != "decode" else "train"]  # the other form's ops are absent
    assert not any(n.target in (other_kda, other_mla) for n in nodes)
    assert not _mixer_calls(gm)
    assert record.statistics["kda_layers"] == n_kda and record.statistics["mla_layers"] == n_mla
    assert record.statistics["nodes_added"] > 0


def test_each_layer_gets_its_own_mixer(interleaved):
    spec, gm, _, graph = interleaved
    KDA_OP, MLA_OP = OPS[graph]
    ops = _layer_ops(gm)
    assert sorted(ops) == list(range(spec.num_layers))
    for i, letter in enumerate(spec.mixers):
        assert (KDA_OP in ops[i], MLA_OP in ops[i]) == (letter == "K", letter == "M"), f"layer {i}"


def test_mixer_parameters_are_the_inventorys(interleaved):
    spec, gm, _, _ = interleaved
    inventory = {w.name: w.shape for w in weight_inventory(spec) if w.component in ("kda", "mla")}
    graph = {n: tuple(p.shape) for n, p in gm.named_parameters() if ".attn." in n}
    assert graph == inventory
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(inventory) <= read  # the inlined ops read every mixer weight under its inventory name


def test_mla_output_gate_follows_the_spec(load, run_passes):
    spec = load("ablations/all-mla.yaml", "mla.output_gate=false")
    gm, _, _ = run_passes(spec, ["interleave"], device="meta")
    names = [n for n, _ in gm.named_parameters()]
    assert "layers.0.attn.o_proj.weight" in names and not any(n.endswith("attn.g_proj.weight") for n in names)
