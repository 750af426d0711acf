"""Inlining a module's traced graph in place of a node: how passes turn kept submodule calls into ops."""

from __future__ import annotations

import operator

from torch import fx, nn
from torch.utils import _pytree as pytree


class _Call(nn.Module):
    """Calls `m.<method>` on the tensors of a fixed argument structure and returns its outputs flattened."""

    def __init__(self, m: nn.Module, method: str, spec: pytree.TreeSpec, constants: dict[int, object]):
        super().__init__()
        self.m, self.method, self.spec, self.constants = m, method, spec, constants
        self.out_spec: pytree.TreeSpec | None = None  # the output's structure, known once traced

    def call_flat(self, tensors: tuple):
        it = iter(tensors)
        leaves = [self.constants[i] if i in self.constants else next(it) for i in range(self.spec.num_leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out, self.out_spec = pytree.tree_flatten(getattr(self.m, self.method)(*args, **kwargs))
        return tuple(out)


def _with_arity(n: int) -> type:
    """A _Call subclass whose forward takes exactly n tensors (fx gives *args a single placeholder)."""
    names = ", ".join(f"a{i}" for i in range(n))
    namespace: dict = {}
    exec(f"def forward(self, {names}):\n    return self.call_flat(({names}{',' if n == 1 else ''}))\n", namespace)
    return type(f"_Call{n}", (_Call,), {"forward": namespace["forward"]})


def attach(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    """Put `module` at dotted `path` in gm's module tree, creating empty parents as needed."""
    parent = gm
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(leaf, module)


def holder(module: nn.Module) -> nn.Module:
    """A plain module tree holding `module`'s own tensors: what a graph owns once the module is inlined.

    Passes may add or delete attributes on it without touching the model definition or other graphs.
    """
    h = nn.Module()
    for name, child in module.named_children():
        h.add_module(name, holder(child))
    for name, p in module._parameters.items():
        if p is not None:
            h.register_parameter(name, p)
    for name, b in module._buffers.items():
        if b is not None:
            h.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
    return h


def _structured(value):
    """`value` with nodes that build a NamedTuple (how fx records one passed to a kept call) as that NamedTuple."""
    if isinstance(value, fx.Node) and value.op == "call_function" and hasattr(value.target, "_fields"):
        return value.target(*(_structured(a) for a in value.args))
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_structured(v) for v in value)
    if isinstance(value, dict):
        return {k: _structured(v) for k, v in value.items()}
    return value


def _replacements(node: fx.Node, value, out: dict[fx.Node, fx.Node], dropped: list[fx.Node]) -> None:
    """Record what replaces `node` and each getitem chain on it (`value` has the call's structure); the
    getitems go to `dropped`, to be erased once nothing reads them."""
    if isinstance(value, fx.Node):
        out[node] = value
        return
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and user.args[0] is node:
            _replacements(user, value[user.args[1]], out, dropped)
            dropped.append(user)
        else:
            raise ValueError(f"{node.name}: a structured output is used other than by indexing")


def _fingerprint(m: nn.Module) -> tuple:
    """What a module's traced code can depend on: its class, plain attributes, tensor metadata, children."""
    plain = tuple((k, repr(v)) for k, v in sorted(vars(m).items()) if not k.startswith("_"))
    tensors = tuple(
        (kind, name, tuple(t.shape), t.dtype, t.device.type)
        for kind, table in (("p", m._parameters), ("b", m._buffers))
        for name, t in table.items()
        if t is not None
    )
    return (type(m), plain, tensors, tuple((n, _fingerprint(c)) for n, c in m._modules.items() if c is not None))


_TRACES: dict[tuple, tuple[fx.Graph, pytree.TreeSpec]] = {}
_TRACES_MAX = 256


def _traced(module: nn.Module, method: str, spec: pytree.TreeSpec, constants: dict, n_inputs: int):
    """(graph, output structure) of `module.<method>` traced flat; structurally identical modules called the
    same way (every layer of one kind) share one trace, whose get_attr targets are relative to the module."""
    from k3compile.ir.lower import FlatTracer  # lower imports the model; keep this file light

    try:
        key = (_fingerprint(module), method, spec, repr(sorted(constants.items())), n_inputs)
        hash(key)
    except TypeError:  # an unhashable constant: trace without caching
        key = None
    if key is not None and key in _TRACES:
        return _TRACES[key]
    call = _with_arity(n_inputs)(module, method, spec, constants)
    traced = (FlatTracer().trace(call), call.out_spec)
    if key is not None:
        if len(_TRACES) >= _TRACES_MAX:
            _TRACES.clear()
        _TRACES[key] = traced
    return traced


def inline_call(
    gm: fx.GraphModule, node: fx.Node, module: nn.Module, path: str, args: tuple, kwargs: dict, method: str = "forward"
) -> None:
    """Replace `node` by the ops of `module.<method>(*args, **kwargs)`; the module's parameters live at `path`.

    `args`/`kwargs` may hold graph nodes anywhere in their structure (lists, NamedTuples, dicts); the
    node's uses (getitem chains on a tuple output) are pointed at the matching inlined values.
    """
    inline_calls(gm, [(node, module, path, args, kwargs)], method)


def inline_calls(gm: fx.GraphModule, calls: list[tuple[fx.Node, nn.Module, str, tuple, dict]], method: str = "forward"):
    """`inline_call` for each (node, module, path, args, kwargs), each reader's arguments rewritten once at the
    end: a depth site reads every earlier layer's output, so rewriting it once per inlined layer was quadratic."""
    replace: dict[fx.Node, fx.Node] = {}
    dropped: list[fx.Node] = []
    for node, module, path, args, kwargs in calls:
        leaves, spec = pytree.tree_flatten(_structured((tuple(args), dict(kwargs))))
        constants = {i: v for i, v in enumerate(leaves) if not isinstance(v, fx.Node)}
        inputs = [v for v in leaves if isinstance(v, fx.Node)]
        sub, out_spec = _traced(module, method, spec, constants, len(inputs))
        attach(gm, path, holder(module))
        placeholders = [n for n in sub.nodes if n.op == "placeholder"]
        val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
        with gm.graph.inserting_before(node):
            flat = gm.graph.graph_copy(sub, val_map)
        for old, new in val_map.items():
            if old.op == "get_attr":
                new.target = f"{path}.{old.target.removeprefix('m.')}"
                new._rename(new.target.replace(".", "_"))  # readable generated code: layers_3_attn_q_proj_weight
            if old.op != "placeholder":
                new.meta["origin"] = path
        _replacements(node, pytree.tree_unflatten(list(flat), out_spec), replace, dropped)
        dropped.append(node)

    def final(n: fx.Node) -> fx.Node:  # an inlined value may itself be a replaced node (a call returning its input)
        while n in replace:
            n = replace[n]
        return n

    readers = dict.fromkeys(u for old in replace for u in old.users if u not in replace)
    for r in readers:
        r.args, r.kwargs = fx.map_arg((r.args, r.kwargs), lambda a: final(a) if a in replace else a)
    for old in dropped:  # inner getitems, then the ones they index, then the call
        gm.graph.erase_node(old)
