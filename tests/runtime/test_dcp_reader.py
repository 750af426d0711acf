"""Distributed checkpoints from strangers: `consolidate` and `train --resume` read DCP metadata without running
code (k3compile.runtime.dcp_reader), check it against the model and k3compile.json, and refuse in one line.

The checkpoint is a real one: one process's training state written by `sharded_checkpoint.save` (DCP), as a
multi-process run writes it, then edited the way an attacker would.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from k3compile.runtime import sharded_checkpoint as dcp_ckpt
from k3compile.runtime.dcp_reader import METADATA

from ..conftest import SMALL, assert_one_line_error

needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs /dev/zero and symbolic links")


@pytest.fixture(scope="module")
def saved(small_build, small_corpus, tmp_path_factory) -> Path:
    """A run folder holding the build and the distributed checkpoint of one training step."""
    import k3compile
    from k3compile.spec.digest import spec_hash, spec_json
    from k3compile.runtime.data import load_corpus, split
    from k3compile.runtime.distributed import Layout
    from k3compile.runtime.generate import build_spec
    from k3compile.runtime.train import _setup, optimizer_layout, train_step

    run_dir = tmp_path_factory.mktemp("dcp") / "run"
    shutil.copytree(small_build.parent, run_dir / "build")
    package = k3compile.load(run_dir / "build" / small_build.name)
    spec = build_spec(package)
    corpus = load_corpus(small_corpus)
    run = _setup(spec, package, corpus, *split(corpus.data, spec.training.seq_len), run_dir, None)
    train_step(run, 0, 2)
    meta = {"compiler": "k3compile test", "spec_name": spec.name, "spec_sha256": spec_hash(spec),
            "spec": json.loads(spec_json(spec)), "optimizer": optimizer_layout(run.optimizer, run.named),
            "data": run.data_fingerprint()}  # fmt: skip
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process writes it here
        warnings.simplefilter("ignore", UserWarning)
        dcp_ckpt.save(Layout(), run, 1, meta)
    return run_dir


@pytest.fixture
def run(saved, tmp_path) -> Path:
    """A copy of the saved run to tamper with."""
    shutil.copytree(saved, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _dcp(run: Path) -> Path:
    return run / "checkpoints" / "step-000001.dcp"


def _metadata(run: Path):
    """The checkpoint's own metadata, as the attacker edits it (the test trusts the file it just wrote)."""
    with open(_dcp(run) / METADATA, "rb") as f:
        return pickle.load(f)


class Runs:
    """Pickles a call when loaded: what a hostile .metadata holds."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _consolidate(cli, run: Path, out: Path, *extra):
    return cli("consolidate", run, "-o", out, "--build", run / "build" / "k3_tiny", *extra)


def test_an_untampered_checkpoint_consolidates_and_resumes(cli, run, tmp_path, small_corpus):
    from k3compile.runtime import checkpoint as ckpt

    rc, out, err = _consolidate(cli, run, tmp_path / "out")
    assert rc == 0, err
    state = ckpt.load(tmp_path / "out")
    assert state.step == 1 and any(k.startswith("model/layers.") for k in state.tensors)
    rc, out, err = cli("train", run / "build" / "k3_tiny", "--steps", "2", "--out", run, "--resume",
                       "--data", small_corpus, *[a for s in SMALL for a in ("--set", s) if s.startswith("training")])
    assert rc == 0, err[-2000:]
    assert "resuming from" in out and [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2]


def _hostile_metadata(run: Path, case: str, tmp_path: Path) -> str:
    """Replace the checkpoint's .metadata (or a shard) as `case` says; returns what the error must name."""
    path = _dcp(run) / METADATA
    sentinel = tmp_path / "PWNED"
    if case == "os.system":
        path.write_bytes(pickle.dumps(Runs(os.system, f"touch {sentinel}")))
        return "posix.system is not DCP metadata"
    if case == "exec-inside-valid-metadata":  # a real Metadata, one field of which runs code
        md = _metadata(run)
        md.planner_data = Runs(exec, f"open({str(sentinel)!r}, 'w').close()")
        path.write_bytes(pickle.dumps(md))
        return "builtins.exec is not DCP metadata"
    if case == "bytes-entry":  # DCP's planner would torch.load(weights_only=False) its bytes
        md = _metadata(run)
        md.state_dict_metadata["model/embed.weight"] = BytesStorageMetadata()
        path.write_bytes(pickle.dumps(md))
        return "BytesStorageMetadata is not DCP metadata"
    if case == "shard-outside":
        md = _metadata(run)
        for info in md.storage_data.values():
            info.relative_path = "../../../outside.distcp"
        path.write_bytes(pickle.dumps(md))
        return "is not a file name in the folder"
    if case == "wrong-shape":
        md = _metadata(run)
        md.state_dict_metadata["model/embed.weight"].properties.dtype = torch.float16
        path.write_bytes(pickle.dumps(md))
        return "does not match this model: model/embed.weight is torch.float16"
    if case == "not-pickle":
        path.write_bytes(b"\x80\x05garbage" * 100)
        return "its .metadata is refused"
    if case == "metadata-is-dev-zero":
        path.unlink()
        path.symlink_to("/dev/zero")
        return "is a symbolic link"
    shard = next(p for p in _dcp(run).iterdir() if p.suffix == ".distcp")
    if case == "shard-is-dev-zero":
        shard.unlink()
        shard.symlink_to("/dev/zero")
        return "is not a regular file"
    if case == "shard-truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        return "is truncated"
    assert case == "shard-garbage"  # the right length, not torch's format: DCP's own failure, in one line
    shard.write_bytes(b"\0" * shard.stat().st_size)
    return "cannot read"


