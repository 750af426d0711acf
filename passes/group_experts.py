"""group_experts: CPU training graphs run the routed experts on the rows they hold, not their capacity buffers.

The train graph keeps the spec's expert capacity C (static shapes, the same choices dropped), so each expert's
buffer [E, C, w] is padded with zero rows wherever an expert got fewer than C tokens: at a capacity factor of
1.5 a third of every expert GEMM, of its fake quantisation and of its activation works on zeros, forward and
backward. Here the dispatch becomes `moe_dispatch_rows` (the kept (token, choice) rows sorted by expert, T*K
of them), each `expert_matmul` an `expert_rows_matmul` over each expert's own rows, and the combine reads the
rows as one [1, T*K, w] buffer; the rows an expert holds are the same and every op between is row-wise, so
every kept token's numbers are the capacity path's. The buffer's activation fake quantisation (blocks along
its rows, zero for a zero row) moves before the dispatch, onto the T token rows instead of T*K.
Only where every op between dispatch and combine is one of those row-wise ops; GPU targets keep the grouped
Triton kernels over the buffers, inference graphs their drop-free dispatch, expert parallelism its exchanges.
Then each expert FFN chain on the rows (gate and up expert_rows_matmul, glu_train, the activation's fake
quantisation, the down expert_rows_matmul) becomes one `expert_rows_ffn`, which runs a few experts at a time
through the whole chain while their rows are in cache, with the chain's numbers.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import k3compile.kernels.experts.op  # noqa: F401  (registers k3::expert_rows_matmul, k3::expert_rows_ffn)
import k3compile.kernels.moe.op  # noqa: F401  (registers k3::moe_dispatch_rows)
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.passes.shard_experts import expert_region

K3 = torch.ops.k3
ROW_WISE = (K3.glu_train.default, K3.mx_fake_quantize.default, operator.getitem)


def _is(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def _groupable(region: list[fx.Node], buffer: fx.Node, num_experts: int, combine: fx.Node) -> bool:
    """Every node row-wise and read only inside the region (or by the combine), and every expert matmul of the
    buffer or a value made from it by stacked weights of the E experts from outside."""
    inside = {*region, buffer}
    for n in region:
        if any(u not in inside and u is not combine for u in n.users):
            return False
        if _is(n, K3.expert_matmul.default):
            x, w = n.args
            val = w.meta.get("val") if isinstance(w, fx.Node) else None
            if x not in inside or w in inside or val is None or val.dim() != 3 or val.shape[0] != num_experts:
                return False
        elif not (n.op == "call_function" and n.target in ROW_WISE):
            return False
    return True


NEW_INDEX = {0: 0, 1: 1, 2: 3, 3: 4}  # moe_dispatch's (buffer, slots, load, dropped) in moe_dispatch_rows' outputs


def _group(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node) -> bool:
    g = gm.graph
    x, indices, num_experts, capacity_factor = dispatch.args
    outs = {u.args[1]: u for u in dispatch.users if _is(u, operator.getitem)}
    buffer = outs.get(0)
    if buffer is None or len(outs) != len(dispatch.users):
        return False
    region = expert_region(buffer, combine.args[0])
    if not region or not _groupable(region, buffer, num_experts, combine) or any(u not in region for u in buffer.users):
        return False
    users = list(buffer.users)
    hoist = users[0] if len(users) == 1 and _is(users[0], K3.mx_fake_quantize.default) else None
    with g.inserting_before(dispatch):
        if hoist is not None:  # row-wise blocks, and fq(0) = 0: quantising the tokens quantises their rows
            x = g.call_function(K3.mx_fake_quantize.default, (x, *hoist.args[1:]), dict(hoist.kwargs))
        grouped = g.call_function(K3.moe_dispatch_rows.default, (x, indices, num_experts, capacity_factor),
                                  dict(dispatch.kwargs))
        counts = g.call_function(operator.getitem, (grouped, 2))
    rows = None
    for i, u in outs.items():
        with g.inserting_before(u):
            new = g.call_function(operator.getitem, (grouped, NEW_INDEX[i]))
        rows = new if i == 0 else rows
        u.replace_all_uses_with(new)
        g.erase_node(u)
    if hoist is not None:
        hoist.replace_all_uses_with(rows)
        g.erase_node(hoist)
    for n in region:
        if _is(n, K3.expert_matmul.default):
            with g.inserting_before(n):
                new = g.call_function(K3.expert_rows_matmul.default, (*n.args, counts), dict(n.kwargs))
            n.replace_all_uses_with(new)
            g.erase_node(n)
    with g.inserting_before(combine):
        as_buffer = g.call_method("unsqueeze", (combine.args[0], 0))  # [1, T*K, w]: one buffer, slot = row
    combine.update_arg(0, as_buffer)
    g.erase_node(dispatch)
    return True


def _sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _fuse_ffn(g: fx.Graph, gate: fx.Node) -> bool:
    """gate = expert_rows_matmul(x, Wg, counts) at the head of gate/up -> glu_train -> [mx_fake_quantize] -> down:
    the chain becomes k3::expert_rows_ffn, when nothing else reads its intermediates."""
    glu = _sole_user(gate)
    if glu is None or not _is(glu, K3.glu_train.default) or glu.args[0] is not gate or glu.kwargs:
        return False
    up, kind, b1, b2 = glu.args[1:]
    x, _, counts = gate.args
    if not _is(up, K3.expert_rows_matmul.default) or up.args[0] is not x or up.args[2] is not counts:
        return False
    act = _sole_user(glu)
    if _sole_user(up) is not glu or act is None or not _is(act, operator.getitem) or act.args[1] != 0:
        return False
    quant, fmt, block = None, None, 0  # block: unused without a quantisation
    down = _sole_user(act)
    if down is not None and _is(down, K3.mx_fake_quantize.default) and not down.kwargs:
        quant, (fmt, block) = down, down.args[1:]
        down = _sole_user(quant)
    if down is None or not _is(down, K3.expert_rows_matmul.default) or down.args[2] is not counts or down.kwargs:
        return False
    with g.inserting_before(down):
        ffn = g.call_function(K3.expert_rows_ffn.default,
                              (x, gate.args[1], up.args[1], down.args[1], counts, kind, b1, b2, fmt, block))
        out = g.call_function(operator.getitem, (ffn, 0))
    out.meta.update(down.meta)
    down.replace_all_uses_with(out)
    for dead in (down, quant, act, glu, up, gate):
        if dead is not None:
            g.erase_node(dead)
    return True


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"grouped": 0, "ffn": 0}
    if ctx.target != "cpu" or ctx.graph != "train" or gm.meta.get("expert_parallel"):
        return stats
    for combine in [n for n in gm.graph.nodes if _is(n, K3.moe_combine.default)]:
        slots = combine.args[2]
        dispatch = slots.args[0] if isinstance(slots, fx.Node) and _is(slots, operator.getitem) else None
        if dispatch is not None and _is(dispatch, K3.moe_dispatch.default) and _group(gm, dispatch, combine):
            stats["grouped"] += 1
    for gate in [n for n in gm.graph.nodes if _is(n, K3.expert_rows_matmul.default)]:
        if _fuse_ffn(gm.graph, gate):  # a member of a chain fused before has no users left: skipped
            stats["ffn"] += 1
    return stats


PASS = GraphPass(
    name="group_experts",
    summary="CPU training: the routed experts run on the rows each holds (sorted by expert), not on zero-padded "
    "capacity buffers, each expert FFN as one op",
    preserves_numerics=True,
    statistics=("grouped", "ffn"),
    run=run,
)
