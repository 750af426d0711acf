"""A graph's top level as a loop over its sublayers, derived from the graph's wiring and checked against it.

The loop carries the residual stream as a list of values (the AttnRes sources; the last one the open
block's sum) and, per companion op the graph applies to every value (`rms_inv`), the list of their
results. Each step calls its sublayer kind's function on `self.layers[i]` with stacks of those lists,
its caches and the graph's inputs; its output either opens a new value or is added to the open one.
Where sublayers pass their values on directly (plain residuals: the running sum and the last output,
which the next sublayer's fused add_rms_norm joins), the loop carries them in numbered slots instead.
`derive` matches every top-level node to that reading and raises NotALoop where the graph differs
(the emitter then keeps the top level unrolled): the emitted loop computes exactly the graph's nodes.
"""

from __future__ import annotations

import ast
import keyword
import operator
import re
from dataclasses import dataclass, field

import torch
from torch import fx

from k3compile.emit.codegen import _ranges, _wrapped
from k3compile.emit.outline import Region, _is_cache_read, readable

_CACHE_KEY = re.compile(r"^([A-Za-z_]\w*)\.(\d+)$")


class NotALoop(Exception):
    """The graph's top level is not a loop over its sublayers (the message says where)."""


@dataclass
class Kind:
    """What every step of one sublayer function reads and writes, by role."""

    function: str
    args: tuple  # per function input: ("stack", list index) | ("cache", base) | ("input", node)
    residual: int  # which output continues the residual stream
    writes: tuple  # (output index, cache base) in the graph output's order
    slots_out: tuple = ()  # the slot form: (output index, slot) per stream output
    layers: list[int] = field(default_factory=list)

    def caches(self) -> tuple[str, ...]:
        """The cache bases it reads, then those it only writes: the order of a step's cache names."""
        read = [a[1] for a in self.args if a[0] == "cache"]
        return tuple(read + [b for _, b in self.writes if b not in read])


@dataclass
class Loop:
    kinds: list[Kind]
    steps: list[tuple[int, int, bool]]  # (layer, kind, whether its output opens a new value)
    initial: list[list[fx.Node]]  # per list: its nodes before the first step (values first, then companions)
    companions: list[tuple]  # per companion list: (target, args, kwargs) with the value as _VALUE
    final: list[list[fx.Node]]  # the lists after the last step
    prologue: list[fx.Node]  # top-level nodes before the loop, in graph order
    epilogue: list[fx.Node]  # top-level nodes after it (the output last)
    caches: fx.Node | None  # the placeholder the caches are read from
    inputs: list[fx.Node] = field(default_factory=list)  # prologue nodes the steps read
    slots: bool = False  # the slot form: `final[0]` holds each slot's last value (None: unused at the start)
    returns_dict: bool = False  # the graph returns its caches as a dict


_VALUE = "<value>"


def _template(node: fx.Node, value: fx.Node) -> tuple:
    """(target, args, kwargs) of `node` with `value` as _VALUE: equal for one op applied to different values."""
    def sub(a):
        return _VALUE if a is value else a

    return node.target, fx.node.map_aggregate(node.args, sub), fx.node.map_aggregate(node.kwargs, sub)


def _companion_of(value: fx.Node, template: tuple) -> fx.Node:
    """The one node applying the companion op `template` to `value`."""
    found = [u for u in value.users if u.op == "call_function" and u.all_input_nodes == [value]
             and _template(u, value) == template]  # fmt: skip
    if len(found) != 1:
        raise NotALoop(f"{value.name} has {len(found)} companions of the kind its predecessors have")
    return found[0]


def _is_stack(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target is torch.stack and len(n.args) == 1 and not n.kwargs
            and isinstance(n.args[0], (list, tuple)))  # fmt: skip


def _output_dict(output: fx.Node, none: dict | None = None) -> dict | None:
    """The graph output's dict of cache tensors (`none` when it returns none)."""
    value = output.args[0]
    dicts = [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, dict)]
    if len(dicts) > 1:
        raise NotALoop("the graph returns several dicts")
    return dicts[0] if dicts else none


