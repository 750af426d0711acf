"""merge_projections: in the decode graph, the projections of one input become one matmul over stacked weights.

Decoding one token per sequence makes every projection a thin matmul whose calls, not its arithmetic,
cost: a KDA layer reads its normalised input through six (q, k, v, the decay's down projection, beta,
the output gate), Gated MLA through three (q_a, kv_a, the output gate), LatentMoE through the latent
down projection and the shared experts' gate/up (`linear_glu`). Each such group becomes one matmul over
the transpose of a buffer stacking the members' weights by rows (`<owner>.merged_proj`, held as its
[in, out] view), split back into the members' outputs; a `linear_glu` member keeps its activation as
`situ_glu` / `swiglu`. A projection alone on its input is a group of one: `torch.mm` on the held
transpose is three aten calls where `F.linear` is eight (eleven on a 3-D input). Consecutive members each
read by a short convolution of the same width (KDA's q, k, v) stay one piece of the product, convolved once
over their channels. The emitted InferenceModel holds each member weight as a view of its rows of that
buffer (`MERGED`), so no weight is held twice and parameter names and checkpoints are unchanged. Prefill and training keep one matmul per
weight: there the matmuls are compute-bound and their separate outputs are contiguous.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import k3compile.kernels.activations.op  # noqa: F401  (registers k3::situ_glu and k3::swiglu)
import k3compile.kernels.fused.op  # noqa: F401  (registers k3::linear_glu)
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


def _groups(gm: fx.GraphModule, params: dict, order: dict) -> list[tuple[fx.Node, list]]:
    """(input, [(projection, its weights)]) for each input and weight dtype and width its projections read;
    projections in graph order."""
    out = []
    for x in gm.graph.nodes:
        members = [(u, ws) for u in x.users if u.args[0] is x and (ws := _weights(u, params)) is not None]
        by_kind: dict[tuple, list] = {}
        for u, ws in members:
            p = params[ws[0].target]
            if all(params[w.target].dtype == p.dtype and params[w.target].shape[1] == p.shape[1] for w in ws):
                by_kind.setdefault((p.dtype, p.shape[1]), []).append((u, ws))
        out += [(x, sorted(group, key=lambda m: order[m[0]])) for group in by_kind.values()]
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


def _reshaped(x: fx.Node) -> fx.Node | None:
    """What x reshapes, if x is only a reshape to explicit sizes for this matmul (KDA's o_proj input), else None."""
    if x.op == "call_method" and x.target in ("view", "reshape") and len(x.users) == 1 and len(x.args) > 2:
        return x.args[0] if isinstance(x.args[0], fx.Node) and "val" in x.args[0].meta else None
    return None


def _rows_view(g: fx.Graph, x: fx.Node, width: int) -> fx.Node:
    """x [N, width] as one view (a reshape where the strides do not fold)."""
    try:
        x.meta["val"].view(-1, width)
        flatten = "view"
    except RuntimeError:  # strides that do not fold: a copy
        flatten = "reshape"
    return g.call_method(flatten, (x, -1, width))


def _matmul(g: fx.Graph, x: fx.Node, w_t: fx.Node, n: int, rows_ok: bool) -> fx.Node:
    """x @ w_t with the fewest aten calls: `torch.mm` on a 2-D x; a 3-D x (a decode step's [B, 1, D]) is viewed
    as rows (what it reshapes, when it is only a reshape) and the product viewed back (five calls where
    `torch.matmul` is seven), or left as rows when `rows_ok` (its one reader reshapes it anyway); others
    `torch.matmul`."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() not in (2, 3):
        return g.call_function(torch.matmul, (x, w_t))
    if val.dim() == 2:
        return g.call_function(torch.mm, (x, w_t))
    source = _reshaped(x)
    y = g.call_function(torch.mm, (_rows_view(g, source if source is not None else x, val.shape[-1]), w_t))
    if rows_ok:
        return y
    if source is not None:  # the reshape's own sizes, the last one n
        return g.call_method("view", (y, *x.args[1:-1], n))
    if all(isinstance(d, int) for d in val.shape[1:-1]):  # the decode graph's one token: [B, 1, n]
        return g.call_method("view", (y, -1, *val.shape[1:-1], n))
    lead = g.call_function(operator.getitem, (g.call_function(getattr, (x, "shape")), slice(None, -1)))
    return g.call_method("view", (y, g.call_function(operator.add, (lead, (n,)))))


def _conv_of(node: fx.Node, tensors: dict) -> fx.Node | None:
    """The short convolution with a state that is `node`'s one user (KDA's q, k, v), else None."""
    (u,) = node.users if len(node.users) == 1 else (None,)
    if u is None or u.target is not K3.short_conv.default or u.args[0] is not node:
        return None
    w, state = u.args[1], u.args[2]
    ok = isinstance(w, fx.Node) and w.op == "get_attr" and w.target in tensors and _input_only(state)
    return u if ok and all(v.target is operator.getitem for v in u.users) else None


def _input_only(node) -> bool:
    """A node computed from the graph's inputs alone (a cache read): it can move up to where it is needed."""
    return isinstance(node, fx.Node) and all(a.op == "placeholder" for a in node.all_input_nodes)


def _pieces(convs: list[fx.Node | None], tensors: dict) -> list[list[int]]:
    """The merged product's pieces, as weight indices: one per weight, but runs of two or more consecutive
    projections each read by a short convolution of the same width are one (one convolution, their channels)."""
    width = [c and tensors[c.args[1].target].shape[1] for c in convs]
    pieces: list[list[int]] = []
    for i, c in enumerate(convs):
        if c is not None and pieces and convs[pieces[-1][-1]] is not None and width[pieces[-1][-1]] == width[i]:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return pieces


