"""fuse: pattern rewrites into fused ops that compute exactly what they replace.

Patterns: residual add + RMSNorm -> add_rms_norm; RMSNorm * sigmoid(gate) ->
rms_norm_gate; gate/up projections + SiTU-GLU or SwiGLU -> linear_glu; router
logits + scoring + selection bias + top-k -> linear_route. (KDA emits
k3::rms_norm_gate itself.)
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import k3compile.ops.fused  # noqa: F401  (registers k3::linear_glu)
from k3compile.ir.pass_manager import GraphPass, PassContext

K3 = torch.ops.k3
ADDS = (operator.add, torch.add)
LINEARS = (F.linear, torch._C._nn.linear)
SIGMOIDS = (torch.sigmoid, F.sigmoid)


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


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
    for act in list(gm.graph.nodes):
        if _is(act, (K3.situ_glu.default,)):
            gate, up, b1, b2 = act.args
            kind = "situ_glu"
        elif _is(act, (K3.swiglu.default,)):
            (gate, up), b1, b2, kind = act.args, 0.0, 0.0, "swiglu"
        else:
            continue
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


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {
        "add_rms_norm": _fuse_add_rms_norm(gm),
        "rms_norm_gate": _fuse_rms_norm_gate(gm),
        "linear_glu": _fuse_linear_glu(gm),
        "router": _fuse_router(gm),
    }
    stats["nodes_rewritten"] = sum(stats.values())
    return stats


PASS = GraphPass(
    name="fuse",
    summary="rewrite add+RMSNorm, RMSNorm*sigmoid gate, gate/up+GLU and router+top-k into fused ops",
    preserves_numerics=True,
    statistics=("add_rms_norm", "rms_norm_gate", "linear_glu", "router", "nodes_rewritten"),
    run=run,
)
