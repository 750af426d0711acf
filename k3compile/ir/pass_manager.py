"""The pass manager: an ordered list of declared passes, the graph verified after each.

Modelled on MLIR's: every pass declares a name, a one-line summary, whether it
preserves numerics and the statistics it reports; the IR can be dumped after any
pass; a failure names the pass and leaves a reproducer (the spec and the pass
list up to the failure).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx

from k3compile.ir.verify import GraphVerificationError, eliminate_dead_code, format_graph, verify_graph
from k3compile.spec.schema import Spec


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: the spec and the build's choices."""

    spec: Spec
    mode: str = "train"  # "train" or "infer"
    target: str = "cpu"
    graph: str = ""  # "train", "prefill" or "decode"; default: the train graph or, in infer mode, prefill
    cpu_kernels: str = "auto"  # the CPU target's C kernels: "auto" (where they build), "c" or "torch"

    def __post_init__(self):
        if not self.graph:
            object.__setattr__(self, "graph", "train" if self.mode == "train" else "prefill")


@dataclass(frozen=True)
class GraphPass:
    """A declared pass: `run(gm, ctx)` rewrites gm in place and returns its statistics."""

    name: str
    summary: str
    preserves_numerics: bool
    statistics: tuple[str, ...]
    run: Callable[[fx.GraphModule, PassContext], dict[str, int]]
    mode_dependent: bool = False  # reads ctx.mode: train and infer graphs part here
    rtol: float | None = None  # --verify-numerics tolerance when not the manager's (bind_kernels: other kernels)


@dataclass
class PassRecord:
    name: str
    summary: str
    preserves_numerics: bool
    status: str  # "ran" | "disabled"
    statistics: dict[str, int] = field(default_factory=dict)
    max_rel_diff: float | None = None  # with --verify-numerics on a numerics-preserving pass

    def as_dict(self) -> dict:
        d = {
            "name": self.name,
            "summary": self.summary,
            "preserves_numerics": self.preserves_numerics,
            "status": self.status,
            "statistics": self.statistics,
        }
        if self.max_rel_diff is not None:
            d["max_rel_diff"] = self.max_rel_diff
        return d


class PassFailure(Exception):
    """A pass raised or left an invalid graph; names the pass and where the reproducer is."""

    def __init__(self, pass_name: str, cause: str, reproducer: Path | None):
        where = f" (reproducer: {reproducer})" if reproducer else ""
        super().__init__(f"pass '{pass_name}' failed: {cause}{where}")
        self.pass_name = pass_name
        self.reproducer = reproducer


class NumericsMismatch(Exception):
    """A pass declared numerics-preserving changed the outputs of a real instance."""


def _rel_diff(a, b) -> float:
    a_t = a if isinstance(a, torch.Tensor) else a[0]
    b_t = b if isinstance(b, torch.Tensor) else b[0]
    a_t, b_t = a_t.double(), b_t.double()
    return float((a_t - b_t).norm() / b_t.norm().clamp_min(1e-30))


