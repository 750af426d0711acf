"""A study: a base spec, its variants (spec files and grid points), one budget, seeds and tasks, resolved and checked.

Everything is validated here, before anything is built, trained or written: a variant that does not validate,
an unknown grid key and an empty study are one-line `AblateError`s naming the file or the key.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from k3compile.ablation.mqar import MQAR
from k3compile.safe_io import shown
from k3compile.spec.schema import Spec

TASKS = ("lm", "mqar")
STUDY_KEYS = {"base", "variants", "grid", "steps", "tokens", "seeds", "tasks", "mqar", "data", "set", "eval_every",
              "jobs", "out"}
MAX_RUNS = 10_000


class AblateError(ValueError):
    """Bad study input; one line naming the file or key."""


@dataclass(frozen=True)
class Variant:
    """One arm of the study: a spec file plus overrides (the study's `set`, then the grid point's)."""

    name: str
    path: Path
    overrides: tuple[str, ...]
    spec: Spec

    def run_spec(self, task: str, seed: int, mqar: MQAR) -> tuple[str, ...]:
        """The overrides of one run: the seed, and MQAR's sequence length for the recall task."""
        extra = (f"training.seed={seed}",) + ((f"training.seq_len={mqar.seq_len}",) if task == "mqar" else ())
        return self.overrides + extra


@dataclass(frozen=True)
class RunKey:
    variant: str
    task: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.variant}/{self.task}-seed{self.seed}"


@dataclass
class Study:
    variants: list[Variant]  # the base first
    steps: dict[str, int]  # per variant: the same token budget may mean other step counts at other batch sizes
    seeds: tuple[int, ...]
    tasks: tuple[str, ...]
    mqar: MQAR
    data: str | None
    eval_every: int
    jobs: int
    out: Path
    budget: dict = field(default_factory=dict)  # what the user asked for: {"steps": N} or {"tokens": N}

    @property
    def base(self) -> Variant:
        return self.variants[0]

    def runs(self) -> list[RunKey]:
        return [RunKey(v.name, t, s) for v in self.variants for t in self.tasks for s in self.seeds]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def fingerprint(self) -> dict:
        """What must match for a rerun into the same folder to continue this study."""
        return {
            "variants": {v.name: hashlib.sha256(v.spec.model_dump_json().encode()).hexdigest() for v in self.variants},
            "steps": self.steps, "seeds": list(self.seeds), "tasks": list(self.tasks), "mqar": asdict(self.mqar),
            "data": self.data, "eval_every": self.eval_every,
        }  # fmt: skip


def _load(path: Path, overrides: tuple[str, ...]) -> Spec:
    from k3compile.spec.load import SpecError, load_spec

    try:
        return load_spec(path, list(overrides))
    except SpecError as e:
        raise AblateError(f"variant {path} does not validate: {e.lines[0]}") from None
    except (OSError, ValueError) as e:
        raise AblateError(f"variant {path}: {e}") from None


def _grid_axes(grid: list[str]) -> list[list[tuple[str, str]]]:
    """'a.b=1,2' entries -> per entry its (key, value) settings; the points are their cartesian product."""
    axes = []
    for entry in grid:
        if not isinstance(entry, str):
            raise AblateError(f"--grid {shown(entry, 60, quote=True)}: expected KEY=V1,V2,... (e.g. moe.top_k=2,4,8)")
        key, sep, values = entry.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key) or not values:
            raise AblateError(f"--grid {shown(entry, 60, quote=True)}: expected KEY=V1,V2,... (e.g. moe.top_k=2,4,8)")
        axes.append([(key, v.strip()) for v in values.split(",")])
    return axes


def _check_int(value, what: str, where: str) -> None:
    if type(value) is not int or value < 1:
        raise AblateError(f"{where}{what} must be an integer of at least 1, got {shown(value, 40, quote=True)}")


