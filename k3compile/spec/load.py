"""Loading specs: safe YAML with source positions, `extends:`, `--set` overrides, one-line errors.

Every failure becomes a `SpecError` whose lines read `file:line:col: field.path: what is wrong`.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from k3compile import safe_io
from k3compile.spec.schema import FieldError, Spec

MAX_FILE_BYTES = 1 << 20  # a spec is a page of YAML, not a data set
MAX_NODES = 50_000  # bounds alias expansion ("billion laughs") and absurd documents
MAX_EXTENDS_DEPTH = 16
MAX_ERROR_LINES = 20  # a screenful; the last line counts the rest

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Loc:
    """A position in a source: file (or override label), 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class SpecError(Exception):
    """A bad spec: one or more one-line messages, each `where: field.path: what`."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


_PLAIN_KEY = re.compile(r"[^\s:'\"]+")


def _fmt_path(path: Path_) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            name = p if _PLAIN_KEY.fullmatch(p) else repr(p)  # keep `file:line:col: path: what` one parseable line
            out += f".{name}" if out else name
    return out or "<spec>"


def _err(loc: Loc | str, path: Path_, msg: str) -> SpecError:
    return SpecError([f"{loc}: {_fmt_path(path)}: {msg}"])


# ---------------------------------------------------------------- YAML with positions


class _Budget:
    def __init__(self):
        self.nodes = 0

    def tick(self, file: str, node: yaml.Node) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            m = node.start_mark
            raise SpecError([f"{file}:{m.line + 1}:{m.column + 1}: <spec>: document too large (over {MAX_NODES} nodes)"])


def _mark(file: str, node: yaml.Node) -> Loc:
    return Loc(file, node.start_mark.line + 1, node.start_mark.column + 1)


_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")  # a tagged collection (!!set, !!python/...) is refused


def _to_python(node: yaml.Node, file: str, path: Path_, locs: dict, budget: _Budget, ctor) -> Any:
    """Build plain data from a composed node, recording where each path came from."""
    budget.tick(file, node)
    if isinstance(node, yaml.CollectionNode) and node.tag not in _PLAIN_TAGS:
        raise _err(_mark(file, node), path, f"unsupported YAML tag {node.tag}")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise _err(_mark(file, key_node), path, "mapping keys must be plain names")
            key = _construct(ctor, key_node, file, path)
            if not isinstance(key, str):
                raise _err(_mark(file, key_node), path, f"key {key!r} is not a name")
            if key in out:
                raise _err(_mark(file, key_node), path + (key,), "duplicate key")
            locs[path + (key,)] = _mark(file, key_node)
            out[key] = _to_python(value_node, file, path + (key,), locs, budget, ctor)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            locs[path + (i,)] = _mark(file, item)
            items.append(_to_python(item, file, path + (i,), locs, budget, ctor))
        return items
    value = _construct(ctor, node, file, path)
    if isinstance(value, (bytes, bytearray)) or type(value).__module__ == "datetime":
        raise _err(_mark(file, node), path, f"unsupported YAML value {node.tag}")
    return value


def _construct(ctor, node: yaml.ScalarNode, file: str, path: Path_) -> Any:
    """A scalar's value; PyYAML's constructors raise plain Python errors on bad tagged text (`!!int abc`)."""
    try:
        return ctor.construct_object(node, deep=True)
    except yaml.YAMLError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        raise _err(_mark(file, node), path, f"cannot read {node.value[:40]!r} as {node.tag}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _parse_yaml(text: str, file: str, spec: bool = True) -> tuple[Any, dict]:
    """(plain data, where each path came from) of YAML text; a spec must be a non-empty mapping (`spec=False`:
    any document, None when empty)."""
    locs: dict[Path_, Loc] = {}
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None and not spec:
                return None, locs
            if root is None:
                raise SpecError([f"{file}:1:1: <spec>: the file is empty"])
            locs[()] = _mark(file, root)
            if spec and not isinstance(root, yaml.MappingNode):
                raise _err(_mark(file, root), (), "the top level must be a mapping of fields")
            data = _to_python(root, file, (), locs, _Budget(), loader)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        m = e.problem_mark or e.context_mark
        where = f"{file}:{m.line + 1}:{m.column + 1}" if m else f"{file}:1:1"
        what = _one_line(" ".join(str(p) for p in (e.context, e.problem) if p))
        raise SpecError([f"{where}: <yaml>: invalid YAML: {what}"]) from None
    except yaml.YAMLError as e:
        raise SpecError([f"{file}:1:1: <yaml>: invalid YAML: {_one_line(str(e))}"]) from None
    except RecursionError:
        raise SpecError([f"{file}:1:1: <yaml>: nesting too deep"]) from None
    return data, locs


def _read(path: Path, loc: Loc | str, field: Path_, what: str = "a spec") -> str:
    """The text of a spec file through the bounded reader (k3compile.safe_io): a regular file of at most
    MAX_FILE_BYTES, read up to that cap (its st_size is not trusted); devices (/dev/zero), pipes and sockets are
    refused before any read."""
    try:
        return safe_io.read_text(path, MAX_FILE_BYTES, what=what)
    except safe_io.MissingFile:
        raise _err(loc, field, f"no such file: {safe_io.shown(_display(path))}") from None
    except safe_io.FileError as e:
        raise _err(loc, field, str(e)) from None


def _resolve(path: Path, loc: Loc | str, field: Path_) -> Path:
    """`path` with symbolic links resolved; a link loop, an over-long name or a NUL byte is a SpecError."""
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError) as e:  # RuntimeError: a link loop (before Python 3.13)
        why = "a symbolic-link loop" if isinstance(e, RuntimeError) else getattr(e, "strerror", None) or str(e)
        raise _err(loc, field, f"cannot resolve {safe_io.shown(path)}: {why}") from None


# ---------------------------------------------------------------- extends and overrides


def _merge(base: dict, top: dict) -> dict:
    """Deep-merge `top` over `base`: mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _load_file(
    path: Path, chain: tuple[Path, ...], loc: Loc | str, field: Path_, root: Path | None
) -> tuple[dict, dict]:
    """A spec file merged over the files its `extends:` chain names; `root` bounds where those lie (None: anywhere)."""
    path = _resolve(path, loc, field)
    if path in chain:
        cycle = " -> ".join(p.name for p in chain + (path,))
        raise _err(loc, field, f"extends cycle: {cycle}")
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise _err(loc, field, f"extends chain deeper than {MAX_EXTENDS_DEPTH}")
    file = _display(path)
    text = _read(path, loc, field)
    data, locs = _parse_extended(text, file, loc) if chain else _parse_yaml(text, file)
    parent = data.pop("extends", None)
    if parent is None:
        return data, locs
    ploc = locs[("extends",)]
    if not isinstance(parent, str) or not parent or "\0" in parent:
        raise _err(ploc, ("extends",), "extends must be a relative path to another spec file")
    target = _extends_target(path, parent, ploc, root)
    base, base_locs = _load_file(target, chain + (path,), ploc, ("extends",), root)
    locs.pop(("extends",), None)
    return _merge(base, data), {**base_locs, **locs}


