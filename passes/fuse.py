"""fuse: pattern rewrites into fused ops that compute exactly what they replace.

Patterns: residual add + RMSNorm -> add_rms_norm; RMSNorm * sigmoid(gate) ->
rms_norm_gate; gate/up projections + SiTU-GLU or SwiGLU -> linear_glu; router
logits + scoring + selection bias + top-k -> linear_route; the routed experts'
stacked gate/up matmuls + GLU -> expert_glu and their down matmul ->
expert_matmul, each reading MXFP4 weights directly (mx_expert_glu,
mx_expert_matmul) when pack_mxfp4 left them packed. (KDA emits
k3::rms_norm_gate itself.)

CPU training graphs keep the GLU projections' matmuls (expert_matmul for the stacked ones) and apply
the activation with glu_train, which returns its derivatives for the backward: the fused GLU ops'
reference backwards recompute both projections and the activation, which on a CPU costs more than the
memory saved.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import k3compile.kernels.experts.op  # noqa: F401  (registers k3::expert_glu and friends)
import k3compile.kernels.fused.op  # noqa: F401  (registers k3::linear_glu)
import k3compile.kernels.glu_train.op  # noqa: F401  (registers k3::glu_train)
from k3compile.ir.pass_manager import GraphPass, PassContext

K3 = torch.ops.k3
ADDS = (operator.add, torch.add)
LINEARS = (F.linear, torch._C._nn.linear)
SIGMOIDS = (torch.sigmoid, F.sigmoid)
MATMULS = (torch.matmul, operator.matmul)
LAST_TWO = ((-1, -2), (-2, -1))


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _glu(act) -> tuple | None:
    """(gate, up, kind, beta1, beta2) of a k3 SiTU-GLU or SwiGLU node, None for anything else."""
    if _is(act, (K3.situ_glu.default,)):
        gate, up, b1, b2 = act.args
        return gate, up, "situ_glu", b1, b2
    if _is(act, (K3.swiglu.default,)):
        gate, up = act.args
        return gate, up, "swiglu", 0.0, 0.0
    return None


def _glus(gm: fx.GraphModule):
    """(node, gate, up, kind, beta1, beta2) of every k3 GLU node, over a snapshot of the graph."""
    for act in list(gm.graph.nodes):
        glu = _glu(act)
        if glu is not None:
            yield (act, *glu)


def _glu_train(gm: fx.GraphModule) -> int:
    """Every SiTU-GLU / SwiGLU -> k3::glu_train's first output (the activation saving its derivatives)."""
    count = 0
    for act, gate, up, kind, b1, b2 in _glus(gm):
        with gm.graph.inserting_before(act):
            fused = gm.graph.call_function(K3.glu_train.default, (gate, up, kind, b1, b2))
            value = gm.graph.call_function(operator.getitem, (fused, 0))
        if "val" in act.meta:  # the activation's shape, which the expert matmuls below it are matched by
            value.meta["val"] = act.meta["val"]
        act.replace_all_uses_with(value)
        gm.graph.erase_node(act)
        count += 1
    return count


def _fuse_add_rms_norm(gm: fx.GraphModule) -> int:
    count = 0
    for norm in list(gm.graph.nodes):
        if not _is(norm, (K3.rms_norm.default,)):
            continue
        s, w, eps = norm.args
        if not _is(s, ADDS) or len(s.args) != 2 or s.kwargs:
            continue
        a, b = s.args
        if not all(isinstance(t, fx.Node) for t in (a, b)):
            continue
        if isinstance(w, fx.Node) and w.op == "get_attr":
            s.prepend(w)  # the weight must exist where the fused op goes
        elif isinstance(w, fx.Node):
            continue
        with gm.graph.inserting_after(s):
            fused = gm.graph.call_function(K3.add_rms_norm.default, (a, b, w, eps))
        with gm.graph.inserting_after(fused):
            normed = gm.graph.call_function(operator.getitem, (fused, 0))
            total = gm.graph.call_function(operator.getitem, (fused, 1))
        norm.replace_all_uses_with(normed)
        gm.graph.erase_node(norm)
        s.replace_all_uses_with(total)
        gm.graph.erase_node(s)
        count += 1
    return count


