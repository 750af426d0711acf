"""routing: MoE routing by build mode.

Training keeps the spec's fixed per-expert capacity (static shapes, dropped
tokens counted) and the balancing statistics the trainer reads after each step.
Inference dispatches drop-free (capacity = tokens), so a served model never skips
an expert a token chose, and drops the statistics (their buffers stay, unused).
The decode graph computes only the experts each token picked: every (token, choice)
row runs its own expert, whose stacked weights are gathered by the routing indices
(`w[indices]` nodes marked `expert_gather`, which pack_mxfp4 turns into gathers of
the packed data and scales), and the rows, in (token, choice) order, combine with the
routing weights without a gather (`moe_combine` with no slots).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.passes.shard_experts import expert_region

DENSE = 0.0  # moe_dispatch's capacity_factor <= 0 means capacity = tokens
STATISTICS = (".router.load", ".router.dropped", ".router.qb_bias", ".router.qb_counts", ".router.aux_loss")


def _is_statistic_update(node: fx.Node) -> bool:
    if node.op != "call_method" or not node.target.endswith("_"):
        return False
    dest = node.args[0]
    return isinstance(dest, fx.Node) and dest.op == "get_attr" and dest.target.endswith(STATISTICS)


def _leading(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() >= 1 else None


def _through_views(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the stacked tensor, the transposes applied to it in order) behind an expert matmul's operand."""
    views = []
    while node.op == "call_method" and node.target == "transpose":
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def _gather_experts(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node, top_k: int) -> None:
    """Rewrite dispatch -> experts [E, C, w] -> combine into experts run on gathered weights, one row per choice."""
    g = gm.graph
    h, indices, num_experts, _ = dispatch.args
    buffer = next(u for u in dispatch.users if u.target is operator.getitem and u.args[1] == 0)
    region = expert_region(buffer, combine.args[0])
    inputs = dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in region and a is not buffer)
    with g.inserting_before(region[0]):
        flat = g.call_method("view", (indices, -1))  # (the router's fresh indices; flatten is two aten calls)
        # each token's row once per choice, [T * K, 1, w]: an expanded view reshaped (repeat_interleave's calls / 2)
        width = h.meta["val"].shape[-1]
        one = g.call_method("view", (h, -1, 1, width))
        rows = g.call_method("reshape", (g.call_method("expand", (one, -1, top_k, -1)), -1, 1, width))
        rows.meta["rows_of"] = h  # copies of h's rows: what is per row of h (pack_mxfp4's fake-quantise) goes before
    for w in (a for a in inputs if _leading(a) == num_experts):
        users = [u for u in w.users if u in region]
        source, views = _through_views(w)
        with g.inserting_before(users[0]):
            gathered = g.call_function(operator.getitem, (source, flat))  # w[flat]: fewer calls than index_select
            gathered.meta["expert_gather"] = "the experts each token picked"
            for v in views:  # the weight's views (its transpose) re-applied to the gathered experts
                gathered = g.call_method(v.target, (gathered, *v.args[1:]), dict(v.kwargs))
        for u in users:
            u.replace_input_with(w, gathered)
    for u in [u for u in buffer.users if u in region]:
        u.replace_input_with(buffer, rows)
    combine.update_arg(2, None)  # the rows are in (token, choice) order: no slots to gather by


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"dispatches": 0, "drop_free": 0, "statistics_removed": 0, "gathered": 0}
    if ctx.mode != "infer":
        stats["dispatches"] = sum(n.target is torch.ops.k3.moe_dispatch.default for n in gm.graph.nodes)
        return stats
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.k3.moe_dispatch.default:
            node.update_arg(3, DENSE)
            stats["dispatches"] += 1
            stats["drop_free"] += 1
        elif node.op == "call_function" and node.target is torch.ops.k3.attach_aux_loss.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif _is_statistic_update(node):
            dest = node.args[0]
            gm.graph.erase_node(node)
            if not dest.users:
                gm.graph.erase_node(dest)
                owner, _, leaf = dest.target.rpartition(".")
                delattr(gm.get_submodule(owner), leaf)
            stats["statistics_removed"] += 1
    if ctx.graph == "decode" and not gm.meta.get("expert_parallel"):
        for combine in [n for n in gm.graph.nodes if n.target is torch.ops.k3.moe_combine.default]:
            _gather_experts(gm, combine.args[2].args[0], combine, ctx.spec.moe.top_k)
            stats["gathered"] += 1
    return stats


PASS = GraphPass(
    name="routing",
    summary="training: fixed expert capacity and balancing statistics; inference: drop-free, no statistics; "
    "decode: only the experts each token picked",
    preserves_numerics=False,
    statistics=("dispatches", "drop_free", "statistics_removed", "gathered"),
    run=run,
    mode_dependent=True,
)