def spec_root(path: Path) -> Path:
    """Where `extends:` may lead from the spec at `path`: the working folder when the spec lies inside it
    (unless that is the filesystem root), else the spec's own folder."""
    cwd, spec = Path.cwd().resolve(), _resolve(Path(path), f"{safe_io.shown(path)}:1:1", ())
    return cwd if spec.is_relative_to(cwd) and cwd != Path(cwd.anchor) else spec.parent


def _extends_target(spec_file: Path, parent: str, loc: Loc, root: Path | None) -> Path:
    """The file an `extends:` names, relative to the file naming it; inside `root` (after symlinks) unless None."""
    target = spec_file.parent / parent
    if root is None:
        return target
    if Path(parent).is_absolute():
        raise _err(loc, ("extends",), f"{parent!r} is an absolute path; extends takes a path relative to the "
                   "spec (--extends-anywhere allows others)")
    if not _resolve(target, loc, ("extends",)).is_relative_to(root):
        raise _err(loc, ("extends",), f"{parent!r} leads outside the spec root {root} (the working folder, or "
                   "the spec's own when it lies outside that); --extends-anywhere allows it")
    return target


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _parse_extended(text: str, file: str, loc: Loc | str) -> tuple[dict, dict]:
    """Parse a file reached through `extends:`; unless it is shaped like a spec, say so without showing any of it.

    Only the spec named by the user gets errors quoting its text: a file it extends may be anything (a key
    file, /etc/shadow), and YAML errors or wrong values would echo its contents. A file whose top level is a
    mapping of spec fields is a spec and gets the usual errors; of any other, at most one field name is shown.
    """

    def refuse(why: str) -> SpecError:
        return _err(loc, ("extends",), f"{file} is not a k3compile spec ({why})")

    try:
        data, locs = _parse_yaml(text, file)
    except SpecError:
        raise refuse("not a YAML mapping of spec fields; check it on its own for details") from None
    unknown = next((k for k in data if k not in Spec.model_fields and k != "extends"), None)
    if unknown is not None:
        if not _FIELD_NAME.fullmatch(unknown):
            raise refuse("a top-level key is not a spec field")
        close = difflib.get_close_matches(unknown, list(Spec.model_fields), n=1, cutoff=0.6)
        raise refuse(f"unknown top-level field {unknown!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    return data, locs


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _parse_value(raw: str, loc: Loc, parts: Path_) -> Any:
    """An override value, read like a file's values: same safe subset, node budget (no alias bombs), one-line errors."""
    try:
        loader = yaml.SafeLoader(raw)
        try:
            node = loader.get_single_node()
            return None if node is None else _to_python(node, loc.file, parts, {}, _Budget(), loader)
        finally:
            loader.dispose()
    except (yaml.YAMLError, RecursionError):
        raise _err(loc, parts, f"cannot parse override value {raw[:40]!r}") from None


def _apply_override(data: dict, locs: dict, text: str, index: int) -> None:
    label = f"--set[{index}]"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise _err(f"{label}:1:1", (), f"override {text!r} is not of the form a.b=value")
    parts: Path_ = tuple(key.split("."))
    if any(not p.isidentifier() for p in parts):
        raise _err(f"{label}:1:1", parts, f"override key {key!r} is not a dotted field path")
    loc = Loc(label, 1, len(key) + 2)
    value = _parse_value(raw, loc, parts)
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
            locs.setdefault(parts[: i + 1], loc)  # a section the override creates is located at the override
        elif not isinstance(child, dict):
            raise _err(f"{label}:1:1", parts[: i + 1], "is a value, not a section")
        node = child
    node[parts[-1]] = value
    for p in [q for q in locs if q[: len(parts)] == parts]:
        del locs[p]
    locs[parts] = loc


# ---------------------------------------------------------------- validation errors


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes an annotation may hold (through Optional, Annotated, tuples)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, tuple, list):
        return [m for a in typing.get_args(annotation) if a is not Ellipsis for m in _unwrap(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _model_at(path: Path_) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Spec
    for p in path:
        if isinstance(p, int):
            continue
        if model is None or p not in model.model_fields:
            return None
        candidates = _unwrap(model.model_fields[p].annotation)
        model = candidates[0] if candidates else None
    return model


def _locate(locs: dict, path: Path_, root: Loc | str) -> Loc | str:
    for n in range(len(path), -1, -1):
        if path[:n] in locs:
            return locs[path[:n]]
    return root


def _data_path(loc: tuple, data: Any) -> Path_:
    """An error's loc as a path in the data: pydantic's own tags (`function-after[...]`) dropped, user keys kept."""
    path: list[str | int] = []
    for p in loc:
        if isinstance(data, dict) and p in data or isinstance(data, list) and isinstance(p, int) and 0 <= p < len(data):
            path.append(p)
            data = data[p]
        elif not (isinstance(p, str) and ("[" in p or p.startswith("function-"))):
            path.append(p)
            data = None
    return tuple(path)


def _describe(err: dict, data: dict) -> tuple[Path_, str]:
    path = _data_path(err["loc"], data)
    kind = err["type"]
    if kind == "extra_forbidden":
        key = path[-1]
        model = _model_at(path[:-1])
        hint = ""
        if model is not None:
            close = difflib.get_close_matches(str(key), list(model.model_fields), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(model.model_fields)}"
        return path, f"unknown field {str(key)!r}{hint}"
    if kind == "missing":
        return path, "required field is missing"
    ctx_err = err.get("ctx", {}).get("error")
    if isinstance(ctx_err, FieldError):
        return path + tuple(ctx_err.path.split(".")), str(ctx_err)
    msg = err["msg"].removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and "input" in err:
        shown = repr(err["input"])
        msg += f" (got {shown if len(shown) <= 40 else shown[:37] + '...'})"
    return path, msg


def _validate(data: dict, locs: dict, root: Loc | str) -> Spec:
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors(include_url=False):
            path, msg = _describe(err, data)
            lines.append((_locate(locs, path, root), _fmt_path(path), msg))
        raise SpecError(_capped(lines)) from None


def _capped(lines: list[tuple[Loc | str, str, str]]) -> list[str]:
    """`where: path: what` lines, at most MAX_ERROR_LINES: a list of 20,000 bad values does not print 20,000 lines."""
    if len(lines) <= MAX_ERROR_LINES:
        return [f"{loc}: {path}: {msg}" for loc, path, msg in lines]
    shown = [f"{loc}: {path}: {msg}" for loc, path, msg in lines[: MAX_ERROR_LINES - 1]]
    loc, path, _ = lines[MAX_ERROR_LINES - 1]
    return shown + [f"{loc}: {path}: {len(lines) - len(shown):,} more errors from here on, not shown"]


# ---------------------------------------------------------------- public API


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = (), extends_anywhere: bool = False) -> Spec:
    """Load, merge (`extends:`), override (`a.b=value`) and validate a spec file.

    `extends:` paths are relative and stay inside `spec_root(path)`; `extends_anywhere` lifts that (opt-in).
    """
    path = Path(path)
    root = None if extends_anywhere else spec_root(path)
    data, locs = _load_file(path, (), f"{path}:1:1", (), root)
    for i, text in enumerate(overrides, 1):
        _apply_override(data, locs, text, i)
    return _validate(data, locs, f"{_display(path)}:1:1")


def read_yaml(path: str | Path, what: str = "a study") -> Any:
    """The plain data of a YAML file that is not a spec (a study), read and parsed exactly as a spec is: the
    bounded reader, the safe subset (no tags), the node budget and the nesting limit; None for an empty file.
    A problem is a SpecError naming the file."""
    path = Path(path)
    return _parse_yaml(_read(path, f"{_display(path)}:1:1", (), what), _display(path), spec=False)[0]


def load_spec_text(text: str, file: str = "<string>") -> Spec:
    """Validate a spec given as YAML text (no `extends:`)."""
    data, locs = _parse_yaml(text, file)
    if "extends" in data:
        raise _err(locs[("extends",)], ("extends",), "extends needs a spec file, not text")
    return _validate(data, locs, f"{file}:1:1")
