"""A training step reads nothing on the host: its loss, gradient norm and routing statistics stay on the device
until the log interval's one read (what lets a GPU run ahead of the host). Checked on CPU by recording every op and
Tensor method that would make the host wait (k3compile.runtime.syncs), on the graph a GPU build trains (built for
h200 with its ops left unbound, so they run their PyTorch references on CPU tensors). The k3 ops are watched from
outside (k3compile.runtime.syncs): what is checked is everything around them, the emitted step and the trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from k3compile.runtime import syncs
from k3compile.runtime.data import load_corpus, split
from k3compile.runtime.generated import check_tokens
from k3compile.runtime.train import _setup, evaluate, read_steps, train_step
from k3compile.spec.load import load_spec

from ..conftest import K3_TINY, TOY_K3

BALANCING = {  # every balancing rule, with the gradient clip of k3-tiny
    "exact quantile": [],
    "histogram quantile": ["moe.router.histogram_bins=64"],
    "aux loss": ["moe.router.balancing=aux_loss"],
}


def _reads(x):
    x.tolist(), float(x.sum()), x.cpu(), bool(x.sum() > 0), x.nonzero(), x[x > 0], torch.tensor([1.0])
    x[torch.tensor([0, 2])], x.sum() * 2, torch.where(x > 0, x, 0)  # integer indexing and arithmetic read nothing


def test_the_watch_sees_every_kind_of_host_read():
    with syncs.watch() as found:
        _reads(torch.randn(5))
    assert all(r.where.startswith("tests/runtime/test_host_syncs.py:") for r in found), found
    assert [r.what for r in found] == [
        "Tensor.tolist", "Tensor.__float__", "aten._local_scalar_dense.default", "Tensor.cpu", "Tensor.__bool__",
        "aten._local_scalar_dense.default", "nonzero (its output shape depends on values)", "aten.nonzero.default",
        "__getitem__ (its output shape depends on values)", "aten.index.Tensor",
        "aten.lift_fresh.default (a tensor made from host data)",
        "aten.lift_fresh.default (a tensor made from host data)",
    ]  # fmt: skip
    with syncs.watch(ops=False) as found:
        _reads(torch.randn(5))
    assert [r.what for r in found] == [
        "Tensor.tolist", "Tensor.__float__", "Tensor.cpu", "Tensor.__bool__", "nonzero (its output shape depends on "
        "values)", "__getitem__ (its output shape depends on values)",
    ]  # fmt: skip


def _lines_of(fn) -> set[str]:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return {f"k3compile/runtime/generated.py:{start + i}" for i in range(len(lines))}


_CPU_TOKEN_CHECK = _lines_of(check_tokens)


@pytest.fixture(scope="module")
def corpus():
    c = load_corpus(None, max_bytes=20_000)
    return c, *split(c.data, 32)


def _run(tmp_path: Path, overrides: list[str], corpus):
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load

    spec = load_spec(K3_TINY, [*TOY_K3, *overrides])
    options = BuildOptions(mode="train", target="h200", disabled=frozenset({"bind_kernels"}))
    package = load(build(spec, tmp_path / "build", options)[0])
    c, train_tokens, val_tokens = corpus
    return lambda: _setup(spec, package, c, train_tokens, val_tokens, tmp_path / "run", None)


@pytest.mark.parametrize("rule", BALANCING)
def test_a_training_step_reads_nothing_and_an_interval_reads_once(tmp_path, corpus, rule):
    setup = _run(tmp_path, BALANCING[rule], corpus)
    run = setup()
    with syncs.watch(ops=False) as found:  # (the backward runs torch.func inside custom ops: Python calls only)
        pending = [train_step(run, step, 4) for step in range(3)]
    # torch.optim's AdamW reads its step counters, which it keeps on the host also for parameters on a GPU; the
    # models' token check reads the ids of CPU tensors only (on a GPU it leaves them to the device's own asserts)
    assert [str(r) for r in found if not r.where.startswith("torch/optim/") and r.where not in _CPU_TOKEN_CHECK] == []
    with syncs.watch() as found:
        together = read_steps(pending)
    assert [r.what for r in found] == ["Tensor.tolist"]
    with syncs.watch() as found:
        evaluate(run)
    reads = [r.what for r in found if r.what.startswith("Tensor.") and r.where not in _CPU_TOKEN_CHECK]
    assert reads == ["Tensor.__float__"]  # the validation loss

    again = setup()  # the same run, its steps read one by one: the same numbers
    one_by_one = [read_steps([train_step(again, step, 4)])[0] for step in range(3)]
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
    assert [strip(r) for r in together] == [strip(r) for r in one_by_one]
    assert {"loss", "grad_norm", "imbalance", "dropped"} <= set(together[0])
    assert ("aux_loss" in together[0]) == (rule == "aux loss")
    assert all(isinstance(v, (int, float)) for r in together for v in r.values())


def test_a_non_finite_loss_is_reported_with_its_step(tmp_path, corpus):
    from k3compile.runtime.train import TrainError

    run = _setup_fast(tmp_path, corpus)
    pending = [train_step(run, step, 4) for step in range(2)]
    pending[1] = dataclasses.replace(pending[1], loss=torch.tensor(float("nan"), dtype=torch.float64))
    with pytest.raises(TrainError, match="the loss is nan at step 2"):
        read_steps(pending)


def _setup_fast(tmp_path, corpus):
    return _run(tmp_path, ["training.optimizer=adamw"], corpus)()