def derive(steps: list, names: dict[int, str]) -> Loop:
    """The loop over the schedule's sublayer steps that computes the graph's top level, or NotALoop."""
    regions = [s for s in steps if isinstance(s, Region)]
    if not regions:
        raise NotALoop("the graph has no sublayers")
    top = [s for s in steps if isinstance(s, fx.Node)]
    output = top[-1]
    returned = _output_dict(output, {})
    key_of = {v: k for k, v in returned.items()}
    if len(key_of) != len(returned):
        raise NotALoop("one tensor is returned under two cache names")
    inside = {n: r for r in regions for n in r.nodes}
    after: set[fx.Node] = set()  # top-level nodes reading a sublayer's output, directly or not
    for n in top:
        if any(a in inside or a in after for a in n.all_input_nodes):
            after.add(n)
    before = [n for n in top if n not in after]
    first = regions[0]
    stacks = [a for a in first.inputs if _is_stack(a)]
    if not stacks:
        return _derive_slots(steps, names, regions, top, output, returned, key_of, inside, after, before)
    lists = [list(s.args[0]) for s in stacks]
    companions, values = [], None  # (list, the list it is a companion of, template); the values' list
    for k, lst in enumerate(lists):  # a companion list holds one op of the same kind per element of another
        for j, other in enumerate(lists):
            if j != k and len(other) == len(lst) and all(c.op == "call_function" and c.all_input_nodes == [v]
                                                         for c, v in zip(lst, other)):  # fmt: skip
                templates = {_template(c, v) for c, v in zip(lst, other)}
                if len(templates) == 1:
                    companions.append((k, j, templates.pop()))
                    break
        else:
            if values is not None:
                raise NotALoop("the first sublayer reads two unrelated stacks")
            values = k
    if values is None or any(j != values for _, j, _ in companions):
        raise NotALoop("the first sublayer's stacks are not one list of values and its companions")
    order = [values] + [k for k, _, _ in companions]
    state = [list(lists[k]) for k in order]
    initial = [list(lst) for lst in state]
    templates = [t for _, _, t in companions]
    covered: set[fx.Node] = set()
    kinds: dict[str, Kind] = {}
    plan: list[tuple[int, int, bool]] = []
    caches_node = None
    written_by: list[fx.Node] = []
    for r in regions:
        args = []
        for a in r.inputs:
            if _is_stack(a):
                match = [j for j, lst in enumerate(state) if list(a.args[0]) == lst]
                if not match or set(a.users) - set(r.nodes):
                    raise NotALoop(f"{a.name} is not a stack of the residual values read by one sublayer")
                args.append(("stack", match[0]))
            elif _is_cache_read(a):
                args.append(("cache", _cache_arg(a, r, caches_node)))
                caches_node = a.args[0]
            elif a not in after and a not in inside and a not in covered:
                args.append(("input", a))
            else:
                raise NotALoop(f"layer {r.layer}'s {r.part} reads {a.name}, which the loop does not carry")
            if args[-1][0] != "input":
                covered.add(a)
        outside = [[u for u in o.users if u not in r.nodes] for o in r.outputs]
        stream = [q for q, users in enumerate(outside) if any(u.op != "output" for u in users)]
        if len(stream) != 1:
            raise NotALoop(f"layer {r.layer}'s {r.part} continues the residual stream with {len(stream)} outputs")
        writes = []
        for q, o in enumerate(r.outputs):
            if q == stream[0]:
                continue
            m = _CACHE_KEY.match(key_of.get(o, ""))
            if m is None or int(m.group(2)) != r.layer:
                raise NotALoop(f"layer {r.layer}'s {r.part} returns {o.name} other than as its own cache")
            writes.append((q, m.group(1)))
            written_by.append(o)
        writes.sort(key=lambda w: list(returned).index(f"{w[1]}.{r.layer}"))
        kind = Kind(names[id(r)], tuple(args), stream[0], tuple(writes))
        known = kinds.setdefault(kind.function, kind)
        if (known.args, known.residual, known.writes) != (kind.args, kind.residual, kind.writes):
            raise NotALoop(f"the {kind.function} steps are wired differently (layer {r.layer})")
        known.layers.append(r.layer)
        y = r.outputs[stream[0]]
        users = [u for u in y.users if u not in r.nodes]
        adds = [u for u in users if u.op == "call_function" and u.target is operator.add
                and u.args == (state[0][-1], y) and not u.kwargs]  # fmt: skip
        opens = not adds
        if adds:
            if users != adds[:1]:
                raise NotALoop(f"layer {r.layer}'s {r.part} output is used beside its residual add")
            value = adds[0]
            state[0][-1] = value
        else:
            value = y
            state[0].append(value)
        if value is not y:
            covered.add(value)
        for j, t in enumerate(templates, start=1):
            c = _companion_of(value, t)
            covered.add(c)
            if opens:
                state[j].append(c)
            else:
                state[j][-1] = c
        plan.append((r.layer, list(kinds).index(kind.function), opens))
    _check_returned(regions, returned, written_by)
    epilogue = _epilogue(top, output, inside, after, covered, {n for lst in state for n in lst}, key_of)
    prologue = _prologue(before, covered, output, epilogue)
    loop = Loop(list(kinds.values()), plan, initial, templates, state, prologue, epilogue, caches_node)
    return _finish(loop, output)