def _fuse_rms_norm_gate(gm: fx.GraphModule) -> int:
    count = 0
    for mul in list(gm.graph.nodes):
        if not _is(mul, (operator.mul, torch.mul)) or len(mul.args) != 2:
            continue
        for norm, sig in (mul.args, mul.args[::-1]):
            if _is(norm, (K3.rms_norm.default,)) and _is(sig, SIGMOIDS) and len(norm.users) == 1 and len(sig.users) == 1:
                x, w, eps = norm.args
                with gm.graph.inserting_before(mul):
                    fused = gm.graph.call_function(K3.rms_norm_gate.default, (x, w, sig.args[0], eps))
                mul.replace_all_uses_with(fused)
                for dead in (mul, norm, sig):
                    gm.graph.erase_node(dead)
                count += 1
                break
    return count


def _fuse_linear_glu(gm: fx.GraphModule) -> int:
    count = 0
    for act, gate, up, kind, b1, b2 in _glus(gm):
        if not (_is(gate, LINEARS) and _is(up, LINEARS)) or len(gate.users) != 1 or len(up.users) != 1:
            continue
        if gate.args[0] is not up.args[0] or len(gate.args) > 2 and gate.args[2] is not None:
            continue
        if len(up.args) > 2 and up.args[2] is not None:
            continue
        with gm.graph.inserting_before(act):
            fused = gm.graph.call_function(K3.linear_glu.default, (gate.args[0], gate.args[1], up.args[1], kind, b1, b2))
        act.replace_all_uses_with(fused)
        for dead in (act, gate, up):
            gm.graph.erase_node(dead)
        count += 1
    return count


def _fuse_router(gm: fx.GraphModule) -> int:
    """Router logits (a linear used only by the router) + scoring + bias + top-k -> k3::linear_route."""
    count = 0
    for route in list(gm.graph.nodes):
        if not _is(route, (K3.moe_route.default,)):
            continue
        logits = route.args[0]
        if not _is(logits, LINEARS) or len(logits.users) != 1 or (len(logits.args) > 2 and logits.args[2] is not None):
            continue
        with gm.graph.inserting_before(route):
            fused = gm.graph.call_function(K3.linear_route.default, (logits.args[0], logits.args[1], *route.args[1:]))
        route.replace_all_uses_with(fused)
        gm.graph.erase_node(route)
        gm.graph.erase_node(logits)
        count += 1
    return count


def _rank_major(node) -> tuple | None:
    """(source, sizes) when `node` is shard_experts' rank-major view torch.unflatten(source, 0, sizes)."""
    if _is(node, (torch.unflatten,)) and len(node.args) == 3 and node.args[1] == 0 and not node.kwargs:
        return node.args[0], node.args[2]
    return None


def _stacked_weight(mm) -> tuple[fx.Node, tuple | None] | None:
    """(W, rank-major sizes or None) when `mm` is matmul(x, W.transpose(-1, -2)), optionally viewed rank-major
    ([ep, E/ep, ...]) after the transpose, with stacked weights W [E, out, in]: the routed experts' matmuls."""
    if not _is(mm, MATMULS) or len(mm.args) != 2 or len(mm.users) == 0:
        return None
    x, t = mm.args
    view = _rank_major(t)
    if view is not None:
        t, sizes = view
    if not (isinstance(t, fx.Node) and t.op == "call_method" and t.target == "transpose" and tuple(t.args[1:]) in LAST_TWO):
        return None
    w = t.args[0]
    x_val, w_val = x.meta.get("val") if isinstance(x, fx.Node) else None, w.meta.get("val")
    if x_val is None or w_val is None or w_val.dim() < 3 or x_val.dim() != w_val.dim() + (view is not None):
        return None
    return w, None if view is None else sizes


def _weight_operand(gm: fx.GraphModule, stacked: tuple) -> fx.Node:
    """The weight as the fused op reads it: W itself, or its rank-major view (made just after W)."""
    w, sizes = stacked
    if sizes is None:
        return w
    with gm.graph.inserting_after(w):
        return gm.graph.call_function(torch.unflatten, (w, 0, sizes))


def _erase_if_unused(gm: fx.GraphModule, *nodes) -> None:
    for node in nodes:
        if isinstance(node, fx.Node) and not node.users:
            inputs = list(node.all_input_nodes)
            gm.graph.erase_node(node)
            _erase_if_unused(gm, *(i for i in inputs if i.op == "call_method" or _rank_major(i) is not None))


