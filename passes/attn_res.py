"""attn_res: wire each depth site as a plain residual sum or as block/full attention residuals.

Lowering keeps every depth site (`layers.<i>.attn_res`, `layers.<i>.ffn_res`, `final_res`) as a call
on the list of all earlier sublayer outputs. Plain residuals become one running sum; attention
residuals become the sums their source plan names, shared between sites, stacked and mixed by
k3::attn_res with the site's own query and norm weight.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.ir.inline import inline_call
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.modules.attn_res import source_plan
from k3compile.modules.model import DEPTH_SITES


def _sum(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    out = nodes[0]
    for n in nodes[1:]:
        out = graph.call_function(operator.add, (out, n))
    return out


def _plain(gm: fx.GraphModule, mixes: list[fx.Node]) -> dict[str, int]:
    running = None
    adds = 0
    for node in mixes:
        (sources,) = node.args
        with gm.graph.inserting_before(node):
            if running is None:
                running = _sum(gm.graph, list(sources))
                adds += len(sources) - 1
            else:
                running = gm.graph.call_function(operator.add, (running, sources[-1]))
                adds += 1
        node.replace_all_uses_with(running)
        gm.graph.erase_node(node)
        _drop(gm, node.target)
    return {"sites": len(mixes), "adds": adds, "attn_res_modules": 0}


def _drop(gm: fx.GraphModule, path: str) -> None:
    """Remove a wired site's module from the graph's tree (a plain site holds no tensors)."""
    owner, _, leaf = path.rpartition(".")
    delattr(gm.get_submodule(owner) if owner else gm, leaf)


def _attention(gm: fx.GraphModule, mixes: list[fx.Node], ctx: PassContext) -> dict[str, int]:
    r = ctx.spec.residual
    sums: dict[tuple[int, ...], fx.Node] = {}
    adds = 0
    for node in mixes:
        (sources,) = node.args
        site = gm.get_submodule(node.target).site
        with gm.graph.inserting_before(node):
            stacked = []
            for src in source_plan(site, r.mode, r.block_size):
                if not src.sublayers:
                    stacked.append(sources[0])
                    continue
                key = src.sublayers
                if key not in sums:  # reuse the sum one sublayer shorter when it exists
                    shorter = sums.get(key[:-1])
                    if shorter is not None:
                        sums[key] = gm.graph.call_function(operator.add, (shorter, sources[1 + key[-1]]))
                        adds += 1
                    else:
                        sums[key] = _sum(gm.graph, [sources[1 + k] for k in key])
                        adds += len(key) - 1
                stacked.append(sums[key])
            stack = gm.graph.call_function(torch.stack, (stacked,))
        inline_call(gm, node, gm.get_submodule(node.target), node.target, (stack,), {}, method="mix")
    return {"sites": len(mixes), "adds": adds, "attn_res_modules": len(mixes)}


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    mixes = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), DEPTH_SITES)]
    before = set(gm.graph.nodes)
    stats = _plain(gm, mixes) if ctx.spec.residual.kind == "plain" else _attention(gm, mixes, ctx)
    for n in gm.graph.nodes:  # the sums and stacks between sublayers (emission keeps them at the top level)
        if n not in before and "origin" not in n.meta:
            n.meta["depth"] = "residual stream"
    return stats


PASS = GraphPass(
    name="attn_res",
    summary="wire plain residuals or block/full attention residuals in place of the generic depth mixes",
    preserves_numerics=True,
    statistics=("sites", "adds", "attn_res_modules"),
    run=run,
)
