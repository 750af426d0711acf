"""Each distinct layer kind as one ONNX function (domain `k3.layer`), called once per layer, as the emitted code does.

The exported graph is flat: torch.export inlines the emitted `prefill_kda(layer, ...)` calls. This pass cuts it
back into sublayers on the ONNX IR. A sublayer `layers.<i>.attn` or `layers.<i>.ffn` (k3compile.emit.outline's
grouping: depth site, pre-norm, mixer or FFN) is every node on a path between two nodes that read its weights,
the constants and size arithmetic only it reads, and the standard ops after it that read only its values (and
values no weight reaches: sizes, caches) where nothing else outside reads those: the cache write, the final
view. The depth mixing between
sublayers (stacks, rms_inv, residual sums) reads two sublayers' values or the embedding and stays at the top.
Sublayers of one kind of the layer table whose nodes are the same up to the values they read are one function,
`<graph>_<kind>` (kda, mla, moe, dense_ffn; `_2` for a second variant); its inputs are the values it reads, weights among them, and its
outputs the values read outside. A sublayer that is not convex in the data flow stays inline.
"""

from __future__ import annotations

import re
from collections import Counter

import onnx_ir as ir

from k3compile.emit.onnx.functions import DOMAIN as K3_DOMAIN
from k3compile.emit.outline import sublayer_of

DOMAIN = "k3.layer"
EMITTED_GRAPH = {"infer": "prefill"}  # the infer graph is the prefill graph from empty caches: same kinds
_CACHE = re.compile(r"^(kda_state|kda_conv_[qkv]|mla_cache)\.\d+$")
_EPILOGUE_DOMAINS = ("",)  # k3 ops after a sublayer (rms_inv of its output) belong to the depth mixing


def outline_layers(model: ir.Model, spec, graph: str, weights: set[str]) -> Counter:
    """Outline model's sublayers in place into `k3.layer` functions; returns the calls per function."""
    main = model.graph
    nodes = list(main)
    regions = _regions(main, nodes, weights)
    kinds: dict[tuple, ir.Function] = {}
    variants: Counter = Counter()
    calls: Counter = Counter()
    base = EMITTED_GRAPH.get(graph, graph)
    for (layer, part), members in sorted(regions.items()):
        inputs, outputs = _boundary(members)
        kind = f"{base}_{_kind(spec, layer, part)}"
        key = (kind, _structure(members, inputs, outputs))
        if key not in kinds:
            variants[kind] += 1
            name = kind + (f"_{variants[kind]}" if variants[kind] > 1 else "")
            _call(main, name, members, inputs, outputs, f"{part}_{layer}")
            kinds[key] = _function(name, members, inputs, outputs, model.opset_imports[""])
        else:
            _call(main, kinds[key].name, members, inputs, outputs, f"{part}_{layer}")
        calls[kinds[key].name] += 1
    for function in kinds.values():
        model.functions[function.identifier()] = function
    if kinds:
        model.opset_imports[DOMAIN] = 1
        main.sort()
    return calls


def _kind(spec, layer: int, part: str) -> str:
    if part == "attn":
        return "kda" if spec.mixers[layer] == "K" else "mla"
    return "moe" if spec.is_moe_layer(layer) else "dense_ffn"


