"""attn_res: wire each generic depth mix as a plain residual sum or as block/full attention residuals."""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.ir.generic_ops import DEPTH_MIX
from k3compile.ir.init import init_parameters
from k3compile.ir.inline import inline_module
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.modules.attn_res import AttnRes, source_plan


def site_path(site: int, num_layers: int) -> str:
    """Where the AttnRes of a site keeps its parameters: before attention, before the FFN, or final."""
    if site == 2 * num_layers:
        return "final_res"
    return f"layers.{site // 2}.{'attn_res' if site % 2 == 0 else 'ffn_res'}"


def _sum(graph: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    out = nodes[0]
    for n in nodes[1:]:
        out = graph.call_function(operator.add, (out, n))
    return out


def _plain(gm: fx.GraphModule, mixes: list[fx.Node]) -> dict[str, int]:
    running = None
    adds = 0
    for node in mixes:
        sources, site = node.args
        with gm.graph.inserting_before(node):
            if running is None:
                running = _sum(gm.graph, list(sources))
                adds += len(sources) - 1
            else:
                running = gm.graph.call_function(operator.add, (running, sources[-1]))
                adds += 1
        node.replace_all_uses_with(running)
        gm.graph.erase_node(node)
    return {"sites": len(mixes), "adds": adds, "attn_res_modules": 0}


def _attention(gm: fx.GraphModule, mixes: list[fx.Node], ctx: PassContext) -> dict[str, int]:
    spec = ctx.spec
    r = spec.residual
    device = next(gm.parameters()).device
    sums: dict[tuple[int, ...], fx.Node] = {}
    adds = 0
    for node in mixes:
        sources, site = node.args
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
        with torch.device(device):
            module = AttnRes(spec.hidden_size, spec.norm_eps)
        path = site_path(site, spec.num_layers)
        init_parameters(module, spec, path)
        inline_module(gm, node, module, path, stack)
    return {"sites": len(mixes), "adds": adds, "attn_res_modules": len(mixes)}


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    mixes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is DEPTH_MIX]
    if ctx.spec.residual.kind == "plain":
        return _plain(gm, mixes)
    return _attention(gm, mixes, ctx)


PASS = GraphPass(
    name="attn_res",
    summary="wire plain residuals or block/full attention residuals in place of the generic depth mixes",
    preserves_numerics=False,
    statistics=("sites", "adds", "attn_res_modules"),
    run=run,
)
