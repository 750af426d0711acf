"""Shared fixtures for the pass tests: spec loading, running a prefix of the pipeline, one full k3-tiny build.

The k3-tiny build (train and infer: the train, prefill and decode graphs, real seeded weights,
--verify-numerics) is the expensive part, so it is made once per session and every pass's test file reads
its graphs and records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SPECS = Path(__file__).resolve().parents[2] / "specs"
K3_TINY = SPECS / "k3-tiny.yaml"


def _load(name: str = "k3-tiny.yaml", *overrides: str):
    from k3compile.spec.load import load_spec

    return load_spec(SPECS / name, overrides=list(overrides))


def _run_passes(spec, names, *, device="cpu", mode="train", target=None, graph=None, cpu_kernels="torch"):
    """Lower `graph` of `spec` and run the named pipeline passes in order: (graph, example inputs, records).

    `graph` defaults to the mode's first graph: "train" in train mode, "prefill" in infer mode. bind_kernels, when
    named, binds the CPU target's references unless `cpu_kernels` says otherwise (the passes' numbers are checked
    against the references; the C kernels have their own tests).
    """
    from k3compile.build import GRAPHS_OF_MODE, pipeline
    from k3compile.ir.lower import lower
    from k3compile.ir.pass_manager import PassContext, PassManager

    graph = graph or GRAPHS_OF_MODE[mode][0]
    by_name = {p.name: p for p in pipeline()}
    lowered = lower(spec, device, graph=graph)
    manager = PassManager([by_name[n] for n in names])
    ctx = PassContext(spec, mode, target or spec.target, graph, cpu_kernels)
    manager.run(lowered.gm, ctx, lowered.example_inputs)
    return lowered.gm, lowered.example_inputs, manager.records


@pytest.fixture(scope="session")
def load():
    """load(name="k3-tiny.yaml", *overrides) -> Spec; `name` is relative to specs/ (ablations/x.yaml)."""
    return _load


@pytest.fixture(scope="session")
def run_passes():
    """run_passes(spec, names, device="cpu", mode="train", target=None, graph=None, cpu_kernels="torch") ->
    (gm, example_inputs, records)."""
    return _run_passes


@pytest.fixture(scope="session")
def tiny_spec():
    return _load()


@pytest.fixture(scope="session")
def tiny_build(tiny_spec):
    """k3-tiny compiled for train and infer with real seeded weights and every numerics-preserving pass checked:
    {"train", "prefill", "decode"} -> CompiledGraph. Bound to the PyTorch references (cpu_kernels="torch"), so the
    passes' claims are checked to their own tolerance; test_bind_kernels rebinds copies to the C kernels."""
    from k3compile.build import BuildOptions, compile_graphs

    return compile_graphs(tiny_spec, ("train", "infer"), BuildOptions(verify_numerics=True, cpu_kernels="torch"))


@pytest.fixture(scope="session")
def record(tiny_build):
    """record(graph, pass name) -> the PassRecord of that pass on that graph ("train", "prefill", "decode")."""

    def get(graph: str, name: str):
        (r,) = [r for r in tiny_build[graph].records if r.name == name]
        return r

    return get
