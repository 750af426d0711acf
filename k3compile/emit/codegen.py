"""Readable Python for a bound graph: the `model.py` of an emitted package.

Nothing from the spec reaches the code unescaped: names and JSON go through
`repr`, and the graph's own code comes from torch.fx's printer.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import types

from torch import fx

from k3compile import __version__
from k3compile.spec.digest import spec_hash, spec_json
from k3compile.spec.schema import Spec


def _importable(obj) -> bool:
    """`from obj.__module__ import obj.__qualname__` is valid and gives back obj (no lambdas, locals, methods)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or not qualname.isidentifier():
        return False
    return getattr(sys.modules.get(module), qualname, None) is obj


def _names_read(*pieces: str) -> set[str]:
    """Every name the generated code pieces (functions, indented methods) read."""
    trees = [ast.parse(textwrap.dedent(piece)) for piece in pieces]
    return {n.id for t in trees for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _imports(globals_: dict, *code: str) -> list[str]:
    """Import lines for the names fx's generated code refers to (and the `code` pieces read, when given)."""
    lines = []
    used = _names_read(*code) if code else set(globals_)
    for name, obj in sorted(globals_.items()):
        if name not in used:
            continue
        if name in ("inf", "nan"):
            lines.append(f"from math import {name}")
        elif name == "NoneType":
            lines.append("NoneType = type(None)")
        elif name == "device":
            lines.append("from torch import device")
        elif getattr(obj, "__module__", None) == "builtins" and name == getattr(obj, "__name__", None):
            continue
        elif isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__}" + ("" if obj.__name__ == name else f" as {name}"))
        elif callable(obj) and _importable(obj):
            lines.append(f"from {obj.__module__} import {obj.__qualname__} as {name}")
        else:
            raise ValueError(f"generated code needs {name!r}, which cannot be imported")
    return sorted(set(lines), key=lambda s: (not s.startswith("import"), s))


def outlined(gm: fx.GraphModule, graph: str, method: str, spec: Spec) -> tuple[list[str], str, list[str]]:
    """(one function per sublayer kind, the graph as a method calling them, the imports both need)."""
    from k3compile.emit.outline import outline_graph

    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    if calls:  # emitted modules rebuild only parameters and buffers, not submodules' code
        raise ValueError(f"graph still calls submodules ({', '.join(calls[:3])}); inline them before emitting")
    functions, top, globals_ = outline_graph(gm, graph, spec)
    src = top.strip("\n").replace("def forward(self,", f"def {method}(self,", 1)
    body = "\n".join(("    " + line) if line.strip() else "" for line in src.splitlines())
    return functions, body, _imports(globals_, *functions, body)


def _persistent(gm: fx.GraphModule, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in gm.get_submodule(owner)._non_persistent_buffers_set


def tensor_rows(gm: fx.GraphModule, kind: str) -> list[tuple]:
    """(name, shape, dtype) per parameter, (name, shape, dtype, persistent) per buffer, in module order."""
    if kind == "parameters":
        return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in gm.named_parameters()]
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), _persistent(gm, n)) for n, t in gm.named_buffers()]


def packed_rows(packed: dict) -> list[tuple]:
    return [(w, p["data"], p["scale"], p["fmt"], p["block"], tuple(p["shape"])) for w, p in packed.items()]


_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")