def _merged_conv(g: fx.Graph, x: fx.Node, convs: list[fx.Node], sizes: list[int], order: dict) -> None:
    """One short convolution over x, the channels of `convs` side by side: their weights and states are stacked
    (two cats), the output and the new state split back into theirs. `order`: the graph's nodes' positions."""
    for a in sorted({a for c in convs for a in c.args[1:3]}, key=order.get):  # weights, cache reads (_input_only)
        if order[a] > order[convs[0]]:
            convs[0].prepend(a)
    weight = g.call_function(torch.cat, ([c.args[1] for c in convs],))
    state = g.call_function(torch.cat, ([c.args[2] for c in convs],), {"dim": 1})
    both = g.call_function(K3.short_conv.default, (x, weight, state), dict(convs[0].kwargs))
    outs = [g.call_method("split", (g.call_function(operator.getitem, (both, k)), sizes), {"dim": d})
            for k, d in ((0, -1), (1, 1))]  # fmt: skip
    pieces = {(v, j): g.call_function(operator.getitem, (outs[v.args[1]], j))
              for j, c in enumerate(convs) for v in c.users}  # fmt: skip
    for (v, _), piece in pieces.items():  # (all made first: the insertion point is convs[0], erased below)
        v.replace_all_uses_with(piece)
        g.erase_node(v)
    for c in convs:
        g.erase_node(c)


def _merge(gm: fx.GraphModule, x: fx.Node, group: list, params: dict, merged: dict, replaced: dict,
           tensors: dict, order: dict) -> int:
    """Merge one group; each projection it erases goes into `replaced` with the node now computing its value.
    `tensors`: every parameter by name; `order`: the nodes' positions before the pass (the conv merge moves
    only a layer's own weight and cache reads, up to its first convolution)."""
    weights = [w.target for _, ws in group for w in ws]
    owner = _owner(weights)
    holder = gm.get_submodule(owner)
    leaf, k = BUFFER, 1
    while hasattr(holder, leaf):
        leaf, k = f"{BUFFER}_{k}", k + 1
    name = f"{owner}.{leaf}" if owner else leaf
    holder.register_buffer(leaf, torch.cat([params[w].detach() for w in weights]).t(), persistent=False)
    merged[name] = weights
    sizes = [params[w].shape[0] for w in weights]
    members = [node if len(ws) == 1 else None for node, ws in group for _ in ws]  # per weight: a lone linear's node
    convs = [m and _conv_of(m, tensors) for m in members]
    pieces = _pieces(convs, tensors)
    first = group[0][0]
    g = gm.graph
    outs: list[fx.Node | None] = [None] * len(weights)
    with g.inserting_before(first):
        lone = group[0][0] if len(weights) == 1 else None  # a projection alone: its reader may take rows
        rows_ok = lone is not None and len(lone.users) == 1 and all(
            u.op == "call_method" and u.target in ("view", "reshape") and u.args[0] is lone for u in lone.users)
        y = _matmul(g, x, g.get_attr(name), sum(sizes), rows_ok)
        if rows_ok and (reader := next(iter(lone.users))).target == "reshape":
            reader.target = "view"  # of the matmul's fresh rows: one call, not two
        widths = [sum(sizes[i] for i in piece) for piece in pieces]
        parts = [y] if len(widths) == 1 else [
            g.call_function(operator.getitem, (split, i))
            for split in [g.call_method("split", (y, widths), {"dim": -1})] for i in range(len(widths))]  # fmt: skip
        for piece, part in zip(pieces, parts):
            if len(piece) == 1:
                outs[piece[0]] = part
            else:
                with g.inserting_before(convs[piece[0]]):
                    _merged_conv(g, part, [convs[i] for i in piece], [sizes[i] for i in piece], order)
    i = 0
    for node, ws in group:
        if len(ws) == 1:
            if node.users:  # (a member whose convolution was merged has none left)
                outs[i].meta.update(node.meta)  # the same value: its shape tells a later group's matmul its rank
                node.replace_all_uses_with(outs[i])
                replaced[node] = outs[i]
        else:
            _, _, _, kind, b1, b2 = node.args
            gate, up = outs[i], outs[i + 1]
            with g.inserting_before(node):
                act = (g.call_function(K3.situ_glu.default, (gate, up, b1, b2)) if kind == "situ_glu"
                       else g.call_function(K3.swiglu.default, (gate, up)))  # fmt: skip
            act.meta.update(node.meta)
            node.replace_all_uses_with(act)
            replaced[node] = act
        g.erase_node(node)
        i += len(ws)
    return len(weights)


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"groups": 0, "weights_merged": 0}
    if ctx.graph != "decode":
        return stats
    params = {n: p for n, p in gm.named_parameters() if not keeps_fp32(ctx.spec, n)}  # those stay fp32 under casts
    merged, replaced = dict(gm.meta.get("merged", {})), {}
    tensors, order = dict(gm.named_parameters()), {n: i for i, n in enumerate(gm.graph.nodes)}
    for x, group in _groups(gm, params, order):  # an input may be a projection merged before (f_down feeds f_up)
        stats["weights_merged"] += _merge(gm, replaced.get(x, x), group, params, merged, replaced, tensors, order)
        stats["groups"] += 1
    gm.meta["merged"] = merged
    return stats


PASS = GraphPass(
    name="merge_projections",
    summary="decode: projections of one input -> one matmul over their stacked, transposed weights (held once)",
    preserves_numerics=True,
    statistics=("groups", "weights_merged"),
    run=run,
)
