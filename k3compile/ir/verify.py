"""Graph verification after every pass: structure (lint, no dangling nodes) and shapes via meta tensors.

Between passes the shape check may be incremental (`reuse=True`): a node keeps its recorded value when
its operation and arguments are those it was computed from and no input's shape, stride or dtype changed,
so a pass that rewrites a few nodes re-propagates only those and what their new shapes reach.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree
from torch import fx

from k3compile.kernels._common.registry import BACKEND_FREE, FAKES


class MetaShapeProp(fx.Interpreter):
    """Runs the graph on meta tensors (k3 ops through their fake impls), recording each node's value.

    Weights and inputs are replaced by meta tensors of the same shape and dtype, so this
    costs no memory and no arithmetic whatever the model size. `run_incremental` recomputes only
    the nodes that changed since the last run (see the module docstring).
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)  # meta values cost nothing to keep
        self.modules_by_name = dict(gm.named_modules(remove_duplicate=False))

    def raw_attr(self, target: str):
        """The object a get_attr reads, its owner found in one table (not attribute by attribute)."""
        owner, _, leaf = target.rpartition(".")
        module = self.modules_by_name.get(owner)
        if module is not None:
            try:
                return getattr(module, leaf)
            except AttributeError:
                pass
        raise GraphVerificationError(f"a get_attr reads missing attribute {target}")

    def fetch_attr(self, target: str):
        value = self.raw_attr(target)
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    def call_function(self, target, args, kwargs):
        fake = FAKES.get(target) if isinstance(target, torch._ops.OpOverload) else None
        if fake is not None and kwargs.keys() <= {"backend"}:  # a k3 op: its fake impl, not the dispatcher's path
            return fake(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        n.meta["val"], n.meta["val_key"] = result, _key(self, n)
        return result

    def run_incremental(self, *inputs) -> None:
        changed: set[fx.Node] = set()  # nodes whose value differs from the one recorded before
        it = iter(inputs)
        for n in self.graph.nodes:
            if n.op == "placeholder":
                result = next(it)
            elif n.op == "output":
                n.meta["val"] = fx.node.map_arg(n.args[0], lambda a: a.meta["val"])
                continue
            else:
                key = _key(self, n)
                if "val" in n.meta and _same_key(n.meta.get("val_key"), key) and changed.isdisjoint(n.all_input_nodes):
                    continue
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
                with self._set_current_node(n):
                    result = getattr(self, n.op)(n.target, args, kwargs)
                n.meta["val_key"] = key
            if "val" not in n.meta or _signature(n.meta["val"]) != _signature(result):
                changed.add(n)
            n.meta["val"] = result


def _key(interp: MetaShapeProp, n: fx.Node) -> tuple:
    """What a node's value is computed from: the object a get_attr reads (held, so its id is never reused),
    or a call's target and arguments (nodes compare by identity)."""
    if n.op == "get_attr":
        return ("get_attr", interp.raw_attr(n.target))
    kwargs = n.kwargs
    if "backend" in kwargs and isinstance(n.target, torch._ops.OpOverload) and n.target in BACKEND_FREE:
        kwargs = {k: v for k, v in kwargs.items() if k != "backend"}  # bind_kernels' choice changes no shape
    return (n.op, n.target, n.args, kwargs)


def _same_key(old, new) -> bool:
    if old is None or old[0] != new[0]:
        return False
    if new[0] == "get_attr":
        return old[1] is new[1]
    try:
        return bool(old == new)
    except RuntimeError:  # a tensor constant among the arguments: compare conservatively
        return False


def _signature(value):
    """The metadata of a (nested) meta value that downstream shapes depend on."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype
    return pytree.tree_map(
        lambda v: (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v, value
    )


class GraphVerificationError(Exception):
    """The graph is malformed: a dangling node, a bad reference, or a shape/type error."""


def is_impure(node: fx.Node) -> bool:
    """fx's purity, plus in-place tensor methods (`buf.add_(x)`: the MoE load statistics) as side effects.

    A call's purity depends on its target alone (higher-order operators aside), so it is looked up once.
    """
    if node.op == "call_method":
        return node.target.endswith("_")
    if node.op != "call_function" or isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.is_impure()
    try:
        return _IMPURE[node.target]
    except KeyError:
        return _IMPURE.setdefault(node.target, node.is_impure())
    except TypeError:  # an unhashable target
        return node.is_impure()


_IMPURE: dict = {}


def eliminate_dead_code(gm: fx.GraphModule) -> bool:
    """Remove unused pure nodes, last first (what a removal frees goes too); whether any went.

    fx's own `eliminate_dead_code` lints the whole graph afterwards, which after every pass of a Kimi K3
    build cost more than the removal; the checks lint once per graph instead (`verify_graph`).
    """
    dead = False
    for n in reversed(gm.graph.nodes):
        if not n.users and not is_impure(n):
            gm.graph.erase_node(n)
            dead = True
    return dead


def _dangling(gm: fx.GraphModule) -> list[str]:
    return [
        n.name
        for n in gm.graph.nodes
        if not n.users and n.op not in ("output", "placeholder") and not is_impure(n)
    ]


def verify_graph(gm: fx.GraphModule, example_inputs: tuple, reuse: bool = False, lint: bool | None = None) -> None:
    """Lint the graph, reject dangling nodes, and propagate meta tensors to check every shape and dtype.

    `example_inputs` may be real or meta tensors; only their metadata is used. Each node's
    `meta['val']` holds its meta output afterwards (dumps print the shapes from it). `reuse` keeps the
    values of nodes that did not change since the last propagation (see the module docstring); `lint`
    (default: a full check, not `reuse`) runs fx's structural lint.
    """
    if lint is None:
        lint = not reuse  # between passes fx's invariants hold (passes edit through its API)
    if lint:
        try:
            gm.graph.lint()
        except Exception as e:  # fx raises bare RuntimeError/AssertionError on malformed graphs
            raise GraphVerificationError(f"graph lint failed: {e}") from e
    dangling = _dangling(gm)
    if dangling:
        raise GraphVerificationError(f"dangling nodes (computed, never used): {', '.join(dangling[:5])}")
    meta_inputs = pytree.tree_map_only(torch.Tensor, lambda x: x.to("meta"), list(example_inputs))
    try:
        with torch.inference_mode():  # no autograd layer: custom ops go straight to their fake impls
            prop = MetaShapeProp(gm)  # every get_attr is looked up, so a missing attribute is found here
            prop.run_incremental(*meta_inputs) if reuse else prop.run(*meta_inputs)
    except GraphVerificationError:
        raise
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