def table_source(rows: list[tuple], names: int = 1) -> str:
    """A `layer_table(...)` call holding each distinct sublayer's rows once, or a tuple literal when the rows
    are not laid out layer by layer (top rows, then each layer's rows together in layer order, tail rows)."""
    from k3compile.emit.outline import sublayer_of

    matches = [_LAYER_NAME.match(r[0]) for r in rows]
    inside = [k for k, m in enumerate(matches) if m]
    if not inside:
        return _rows_literal(rows, "")
    first, last = inside[0], inside[-1]
    order = [int(matches[k].group(1)) for k in range(first, last + 1) if matches[k]]
    if len(inside) != last - first + 1 or order != sorted(order):
        return _rows_literal(rows, "")
    kinds: dict[tuple, int] = {}
    layers: list[list[int]] = [[] for _ in range(order[-1] + 1)]
    groups: dict[tuple[int, str], list[tuple]] = {}
    for k in range(first, last + 1):
        i, part, _ = sublayer_of(rows[k][0]) or (int(matches[k].group(1)), "", "")
        prefix = f"layers.{i}."
        groups.setdefault((i, part), []).append(tuple(v.removeprefix(prefix) if j < names else v
                                                      for j, v in enumerate(rows[k])))  # fmt: skip
    for (i, _), rel in groups.items():
        layers[i].append(kinds.setdefault(tuple(rel), len(kinds)))
    users = {k: [i for i, parts in enumerate(layers) if k in parts] for k in kinds.values()}
    kind_text = "".join(
        f"        (  # {k}: layers {_ranges(users[k])}\n{_rows_literal(list(rel), '            ', bare=True)}        ),\n"
        for rel, k in kinds.items()
    )
    return (
        "layer_table(\n"
        + (f"    top={_rows_literal(rows[:first], '    ')},\n" if first else "")
        + f"    kinds=(\n{kind_text}    ),\n"
        + f"    layers={_wrapped(tuple(tuple(p) for p in layers), '    ')},\n"
        + (f"    tail={_rows_literal(rows[last + 1 :], '    ')},\n" if last + 1 < len(rows) else "")
        + (f"    names={names},\n" if names != 1 else "")
        + ")"
    )