def _mqar(mqar, where: str) -> MQAR:
    """The MQAR task of a study's `mqar` mapping (or an MQAR): known keys, integer values."""
    if isinstance(mqar, MQAR):
        return mqar
    if not isinstance(mqar, dict | None):
        raise AblateError(f"{where}mqar must map {', '.join(MQAR.__dataclass_fields__)} to integers")
    for key, value in (mqar or {}).items():
        if key not in MQAR.__dataclass_fields__:
            raise AblateError(f"{where}unknown mqar key {shown(key, 40, quote=True)}; known: "
                              f"{', '.join(MQAR.__dataclass_fields__)}")
        _check_int(value, f"mqar.{key}", where)
    return MQAR(**(mqar or {}))


def _check_grid_key(base: Variant, key: str) -> None:
    """An unknown grid key is named as such (not as a spec error further down)."""
    node: object = Spec
    for part in key.split("."):
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            raise AblateError(f"unknown grid key {key!r} (no spec field {part!r} there)")
        annotation = fields[part].annotation
        args = getattr(annotation, "__args__", (annotation,))
        node = next((a for a in args if hasattr(a, "model_fields")), None)


def _unique_name(name: str, taken: set[str]) -> str:
    out, n = name, 2
    while out in taken:
        out, n = f"{name}-{n}", n + 1
    taken.add(out)
    return out


