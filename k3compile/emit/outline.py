"""Outlining: a bound graph as one function per distinct sublayer kind, called from a loop over the layers.

Each node belongs to at most one sublayer: `layers.<i>.attn` (its depth site, pre-norm and token mixer)
or `layers.<i>.ffn` (depth site, pre-norm, MoE or dense FFN), seeded by the parameters it reads and
grown along the data flow (a node joining two sublayers, like plain residuals' fused add + next pre-norm,
goes to the one whose weights it reads); the depth mixing between sublayers (sums and stacks the attn_res
pass made) stays at the top level, while pure glue computed from the graph's inputs alone (a cache's
dtype, views of the decode positions) joins the one sublayer that uses it. Sublayers whose code is the
same up to their parameters' layer are one kind, emitted once as `def <kind>(layer, ...)` and called with `self.layers[i]` from the loop of
`k3compile.emit.loop` (or, for a graph that is not such a loop, from an unrolled top level). A sublayer
that cannot be cut out as one call (its region is not convex in the data flow) stays inline.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import fx
from torch.utils import _pytree as pytree

from k3compile.ir.lower import EXAMPLE_BATCH, EXAMPLE_CACHE_LEN, EXAMPLE_TOKENS

SUBLAYER_PARTS = {"attn_res": "attn", "attn_norm": "attn", "attn": "attn", "ffn_res": "ffn", "ffn_norm": "ffn",
                  "moe": "ffn", "ffn": "ffn"}  # fmt: skip
_LAYER_ATTR = re.compile(r"^layers\.(\d+)\.([A-Za-z_]+)\.?(.*)$")


def sublayer_of(target: str) -> tuple[int, str, str] | None:
    """(layer, "attn" | "ffn", path inside the layer) of a parameter or buffer name, None outside layers."""
    m = _LAYER_ATTR.match(target)
    if m is None or m.group(2) not in SUBLAYER_PARTS:
        return None
    return int(m.group(1)), SUBLAYER_PARTS[m.group(2)], target.split(".", 2)[2]


@dataclass
class Region:
    layer: int
    part: str
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)  # values from outside, in order of first use
    outputs: list[fx.Node] = field(default_factory=list)  # values used outside, in graph order
    kind: str = ""
    code: str = ""  # the function's body text, the same for every region of one kind


def _regions(gm: fx.GraphModule) -> dict[tuple[int, str], Region]:
    owner: dict[fx.Node, tuple[int, str]] = {}
    regions: dict[tuple[int, str], Region] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or n.meta.get("depth"):
            continue
        if n.op == "get_attr":
            where = sublayer_of(n.target)
            key = None if where is None else where[:2]
        else:
            keys = {owner[a] for a in n.all_input_nodes if a in owner}
            if len(keys) > 1:  # joins sublayers: it is the one's whose weights it reads (a fused next pre-norm)
                keys = {owner[a] for a in n.all_input_nodes if a in owner and a.op == "get_attr"}
            if any(a.op == "get_attr" and a not in owner for a in n.all_input_nodes):
                keys = set()  # reads a weight outside the layers (the final norm): the top level's
            key = keys.pop() if len(keys) == 1 else None
        if key is not None:
            owner[n] = key
            regions.setdefault(key, Region(*key)).nodes.append(n)
    _absorb_glue(gm, owner, regions)
    for r in regions.values():
        inside = set(r.nodes)
        seen: dict[fx.Node, None] = {}
        for n in r.nodes:
            for a in n.all_input_nodes:
                if a not in inside:
                    seen.setdefault(a)
        r.inputs = list(seen)
        r.outputs = [n for n in r.nodes if any(u not in inside for u in n.users)]
    return {k: r for k, r in regions.items() if r.outputs}


def _is_cache_read(n: fx.Node) -> bool:
    """`caches['<kind>.<layer>']`: one cache tensor looked up in a graph input."""
    return (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], str)
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder")  # fmt: skip


def _absorb_glue(gm: fx.GraphModule, owner: dict, regions: dict) -> None:
    """Move into a sublayer the pure nodes computed from the graph's inputs alone (a cache's dtype, the
    decode positions' views) that only it uses: its function then takes the cache and positions themselves."""
    from_inputs: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or (n.op in ("call_function", "call_method") and n not in owner
                                     and not n.meta.get("depth") and not n.is_impure()
                                     and all(a in from_inputs for a in n.all_input_nodes)):  # fmt: skip
            from_inputs.add(n)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = set()
    for n in reversed(gm.graph.nodes):
        if n not in from_inputs or n.op == "placeholder" or _is_cache_read(n) or not n.users:
            continue
        keys = {owner.get(u) for u in n.users}
        if len(keys) == 1 and None not in keys:
            owner[n] = key = keys.pop()
            regions[key].nodes.append(n)
            moved.add(key)
    for key in moved:
        regions[key].nodes.sort(key=position.__getitem__)