CASES = ["os.system", "exec-inside-valid-metadata", "bytes-entry", "shard-outside", "wrong-shape", "not-pickle",
         "metadata-is-dev-zero", "shard-is-dev-zero", "shard-truncated", "shard-garbage"]  # fmt: skip


@needs_posix
@pytest.mark.parametrize("case", CASES)
def test_consolidate_refuses_hostile_metadata_without_running_it(cli, run, tmp_path, case, bounded):
    what = _hostile_metadata(run, case, tmp_path)
    assert_one_line_error(_consolidate(cli, run, tmp_path / "out"), "step-000001.dcp", what)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()


@needs_posix
@pytest.mark.parametrize("case", ["os.system", "bytes-entry", "shard-is-dev-zero"])
def test_resume_refuses_hostile_metadata_without_running_it(cli, run, tmp_path, case, small_corpus, bounded):
    what = _hostile_metadata(run, case, tmp_path)
    before = (run / "metrics.jsonl").exists()
    result = cli("train", run / "build" / "k3_tiny", "--steps", "2", "--out", run, "--resume", "--data", small_corpus,
                 "--set", "training.optimizer=adamw")
    assert_one_line_error(result, "step-000001.dcp", what)
    assert not (tmp_path / "PWNED").exists() and (run / "metrics.jsonl").exists() == before


def _edit_record(run: Path, edit) -> None:
    path = _dcp(run) / dcp_ckpt.META
    record = json.loads(path.read_text())
    path.write_text(json.dumps(edit(record)))


@needs_posix
@pytest.mark.parametrize("case, what", [
    (lambda r: {k: v for k, v in r.items() if k != "spec"}, "spec: Field required"),
    (lambda r: {**r, "spec": {**r["spec"], "hidden_size": "wide"}}, "records a spec that does not validate: hidden_size"),
    (lambda r: {**r, "spec": ["not", "a", "spec"]}, "spec: Input should be a valid dictionary"),
    (lambda r: {**r, "step": 7}, "records step 7 in the folder of step 1"),
    (lambda r: {**r, "layout": {"dp": "2", "ep": 1}}, "layout.dp"),
    (lambda r: {**r, "spec": {**r["spec"], "kda": {**r["spec"]["kda"], "delta_rule": False}}},
     "whose architecture is not the one of the build"),
    (lambda r: [r] * 3, "Input should be a valid dictionary"),
    ("deep", "nests deeper than"),
    ("dev-zero", "holds no distributed checkpoint"),  # not a file: the folder is no checkpoint
])  # fmt: skip
def test_consolidate_refuses_a_bad_k3compile_json_in_one_line(cli, run, tmp_path, case, what, bounded):
    """k3compile.json is read bounded and strictly typed before anything is loaded; its spec must be the build's."""
    path = _dcp(run) / dcp_ckpt.META
    if case == "deep":
        path.write_text("[" * 50_000 + "]" * 50_000)
    elif case == "dev-zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    else:
        _edit_record(run, case)
    assert_one_line_error(_consolidate(cli, run, tmp_path / "out"), run, what)
    assert not (tmp_path / "out").exists()


def test_consolidate_without_build_finds_the_run_s_and_checks_the_recorded_spec(cli, run, tmp_path):
    """Without --build, the recorded spec names the build: a spec that does not validate is one line, not a
    KeyError or a ValidationError traceback."""
    _edit_record(run, lambda r: {**r, "spec": {"name": 5}})
    result = cli("consolidate", run, "-o", tmp_path / "out")
    assert_one_line_error(result, "k3compile.json records a spec that does not validate")