def _cache_arg(a: fx.Node, r: Region, caches_node: fx.Node | None) -> str:
    """The cache base of layer r's read `a`, checking it is that layer's own and read from one input."""
    m = _CACHE_KEY.match(a.args[1])
    if m is None or int(m.group(2)) != r.layer or set(a.users) - set(r.nodes):
        raise NotALoop(f"cache {a.args[1]!r} is not layer {r.layer}'s own")
    if caches_node not in (None, a.args[0]):
        raise NotALoop("caches are read from two inputs")
    return m.group(1)


def _derive_slots(steps, names, regions, top, output, returned, key_of, inside, after, before) -> Loop:
    """The slot form, for sublayers that pass their values on directly (plain residuals: the sum and the last
    output, which the next sublayer's fused add_rms_norm joins): each value the stream carries from one step
    to a later one, or to the tail, sits in a numbered slot; a step's outputs fill the slots freed by then."""
    last: dict[fx.Node, int] = {}  # stream value -> the last step reading it (len(regions): the tail)
    for k, r in enumerate(regions):
        for a in r.inputs:
            last[a] = k
    for n in top:
        if n in after:
            for a in n.all_input_nodes:
                if not (n is output and a in key_of):
                    last[a] = len(regions)
    seeds = [a for a in regions[0].inputs if a.op != "placeholder" and not _is_cache_read(a) and a not in inside]
    if not seeds:
        raise NotALoop("the first sublayer reads neither a stack of residual values nor a value to carry")
    slot: list[fx.Node | None] = list(seeds)
    initial = list(seeds)
    covered: set[fx.Node] = set()
    kinds: dict[str, Kind] = {}
    plan: list[tuple[int, int, bool]] = []
    caches_node = None
    written_by: list[fx.Node] = []
    for k, r in enumerate(regions):
        args = []
        for a in r.inputs:
            if _is_cache_read(a):
                args.append(("cache", _cache_arg(a, r, caches_node)))
                caches_node = a.args[0]
                covered.add(a)
            elif a in slot:
                args.append(("slot", slot.index(a)))
            elif a not in after and a not in inside:
                args.append(("input", a))
            else:
                raise NotALoop(f"layer {r.layer}'s {r.part} reads {a.name}, which the loop does not carry")
        slot = [v if v is not None and last.get(v, -1) > k else None for v in slot]
        writes, outs = [], []
        for q, o in enumerate(r.outputs):
            if o in key_of:
                m = _CACHE_KEY.match(key_of[o])
                if m is None or int(m.group(2)) != r.layer or set(o.users) - {output} - set(r.nodes):
                    raise NotALoop(f"layer {r.layer}'s {r.part} returns {o.name} other than as its own cache")
                writes.append((q, m.group(1)))
                written_by.append(o)
                continue
            free = slot.index(None) if None in slot else len(slot)
            slot[free:free + 1] = [o]
            outs.append((q, free))
        writes.sort(key=lambda w: list(returned).index(f"{w[1]}.{r.layer}"))
        kind = Kind(names[id(r)], tuple(args), -1, tuple(writes), tuple(outs))
        known = kinds.setdefault(kind.function, kind)
        if (known.args, known.writes, known.slots_out) != (kind.args, kind.writes, kind.slots_out):
            raise NotALoop(f"the {kind.function} steps are wired differently (layer {r.layer})")
        known.layers.append(r.layer)
        plan.append((r.layer, list(kinds).index(kind.function), True))
    _check_returned(regions, returned, written_by)
    epilogue = _epilogue(top, output, inside, after, covered, {v for v in slot if v is not None}, key_of)
    prologue = _prologue(before, covered, output, epilogue)
    initial += [None] * (len(slot) - len(initial))
    loop = Loop(list(kinds.values()), plan, [initial], [], [slot], prologue, epilogue, caches_node)
    loop.slots = True
    return _finish(loop, output)


