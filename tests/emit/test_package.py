"""Emitted packages on disk: atomic writes (emit.package) and importing them (k3compile.load, plain `import`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import k3compile
from k3compile.emit import package
from k3compile.emit.package import MARKER, BuildDirError, write_package

FILES = {"model.py": b"X = 1\n", "graphs/train-final.txt": b"graph\n"}


def test_write_package_writes_files_and_marker(tmp_path, snapshot):
    dest = write_package(tmp_path / "out" / "pkg", FILES, {"spec": "s"})
    assert dest == tmp_path / "out" / "pkg"
    assert snapshot(dest) == {**FILES, MARKER: b'{\n  "spec": "s"\n}\n'}
    assert os.listdir(tmp_path / "out") == ["pkg"]


@pytest.fixture
def previous(tmp_path, snapshot):
    """A previous build at out/pkg, and its bytes."""
    dest = write_package(tmp_path / "out" / "pkg", {"model.py": b"OLD = 1\n"}, {"spec": "s"})
    return dest, snapshot(dest)


def _fail_on_call(monkeypatch, owner, attr: str, n: int, exc: BaseException) -> None:
    """Make owner.attr raise `exc` on its n-th call (1-based), behaving normally otherwise."""
    real, calls = getattr(owner, attr), []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, wrapper)


@pytest.mark.parametrize(
    "where, exc, raised",
    [
        ("second file", OSError(28, "No space left on device"), BuildDirError),
        ("second file", KeyboardInterrupt(), KeyboardInterrupt),
        ("swap into place", OSError(13, "Permission denied"), BuildDirError),
    ],
)
def test_failed_write_keeps_previous_and_leaves_no_staging(monkeypatch, previous, snapshot, where, exc, raised):
    dest, before = previous
    if where == "second file":
        _fail_on_call(monkeypatch, Path, "write_bytes", 2, exc)
    else:  # os.replace #1 moves the previous build aside, #2 would move the new one in
        _fail_on_call(monkeypatch, package.os, "replace", 2, exc)
    with pytest.raises(raised):
        write_package(dest, {**FILES, "extra.txt": b"new\n"}, {"spec": "s"})
    monkeypatch.undo()
    assert os.listdir(dest.parent) == ["pkg"]
    assert snapshot(dest) == before


def test_unwritable_parent_is_a_build_dir_error_not_a_traceback(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(BuildDirError, match="cannot write"):
        write_package(tmp_path / "file" / "pkg", FILES, {})


def test_load_imports_the_build_folder_and_its_parent(tiny_build):
    dest, manifest = tiny_build
    mod = k3compile.load(dest)
    assert k3compile.load(dest.parent) is mod and k3compile.load(str(dest)) is mod
    assert mod.__all__ == ["SPEC_JSON", "TARGET", "Model", "InferenceModel"]
    assert mod.Model.SPEC_JSON == mod.InferenceModel.SPEC_JSON == mod.SPEC_JSON
    assert mod.Model().spec.model_dump(mode="json") == manifest["spec"]["fields"]


def test_load_refuses_what_is_not_exactly_one_build(tiny_build, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a k3compile build"):
        k3compile.load(tmp_path)  # empty dir
    with pytest.raises(FileNotFoundError, match="not a k3compile build"):
        k3compile.load(tmp_path / "missing")
    for name in ("a", "b"):
        shutil.copytree(tiny_build[0], tmp_path / name)
    with pytest.raises(FileNotFoundError, match="not a k3compile build"):
        k3compile.load(tmp_path)  # two builds: ambiguous


def test_load_skips_hidden_staging_dirs_and_sees_rebuilds(tiny_build, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny_build[0], out / "k3_tiny")
    shutil.copytree(tiny_build[0], out / ".k3_tiny.tmp-abc")  # a concurrent build about to swap in
    first = k3compile.load(out)
    assert Path(first.__file__).parent == out / "k3_tiny"
    with open(out / "k3_tiny" / "model.py", "a") as f:  # a rebuild that changed the code
        f.write("\nREBUILT = True\n")
    second = k3compile.load(out)
    assert second is not first and second.model.REBUILT and not hasattr(first.model, "REBUILT")


def test_package_imports_by_name_with_its_parent_on_sys_path(tiny_build):
    dest, _ = tiny_build
    script = textwrap.dedent(
        """
        import importlib, sys
        import torch
        sys.path.insert(0, sys.argv[1])
        pkg = importlib.import_module("k3_tiny")
        assert pkg.__all__ == ["SPEC_JSON", "TARGET", "Model", "InferenceModel"], pkg.__all__
        assert pkg.Model.__module__ == "k3_tiny.model"
        logits = pkg.InferenceModel(device="meta")(torch.zeros(1, 3, dtype=torch.long, device="meta"))
        print(tuple(logits.shape), logits.dtype)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(dest.parent)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "(1, 3, 256) torch.float32"
