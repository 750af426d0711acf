"""merge_projections: in the decode graph, the projections of one input become one matmul over stacked weights.

Decoding one token per sequence makes every projection a thin matmul whose calls, not its arithmetic,
cost: a KDA layer reads its normalised input through six (q, k, v, the decay's down projection, beta,
the output gate), Gated MLA through three (q_a, kv_a, the output gate), LatentMoE through the latent
down projection and the shared experts' gate/up (`linear_glu`). Each such group becomes one linear over
a buffer stacking the members' weights by rows (`<owner>.merged_proj`), split back into the members'
outputs; a `linear_glu` member keeps its activation as `situ_glu` / `swiglu`. The emitted InferenceModel
holds each member weight as a view of its rows of that buffer (`MERGED`), so no weight is held twice and
parameter names and checkpoints are unchanged. Prefill and training keep one matmul per weight: there the
matmuls are compute-bound and their separate outputs are contiguous.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import k3compile.ops.activations  # noqa: F401  (registers k3::situ_glu and k3::swiglu)
import k3compile.ops.fused  # noqa: F401  (registers k3::linear_glu)
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.spec.weights import keeps_fp32

K3 = torch.ops.k3
LINEARS = (F.linear, torch._C._nn.linear)
BUFFER = "merged_proj"


def _weights(node: fx.Node, params: dict) -> list[fx.Node] | None:
    """The weight nodes a mergeable projection reads (a bias-free linear, or linear_glu's gate and up), else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target in LINEARS and len(node.args) in (2, 3) and (len(node.args) == 2 or node.args[2] is None):
        ws = [node.args[1]]
    elif node.target is K3.linear_glu.default:
        ws = [node.args[1], node.args[2]]
    else:
        return None
    ok = all(isinstance(w, fx.Node) and w.op == "get_attr" and w.target in params and params[w.target].dim() == 2
             for w in ws)  # fmt: skip
    return ws if ok else None


def _groups(gm: fx.GraphModule, params: dict) -> list[tuple[fx.Node, list[tuple[fx.Node, list[fx.Node]]]]]:
    """(input, [(projection, its weights)]) for each input read by two or more projections whose weights share
    a dtype and width; projections in graph order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for x in gm.graph.nodes:
        members = [(u, ws) for u in x.users if u.args[0] is x and (ws := _weights(u, params)) is not None]
        by_kind: dict[tuple, list] = {}
        for u, ws in members:
            p = params[ws[0].target]
            if all(params[w.target].dtype == p.dtype and params[w.target].shape[1] == p.shape[1] for w in ws):
                by_kind.setdefault((p.dtype, p.shape[1]), []).append((u, ws))
        out += [(x, sorted(group, key=lambda m: order[m[0]])) for group in by_kind.values() if len(group) >= 2]
    return out


def _owner(names: list[str]) -> str:
    """The deepest module holding every weight in `names` ('layers.3.attn' for its q_proj.weight and k_proj.weight)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _merge(gm: fx.GraphModule, x: fx.Node, group: list, params: dict, merged: dict) -> int:
    weights = [w.target for _, ws in group for w in ws]
    owner = _owner(weights)
    holder = gm.get_submodule(owner)
    leaf, k = BUFFER, 1
    while hasattr(holder, leaf):
        leaf, k = f"{BUFFER}_{k}", k + 1
    name = f"{owner}.{leaf}" if owner else leaf
    holder.register_buffer(leaf, torch.cat([params[w].detach() for w in weights]), persistent=False)
    merged[name] = weights
    sizes = [params[w].shape[0] for w in weights]
    first = group[0][0]
    g = gm.graph
    with g.inserting_before(first):
        stacked = g.get_attr(name)
        y = g.call_function(torch._C._nn.linear, (x, stacked))
        parts = g.call_method("split", (y, sizes), {"dim": -1})
        outs = [g.call_function(operator.getitem, (parts, i)) for i in range(len(sizes))]
    i = 0
    for node, ws in group:
        if len(ws) == 1:
            node.replace_all_uses_with(outs[i])
        else:
            _, _, _, kind, b1, b2 = node.args
            gate, up = outs[i], outs[i + 1]
            with g.inserting_before(node):
                act = (g.call_function(K3.situ_glu.default, (gate, up, b1, b2)) if kind == "situ_glu"
                       else g.call_function(K3.swiglu.default, (gate, up)))  # fmt: skip
            node.replace_all_uses_with(act)
        g.erase_node(node)
        i += len(ws)
    return len(weights)


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"groups": 0, "weights_merged": 0}
    if ctx.graph != "decode":
        return stats
    params = {n: p for n, p in gm.named_parameters() if not keeps_fp32(ctx.spec, n)}  # those stay fp32 under casts
    merged = dict(gm.meta.get("merged", {}))
    for x, group in _groups(gm, params):
        stats["weights_merged"] += _merge(gm, x, group, params, merged)
        stats["groups"] += 1
    gm.meta["merged"] = merged
    return stats


PASS = GraphPass(
    name="merge_projections",
    summary="decode: projections of one input -> one matmul over their stacked weights (held once, as views)",
    preserves_numerics=True,
    statistics=("groups", "weights_merged"),
    run=run,
)