def resolve_study(
    base: str | Path, variants=(), grid=(), steps: int | None = None, tokens: int | None = None, seeds=(0,),
    tasks=("lm", "mqar"), mqar: MQAR | dict | None = None, data: str | None = None, overrides=(),
    eval_every: int | None = None, jobs: int = 1, out: str | Path | None = None, source: str = "",
) -> Study:  # fmt: skip
    """Check and resolve every input of a study; `source` names the study file in errors."""
    where = f"{source}: " if source else ""
    if steps is not None and tokens is not None:
        raise AblateError(f"{where}give steps or tokens, not both")
    if steps is None and tokens is None:
        raise AblateError(f"{where}give a budget: steps or tokens")
    budget = {"steps": steps} if steps is not None else {"tokens": tokens}
    _check_int(steps if steps is not None else tokens, "the budget" if steps is None else "steps", where)
    tasks = tuple(tasks)
    if not tasks or any(t not in TASKS for t in tasks) or len(set(tasks)) != len(tasks):
        shown_tasks = ",".join(map(str, tasks)) or "none"
        raise AblateError(f"{where}tasks must be a comma list of {', '.join(TASKS)}, got {shown(shown_tasks, 60)}")
    seeds = tuple(seeds)
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise AblateError(f"{where}seeds must be distinct non-negative integers, got {shown(list(seeds), 60)}")
    _check_int(jobs, "jobs", where)
    if eval_every is not None:
        _check_int(eval_every, "eval_every", where)
    task = _mqar(mqar, where)
    if "mqar" in tasks and (why := task.check()):
        raise AblateError(f"{where}{why}")
    if out is None:
        raise AblateError(f"{where}give an output folder (--out DIR)")
    variants, overrides = list(variants), tuple(overrides)
    for value in (base, *variants, *overrides, data, out):
        if value is not None and (not isinstance(value, str | os.PathLike) or "\0" in str(value)):
            raise AblateError(f"{where}{shown(value, 60, quote=True)} is not a path or an override")
    axes = _grid_axes(list(grid))  # the number of runs is bounded before any point is made or any spec read
    runs = (1 + len(variants) + (math.prod(map(len, axes)) if axes else 0)) * len(tasks) * len(seeds)
    if runs > MAX_RUNS:
        raise AblateError(f"{where}{runs:,} runs is more than {MAX_RUNS:,}")
    base_path = Path(base)
    taken: set[str] = set()
    arms = [Variant(_unique_name("base", taken), base_path, overrides, _load(base_path, overrides))]
    for path in map(Path, variants):
        arms.append(Variant(_unique_name(path.stem, taken), path, overrides, _load(path, overrides)))
    for point in (list(p) for p in itertools.product(*axes)) if axes else ():
        for key, _ in point:
            _check_grid_key(arms[0], key)
        sets = tuple(f"{k}={v}" for k, v in point)
        name = _unique_name(",".join(sets), taken)
        try:
            spec = _load(base_path, overrides + sets)
        except AblateError as e:
            raise AblateError(f"grid point {name}: {str(e).split(': ', 1)[1]}") from None
        arms.append(Variant(name, base_path, overrides + sets, spec))
    if len(arms) == 1:
        raise AblateError(f"{where}empty study: no variants and no grid to compare with the base {base_path}")
    per_step = {v.name: v.spec.training.batch_size * v.spec.training.seq_len for v in arms}
    steps_of = {n: steps if steps is not None else max(1, math.ceil(tokens / t)) for n, t in per_step.items()}
    every = eval_every or max(1, min(steps_of.values()) // 6)
    return Study(arms, steps_of, seeds, tasks, task, data, every, jobs, Path(out), budget)


def load_study(path: str | Path, **cli) -> Study:
    """A STUDY.yaml (paths relative to it); `cli` options given on the command line take precedence.

    The file is read as a spec is (bounded, plain YAML, the node budget) and every key is type-checked.
    """
    from k3compile.spec.load import SpecError, read_yaml

    path = Path(path)
    try:
        data = read_yaml(path)
    except SpecError as e:
        raise AblateError(e.lines[0]) from None
    if not data:
        raise AblateError(f"{path}: empty study (give base, variants or grid, and steps or tokens)")
    if not isinstance(data, dict):
        raise AblateError(f"{path}: a study is a mapping of {', '.join(sorted(STUDY_KEYS))}")
    unknown = sorted(set(data) - STUDY_KEYS)
    if unknown:
        raise AblateError(f"{path}: unknown study key {unknown[0]!r}; known: {', '.join(sorted(STUDY_KEYS))}")
    if "base" not in data:
        raise AblateError(f"{path}: the study names no base spec")
    try:
        doc = _StudyFile.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "union[")))
        raise AblateError(f"{path}: {field}: {err['msg']}") from None
    here = path.parent

    def rel(name: str) -> Path:
        return Path(os.path.normpath(here / name))

    merged = {
        "base": rel(doc.base),
        "variants": [rel(v) for v in doc.variants or []],
        "grid": [f"{k}={','.join(str(x).lower() if isinstance(x, bool) else str(x) for x in (v if isinstance(v, list) else [v]))}"
                 for k, v in (doc.grid or {}).items()],
        "steps": doc.steps, "tokens": doc.tokens, "seeds": tuple(doc.seeds or [0]), "tasks": tuple(doc.tasks or TASKS),
        "mqar": doc.mqar, "data": str(rel(doc.data)) if doc.data else None, "overrides": tuple(doc.set or []),
        "eval_every": doc.eval_every, "jobs": doc.jobs, "out": rel(doc.out) if doc.out else None,
    }  # fmt: skip
    for key, value in cli.items():
        if value is not None and value != () and value != []:
            merged[key] = value
    if cli.get("steps") is not None:
        merged["tokens"] = None
    if cli.get("tokens") is not None:
        merged["steps"] = None
    return resolve_study(**merged, source=str(path))


_Path = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
_Scalar = StrictBool | StrictInt | StrictFloat | StrictStr


class _StudyFile(BaseModel):
    """A study file's keys and their types (values are checked further by `resolve_study`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    base: _Path
    variants: list[_Path] | None = None
    grid: dict[str, list[_Scalar] | _Scalar] | None = None
    steps: int | None = None
    tokens: int | None = None
    seeds: list[int] | None = None
    tasks: list[str] | None = None
    mqar: dict[str, int] | None = None
    data: _Path | None = None
    set: list[str] | None = None
    eval_every: int | None = None
    jobs: int = 1
    out: _Path | None = None


def describe(study: Study) -> str:
    return json.dumps(study.fingerprint(), sort_keys=True)
