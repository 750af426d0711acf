"""Graph verification after every pass: structure (lint, no dangling nodes) and shapes via fake tensors."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch import fx


class MetaShapeProp(fx.Interpreter):
    """Runs the graph on meta tensors (k3 ops through their fake impls), recording each node's value.

    Weights and inputs are replaced by meta tensors of the same shape and dtype, so this
    costs no memory and no arithmetic whatever the model size.
    """

    def fetch_attr(self, target: str):
        value = super().fetch_attr(target)
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        n.meta["val"] = result
        return result


class GraphVerificationError(Exception):
    """The graph is malformed: a dangling node, a bad reference, or a shape/type error."""


def is_impure(node: fx.Node) -> bool:
    """fx's purity, plus in-place tensor methods (`buf.add_(x)`: the MoE load statistics) as side effects."""
    return node.is_impure() or (node.op == "call_method" and node.target.endswith("_"))


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)


def _dangling(gm: fx.GraphModule) -> list[str]:
    return [
        n.name
        for n in gm.graph.nodes
        if not n.users and n.op not in ("output", "placeholder") and not is_impure(n)
    ]


def _has_attr(root: torch.nn.Module, target: str) -> bool:
    obj = root
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def verify_graph(gm: fx.GraphModule, example_inputs: tuple) -> None:
    """Lint the graph, reject dangling nodes, and propagate meta tensors to check every shape and dtype.

    `example_inputs` may be real or meta tensors; only their metadata is used. Each node's
    `meta['val']` holds its meta output afterwards (dumps print the shapes from it).
    """
    try:
        gm.graph.lint()
    except Exception as e:  # fx raises bare RuntimeError/AssertionError on malformed graphs
        raise GraphVerificationError(f"graph lint failed: {e}") from e
    dangling = _dangling(gm)
    if dangling:
        raise GraphVerificationError(f"dangling nodes (computed, never used): {', '.join(dangling[:5])}")
    for n in gm.graph.nodes:
        if n.op == "get_attr" and not _has_attr(gm, n.target):
            raise GraphVerificationError(f"node {n.name} reads missing attribute {n.target}")
    meta_inputs = pytree.tree_map_only(torch.Tensor, lambda x: x.to("meta"), list(example_inputs))
    try:
        with torch.no_grad():
            MetaShapeProp(gm).run(*meta_inputs)
    except Exception as e:
        raise GraphVerificationError(f"shape propagation failed: {type(e).__name__}: {e}".splitlines()[0]) from e


def format_graph(gm: fx.GraphModule) -> str:
    """Readable text of the graph, one node a line, with the inferred shape and dtype of each value."""
    lines = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            typ = f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
        elif isinstance(val, (tuple, list)):
            typ = "(" + ", ".join(
                f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)
                for v in val
            ) + ")"
        else:
            typ = ""
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        if hasattr(n.target, "_schema"):
            target = str(n.target._schema.name) + (f".{n.target._overloadname}" if getattr(n.target, "_overloadname", "default") != "default" else "")
        args = ", ".join(_fmt_arg(a) for a in n.args)
        kernel = n.meta.get("kernel")
        suffix = f"    # kernel: {kernel['impl']}" if kernel else ""
        lines.append(f"%{n.name}: {typ} = {n.op}[{target}]({args}){suffix}")
    return "\n".join(lines) + "\n"


def _fmt_arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    return repr(a)
