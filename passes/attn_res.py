"""attn_res: wire each depth site as a plain residual sum or as block/full attention residuals.

Lowering keeps every depth site (`layers.<i>.attn_res`, `layers.<i>.ffn_res`, `final_res`) as a call
on the list of all earlier sublayer outputs. Plain residuals become one running sum; attention
residuals become the sums their source plan names, shared between sites, stacked and mixed by
k3::attn_res with the site's own query and norm weight. On the CPU target the train and prefill graphs
normalise each source once: its 1/rms (k3::rms_inv) is computed where it is first read and shared by
every later site, which mixes with k3::attn_res_normed. The GPU kernel of k3::attn_res normalises in the
pass over a source that mixes it, and at decode (one token) the per-site op is cheaper than a second one.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.ir.inline import attach, holder, inline_call
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
    rinvs: dict[tuple[fx.Node, float], fx.Node] = {}  # (source, eps) -> its k3::rms_inv, made once
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
        if ctx.target == "cpu" and ctx.graph != "decode":
            _mix_normed(gm, node, stack, stacked, rinvs)
        else:
            inline_call(gm, node, gm.get_submodule(node.target), node.target, (stack,), {}, method="mix")
    return {"sites": len(mixes), "adds": adds, "attn_res_modules": len(mixes)}


def _mix_normed(gm: fx.GraphModule, node: fx.Node, stack: fx.Node, stacked: list[fx.Node], rinvs: dict) -> None:
    """Replace the site `node` by k3::attn_res_normed over `stack`, each source's k3::rms_inv made once."""
    path = node.target
    site = gm.get_submodule(path)
    eps = site.norm.eps
    with gm.graph.inserting_before(stack):
        for src in stacked:
            if (src, eps) not in rinvs:
                rinvs[src, eps] = gm.graph.call_function(torch.ops.k3.rms_inv.default, (src, eps))
    attach(gm, path, holder(site))
    with gm.graph.inserting_before(node):
        rinv = gm.graph.call_function(torch.stack, ([rinvs[src, eps] for src in stacked],))
        params = []
        for leaf in ("query", "norm.weight"):
            param = gm.graph.get_attr(f"{path}.{leaf}")
            param._rename(param.target.replace(".", "_"))
            param.meta["origin"] = path
            params.append(param)
        mixed = gm.graph.call_function(torch.ops.k3.attn_res_normed.default, (stack, rinv, *params))
    mixed.meta["origin"] = path
    node.replace_all_uses_with(mixed)
    gm.graph.erase_node(node)


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
