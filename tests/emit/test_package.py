"""Emitted packages on disk: atomic writes (emit.package) and importing them (k3compile.load, plain `import`)."""

from __future__ import annotations

import hashlib
import json
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
from k3compile.loader import BuildLoadError

FILES = {"model.py": b"X = 1\n", "graphs/train-final.txt": b"graph\n"}


def test_write_package_writes_files_and_marker(tmp_path, snapshot):
    dest = write_package(tmp_path / "out" / "pkg", FILES, {"spec": "s"})
    assert dest == tmp_path / "out" / "pkg"
    marker = {"spec": "s", "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in FILES.items()}}
    assert snapshot(dest) == {**FILES, MARKER: (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode()}
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
        _fail_on_call(monkeypatch, package.os, "fsync", 2, exc)  # fsync #2 follows the second file's write
    else:
        _fail_on_call(monkeypatch, package, "_exchange", 1, exc)
    with pytest.raises(raised):
        write_package(dest, {**FILES, "extra.txt": b"new\n"}, {"spec": "s"})
    monkeypatch.undo()
    assert os.listdir(dest.parent) == ["pkg"]
    assert snapshot(dest) == before


def test_unwritable_parent_is_a_build_dir_error_not_a_traceback(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(BuildDirError, match="exists and is not a folder"):
        write_package(tmp_path / "file" / "pkg", FILES, {})


def test_load_imports_the_build_folder_and_its_parent(tiny_build):
    dest, manifest = tiny_build
    mod = k3compile.load(dest)
    assert k3compile.load(dest.parent) is mod and k3compile.load(str(dest)) is mod
    assert mod.__all__ == ["SPEC_JSON", "TARGET", "Model", "InferenceModel"]
    assert mod.Model.SPEC_JSON == mod.InferenceModel.SPEC_JSON == mod.SPEC_JSON
    assert mod.Model().spec.model_dump(mode="json") == manifest["spec"]["fields"]


def test_load_refuses_what_is_not_exactly_one_build(tiny_build, tmp_path):
    with pytest.raises(BuildLoadError, match="not a k3compile build"):
        k3compile.load(tmp_path)  # empty dir
    with pytest.raises(BuildLoadError, match="not a k3compile build"):
        k3compile.load(tmp_path / "missing")
    for name in ("b", "a"):
        shutil.copytree(tiny_build[0], tmp_path / name)
    with pytest.raises(BuildLoadError, match=r"holds 2 builds \(a, b\); name one of them"):
        k3compile.load(tmp_path)  # two builds: ambiguous


def test_load_skips_hidden_staging_dirs_and_sees_rebuilds(tiny_build, tmp_path, snapshot):
    out = tmp_path / "out"
    shutil.copytree(tiny_build[0], out / "k3_tiny")
    shutil.copytree(tiny_build[0], out / ".k3_tiny.tmp-abc")  # a concurrent build about to swap in
    first = k3compile.load(out)
    assert Path(first.__file__).parent == out / "k3_tiny"
    files = snapshot(out / "k3_tiny")
    marker = json.loads(files.pop(MARKER))
    files["model.py"] += b"\nREBUILT = True\n"  # a rebuild that changed the code
    write_package(out / "k3_tiny", files, marker)
    second = k3compile.load(out)
    assert second is not first and second.model.REBUILT and not hasattr(first.model, "REBUILT")


def _rewritten(build, dest, snapshot, edit):
    """A copy of `build` at `dest` written by write_package after `edit(files)`: its marker agrees with its files."""
    files = snapshot(build)
    marker = json.loads(files.pop(MARKER))
    edit(files)
    return write_package(dest, files, marker)


def test_an_edited_build_is_refused_before_its_code_runs(tiny_build, tmp_path):
    dest = tmp_path / "k3_tiny"
    shutil.copytree(tiny_build[0], dest)
    ran = tmp_path / "ran"
    with open(dest / "model.py", "a") as f:
        f.write(f"\nopen({str(ran)!r}, 'w').close()\n")
    with pytest.raises(BuildLoadError, match=r"k3_tiny/model.py is not the file the build wrote .*; rebuild it"):
        k3compile.load(dest)
    assert not ran.exists()
    (dest / "graphs" / "train-final.txt").unlink()
    with pytest.raises(BuildLoadError, match="graphs/train-final.txt is missing"):
        k3compile.load(dest)


def test_a_manifest_that_contradicts_model_py_is_refused(tiny_build, tmp_path, snapshot):
    def other_spec(files):
        manifest = json.loads(files["manifest.json"])
        manifest["spec"]["fields"]["hidden_size"] += 1
        files["manifest.json"] = json.dumps(manifest).encode()

    dest = _rewritten(tiny_build[0], tmp_path / "k3_tiny", snapshot, other_spec)
    with pytest.raises(BuildLoadError, match="manifest.json and model.py record different specs"):
        k3compile.load(dest)


def test_a_build_without_file_hashes_or_that_cannot_import_is_one_error(tiny_build, tmp_path, snapshot):
    old = tmp_path / "old" / "k3_tiny"
    shutil.copytree(tiny_build[0], old)
    (old / MARKER).write_text('{"compiler": "0.1.0", "spec": "k3-tiny"}')
    with pytest.raises(BuildLoadError, match="older k3compile .* rebuild it"):
        k3compile.load(old)

    def break_code(files):
        files["model.py"] += b"\ndef (:\n"

    dest = _rewritten(tiny_build[0], tmp_path / "broken" / "k3_tiny", snapshot, break_code)
    with pytest.raises(BuildLoadError, match=r"cannot import the build \(SyntaxError: .*\); rebuild it"):
        k3compile.load(dest)


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


# ------------------------------------------------------------------ crash safety of the swap

KILL_SCRIPT = textwrap.dedent(
    """
    import os, shutil, signal, sys
    from pathlib import Path
    from k3compile.emit import package

    dest, n = Path(sys.argv[1]), int(sys.argv[2])
    calls = []

    def dying(real):
        def call(*args, **kwargs):
            calls.append(real.__name__)
            if len(calls) == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    for owner, name in ((os, "replace"), (os, "rename"), (os, "fsync"), (shutil, "rmtree")):
        setattr(owner, name, dying(getattr(owner, name)))
    package.write_package(dest, {"model.py": b"NEW = 1\\n", "graphs/x.txt": b"g\\n"}, {"spec": "s"})
    print(len(calls))
    """
)


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_a_kill_9_anywhere_in_a_rebuild_leaves_a_whole_build_and_the_next_build_cleans_up(previous, snapshot):
    """Killed before the n-th rename, fsync or delete of a rebuild, for every n: one of the two builds is in place."""
    dest, before = previous
    n = 1
    while True:
        proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(dest), str(n)], capture_output=True, text=True,
                              timeout=60)
        now = snapshot(dest) if dest.is_dir() else None
        assert now is not None, f"killed at call {n}: no build at {dest}"
        assert now == before or now[MARKER] != before[MARKER] and now["model.py"] == b"NEW = 1\n", n
        if proc.returncode == 0:
            break
        assert proc.returncode == -9, proc.stderr
        write_package(dest, {"model.py": b"OLD = 1\n"}, {"spec": "s"})  # the next build cleans up after the kill
        assert os.listdir(dest.parent) == ["pkg"] and snapshot(dest) == before, n
        n += 1
    assert n > 3  # the script got past the writes and the swap before running to the end
    assert os.listdir(dest.parent) == ["pkg"]


def test_a_live_builds_staging_folder_is_left_alone(previous):
    """Leftovers are deleted only when the process that made them is gone (here: this one, alive)."""
    dest, _ = previous
    staging = dest.parent / f"{package.staging_prefix(dest, 'tmp')}live"
    staging.mkdir()
    write_package(dest, FILES, {"spec": "s"})
    assert staging.is_dir()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fsynced paths from /proc")
def test_every_file_and_folder_is_fsynced_before_and_after_the_swap(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(package.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    dest = write_package(tmp_path / "out" / "pkg", FILES, {"spec": "s"})
    staged = {p.split("/.pkg.tmp-", 1)[1].partition("/")[2] for p in synced if "/.pkg.tmp-" in p}
    assert staged >= {*FILES, MARKER, "graphs", ""}, synced  # "" is the staging folder itself
    assert synced[-1] == str(dest.parent)  # the parent, once the new name is in it


# ------------------------------------------------------------------ what a build may replace


def test_a_build_holding_files_it_did_not_write_is_not_replaced(previous, snapshot):
    """A run's checkpoints put inside a build folder survive the next build (which refuses, naming them)."""
    dest, _ = previous
    (dest / "checkpoints").mkdir()
    (dest / "checkpoints" / "step-000005.json").write_text("{}")
    (dest / "__pycache__").mkdir()
    (dest / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"")  # importing the build writes these: fine
    before = snapshot(dest)
    with pytest.raises(BuildDirError, match=r"holds files the build did not write \(checkpoints/step-000005.json\)"):
        write_package(dest, FILES, {"spec": "s"})
    assert snapshot(dest) == before


@pytest.mark.parametrize("occupant", ["dangling symlink", "symlink to a build", "out is a file", "out under a file"])
def test_what_cannot_become_the_build_is_refused_in_one_line(tmp_path, occupant, previous):
    out = tmp_path / "elsewhere"
    if occupant == "dangling symlink":
        out.mkdir()
        (out / "pkg").symlink_to(tmp_path / "nowhere")
    elif occupant == "symlink to a build":
        out.mkdir()
        (out / "pkg").symlink_to(previous[0])
    elif occupant == "out is a file":
        out.write_text("x")
    else:
        out.write_text("x")
        out = out / "sub"
    message = "is a symbolic link" if "symlink" in occupant else "is not a folder"
    with pytest.raises(BuildDirError, match=message):
        package.check_dest(out / "pkg")