@dataclass
class PassManager:
    """Runs passes in order over a graph, verifying after each.

    `dump_after` names passes (or 'all') after which the graph text goes to `on_dump(name, text)`;
    `numerics` is (graph, inputs) of a small real instance that runs every pass too and is
    compared before and after each numerics-preserving one (`--verify-numerics`). Between passes
    shapes are re-propagated only where a pass changed the graph, and fully once at the end; with
    `check_every_pass`, dumps or numerics checks every pass gets the full check.
    """

    passes: list[GraphPass]
    disabled: frozenset[str] = frozenset()
    dump_after: frozenset[str] = frozenset()
    on_dump: Callable[[str, str], None] | None = None
    on_pass: Callable[[str], None] | None = None
    numerics: tuple[fx.GraphModule, tuple] | None = None
    rtol: float = 1e-5
    reproducer_root: Path | None = None
    records: list[PassRecord] = field(default_factory=list)
    check_every_pass: bool = False

    def __post_init__(self):
        known = {p.name for p in self.passes}
        for name in self.disabled | (self.dump_after - {"all"}):
            if name not in known:
                raise ValueError(f"unknown pass '{name}'; passes are: {', '.join(p.name for p in self.passes)}")

    def run(
        self, gm: fx.GraphModule, ctx: PassContext, example_inputs: tuple, start: int = 0, stop: int | None = None
    ) -> fx.GraphModule:
        """Run passes[start:stop] over gm in place (verified first, then after each pass)."""
        verify_graph(gm, example_inputs)
        if start == 0:
            self._dump(gm, 0, "lowered")
        stop = len(self.passes) if stop is None else stop
        incremental = not (self.check_every_pass or self.dump_after or self.numerics is not None)
        for i in range(start, stop):
            p = self.passes[i]
            if p.name in self.disabled:
                self.records.append(PassRecord(p.name, p.summary, p.preserves_numerics, "disabled"))
                continue
            if self.on_pass is not None:
                self.on_pass(p.name)
            try:
                stats = p.run(gm, ctx) or {}
                eliminate_dead_code(gm)
                verify_graph(gm, example_inputs, reuse=incremental)  # the code is regenerated once, at the end
            except NumericsMismatch:
                raise
            except Exception as e:
                cause = f"{type(e).__name__}: {e}" if not isinstance(e, GraphVerificationError) else str(e)
                raise PassFailure(p.name, cause.splitlines()[0], self._reproducer(ctx, i + 1)) from e
            record = PassRecord(p.name, p.summary, p.preserves_numerics, "ran", dict(stats))
            if self.numerics is not None:
                record.max_rel_diff = self._check_numerics(p, ctx)
            self.records.append(record)
            self._dump(gm, i + 1, p.name)
        if incremental:  # every value is already current (the incremental propagation): lint the structure
            try:
                verify_graph(gm, example_inputs, reuse=True, lint=True)
            except GraphVerificationError as e:
                raise PassFailure(self.passes[stop - 1].name, str(e).splitlines()[0], self._reproducer(ctx, stop)) from e
        gm.recompile()
        return gm

    def fork(self) -> "PassManager":
        """A manager that continues from this one's state on a copy (train and infer part after shared passes)."""
        numerics = None
        if self.numerics is not None:
            numerics = (copy.deepcopy(self.numerics[0]), self.numerics[1])
        return PassManager(
            self.passes, self.disabled, self.dump_after, self.on_dump, self.on_pass, numerics, self.rtol,
            self.reproducer_root, list(self.records), self.check_every_pass,
        )  # fmt: skip

    def _check_numerics(self, p: GraphPass, ctx: PassContext) -> float | None:
        small, inputs = self.numerics
        if not p.preserves_numerics:  # the graph before may not run yet (unresolved generic ops)
            self._run_on(small, p, ctx, inputs)
            return None
        snapshot = copy.deepcopy(small)
        with torch.no_grad():
            before = small(*inputs)
            self._run_on(small, p, ctx, inputs)
            after = small(*inputs)
        diff = _rel_diff(after, before)
        rtol = self.rtol if p.rtol is None else p.rtol
        if not diff <= rtol:
            self.numerics = (snapshot, inputs)
            raise NumericsMismatch(
                f"pass '{p.name}' is declared numerics-preserving but changed the outputs "
                f"(relative difference {diff:.3g} > {rtol:g})"
            )
        return diff

    @staticmethod
    def _run_on(gm: fx.GraphModule, p: GraphPass, ctx: PassContext, inputs: tuple) -> None:
        verify_graph(gm, inputs)  # passes read the shapes (meta['val']) as on the main graph
        p.run(gm, ctx)
        eliminate_dead_code(gm)
        gm.recompile()

    def _dump(self, gm: fx.GraphModule, index: int, name: str) -> None:
        wanted = {"all", name} & self.dump_after or (index == 0 and self.dump_after)
        if self.on_dump is not None and wanted:
            self.on_dump(f"{index:02d}-{name}", format_graph(gm))

    def _reproducer(self, ctx: PassContext, failed_index: int) -> Path | None:
        root = self.reproducer_root or Path(tempfile.gettempdir())
        try:
            root.mkdir(parents=True, exist_ok=True)
            where = Path(tempfile.mkdtemp(prefix=f"k3compile-repro-{ctx.spec.name}-", dir=root))
            (where / "spec.json").write_text(ctx.spec.model_dump_json(indent=2) + "\n")
            passes = [p.name for p in self.passes[:failed_index] if p.name not in self.disabled]
            (where / "passes.txt").write_text("\n".join(passes) + "\n")
            (where / "README.txt").write_text(
                f"Pass '{passes[-1]}' failed in mode {ctx.mode}, target {ctx.target}.\n"
                "Rerun: k3compile build spec.json with the passes in passes.txt (the last one fails).\n"
            )
            return where
        except OSError:
            return None