def _wrapped_string(text: str, width: int = 100) -> str:
    """A long string as adjacent literals in parentheses, one per line, cut after commas near `width`."""
    pieces, start = [], 0
    while start < len(text):
        end = start + width
        if end < len(text):
            cut = text.rfind(",", start, end)
            end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    if len(pieces) == 1:
        return repr(text)
    return "(\n" + "".join(f"    {p!r}\n" for p in pieces) + ")"


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], None
    for k, v in enumerate(values):
        if start is None:
            start = v
        if k + 1 == len(values) or values[k + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _rows_literal(rows: list[tuple], indent: str, bare: bool = False) -> str:
    """Rows one per line: bare (for inside another literal) or as a tuple literal."""
    if bare:
        return "".join(f"{indent}{r!r},\n" for r in rows)
    body = "".join(f"{indent}    {r!r},\n" for r in rows)
    return f"(\n{body}{indent})" if rows else "()"


def _wrapped(values: tuple, indent: str, width: int = 100) -> str:
    """A tuple literal of short values, wrapped at `width` columns."""
    lines, line = [], ""
    for v in values:
        item = f"{v!r}, "
        if len(indent) + 4 + len(line) + len(item) > width:
            lines.append(line.rstrip())
            line = ""
        line += item
    lines.append(line.rstrip())
    return "(\n" + "".join(f"{indent}    {ln}\n" for ln in lines) + f"{indent})"


def header(spec: Spec, passes: list[str], target: str, mode: str) -> str:
    return (
        f"# Generated by k3compile {__version__}; rebuild from the spec instead of editing.\n"
        f"# spec: {spec.name!r}, sha256 {spec_hash(spec)}\n"
        f"# passes: {', '.join(passes)}\n"
        f"# target: {target}, mode: {mode}\n"
    )


def merged_rows(merged: dict) -> list[tuple]:
    """(stacked buffer, member weight) per member of each of merge_projections' groups, members in row order."""
    return [(name, w) for name, members in merged.items() for w in members]


def _class(cls_name: str, base: str, doc: str, prefix: str, tables_gm: fx.GraphModule, packed: dict,
           default_device: str, methods: list[str], merged: dict | None = None) -> str:
    tables = (
        f"{prefix}_PARAMETERS = {table_source(tensor_rows(tables_gm, 'parameters'))}\n"
        f"{prefix}_BUFFERS = {table_source(tensor_rows(tables_gm, 'buffers'))}\n"
        f"{prefix}_PACKED = packed_table({table_source(packed_rows(packed), names=3)})\n"
    )
    if merged:
        tables += f"{prefix}_MERGED = {table_source(merged_rows(merged), names=2)}\n"
    return (
        f"{tables}\n\n"
        f"class {cls_name}({base}):\n"
        f'    """{doc}"""\n\n'
        f"    SPEC_JSON = SPEC_JSON\n"
        f"    PARAMETERS = {prefix}_PARAMETERS\n"
        f"    BUFFERS = {prefix}_BUFFERS\n"
        f"    PACKED = {prefix}_PACKED\n"
        + (f"    MERGED = {prefix}_MERGED\n" if merged else "")
        + f"    DEFAULT_DEVICE = {default_device!r}\n\n"
        + "\n\n".join(methods)
        + "\n"
    )


K3_CALL = re.compile(r"torch\.ops\.k3\.(\w+)\.default\(")
K3_BOUND_CALL = re.compile(r"torch\.ops\.k3\.(\w+)\.default\((.*?), backend = '(torch|c)'\)")
DIRECT_MODULES = {"torch": "direct", "c": "direct.c"}


def direct_calls(code: str) -> str:
    """`code` calling k3compile.ops.direct instead of the dispatcher: every k3 op call there is bound to its
    PyTorch reference (backend "torch": `direct.<op>`) or its C kernel (backend "c": `direct.c.<op>`), whose
    direct forms run the same functions without the custom op's per-call overhead."""
    out = K3_BOUND_CALL.sub(lambda m: f"{DIRECT_MODULES[m[3]]}.{m[1]}({m[2]})", code)
    if K3_CALL.search(out):
        raise ValueError("direct calls need every k3 op bound to backend 'torch' or 'c'")
    return out


def model_source(
    spec: Spec,
    passes: list[str],
    target: str,
    graphs: dict[str, fx.GraphModule],
    default_device: str,
    packed: dict[str, dict],
) -> str:
    """The text of model.py: `Model` from the train graph, `InferenceModel` from the prefill and decode graphs."""
    imports: set[str] = set()
    classes = []
    functions: list[str] = []
    if "train" in graphs:
        funcs, body, imps = outlined(graphs["train"], "train", "graph", spec)
        if target == "cpu":  # the CPU training module calls its ops directly (k3compile.ops.direct)
            funcs, body = [direct_calls(f) for f in funcs], direct_calls(body)
            imps = [*imps, "from k3compile.ops import direct"]
        functions += funcs
        imports.update(imps)
        doc = "Training module: forward(tokens, labels=None) -> logits, or the mean next-token loss."
        classes.append(_class("Model", "TrainingModule", doc, "TRAIN", graphs["train"], packed["train"],
                              default_device, [body]))  # fmt: skip
    if "prefill" in graphs:
        _check_same_tensors(graphs["prefill"], graphs["decode"])
        methods = []
        for graph in ("prefill", "decode"):
            funcs, body, imps = outlined(graphs[graph], graph, f"{graph}_graph", spec)
            functions += funcs
            imports.update(imps)
            methods.append(body)
        doc = "Inference module: prefill(tokens) and decode(tokens, cache) through the compiled graphs; forward(tokens) -> logits."
        classes.append(_class("InferenceModel", "InferenceModule", doc, "INFER", graphs["prefill"], packed["prefill"],
                              default_device, methods, graphs["decode"].meta.get("merged")))  # fmt: skip
    lines = [header(spec, passes, target, "+".join(graphs)), '"""The model, generated from its bound graphs."""', ""]
    lines += sorted(i for i in imports if i.startswith("import"))
    lines += sorted(i for i in imports if not i.startswith("import"))
    lines += ["", "import k3compile.ops  # noqa: F401  (registers the torch.ops.k3 operators)", ""]
    runtime = ["InferenceModule", "TrainingModule", "layer_table", "packed_table"]
    runtime += ["layer_steps"] if any("= layer_steps(" in f for f in functions) else []
    lines += [f"from k3compile.runtime.generated import {', '.join(sorted(runtime))}", ""]
    lines += [f"SPEC_JSON = {_wrapped_string(spec_json(spec))}", f"TARGET = {target!r}  # the kernels' target (see bind_kernels)", "", ""]
    return "\n".join(lines) + "\n\n".join(functions) + "\n\n" + "\n\n".join(classes)


def _check_same_tensors(a: fx.GraphModule, b: fx.GraphModule) -> None:
    """The prefill and decode graphs read one set of weights (one InferenceModel holds both; merge_projections'
    stacked buffers are views of them)."""
    def names(gm):
        merged = gm.meta.get("merged", {})
        return sorted(n for n, _ in gm.named_parameters()) + sorted(n for n, _ in gm.named_buffers() if n not in merged)

    if names(a) != names(b):
        only = sorted(set(names(a)) ^ set(names(b)))
        raise ValueError(f"prefill and decode graphs hold different tensors: {', '.join(only[:5])}")