def _check_returned(regions: list, returned: dict, written_by: list) -> None:
    if list(returned.values()) != [v for v in returned.values() if v in written_by] or len(returned) != len(written_by):
        raise NotALoop("the graph returns caches the sublayers did not write")
    order_in_output = [next(k for k, r in enumerate(regions) if v in r.outputs) for v in returned.values()]
    if order_in_output != sorted(order_in_output):
        raise NotALoop("the returned caches are not in the order of the sublayers")


def _epilogue(top, output, inside, after, covered, finals, key_of) -> list[fx.Node]:
    """The top-level nodes after the loop, the output last: they may read only the values the loop ends with."""
    epilogue = []
    for n in top:
        if n in covered or n not in after:
            continue
        for a in n.all_input_nodes:
            if a in finals:
                continue
            if a in inside and not (n is output and a in key_of):
                raise NotALoop(f"{n.name} reads {a.name} inside a sublayer")
            if a in covered:
                raise NotALoop(f"{n.name} reads {a.name}, an intermediate residual value")
        epilogue.append(n)
    if output not in epilogue:
        raise NotALoop("the graph's output does not depend on its layers")
    return epilogue


def _prologue(before, covered, output, epilogue) -> list[fx.Node]:
    prologue = [n for n in before if n not in covered and n is not output]
    for n in prologue + epilogue[:-1]:  # these move before or after every sublayer: they must be pure
        if n.op != "placeholder" and n.is_impure():
            raise NotALoop(f"{n.name} has side effects outside the sublayers")
    return prologue


def _finish(loop: Loop, output: fx.Node) -> Loop:
    loop.returns_dict = _output_dict(output, None) is not None
    loop.inputs = list(dict.fromkeys(a[1] for k in loop.kinds for a in k.args if a[0] == "input"))
    return loop


# ---------------------------------------------------------------- text


class _Marker:
    """Stands for the loop in the printed top level: fx prints `loop = <name>(initial lists, inputs)`."""

    def __init__(self, module: str):
        self.__name__ = self.__qualname__ = "loop_over_layers"
        self.__module__ = module

    def __call__(self, *args):  # never run: the graph is only printed
        raise RuntimeError("the loop marker is emitted code, not callable here")


def _loop_inputs(loop: Loop) -> list[fx.Node]:
    """The prologue nodes the loop body reads: the steps' inputs, then the caches' placeholder."""
    return loop.inputs + ([loop.caches] if loop.caches is not None and loop.caches not in loop.inputs else [])


