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

import yaml

from k3compile.ablation.mqar import MQAR
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


def _grid_points(grid: list[str]) -> list[list[tuple[str, str]]]:
    """'a.b=1,2' entries -> the cartesian product of (key, value) settings."""
    axes = []
    for entry in grid:
        key, sep, values = entry.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", key) or not values:
            raise AblateError(f"--grid {entry!r}: expected KEY=V1,V2,... (e.g. moe.top_k=2,4,8)")
        axes.append([(key, v.strip()) for v in values.split(",")])
    return [list(p) for p in itertools.product(*axes)] if axes else []


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
    if (steps if steps is not None else tokens) < 1:
        raise AblateError(f"{where}the budget must be at least 1, got {budget}")
    tasks = tuple(tasks)
    if not tasks or any(t not in TASKS for t in tasks) or len(set(tasks)) != len(tasks):
        raise AblateError(f"{where}tasks must be a comma list of {', '.join(TASKS)}, got {','.join(tasks) or 'none'}")
    seeds = tuple(seeds)
    if not seeds or any(type(s) is not int or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise AblateError(f"{where}seeds must be distinct non-negative integers, got {list(seeds)}")
    if jobs < 1:
        raise AblateError(f"{where}jobs must be at least 1, got {jobs}")
    if eval_every is not None and eval_every < 1:
        raise AblateError(f"{where}eval_every must be at least 1, got {eval_every}")
    task = mqar if isinstance(mqar, MQAR) else MQAR(**(mqar or {}))
    if "mqar" in tasks and (why := task.check()):
        raise AblateError(f"{where}{why}")
    if out is None:
        raise AblateError(f"{where}give an output folder (--out DIR)")
    base_path, overrides = Path(base), tuple(overrides)
    taken: set[str] = set()
    arms = [Variant(_unique_name("base", taken), base_path, overrides, _load(base_path, overrides))]
    for path in map(Path, variants):
        arms.append(Variant(_unique_name(path.stem, taken), path, overrides, _load(path, overrides)))
    for point in _grid_points(list(grid)):
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
    study = Study(arms, steps_of, seeds, tasks, task, data, every, jobs, Path(out), budget)
    if len(study.runs()) > MAX_RUNS:
        raise AblateError(f"{where}{len(study.runs())} runs is more than {MAX_RUNS}")
    return study


def load_study(path: str | Path, **cli) -> Study:
    """A STUDY.yaml (paths relative to it); `cli` options given on the command line take precedence."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise AblateError(f"cannot read study {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise AblateError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not data:
        raise AblateError(f"{path}: empty study (give base, variants or grid, and steps or tokens)")
    if not isinstance(data, dict):
        raise AblateError(f"{path}: a study is a mapping of {', '.join(sorted(STUDY_KEYS))}")
    unknown = sorted(set(data) - STUDY_KEYS)
    if unknown:
        raise AblateError(f"{path}: unknown study key {unknown[0]!r}; known: {', '.join(sorted(STUDY_KEYS))}")
    if "base" not in data:
        raise AblateError(f"{path}: the study names no base spec")
    here = path.parent

    def rel(name) -> Path:
        return Path(os.path.normpath(here / str(name)))

    def listed(key: str) -> list:
        value = data.get(key) or []
        if not isinstance(value, list):
            raise AblateError(f"{path}: {key} must be a list")
        return value

    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise AblateError(f"{path}: grid must map spec keys to lists of values")
    merged = {
        "base": rel(data["base"]),
        "variants": [rel(v) for v in listed("variants")],
        "grid": [f"{k}={','.join(str(x).lower() if isinstance(x, bool) else str(x) for x in (v if isinstance(v, list) else [v]))}"
                 for k, v in grid.items()],
        "steps": data.get("steps"), "tokens": data.get("tokens"),
        "seeds": tuple(listed("seeds") or [0]), "tasks": tuple(listed("tasks") or TASKS),
        "mqar": data.get("mqar"), "data": str(rel(data["data"])) if data.get("data") else None,
        "overrides": tuple(str(s) for s in listed("set")), "eval_every": data.get("eval_every"),
        "jobs": data.get("jobs", 1), "out": rel(data["out"]) if data.get("out") else None,
    }  # fmt: skip
    if merged["mqar"] is not None and not isinstance(merged["mqar"], dict):
        raise AblateError(f"{path}: mqar must map num_kv_pairs, seq_len, num_queries, vocab to integers")
    if merged["mqar"]:
        bad = sorted(set(merged["mqar"]) - set(MQAR.__dataclass_fields__))
        if bad:
            raise AblateError(f"{path}: unknown mqar key {bad[0]!r}; known: {', '.join(MQAR.__dataclass_fields__)}")
    for key, value in cli.items():
        if value is not None and value != () and value != []:
            merged[key] = value
    if cli.get("steps") is not None:
        merged["tokens"] = None
    if cli.get("tokens") is not None:
        merged["steps"] = None
    return resolve_study(**merged, source=str(path))


def describe(study: Study) -> str:
    return json.dumps(study.fingerprint(), sort_keys=True)