def schedule(gm: fx.GraphModule, regions: dict) -> list[fx.Node | Region]:
    """Graph order with each convex region contracted to one step; non-convex regions are dissolved."""
    while True:
        unit = {n: r for r in regions.values() for n in r.nodes}
        g = nx.DiGraph()
        position = {}
        for i, n in enumerate(gm.graph.nodes):
            u = unit.get(n, n)
            key = (u.layer, u.part) if isinstance(u, Region) else n
            position.setdefault(key, i)
            g.add_node(key)
            for a in n.all_input_nodes:
                ua = unit.get(a, a)
                ka = (ua.layer, ua.part) if isinstance(ua, Region) else a
                if ka != key:
                    g.add_edge(ka, key)
        try:
            order = list(nx.lexicographical_topological_sort(g, key=position.__getitem__))
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(g)
            bad = next(k for edge in cycle for k in edge if isinstance(k, tuple))
            del regions[bad]
            continue
        return [regions[k] if isinstance(k, tuple) else k for k in order]


def _shape(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_shape(v) for v in val) + ")"
    return ""


def region_graph(r: Region) -> tuple[fx.Graph, list[str]]:
    """The region as a graph of its own: placeholders for its inputs, get_attr relative to its layer."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = []
    for i, a in enumerate(r.inputs):
        name = _input_name(a, i)
        names.append(name)
        env[a] = g.placeholder(name)
        env[a].meta = dict(a.meta)
    for n in r.nodes:
        if n.op == "get_attr":
            new = g.get_attr(sublayer_of(n.target)[2])
        else:
            new = g.create_node(n.op, n.target, fx.map_arg(n.args, env.__getitem__), fx.map_arg(n.kwargs, env.__getitem__))
        new.meta = dict(n.meta)
        env[n] = new
    outs = [env[o] for o in r.outputs]
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    return g, names


def fingerprint(r: Region) -> str:
    """Everything `region_graph`'s printed code depends on: each node's op, target (relative to its layer),
    arguments (values of the region by position) and shape, and each input's name and shape."""
    index = {a: f"%in{i}:{_input_name(a, i)}:{_value(a)}" for i, a in enumerate(r.inputs)}
    index.update((n, f"%{j}") for j, n in enumerate(r.nodes))

    def leaf(a):
        if isinstance(a, fx.Node):
            return index[a]
        return f"<tensor {id(a)}>" if isinstance(a, torch.Tensor) else a

    rows = [(n.op, sublayer_of(n.target)[2] if n.op == "get_attr" else n.target,
             fx.node.map_aggregate((n.args, n.kwargs), leaf), _value(n)) for n in r.nodes]  # fmt: skip
    return repr((list(index.values())[: len(r.inputs)], rows, [index[o] for o in r.outputs]))


def _value(n: fx.Node) -> str:
    """A node's recorded value as text: tensors by dtype and shape, anything else by repr."""
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor):  # most nodes: no tree walk
        return repr((val.dtype, tuple(val.shape)))
    return repr(pytree.tree_map_only(torch.Tensor, lambda t: (t.dtype, tuple(t.shape)), val))


def _input_name(node: fx.Node, i: int) -> str:
    """A placeholder name that reads the same in every layer: a cache's kind, else x, x_1, ..."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], str):
        return node.args[1].split(".")[0]
    if node.op == "placeholder":
        return node.name
    return "x" if i == 0 else f"x_{i}"


class _Outlined:
    """Stands for an outlined function in a top-level graph: fx prints a call by its name."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name
        self.__module__ = OUTLINED_MODULE

    def __call__(self, *args):  # never run: the graph is only printed
        raise RuntimeError(f"{self.__name__} is emitted code, not callable here")


