"""`k3compile build`: lower the model definition to its graphs, run the pass pipeline on each, emit the package.

A train build has the train graph; an infer build the prefill and decode graphs; "both" all three.
Every graph is traced from one model definition (sharing its weights) and runs every pass.
Small specs lower with real, initialised weights on the CPU; full-size ones on the
meta device, so a 2.8T-parameter model builds in seconds with no weight memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx

from k3compile import __version__
from k3compile.analysis.params import param_counts
from k3compile.analysis.stats import spec_stats
from k3compile.emit.codegen import model_source
from k3compile.emit.package import check_dest, write_package
from k3compile.ir.lower import MIXERS, build_model, lower
from k3compile.modules.model import DEPTH_SITES
from k3compile.ir.pass_manager import GraphPass, PassContext, PassManager, PassRecord
from k3compile.ir.verify import format_graph
from k3compile.spec.digest import package_name, spec_hash
from k3compile.spec.schema import Spec

REAL_WEIGHTS_MAX_PARAMS = 200_000_000  # above this, lower on the meta device
MODES = ("train", "infer")
GRAPHS_OF_MODE = {"train": ("train",), "infer": ("prefill", "decode")}
# The submodule calls lowering keeps, in pipeline order, and the pass that turns each into ops.
RESOLVED_BY = {MIXERS: "interleave", DEPTH_SITES: "attn_res"}


class UnrunnableBuild(ValueError):
    """The passes left a graph that cannot run (a needed pass was disabled): no package is written."""


def pipeline() -> list[GraphPass]:
    """The passes in order: interleave ▸ attn_res ▸ shard_experts ▸ routing ▸ pack_mxfp4 ▸ fuse
    ▸ group_experts ▸ merge_projections ▸ bind_kernels."""
    from k3compile.passes import (attn_res, bind_kernels, fuse, group_experts, interleave, merge_projections,
                                  pack_mxfp4, routing, shard_experts)

    passes = (interleave, attn_res, shard_experts, routing, pack_mxfp4, fuse, group_experts, merge_projections,
              bind_kernels)
    return [m.PASS for m in passes]


@dataclass(frozen=True)
class BuildOptions:
    target: str | None = None  # default: the spec's
    mode: str = "both"  # train | infer | both
    disabled: frozenset[str] = frozenset()
    dump_after: frozenset[str] = frozenset()
    verify_numerics: bool = False
    device: str | None = None  # default: cpu for small specs, meta for large
    check_every_pass: bool = False  # full shape propagation after every pass, not only where it changed
    cpu_kernels: str = "auto"  # CPU target: C kernels where they build ("auto"), insist ("c"), references ("torch")


@dataclass
class CompiledGraph:
    graph: str  # train | prefill | decode
    gm: fx.GraphModule
    records: list[PassRecord]
    dumps: dict[str, str] = field(default_factory=dict)


def lowering_device(spec: Spec, options: BuildOptions) -> str:
    if options.device:
        return options.device
    return "cpu" if param_counts(spec)["total"] <= REAL_WEIGHTS_MAX_PARAMS else "meta"


def compile_graphs(
    spec: Spec, modes: tuple[str, ...], options: BuildOptions, on_pass: Callable[[str], None] | None = None
) -> dict[str, CompiledGraph]:
    """Build the model definition once, then lower and run every pass on each graph the modes need."""
    device = lowering_device(spec, options)
    target = options.target or spec.target
    if options.verify_numerics and device == "meta":
        raise ValueError("--verify-numerics needs real weights: use it on a small spec (or --set smaller dims)")
    model = build_model(spec, device)
    small = model if options.verify_numerics and device == "cpu" else None
    if options.verify_numerics and small is None:
        small = build_model(spec, "cpu")
    out = {}
    for mode in modes:
        for graph in GRAPHS_OF_MODE[mode]:
            lowered = lower(spec, graph=graph, model=model)
            numerics = None
            if small is not None:
                check = lower(spec, graph=graph, model=small)
                numerics = (check.gm, check.example_inputs)
            dumps: dict[str, str] = {}
            manager = PassManager(
                pipeline(),
                disabled=options.disabled,
                dump_after=options.dump_after,
                numerics=numerics,
                on_dump=dumps.__setitem__,
                on_pass=None if on_pass is None else (lambda name, g=graph: on_pass(f"{g}: {name}")),
                check_every_pass=options.check_every_pass,
            )
            manager.run(lowered.gm, PassContext(spec, mode, target, graph, options.cpu_kernels), lowered.example_inputs)
            out[graph] = CompiledGraph(graph, lowered.gm, manager.records, dumps)
    return out


def check_runnable(compiled: dict[str, CompiledGraph]) -> None:
    """Refuse graphs that still call a kept submodule: their package would fail at its first forward."""
    for graph, c in compiled.items():
        left = [c.gm.get_submodule(n.target) for n in c.gm.graph.nodes if n.op == "call_module"]
        kinds = next((k for k in RESOLVED_BY if any(isinstance(m, k) for m in left)), None)
        if kinds is not None:
            needed = RESOLVED_BY[kinds]
            name = next(type(m).__name__ for m in left if isinstance(m, kinds))
            raise UnrunnableBuild(
                f"the {graph} graph still calls {name} modules, so the package could not run; "
                f"it needs the {needed} pass (drop --disable-pass {needed})"
            )


def binding_table(gm: fx.GraphModule) -> list[dict]:
    """One row per bound op kind: op, implementation, node count, reason."""
    rows: dict[tuple, dict] = {}
    for n in gm.graph.nodes:
        k = n.meta.get("kernel")
        if not k:
            continue
        key = (k["op"], k["impl"], k.get("reason", ""))
        rows.setdefault(key, {"op": k["op"], "impl": k["impl"], "nodes": 0, "reason": k.get("reason", "")})
        rows[key]["nodes"] += 1
    return sorted(rows.values(), key=lambda r: (r["op"], r["impl"]))


def _bindings(gm: fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta["kernel"] for n in gm.graph.nodes if n.meta.get("kernel")}


def _packed(gm: fx.GraphModule) -> dict:
    return dict(gm.meta.get("packed", {}))


def build(
    spec: Spec, out_dir: Path, options: BuildOptions = BuildOptions(), on_pass: Callable[[str], None] | None = None
) -> tuple[Path, dict]:
    """Compile every requested mode and write `out_dir/<spec name>/`; returns (path, manifest)."""
    modes = MODES if options.mode == "both" else (options.mode,)
    target = options.target or spec.target
    dest = Path(out_dir) / package_name(spec)
    check_dest(dest)  # refuse before compiling, not after it
    compiled = compile_graphs(spec, modes, options, on_pass)
    check_runnable(compiled)
    device = lowering_device(spec, options)
    pass_names = [r.name for r in next(iter(compiled.values())).records if r.status == "ran"]
    source = model_source(
        spec,
        pass_names,
        target,
        {g: c.gm for g, c in compiled.items()},
        default_device=device,
        packed={g: _packed(c.gm) for g, c in compiled.items()},
    )
    manifest = {
        "compiler": f"k3compile {__version__}",
        "spec": {"name": spec.name, "sha256": spec_hash(spec), "fields": spec.model_dump(mode="json")},
        "target": target,
        "modes": list(modes),
        "graphs": list(compiled),
        "weights": "meta (shapes only; load real weights later)" if device == "meta" else "initialised (seeded)",
        "stats": spec_stats(spec),
        "passes": {m: [r.as_dict() for r in c.records] for m, c in compiled.items()},
        "binding_table": {m: binding_table(c.gm) for m, c in compiled.items()},
        "bindings": {m: _bindings(c.gm) for m, c in compiled.items()},
    }
    exports = ["SPEC_JSON", "TARGET"] + [{"train": "Model", "infer": "InferenceModel"}[m] for m in modes]
    files = {
        "model.py": source.encode(),
        "__init__.py": _init_source(spec, exports).encode(),
        "manifest.json": (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(),
    }
    for g, c in compiled.items():
        files[f"graphs/{g}-final.txt"] = format_graph(c.gm).encode()
        for name, text in c.dumps.items():
            files[f"graphs/{g}/{name}.txt"] = text.encode()
    dest = write_package(dest, files, {"compiler": __version__, "spec": spec.name})
    return dest, manifest


def _init_source(spec: Spec, exports: list[str]) -> str:
    return (
        f'"""k3compile build of spec {spec.name!r} (sha256 {spec_hash(spec)[:16]}...): import Model / InferenceModel."""\n\n'
        f"from .model import {', '.join(exports)}\n\n"
        f"__all__ = {exports!r}\n"
    )