def _regions(main: ir.Graph, nodes: list[ir.Node], weights: set[str]) -> dict[tuple[int, str], list[ir.Node]]:
    """(layer, part) -> its nodes in graph order; sublayers that overlap another or a node reading two are dropped."""
    pos = {node: i for i, node in enumerate(nodes)}
    keyed = {}
    for value in [*main.inputs, *main.initializers.values()]:
        where = sublayer_of(value.name) if value.name else None
        if where is not None:
            keyed[value] = where[:2]
    free, sized = _free_values(nodes, main, weights)
    constant = free - sized
    readers: dict[tuple[int, str], list[ir.Node]] = {}
    blocked = set()
    for node in nodes:
        keys = {keyed[v] for v in node.inputs if v in keyed}
        if len(keys) == 1 and all(v is None or v in keyed or v in constant for v in node.inputs):
            key = next(iter(keys))  # a weight's transpose or cast: read where it is used
            keyed.update((v, key) for v in node.outputs)
        if len(keys) > 1 or (keys and _has_subgraph(node)):
            blocked.add(node)
        elif keys:
            readers.setdefault(keys.pop(), []).append(node)
    owner: dict[ir.Node, tuple[int, str]] = {}
    bad = set()
    for key, seeds in readers.items():
        lo, hi = pos[seeds[0]], pos[seeds[-1]]
        below = _closure(seeds, lambda n: (u.node for o in n.outputs for u in o.uses()), lambda n: pos.get(n, hi + 1) <= hi)
        above = _closure(seeds, lambda n: (v.producer() for v in n.inputs if v is not None), lambda n: pos.get(n, -1) >= lo)
        for node in below & above:
            if node in blocked or _has_subgraph(node):
                bad.add(key)
            elif owner.setdefault(node, key) != key:
                bad.update((key, owner[node]))
    owner = {n: k for n, k in owner.items() if k not in bad}
    owner.update(_epilogues(nodes, owner, blocked, free))
    for node in reversed(nodes):  # what only one sublayer reads and no weight reaches: its constants and shapes
        if node in owner or node in blocked or _has_subgraph(node) or not all(v in free for v in node.outputs):
            continue
        users = {owner.get(u.node) for o in node.outputs for u in o.uses()}
        if len(users) == 1 and None not in users:
            owner[node] = users.pop()
    regions: dict[tuple[int, str], list[ir.Node]] = {}
    for node in nodes:
        if node in owner:
            regions.setdefault(owner[node], []).append(node)
    return regions


def _epilogues(nodes, owner, blocked, free) -> dict[ir.Node, tuple[int, str]]:
    """Standard ops after a sublayer that read only its values (and free ones), where each of its values they
    read is read by nothing else outside: its cache write, its final view. A value the depth mixing also reads
    (a sublayer's output, which a stack unsqueezes) keeps its readers at the top."""
    found: dict[ir.Node, tuple[int, str]] = {}
    for node in nodes:
        if node in owner or node in blocked or node.domain not in _EPILOGUE_DOMAINS or _has_subgraph(node):
            continue
        sources = {owner.get(v.producer(), found.get(v.producer())) for v in node.inputs if v is not None and v not in free}
        if len(sources) == 1 and None not in sources:
            found[node] = sources.pop()
    changed = True
    while changed:
        changed = False
        for node, key in list(found.items()):
            for v in node.inputs:
                if v is None or v in free:
                    continue
                if (owner.get(v.producer(), found.get(v.producer())) != key
                        or any(owner.get(u.node, found.get(u.node)) != key for u in v.uses())):
                    del found[node]
                    changed = True
                    break
    return found


def _closure(seeds, step, keep) -> set[ir.Node]:
    seen = set(seeds)
    todo = list(seeds)
    while todo:
        for nxt in step(todo.pop()):
            if nxt is not None and nxt not in seen and keep(nxt):
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _free_values(nodes: list[ir.Node], main: ir.Graph, weights: set[str]) -> tuple[set[ir.Value], set[ir.Value]]:
    """(values no weight reaches, those of them that the user inputs reach): constants, and what the user inputs
    (tokens, positions, caches) give without a weight: sizes, cache reads, positions + 1."""
    sized = {v for v in main.inputs if v.name not in weights and not v.is_initializer()}
    free = set(sized)
    for node in nodes:
        if not _has_subgraph(node) and all(v is None or v in free for v in node.inputs):
            free.update(node.outputs)
            if any(v in sized for v in node.inputs):
                sized.update(node.outputs)
    return free, sized