OUTLINED_MODULE = "k3compile_outlined"  # fx prefixes a call's global name with it; the emitter drops it


def top_level(gm: fx.GraphModule, steps: list, names: dict[int, str]) -> fx.Graph:
    """The graph's top level: its own nodes in schedule order, each region a call of its kind's function."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    functions: dict[str, _Outlined] = {}
    layers: dict[int, fx.Node] = {}
    for step in steps:
        if isinstance(step, fx.Node):
            if step.op == "output":
                g.output(fx.map_arg(step.args[0], env.__getitem__))
            else:
                env[step] = g.node_copy(step, env.__getitem__)
            continue
        if not layers:
            layers[-1] = g.get_attr("layers")
        if step.layer not in layers:
            layers[step.layer] = g.create_node(
                "call_function", operator.getitem, (layers[-1], step.layer), name=f"layer_{step.layer}"
            )
        name = names[id(step)]
        fn = functions.setdefault(name, _Outlined(name))
        call = g.create_node("call_function", fn, (layers[step.layer], *(env[a] for a in step.inputs)),
                             name=f"{step.part}_{step.layer}")  # fmt: skip
        if len(step.outputs) == 1:
            env[step.outputs[0]] = call
        else:
            for k, o in enumerate(step.outputs):
                env[o] = g.create_node("call_function", operator.getitem, (call, k), name=f"{step.part}_{step.layer}_{k}")
    return g


# ---------------------------------------------------------------- text


# The example inputs' sizes (distinct from every model dimension) named in shape comments.
SYMBOLS = {str(EXAMPLE_BATCH): "B", str(EXAMPLE_TOKENS): "T", str(EXAMPLE_CACHE_LEN): "S",
           str(EXAMPLE_BATCH * EXAMPLE_TOKENS): "B*T"}  # fmt: skip
_ANNOTATED = re.compile(r'^(\s*)(\w+): "([^"]*)" = (.*)$')
_DELETIONS = re.compile(r";  (\w+ = )+None$")
_SIGNATURE = re.compile(r'(\w+): "([^"]*)"')


def symbols(gm: fx.GraphModule, spec) -> dict[str, str]:
    """SYMBOLS, plus the routed rows (B*k for top-k routing: the decode step's; B*T*k: the train graph's rows
    sorted by expert) where no weight has that size."""
    out = dict(SYMBOLS)
    if spec.moe is None:
        return out
    weights = {d for n in gm.graph.find_nodes(op="get_attr") if isinstance(v := n.meta.get("val"), torch.Tensor)
               for d in v.shape}  # fmt: skip
    rows = EXAMPLE_BATCH * spec.moe.top_k
    if rows not in weights:
        out.setdefault(str(rows), f"B*{spec.moe.top_k}")
    if rows * EXAMPLE_TOKENS not in weights:
        out.setdefault(str(rows * EXAMPLE_TOKENS), f"B*T*{spec.moe.top_k}")
    return out


def _dims(text: str, names_of: dict[str, str]) -> str:
    """'f32[5, 11, 256]' -> '[B, T, 256]' (float32 implied), with the example sizes named."""
    dtype, _, dims = text.partition("[")
    names = [names_of.get(d.strip(), d.strip()) for d in dims.rstrip("]").split(",") if d.strip()]
    shown = "[" + ", ".join(names) + "]"
    return shown if dtype == "f32" else f"{dtype}{shown}"


def readable(src: str, keep_deletions: bool, names_of: dict[str, str] = SYMBOLS) -> str:
    """fx's verbose source with the type annotations turned into end-of-line shape comments."""
    out = []
    for line in src.strip("\n").splitlines():
        if line.strip().startswith("# No stacktrace"):
            continue
        if line.lstrip().startswith("def "):
            out.append(_SIGNATURE.sub(r"\1", line))
            continue
        m = _ANNOTATED.match(line)
        if m:
            indent, name, typ, expr = m.groups()
            if not keep_deletions:
                expr = _DELETIONS.sub("", expr)
            line = f"{indent}{name} = {expr}" + (f"  # {_dims(typ, names_of)}" if "[" in typ else "")
        elif not keep_deletions:
            line = _DELETIONS.sub("", line)
        out.append(line)
    return "\n".join(out)


