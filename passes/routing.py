"""routing: MoE routing by build mode.

Training keeps the spec's fixed per-expert capacity (static shapes, dropped
tokens counted) and the balancing statistics the trainer reads after each step.
Inference dispatches drop-free (capacity = tokens), so a served model never skips
an expert a token chose, and drops the statistics (their buffers stay, unused).
"""

from __future__ import annotations

import torch
from torch import fx

from k3compile.ir.pass_manager import GraphPass, PassContext

DENSE = 0.0  # moe_dispatch's capacity_factor <= 0 means capacity = tokens
STATISTICS = (".router.load", ".router.dropped", ".router.qb_bias", ".router.qb_counts", ".router.aux_loss")


def _is_statistic_update(node: fx.Node) -> bool:
    if node.op != "call_method" or not node.target.endswith("_"):
        return False
    dest = node.args[0]
    return isinstance(dest, fx.Node) and dest.op == "get_attr" and dest.target.endswith(STATISTICS)


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"dispatches": 0, "drop_free": 0, "statistics_removed": 0}
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
    return stats


PASS = GraphPass(
    name="routing",
    summary="training: fixed expert capacity and balancing statistics; inference: drop-free, no statistics",
    preserves_numerics=False,
    statistics=("dispatches", "drop_free", "statistics_removed"),
    run=run,
    mode_dependent=True,
)