def _has_subgraph(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())


def _boundary(members: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Value]]:
    """The values a region reads from outside (in order of first use) and those read outside it (graph order)."""
    inside = set(members)
    inputs: dict[ir.Value, None] = {}
    outputs = []
    for node in members:
        for v in node.inputs:
            if v is not None and v.producer() not in inside:
                inputs.setdefault(v)
        for v in node.outputs:
            if v.is_graph_output() or any(u.node not in inside for u in v.uses()):
                outputs.append(v)
    return list(inputs), outputs


def _structure(members, inputs, outputs) -> tuple:
    """The region's nodes with values named by position (inputs by index, the rest by producer and output)."""
    index: dict[ir.Value, tuple] = {v: ("in", k) for k, v in enumerate(inputs)}
    parts = []
    for j, node in enumerate(members):
        attrs = []
        for name, attr in sorted(node.attributes.items()):
            value = attr.value
            if attr.type == ir.AttributeType.TENSOR:
                value = (value.dtype, tuple(value.shape), value.tobytes())
            elif isinstance(value, (list, tuple)):
                value = tuple(value)
            attrs.append((name, attr.type, value))
        ins = tuple(None if v is None else index[v] for v in node.inputs)
        parts.append((node.domain, node.op_type, node.overload, ins, tuple(attrs), len(node.outputs)))
        for k, v in enumerate(node.outputs):
            index[v] = (j, k)
    return tuple(parts), tuple(index[v] for v in outputs)


def _input_names(inputs: list[ir.Value]) -> list[str]:
    """A weight by its path in the layer (attn.q_proj.weight), a cache by its kind, anything else x, x_1, ..."""
    names, seen = [], Counter()
    for v in inputs:
        where = sublayer_of(v.name) if v.name else None
        cache = _CACHE.match(v.name or "")
        name = where[2] if where else cache.group(1) if cache else "x"
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}_{seen[name] - 1}")
    return names


def _call(main: ir.Graph, function_name: str, members, inputs, outputs, name: str) -> None:
    """Replace the region by one call of the function; its nodes leave the main graph."""
    call = ir.node(function_name, inputs, domain=DOMAIN, num_outputs=len(outputs), name=name)
    inside = set(members)
    for new, old in zip(call.outputs, outputs):
        new.name, new.type, new.shape = old.name, old.type, old.shape
        for use in list(old.uses()):
            if use.node not in inside:
                use.node.replace_input_with(use.idx, new)
        for k, out in enumerate(main.outputs):
            if out is old:
                main.outputs[k] = new
    main.insert_after(members[-1], call)
    main.remove(members, safe=False)


def _function(name, members, inputs, outputs, opset: int) -> ir.Function:
    """The cut-out nodes of a kind's first region as the function's body. Its values lose their types and
    shapes, which hold for that layer only (a depth site's stack grows with depth): the call sites keep theirs."""
    formals = [ir.Value(name=n) for n in _input_names(inputs)]
    inside = set(members)
    for actual, formal in zip(inputs, formals):
        for use in list(actual.uses()):
            if use.node in inside:
                use.node.replace_input_with(use.idx, formal)
    for node in members:
        for v in node.outputs:
            v.type = v.shape = None
    body = ir.Graph(formals, outputs, nodes=members, opset_imports={"": opset, K3_DOMAIN: 1}, name=name)
    return ir.Function(DOMAIN, name, graph=body, attributes=[])


def k3_calls(model: ir.Model) -> Counter:
    """The k3 functions called, counted through the layer functions: one count per call in the main graph, and
    per layer function call one for each call in its body."""
    calls = Counter()
    for node in model.graph:
        if node.domain == K3_DOMAIN:
            calls[node.op_type] += 1
        elif node.domain == DOMAIN:
            body = model.functions[node.op_identifier()]
            calls.update(n.op_type for n in body if n.domain == K3_DOMAIN)
    return calls