_SIMPLE = re.compile(r"^(\s*)(\w+) = ((?:layer|self)\.[\w.]+|caches\['[\w.]+'\])(  #.*)?$")
_UNPACKED = re.compile(r"^(\s*)(\w+)_(\d+) = (\w+)\[(\d+)\](;  \w+ = None)?$")


def _split(line: str) -> tuple[str, list[str], str]:
    """(code, the names fx's deletion suffix frees, comment) of one generated line."""
    code, sep, comment = line.partition("  #")
    freed: list[str] = []
    m = _DELETIONS.search(code)
    if m:
        freed = [n.strip() for n in code[m.start() + 3 :].split("=")[:-1]]
        code = code[: m.start()]
    return code, freed, sep + comment


def _join(code: str, freed: list[str], comment: str) -> str:
    return code + (f";  {' = '.join(freed)} = None" if freed else "") + comment


_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # a variable, not an attribute (`torch.stack` is not `stack`)
_STACK = re.compile(r"^(\s*)(\w+) = (torch\.stack\((?:\[[\w, ]*\]|\w+)\))(  #.*)?$")
_LAYER = re.compile(r"^(\s*)(layer_\d+) = (layers\[\d+\])$")


def inline_simple(text: str) -> str:
    """Put parameter reads, cache lookups and source stacks used exactly once straight into their use, and
    read each layer as `layers[i]` where it is passed (no side effects move: these expressions are pure)."""
    lines = [_split(line) for line in text.splitlines()]
    words = Counter(w for code, _, _ in lines for w in _NAME.findall(code))
    out, pending, aliases = [], {}, {}
    for code, freed, comment in lines:
        layer = _LAYER.match(code)
        if layer:
            aliases[layer.group(2)] = layer.group(3)
            continue
        m = _SIMPLE.match(code + comment) or _STACK.match(code + comment)
        if m and words[m.group(2)] == 2 and m.group(3) != "self.layers":  # defined once, used once (not by aliases)
            pending[m.group(2)] = (m.group(3), freed)
            continue
        for name in [n for n in pending if re.search(rf"(?<![\w.]){n}\b", code)]:
            expr, later = pending.pop(name)
            code = re.sub(rf"(?<![\w.]){name}\b", lambda _m, v=expr: v, code)
            freed = [f for f in freed if f != name] + later  # freeing later than before is always safe
        for name in [n for n in aliases if re.search(rf"(?<![\w.]){n}\b", code)]:
            code = re.sub(rf"(?<![\w.]){name}\b", aliases[name], code)
        freed = [f for f in freed if f not in aliases]
        out.append(_join(code, freed, comment))
    return "\n".join(out)


_IN_PLACE = re.compile(r"^(\s*)(\w+) = (layer\.[\w.]+\.\w+_\(.*)$")  # `add_ = layer.moe.router.load.add_(x)`


def training_only_writes(text: str) -> str:
    """Guard each in-place write to a layer's buffer (the routers' balancing statistics) with `if layer.training:`,
    so an eval() forward of the training Model changes no buffer; the written value is never read afterwards."""
    lines = text.splitlines()
    words = Counter(w for line in lines for w in _NAME.findall(line.split("  #")[0]))
    out = []
    for line in lines:
        m = _IN_PLACE.match(line)
        if m and words[m.group(2)] == 1:
            indent, _, write = m.groups()
            out += [f"{indent}if layer.training:", f"{indent}    {write}"]
            continue
        out.append(line)
    return "\n".join(out)


_SHAPE = re.compile(r"^(\s*)(\w+) = (\w+)\.shape$")
_SHAPE_ITEM = re.compile(r"^\s*(\w+) = (\w+)\[(\d+)\]$")