def top_graph(loop: Loop, module: str) -> tuple[fx.Graph, fx.Node]:
    """Prologue, one marker call standing for the loop, then the epilogue reading the loop's lists."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in loop.prologue:
        env[n] = g.node_copy(n, env.__getitem__)
    extra = _loop_inputs(loop)
    if loop.slots:
        initial = [None if n is None else env[n] for n in loop.initial[0]]
        labels = [f"stream_{j}" for j in range(len(initial))]
    else:
        initial = [[env[n] for n in lst] for lst in loop.initial]
        labels = ["sources"] + [f"sources_{_op_name(t[0])}" for t in loop.companions]
    marker = g.create_node("call_function", _Marker(module), (*initial, *[env[n] for n in extra]), name="loop")
    outs = [g.create_node("call_function", operator.getitem, (marker, j), name=label) for j, label in enumerate(labels)]
    written = g.create_node("call_function", operator.getitem, (marker, len(outs)), name="written")
    if loop.slots:  # a slot's last value is the slot itself
        index = {n: (j, None) for j, n in enumerate(loop.final[0]) if n is not None}
    else:  # a list's element by its place from the end
        index = {n: (j, p - len(lst)) for j, lst in enumerate(loop.final) for p, n in enumerate(lst)}

    def read(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a not in index:
            raise NotALoop(f"the top level after the sublayers reads {a.name}")
        j, p = index[a]
        env[a] = outs[j] if p is None else g.create_node("call_function", operator.getitem, (outs[j], p))
        return env[a]

    for n in loop.epilogue:
        if n.op == "output":
            value = n.args[0]
            parts = value if isinstance(value, tuple) else (value,)
            parts = tuple(written if isinstance(v, dict) else fx.map_arg(v, read) for v in parts)
            g.output(parts if isinstance(value, tuple) else parts[0])
            continue
        if _is_stack(n) and any(list(n.args[0]) == lst for lst in loop.final):
            j = next(j for j, lst in enumerate(loop.final) if list(n.args[0]) == lst)
            env[n] = g.create_node("call_function", torch.stack, (outs[j],), name=n.name)
            env[n].meta = dict(n.meta)
            continue
        env[n] = g.node_copy(n, read)
    return g, marker


def _op_name(target) -> str:
    name = getattr(target, "__name__", "") or ""
    name = str(getattr(target, "_opname", name)).split(".")[0]
    return name if name.isidentifier() else "companion"


def _companion_code(template: tuple, value: str) -> tuple[str, dict]:
    """The companion op applied to `value` as an expression, and the globals it needs."""
    g = fx.Graph()
    v = g.placeholder(value)
    target, args, kwargs = template
    swap = lambda a: v if a == _VALUE else a  # noqa: E731
    node = g.call_function(target, fx.node.map_aggregate(args, swap), fx.node.map_aggregate(kwargs, swap))
    g.output(node)
    code = g.python_code(root_module="self", verbose=False)
    line = next(ln for ln in code.src.splitlines() if ln.strip().startswith(f"{node.name} = "))
    expr = line.split(" = ", 1)[1].split(";  ")[0]
    return expr, code.globals


def _which(layers: list[int], width: int = 60) -> str:
    """'layers 3, 7' for a comment, or '24 layers' where the list would run past `width` characters."""
    listed = f"layers {_ranges(layers)}"
    return listed if len(listed) <= width else f"{len(layers)} layers"


def _fresh(name: str, taken: set[str]) -> str:
    while name in taken or keyword.iskeyword(name):
        name += "_"
    taken.add(name)
    return name


def steps_table(loop: Loop, table: str) -> str:
    """`<TABLE> = layer_steps(...)`: per step (layer, kind[, opens a new value]), per kind its cache bases."""
    uniform = len({opens for _, _, opens in loop.steps}) == 1
    rows = tuple((i, k) if uniform else (i, k, int(opens)) for i, k, opens in loop.steps)
    columns = "layer, sublayer kind" + ("" if uniform else ", 1 where its output opens a new residual value")
    cached = any(k.caches() for k in loop.kinds)
    text = f"# {table}: per step ({columns})\n"
    text += "# and per kind the caches it reads and writes (layer_steps adds each step's cache names)\n" * cached
    if not cached:
        return text + f"{table} = {_wrapped(rows, '')}\n"
    kinds = "".join(f"        {k.caches()!r},  # {j}: {k.function}, {_which(k.layers)}\n"
                    for j, k in enumerate(loop.kinds))  # fmt: skip
    return text + f"{table} = layer_steps(\n    {_wrapped(rows, '    ')},\n    caches=(\n{kinds}    ),\n)\n"


def loop_text(loop: Loop, table: str, marker_line: str, lists: list[str], written: str, indent: str,
              taken: set[str]) -> tuple[str, dict]:  # fmt: skip
    """The loop's source in place of the marker line, and the globals the companion ops need."""
    call = ast.parse(marker_line.split(" = ", 1)[1].split(";  ")[0].split("  #")[0].strip()).body[0].value
    sources = [ast.unparse(a) for a in call.args]
    count = len(loop.initial[0]) if loop.slots else len(loop.initial)
    initial, extra = sources[:count], sources[count:]
    where = dict(zip(_loop_inputs(loop), extra))
    uniform = len({opens for _, _, opens in loop.steps}) == 1
    opens_all = loop.steps[0][2]
    cached = any(k.caches() for k in loop.kinds)
    i, kind, opens, names, layer, y = (_fresh(n, taken) for n in ("i", "kind", "opens", "names", "layer", "y"))
    lines = []
    if loop.slots:
        lines.append(f"{', '.join(lists)} = {', '.join(initial)}  # the values the residual stream carries on")
    for j, (name, init) in enumerate(zip(lists, initial) if not loop.slots else ()):
        stream = "the AttnRes sources" + ("" if uniform else "; the last one the open block's sum")
        what = (f"the residual stream's values ({stream})" if j == 0
                else f"per value, {_companion_code(loop.companions[j - 1], 'value')[0]}")  # fmt: skip
        lines.append(f"{name} = {init}  # {what}")
    if cached or loop.returns_dict:
        lines.append(f"{written} = {{}}  # the caches the layers write")
    head = ", ".join([i, kind] + ([] if uniform else [opens]) + ([names] if cached else []))
    lines.append(f"for {head} in {table}:")
    lines.append(f"    {layer} = self.layers[{i}]")
    globals_: dict = {}
    single = len(loop.kinds) == 1
    temps: dict[str, str] = {}  # cache base -> the local holding a step's new tensor of it
    for k, spec in enumerate(loop.kinds):
        bases = spec.caches()
        for b in bases:
            temps.setdefault(b, _fresh(b if b.isidentifier() else "cache", taken))
        args = [layer]
        for role, what in spec.args:
            if role == "stack":
                args.append(f"torch.stack({lists[what]})")
            elif role == "cache":
                args.append(f"{where[loop.caches]}[{names}[{bases.index(what)}]]")
            elif role == "slot":
                args.append(lists[what])
            else:
                args.append(where[what])
        role_of = {q: temps[b] for q, b in spec.writes} | {q: lists[j] for q, j in spec.slots_out}
        if not loop.slots:
            role_of[spec.residual] = y
        outs = [role_of[q] for q in range(len(role_of))]
        pad = "    " if single else "        "
        if not single:
            branch = "if" if k == 0 else "elif" if k + 1 < len(loop.kinds) else "else"
            test = f" {kind} == {k}" if branch != "else" else ""
            lines.append(f"    {branch}{test}:  # {_which(spec.layers)}")
        lines.append(f"{pad}{', '.join(outs)} = {spec.function}({', '.join(args)})")
        if spec.writes:
            targets = ", ".join(f"{written}[{names}[{bases.index(b)}]]" for _, b in spec.writes)
            lines.append(f"{pad}{targets} = {', '.join(temps[b] for _, b in spec.writes)}")
    if loop.slots:
        return "\n".join(indent + ln for ln in lines), globals_
    updates = []
    for j, name in enumerate(lists[1:], start=1):
        expr, more = _companion_code(loop.companions[j - 1], y)
        globals_.update(more)
        updates.append((name, expr))
    adds = [f"{y} = {lists[0]}.pop() + {y}"] + [f"{name}.pop()" for name, _ in updates]
    if not uniform:
        lines.append(f"    if not {opens}:  # the output joins the open value")
        lines += [f"        {a}" for a in adds]
    elif not opens_all:
        lines += [f"    {a}" for a in adds]
    lines.append(f"    {lists[0]}.append({y})")
    lines += [f"    {name}.append({expr})" for name, expr in updates]
    return "\n".join(indent + ln for ln in lines), globals_


