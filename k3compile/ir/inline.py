"""Inlining a module's traced graph in place of a node: how passes turn generic ops into layers."""

from __future__ import annotations

from torch import Tensor, fx, nn


class _FirstOutput(nn.Module):
    """Calls the wrapped module with fixed keyword arguments and keeps its first output (mixers return (y, state))."""

    def __init__(self, m: nn.Module, kwargs: dict):
        super().__init__()
        self.m = m
        self.kwargs = kwargs

    def forward(self, x: Tensor) -> Tensor:
        out = self.m(x, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def attach(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    """Put `module` at dotted `path` in gm's module tree, creating empty parents as needed."""
    parent = gm
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(leaf, module)


def inline_module(
    gm: fx.GraphModule, node: fx.Node, module: nn.Module, path: str, x: fx.Node, **kwargs
) -> fx.Node:
    """Replace `node` by the ops of `module(x, **kwargs)`; the module's parameters live at `path`."""
    from k3compile.ir.lower import FlatTracer  # lower imports the modules; keep this file light

    sub = FlatTracer().trace(_FirstOutput(module, kwargs))
    attach(gm, path, module)
    (placeholder,) = [n for n in sub.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = {placeholder: x}
    with gm.graph.inserting_before(node):
        out = gm.graph.graph_copy(sub, val_map)
    for old, new in val_map.items():
        if old.op == "get_attr":
            new.target = f"{path}.{old.target.removeprefix('m.')}"
            new._rename(new.target.replace(".", "_"))  # readable generated code: layers_3_attn_q_proj_weight
        if old.op != "placeholder":
            new.meta["origin"] = path
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return out
