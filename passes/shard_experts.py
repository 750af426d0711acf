"""shard_experts: split each MoE's expert computation across `parallel.ep` expert-parallel ranks.

Rank r owns experts [r E/ep, (r+1) E/ep). In every graph (train, prefill, decode) the dispatched
fixed-capacity buffer [E, C, w] goes through `to_expert_owners` (an autograd all-to-all to the owning ranks,
equal static splits), the rank's own E/ep experts run on what every rank sent them, and `from_expert_owners`
brings the outputs back to [E, C, w] for the combine; the emitted Model and InferenceModel then hold only
their E/ep experts (k3compile.runtime.generated). In one process (no expert-parallel group) both exchanges
are the identity and the package holds every expert. Shapes stay static and the numbers are unchanged.
A no-op at ep = 1.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.ops.expert_parallel import from_expert_owners, to_expert_owners

K3 = torch.ops.k3


def _is(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def expert_region(buffer: fx.Node, expert_out: fx.Node) -> list[fx.Node]:
    """Nodes between the dispatched buffer and the expert outputs, in graph order."""
    down: set[fx.Node] = set()  # what the buffer reaches, up to the expert outputs (not the rest of the graph)
    stack = [buffer]
    while stack:
        for u in stack.pop().users:
            if u not in down and u <= expert_out:
                down.add(u)
                stack.append(u)
    region: set[fx.Node] = set()
    stack = [expert_out]
    while stack:
        n = stack.pop()
        if n in down and n not in region:
            region.add(n)
            stack.extend(a for a in n.all_input_nodes)
    return sorted(region)  # fx nodes order as in the graph


def _exchange(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node) -> int:
    """buffer -> to_expert_owners -> local experts -> from_expert_owners -> combine."""
    buffer = next(u for u in dispatch.users if _is(u, operator.getitem) and u.args[1] == 0)
    expert_out = combine.args[0]
    region = expert_region(buffer, expert_out)
    users = [u for u in buffer.users if u in region]
    with gm.graph.inserting_after(buffer):
        sent = gm.graph.call_function(to_expert_owners, (buffer,))
    sent.meta["expert_parallel"] = "all-to-all to the expert owners [E/ep, ep C, w]"
    for u in users:
        u.replace_input_with(buffer, sent)
    with gm.graph.inserting_before(combine):
        back = gm.graph.call_function(from_expert_owners, (expert_out,))
    back.meta["expert_parallel"] = "all-to-all back from the expert owners [E, C, w]"
    combine.replace_input_with(expert_out, back)
    for n in region:
        n.meta["expert_parallel"] = "local experts"
    return 2


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    ep = ctx.spec.parallel.ep
    stats = {"moe_layers": 0, "ranks": ep, "experts_per_rank": 0, "nodes_rewritten": 0}
    if ep == 1 or ctx.spec.moe is None:
        return stats
    plan = {}
    for combine in [n for n in gm.graph.nodes if _is(n, K3.moe_combine.default)]:
        slots = combine.args[2]
        dispatch = slots.args[0]
        stats["nodes_rewritten"] += _exchange(gm, dispatch, combine)
        stats["moe_layers"] += 1
        per_rank = dispatch.args[2] // ep
        plan[dispatch.name] = {r: [r * per_rank, (r + 1) * per_rank] for r in range(ep)}
        stats["experts_per_rank"] = per_rank
    gm.meta["expert_parallel"] = plan
    return stats


PASS = GraphPass(
    name="shard_experts",
    summary="assign experts to expert-parallel ranks: dispatch, per-rank local experts, combine (no-op at ep=1)",
    preserves_numerics=True,
    statistics=("moe_layers", "ranks", "experts_per_rank", "nodes_rewritten"),
    run=run,
)