def names_in(text: str) -> set[str]:
    """Every identifier a piece of printed code mentions (a superset of the variables it binds)."""
    return set(re.findall(r"[A-Za-z_]\w*", text))


def rolled(loop: Loop, table: str, module: str, names_of: dict) -> tuple[str, dict]:
    """The top level's source as `def forward(self, ...)` with the loop in it, and the globals it refers to."""
    g, marker = top_graph(loop, module)
    code = g.python_code(root_module="self", verbose=True)
    text = readable(code.src, keep_deletions=True, names_of=names_of).replace(f"{module}_", "")
    lines = text.splitlines()
    at = next(k for k, ln in enumerate(lines) if re.match(rf"^\s*{marker.name} = loop_over_layers\(", ln))
    taken = names_in(text) | {k.function for k in loop.kinds}
    picked = re.compile(rf"^\s*(\w+) = {marker.name}\[(\d+)\](;.*)?$")
    got = {}
    rest = []
    for ln in lines[at + 1 :]:
        m = picked.match(ln)
        if m:
            got[int(m.group(2))] = m.group(1)
        else:
            rest.append(ln)
    count = len(loop.final[0]) if loop.slots else len(loop.final)
    lists = [got.get(j, _fresh(f"sources_{j}", taken)) for j in range(count)]
    written = got.get(count, _fresh("written", taken))
    indent = re.match(r"^(\s*)", lines[at]).group(1)
    body, more = loop_text(loop, table, lines[at], lists, written, indent, taken)
    return "\n".join(lines[:at] + [body] + rest), {**code.globals, **more}
