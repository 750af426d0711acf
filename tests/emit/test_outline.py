"""Outlining: sublayer kinds found once, their code generated once per distinct region, shapes named."""

from __future__ import annotations

import re

import pytest
from k3compile.build import BuildOptions, compile_graphs
from k3compile.emit.outline import _regions, fingerprint, outline_graph, readable, region_graph, symbols
from k3compile.ir.lower import EXAMPLE_BATCH


@pytest.fixture(scope="module")
def tiny_graphs(tiny_spec):
    """k3-tiny's three compiled graphs (meta device: only shapes are needed)."""
    return compile_graphs(tiny_spec, ("train", "infer"), BuildOptions(device="meta"))


def _code(region) -> str:
    return region_graph(region)[0].python_code(root_module="layer", verbose=True).src


@pytest.mark.parametrize("graph", ["train", "prefill", "decode"])
def test_regions_with_one_fingerprint_print_the_same_code(tiny_graphs, graph):
    regions = list(_regions(tiny_graphs[graph].gm).values())
    by_key: dict[str, set[str]] = {}
    for r in regions:
        by_key.setdefault(fingerprint(r), set()).add(_code(r))
    assert all(len(codes) == 1 for codes in by_key.values())
    codes = {_code(r) for r in regions}
    assert len(by_key) == len(codes) < len(regions)  # distinct code <=> distinct fingerprint; layers share


def test_a_changed_shape_changes_the_fingerprint(tiny_graphs):
    region = next(iter(_regions(tiny_graphs["train"].gm).values()))
    before = fingerprint(region)
    node = next(n for n in region.nodes if n.op == "call_function")
    saved = node.meta["val"]
    try:
        node.meta["val"] = saved.new_empty((*saved.shape[:-1], saved.shape[-1] + 1))
        assert fingerprint(region) != before
    finally:
        node.meta["val"] = saved


def test_decode_shape_comments_name_the_routed_rows(tiny_graphs, tiny_spec):
    k = tiny_spec.moe.top_k
    gm = tiny_graphs["decode"].gm
    assert symbols(gm, tiny_spec)[str(EXAMPLE_BATCH * k)] == f"B*{k}"
    functions, _, _ = outline_graph(gm, "decode", tiny_spec)
    moe = next(f for f in functions if f.startswith("def decode_moe("))
    assert re.search(rf"\.reshape\(-1, 1, \d+\)  # \[B\*{k}, 1, \d+\]", moe)  # a row per (token, choice)
    assert "# [B, 1, " in moe


def test_readable_names_only_the_symbols_it_is_given():
    src = 'def forward(self, x):\n    y: "f32[5, 20, 7]" = x.relu()\n    return y'
    assert readable(src, keep_deletions=False).splitlines()[1] == "    y = x.relu()  # [B, 20, 7]"
    assert readable(src, False, {"5": "B", "20": "B*4"}).splitlines()[1] == "    y = x.relu()  # [B, B*4, 7]"
