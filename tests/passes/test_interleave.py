"""interleave: each layer's generic token mixer becomes KDA or Gated MLA exactly as the spec's layout says."""

from __future__ import annotations

import pytest
import torch

from k3compile.ir.generic_ops import TOKEN_MIXER
from k3compile.spec.weights import weight_inventory

K3 = torch.ops.k3
KDA_OP, MLA_OP = K3.kda_chunk.default, K3.mla_attention.default

LAYOUTS = {
    "k3-tiny": ("k3-tiny.yaml",),
    "all-kda": ("ablations/all-kda.yaml",),
    "all-mla": ("ablations/all-mla.yaml",),
    "pattern-KM": ("k3-tiny.yaml", "layout.pattern=KM", "layout.last_layer_full=false"),
    "explicit": ("k3-tiny.yaml", "layout.pattern=null", "layout.layers=[M, K, K, M, M, K, K, K]", "layout.last_layer_full=false"),
    "last-full": ("k3-tiny.yaml", "layout.pattern=K", "layout.last_layer_full=true"),
}


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def interleaved(request, load, run_passes):
    spec = load(*LAYOUTS[request.param])
    gm, _, records = run_passes(spec, ["interleave"], device="meta")
    return spec, gm, records[0]


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


def test_kda_and_mla_counts_match_the_layout(interleaved):
    spec, gm, record = interleaved
    n_kda, n_mla = spec.mixers.count("K"), spec.mixers.count("M")
    nodes = list(gm.graph.nodes)
    assert sum(n.target is KDA_OP for n in nodes) == n_kda
    assert sum(n.target is MLA_OP for n in nodes) == n_mla
    assert not any(n.target is TOKEN_MIXER for n in nodes)
    assert record.statistics["kda_layers"] == n_kda and record.statistics["mla_layers"] == n_mla
    assert record.statistics["nodes_added"] > 0


def test_each_layer_gets_its_own_mixer(interleaved):
    spec, gm, _ = interleaved
    ops = _layer_ops(gm)
    assert sorted(ops) == list(range(spec.num_layers))
    for i, letter in enumerate(spec.mixers):
        assert (KDA_OP in ops[i], MLA_OP in ops[i]) == (letter == "K", letter == "M"), f"layer {i}"


def test_mixer_parameters_are_the_inventorys(interleaved):
    spec, gm, _ = interleaved
    inventory = {w.name: w.shape for w in weight_inventory(spec) if w.component in ("kda", "mla")}
    graph = {n: tuple(p.shape) for n, p in gm.named_parameters() if ".attn." in n}
    assert graph == inventory


def test_mla_output_gate_follows_the_spec(load, run_passes):
    spec = load("ablations/all-mla.yaml", "mla.output_gate=false")
    gm, _, _ = run_passes(spec, ["interleave"], device="meta")
    names = [n for n, _ in gm.named_parameters()]
    assert "layers.0.attn.o_proj.weight" in names and not any(n.endswith("attn.g_proj.weight") for n in names)