def _fuse_experts(gm: fx.GraphModule) -> tuple[int, int]:
    """Stacked-weight gate/up matmuls + GLU -> k3::expert_glu; the remaining stacked matmuls -> k3::expert_matmul."""
    glu = 0
    for act, gate, up, kind, b1, b2 in _glus(gm):
        sg, su = _stacked_weight(gate), _stacked_weight(up)
        if sg is None or su is None or gate.args[0] is not up.args[0] or len(gate.users) != 1 or len(up.users) != 1:
            continue
        wg, wu = _weight_operand(gm, sg), _weight_operand(gm, su)
        with gm.graph.inserting_before(act):
            fused = gm.graph.call_function(K3.expert_glu.default, (gate.args[0], wg, wu, kind, b1, b2))
        act.replace_all_uses_with(fused)
        views = (gate.args[1], up.args[1])
        for dead in (act, gate, up):
            gm.graph.erase_node(dead)
        _erase_if_unused(gm, *views)
        glu += 1
    matmul = 0
    for mm in list(gm.graph.nodes):
        stacked = _stacked_weight(mm)
        if stacked is None:
            continue
        w = _weight_operand(gm, stacked)
        with gm.graph.inserting_before(mm):
            fused = gm.graph.call_function(K3.expert_matmul.default, (mm.args[0], w))
        mm.replace_all_uses_with(fused)
        view = mm.args[1]
        gm.graph.erase_node(mm)
        _erase_if_unused(gm, view)
        matmul += 1
    return glu, matmul


def _packed_e2m1(gm: fx.GraphModule, w) -> tuple | None:
    """(data, scale, block) when `w` is an MXFP4 dequantisation read only by the expert op, looking through
    the rank-major view (then data and scale get the same view)."""
    view = _rank_major(w) if isinstance(w, fx.Node) and len(w.users) == 1 else None
    deq = view[0] if view is not None else w
    if not _is(deq, (K3.mx_dequantize.default,)) or len(deq.users) != 1:
        return None
    data, scale, fmt, block = deq.args[:4]
    if fmt != "e2m1":
        return None
    if view is not None:
        with gm.graph.inserting_before(w):
            data, scale = (gm.graph.call_function(torch.unflatten, (t, 0, view[1])) for t in (data, scale))
    return data, scale, block


def _fuse_mx_experts(gm: fx.GraphModule) -> int:
    """expert_glu / expert_matmul over dequantised MXFP4 weights -> their MX forms, which dequantise in registers."""
    count = 0
    for node in list(gm.graph.nodes):
        if _is(node, (K3.expert_glu.default,)):
            x, wg, wu, kind, b1, b2 = node.args
            g = _packed_e2m1(gm, wg)
            u = _packed_e2m1(gm, wu) if g is not None else None
            if g is None or u is None or g[2] != u[2]:
                continue
            target, args, dead = K3.mx_expert_glu.default, (x, g[0], g[1], u[0], u[1], g[2], kind, b1, b2), (wg, wu)
        elif _is(node, (K3.expert_matmul.default,)):
            x, w = node.args
            packed = _packed_e2m1(gm, w)
            if packed is None:
                continue
            target, args, dead = K3.mx_expert_matmul.default, (x, *packed), (w,)
        else:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(target, args)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
        for d in dead:  # the view (if any), then the dequantisation
            inner = _rank_major(d)
            _erase_if_unused(gm, d)
            if inner is not None:
                _erase_if_unused(gm, inner[0])
        count += 1
    return count


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    glu_train = _glu_train(gm) if ctx.target == "cpu" and ctx.graph == "train" else 0
    expert_glu, expert_matmul = _fuse_experts(gm)
    stats = {
        "glu_train": glu_train,
        "add_rms_norm": _fuse_add_rms_norm(gm),
        "rms_norm_gate": _fuse_rms_norm_gate(gm),
        "linear_glu": _fuse_linear_glu(gm),
        "router": _fuse_router(gm),
        "expert_glu": expert_glu,
        "expert_matmul": expert_matmul,
        "mx_experts": _fuse_mx_experts(gm),
    }
    stats["nodes_rewritten"] = sum(stats.values())
    return stats


PASS = GraphPass(
    name="fuse",
    summary="rewrite add+RMSNorm, RMSNorm*sigmoid gate, gate/up+GLU (glu_train on CPU training graphs), router+top-k "
    "and expert GEMMs into fused ops",
    preserves_numerics=True,
    statistics=(
        "glu_train", "add_rms_norm", "rms_norm_gate", "linear_glu", "router", "expert_glu", "expert_matmul",
        "mx_experts", "nodes_rewritten",
    ),
    run=run,
)
