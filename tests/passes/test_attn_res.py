"""attn_res: plain residuals equal the model definition's depth sites exactly; block/full AttnRes mix the
planned sources and compute what the unwired sites (`layers.<i>.attn_res`, `layers.<i>.ffn_res`, `final_res`) do."""

from __future__ import annotations

import operator

import pytest
import torch

from k3compile.kernels._common.compare import rel_rms
from torch import fx

from torch.utils import _pytree as pytree

from k3compile.ir.lower import EXAMPLE_BATCH, EXAMPLE_TOKENS, lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.modules.attn_res import source_plan
from k3compile.modules.model import DEPTH_SITES
from k3compile.passes import attn_res, interleave

ATTN_RES_OP = torch.ops.k3.attn_res.default
NORMED_OP = torch.ops.k3.attn_res_normed.default  # the CPU target's train and prefill form
MIX_OPS = (ATTN_RES_OP, NORMED_OP)

VARIANTS = {
    "block-2": ("k3-tiny.yaml",),
    "block-1": ("k3-tiny.yaml", "residual.block_size=1"),
    "block-3": ("k3-tiny.yaml", "residual.block_size=3"),  # 8 layers: the last block is partial
    "full": ("k3-tiny.yaml", "residual.mode=full", "residual.block_size=null"),
}


GRAPHS = ("train", "prefill", "decode")


def context(spec, graph: str = "train") -> PassContext:
    return PassContext(spec, "train" if graph == "train" else "infer", spec.target, graph)


def split_run(spec, device, graph="train"):
    """Lower, interleave, then (graph, inputs, manager) ready to run attn_res with `manager.run(..., start=1)`."""
    lowered = lower(spec, device, graph=graph)
    pm = PassManager([interleave.PASS, attn_res.PASS])
    pm.run(lowered.gm, context(spec, graph), lowered.example_inputs, stop=1)
    return lowered.gm, lowered.example_inputs, pm


def depth_sites(gm) -> list[fx.Node]:
    """The depth-site calls lowering keeps and attn_res wires."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), DEPTH_SITES)]


def flat(out) -> list[torch.Tensor]:
    """A graph's outputs as a flat list: logits (train), or logits and every cache (prefill, decode)."""
    return pytree.tree_leaves(out)


def site_of(path: str, num_layers: int) -> int:
    if path == "final_res":
        return 2 * num_layers
    _, layer, kind = path.split(".")
    return 2 * int(layer) + (kind == "ffn_res")


# ---------------------------------------------------------------- plain


@pytest.fixture(scope="module", params=GRAPHS)
def plain(request, load):
    spec = load("ablations/no-attn-res.yaml")
    graph = request.param
    gm, inputs, pm = split_run(spec, "cpu", graph)
    with torch.no_grad():
        unwired = gm(*pytree.tree_map_only(torch.Tensor, torch.clone, inputs))  # the kept sites run eagerly: the plain sum
    pm.run(gm, context(spec, graph), inputs, start=1)
    with torch.no_grad():
        wired = gm(*pytree.tree_map_only(torch.Tensor, torch.clone, inputs))  # decode writes its caches in place
    return spec, gm, pm.records[-1], unwired, wired


def test_plain_equals_the_model_definitions_depth_sites_exactly(plain):
    _, gm, _, unwired, wired = plain
    got, want = flat(wired), flat(unwired)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not depth_sites(gm)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)  # mixers and sites all inlined


def test_plain_is_one_running_sum(plain):
    spec, gm, record, _, _ = plain
    L = spec.num_layers
    assert record.statistics == {"sites": 2 * L + 1, "adds": 2 * L, "attn_res_modules": 0}
    assert not any(n.target in MIX_OPS for n in gm.graph.nodes)
    assert not any(n.endswith(".query") for n, _ in gm.named_parameters())


