"""attn_res: plain residuals equal the generic depth mix exactly; block/full AttnRes mix the planned sources."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from k3compile.ir.generic_ops import DEPTH_MIX
from k3compile.ir.lower import lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.modules.attn_res import source_plan
from k3compile.passes import attn_res, interleave

ATTN_RES_OP = torch.ops.k3.attn_res.default

VARIANTS = {
    "block-2": ("k3-tiny.yaml",),
    "block-1": ("k3-tiny.yaml", "residual.block_size=1"),
    "block-3": ("k3-tiny.yaml", "residual.block_size=3"),  # 8 layers: the last block is partial
    "full": ("k3-tiny.yaml", "residual.mode=full", "residual.block_size=null"),
}


def split_run(spec, device):
    """Lower, interleave, then (graph, inputs, manager) ready to run attn_res with `manager.run(..., start=1)`."""
    lowered = lower(spec, device)
    pm = PassManager([interleave.PASS, attn_res.PASS])
    pm.run(lowered.gm, PassContext(spec), lowered.example_inputs, stop=1)
    return lowered.gm, lowered.example_inputs, pm


def site_of(path: str, num_layers: int) -> int:
    if path == "final_res":
        return 2 * num_layers
    _, layer, kind = path.split(".")
    return 2 * int(layer) + (kind == "ffn_res")


# ---------------------------------------------------------------- plain


@pytest.fixture(scope="module")
def plain(load):
    spec = load("ablations/no-attn-res.yaml")
    gm, inputs, pm = split_run(spec, "cpu")
    with torch.no_grad():
        generic = gm(*inputs)  # the unresolved depth mixes run their reference: the plain sum
    pm.run(gm, PassContext(spec), inputs, start=1)
    with torch.no_grad():
        wired = gm(*inputs)
    return spec, gm, pm.records[-1], generic, wired


def test_plain_equals_the_generic_depth_mix_exactly(plain):
    _, gm, _, generic, wired = plain
    assert torch.equal(wired, generic)
    assert not any(n.target is DEPTH_MIX for n in gm.graph.nodes)


def test_plain_is_one_running_sum(plain):
    spec, gm, record, _, _ = plain
    L = spec.num_layers
    assert record.statistics == {"sites": 2 * L + 1, "adds": 2 * L, "attn_res_modules": 0}
    assert not any(n.target is ATTN_RES_OP for n in gm.graph.nodes)
    assert not any(n.endswith(".query") for n, _ in gm.named_parameters())


# ---------------------------------------------------------------- block and full


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def wired(request, load):
    """(spec, graph after attn_res, record, {source node: index}) where index 0 is the embedding, k+1 sublayer k."""
    spec = load(*VARIANTS[request.param])
    gm, inputs, pm = split_run(spec, "meta")
    (final,) = [n for n in gm.graph.nodes if n.target is DEPTH_MIX and n.args[1] == 2 * spec.num_layers]
    index = {node: k for k, node in enumerate(final.args[0])}
    pm.run(gm, PassContext(spec), inputs, start=1)
    return spec, gm, pm.records[-1], index


def _leaves(node: fx.Node, index: dict) -> list[int]:
    """The sources a stacked value sums, as indices: a source itself, or an add tree over sources."""
    if node in index:
        return [index[node]]
    assert node.target is operator.add, f"{node.name} is neither a source nor a sum of sources"
    return sorted(i for a in node.args for i in _leaves(a, index))


def test_every_site_mixes_the_planned_sources(wired):
    spec, gm, record, index = wired
    r = spec.residual
    ops = [n for n in gm.graph.nodes if n.target is ATTN_RES_OP]
    sites = [site_of(n.meta["origin"], spec.num_layers) for n in ops]
    assert sorted(sites) == list(range(2 * spec.num_layers + 1))
    for op, site in zip(ops, sites):
        stack = op.args[0]
        assert stack.target is torch.stack
        got = [_leaves(s, index) for s in stack.args[0]]
        plan = source_plan(site, r.mode, r.block_size)
        want = [[0] if not s.sublayers else [k + 1 for k in s.sublayers] for s in plan]
        assert got == want, f"site {site}"
        val = stack.meta["val"]
        assert tuple(val.shape) == (len(plan), 2, 8, spec.hidden_size)


def test_statistics_and_parameters(wired):
    spec, gm, record, _ = wired
    n_sites = 2 * spec.num_layers + 1
    assert record.statistics["sites"] == record.statistics["attn_res_modules"] == n_sites
    if spec.residual.mode == "full":
        assert record.statistics["adds"] == 0  # every source is one sublayer output
    queries = [n for n, _ in gm.named_parameters() if n.endswith(".query")]
    assert len(queries) == n_sites and "final_res.query" in queries
    assert not any(n.target is DEPTH_MIX for n in gm.graph.nodes)


def test_block_sums_are_shared_between_sites(load):
    """Each distinct (partial or finished) block sum is built once: block-2 on 8 layers needs 12 adds, not more."""
    spec = load()
    gm, inputs, pm = split_run(spec, "meta")
    pm.run(gm, PassContext(spec), inputs, start=1)
    # Sums of 2..4 consecutive sublayer outputs, each one add longer than the last: 3 adds per block of 4, 4 blocks.
    assert pm.records[-1].statistics["adds"] == 12


def test_zero_queries_average_the_sources(load):
    """At init every query is zero, so each AttnRes is the plain mean of the sources it stacks."""
    spec = load("k3-tiny.yaml", "residual.block_size=3")
    gm, inputs, pm = split_run(spec, "cpu")
    pm.run(gm, PassContext(spec), inputs, start=1)
    seen = []

    class Watch(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.target is ATTN_RES_OP:
                seen.append((self.env[n.args[0]], out))
            return out

    with torch.no_grad():
        Watch(gm).run(*inputs)
    assert len(seen) == 2 * spec.num_layers + 1
    for stack, out in seen:
        torch.testing.assert_close(out, stack.mean(0), rtol=1e-5, atol=1e-6)