def unpack_shapes(text: str) -> str:
    """`s = x.shape`, `a = s[0]`, `b = s[1]` (s used nowhere else) -> `a, b = x.shape[:2]`."""
    lines = text.splitlines()
    words = Counter(w for line in lines for w in re.findall(r"\b\w+\b", line.split("  #")[0]))
    out, i = [], 0
    while i < len(lines):
        m = _SHAPE.match(lines[i])
        names = []
        while m and i + 1 + len(names) < len(lines):
            item = _SHAPE_ITEM.match(lines[i + 1 + len(names)])
            if not item or item.group(2) != m.group(2) or int(item.group(3)) != len(names):
                break
            names.append(item.group(1))
        if m and names and words[m.group(2)] == 1 + len(names):
            out.append(f"{m.group(1)}{', '.join(names)} = {m.group(3)}.shape[:{len(names)}]")
            i += 1 + len(names)
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def unpack_tuples(text: str) -> str:
    """`y = f(...)` then `y_0 = y[0]`, `y_1 = y[1]`, ... -> `y_0, y_1, ... = f(...)`."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        j = i + 1
        names = []
        while j < len(lines):
            m = _UNPACKED.match(lines[j])
            if not m or m.group(4) != m.group(2) or int(m.group(5)) != len(names) or int(m.group(3)) != len(names):
                break
            names.append(f"{m.group(2)}_{m.group(3)}")
            j += 1
        head = re.match(r"^(\s*)(\w+) = (.*)$", line)
        if names and head and head.group(2) == names[0].rsplit("_", 1)[0]:
            expr = head.group(3)
            out.append(f"{head.group(1)}{', '.join(names)} = {expr}")
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


_DESCRIBE = {"kda": "KDA token mixer", "mla": "Gated MLA token mixer", "moe": "LatentMoE FFN", "dense_ffn": "dense FFN"}


def outline_graph(gm: fx.GraphModule, graph: str, spec) -> tuple[list[str], str, dict]:
    """(function texts, the top level's source as `def forward(self, ...)`, the globals both refer to)."""
    steps = schedule(gm, _regions(gm))
    kinds: dict[str, str] = {}  # function body -> name
    users: dict[str, list[int]] = {}
    names: dict[int, str] = {}
    signature: dict[str, str] = {}
    variants: Counter = Counter()
    globals_: dict = {}
    names_of = symbols(gm, spec)
    bodies: dict[str, str] = {}  # region fingerprint -> body: the code of each distinct region generated once
    for step in steps:
        if isinstance(step, fx.Node):
            continue
        key = fingerprint(step)
        if key not in bodies:
            code = region_graph(step)[0].python_code(root_module="layer", verbose=True)
            body = unpack_shapes(inline_simple(readable(code.src, keep_deletions=False, names_of=names_of)))
            bodies[key] = training_only_writes(body)
            globals_.update(code.globals)
        body = bodies[key]
        if body not in kinds:
            if step.part == "attn":
                kind = "kda" if spec.mixers[step.layer] == "K" else "mla"
            else:
                kind = "moe" if spec.is_moe_layer(step.layer) else "dense_ffn"
            base = f"{graph}_{kind}"
            variants[base] += 1
            kinds[body] = base + (f"_{variants[base]}" if variants[base] > 1 else "")
            signature[kinds[body]] = _DESCRIBE[kind]
        names[id(step)] = kinds[body]
        users.setdefault(kinds[body], []).append(step.layer)
    functions = [_function(name, body, signature[name], users[name], graph) for body, name in kinds.items()]
    from k3compile.emit.loop import NotALoop, derive, rolled, steps_table

    table = f"{graph.upper()}_STEPS"  # the loop's steps, a module-level table after the functions
    try:
        loop = derive(steps, names)
        text, more = rolled(loop, table, OUTLINED_MODULE, names_of)
        globals_.update(more)
        return functions + [steps_table(loop, table)], inline_simple(text), globals_
    except NotALoop as why:
        reason = " ".join(str(why).split())  # one comment line
    top = top_level(gm, steps, names).python_code(root_module="self", verbose=True)
    globals_.update({k: v for k, v in top.globals.items() if not isinstance(v, _Outlined)})
    text = readable(top.src, keep_deletions=True, names_of=names_of).replace(f"{OUTLINED_MODULE}_", "")
    text = inline_simple(unpack_tuples(text))
    head, _, rest = text.partition("\n")
    return functions, f"{head}\n    # unrolled, not a loop over the layers: {reason}\n{rest}", globals_


def _function(name: str, body: str, what: str, layers: list[int], graph: str) -> str:
    header, rest = body.split("\n", 1)
    args = header.removeprefix("def forward(self, ").removeprefix("def forward(self")
    where = ", ".join(str(i) for i in layers)
    return (f"def {name}(layer, {args}\n"
            f'    """{graph} graph: one sublayer of the {what} kind (depth mix, pre-norm, {what}); layers {where}."""\n'
            f"{rest.rstrip()}\n")  # fmt: skip