# ---------------------------------------------------------------- block and full


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def wired(request, load):
    """(spec, graph after attn_res, record, {source node: index}) where index 0 is the embedding, k+1 sublayer k."""
    spec = load(*VARIANTS[request.param])
    gm, inputs, pm = split_run(spec, "meta")
    (final,) = [n for n in depth_sites(gm) if gm.get_submodule(n.target).site == 2 * spec.num_layers]
    assert final.target == "final_res"
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
    ops = [n for n in gm.graph.nodes if n.target in MIX_OPS]
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
        assert tuple(val.shape) == (len(plan), EXAMPLE_BATCH, EXAMPLE_TOKENS, spec.hidden_size)


def test_statistics_and_parameters(wired):
    spec, gm, record, _ = wired
    n_sites = 2 * spec.num_layers + 1
    assert record.statistics["sites"] == record.statistics["attn_res_modules"] == n_sites
    if spec.residual.mode == "full":
        assert record.statistics["adds"] == 0  # every source is one sublayer output
    queries = [n for n, _ in gm.named_parameters() if n.endswith(".query")]
    assert len(queries) == n_sites and "final_res.query" in queries
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(queries) <= read  # each inlined k3::attn_res reads its own site's query
    assert not depth_sites(gm)


def test_each_source_is_normalised_once_on_cpu(wired):
    """On the CPU target every site mixes with attn_res_normed, and each distinct source has one rms_inv."""
    spec, gm, _, _ = wired
    sites = [n for n in gm.graph.nodes if n.target in MIX_OPS]
    assert all(n.target is NORMED_OP for n in sites)
    rinvs = [n for n in gm.graph.nodes if n.target is torch.ops.k3.rms_inv.default]
    sources = {src for n in sites for src in n.args[0].args[0]}
    assert len(rinvs) == len(sources) and {r.args[0] for r in rinvs} == sources
    for n in sites:  # each site reads the factors of exactly its own sources, in order
        assert [r.args[0] for r in n.args[1].args[0]] == list(n.args[0].args[0])


@pytest.mark.parametrize("target", ["h200"])
def test_gpu_targets_and_decode_keep_the_fused_op(load, target):
    spec = load("k3-tiny.yaml")
    for graph, tgt in (("train", target), ("decode", "cpu")):
        gm, inputs, pm = split_run(spec, "meta", graph)
        pm.run(gm, PassContext(spec, "train" if graph == "train" else "infer", tgt, graph), inputs, start=1)
        ops = {n.target for n in gm.graph.nodes}
        assert ATTN_RES_OP in ops and NORMED_OP not in ops and torch.ops.k3.rms_inv.default not in ops


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
            if n.target in MIX_OPS:
                seen.append((self.env[n.args[0]], out))
            return out

    with torch.no_grad():
        Watch(gm).run(*inputs)
    assert len(seen) == 2 * spec.num_layers + 1
    for stack, out in seen:
        torch.testing.assert_close(out, stack.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize("variant", ["block-3", "full"])
def test_wired_attention_residuals_equal_the_unwired_sites(load, variant, graph):
    """attn_res preserves numerics: with non-zero queries, the wired graph equals the kept AttnResSite calls."""
    spec = load(*VARIANTS[variant])
    gm, inputs, pm = split_run(spec, "cpu", graph)
    # In float64, so the comparison sees the wiring, not fp32 roundings that random routing amplifies.
    gm.double()
    inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, inputs)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in gm.named_parameters():
            if name.endswith(".query"):
                p.copy_(torch.randn(p.shape, generator=gen))
        unwired = flat(gm(*pytree.tree_map_only(torch.Tensor, torch.clone, inputs)))
    pm.run(gm, context(spec, graph), inputs, start=1)
    assert not depth_sites(gm)
    with torch.no_grad():
        wired = flat(gm(*pytree.tree_map_only(torch.Tensor, torch.clone, inputs)))
    assert len(wired) == len(unwired)
    for a, b in zip(wired, unwired):
        assert rel_rms(a, b) <= 1e-12
