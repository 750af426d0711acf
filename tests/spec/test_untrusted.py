"""Spec files from strangers: devices, pipes and `extends:` that leaves the spec's folder are one-line errors.

A spec is data. Reading one must never hang (a FIFO), grow without bound (/dev/zero) or show the lines of
a file that is not a spec (`extends: /etc/shadow`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from k3compile.spec.load import SpecError, load_spec

from ..conftest import K3_TINY

NOT_A_SPEC = "root:$6$salt$0123456789abcdef:19000:0:99999:7:::\nSECRET_TOKEN: hunter2\nother: value\n"


@pytest.fixture
def spec_dir(tmp_path, monkeypatch):
    """tmp_path/specs holding a copy of k3-tiny (base.yaml), with tmp_path as the working directory."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "base.yaml").write_text(K3_TINY.read_text())
    monkeypatch.chdir(tmp_path)
    return folder


def _one_error(cli, *argv) -> str:
    rc, out, err = cli(*argv)
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and /dev/zero")
def test_devices_and_pipes_are_refused_without_reading_them(tmp_path):
    """In a child process with a memory cap and a timeout: before the fix /dev/zero filled memory, a FIFO hung."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    (tmp_path / "to_fifo.yaml").write_text("extends: pipe.yaml\nname: x\n")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "to_zero.yaml").write_text("extends: zero.yaml\nname: x\n")
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from k3compile.spec.load import SpecError, load_spec
        for path in ("/dev/zero", "/dev/urandom", "pipe.yaml", "to_fifo.yaml", "zero.yaml", "to_zero.yaml"):
            try:
                load_spec(path, extends_anywhere=True)
            except SpecError as e:
                print(*e.lines)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 6, proc.stderr[-2000:]
    assert all("is not a regular file" in line for line in lines), lines
    assert lines[3].startswith("to_fifo.yaml:1:1: extends: ")


def test_a_file_over_the_cap_is_refused_whatever_its_size_says(write_spec, monkeypatch):
    """The cap counts the bytes read, not st_size (0 for devices, stale for a growing file)."""
    from k3compile.spec import load as load_module

    path = write_spec("name: x\n" + "# padding\n" * 200)
    monkeypatch.setattr(load_module, "MAX_FILE_BYTES", 1000)
    with pytest.raises(SpecError, match=r"is over 1000 bytes; a spec may be at most 1000"):
        load_spec(path)


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../OUT", "../../OUT", "link.yaml"])
def test_extends_outside_the_spec_root_is_refused(cli, spec_dir, tmp_path, target):
    """The root is the working directory (holding the spec); absolute paths, `..` past it and symlinks out fail."""
    outside = tmp_path.parent / f"{tmp_path.name}-outside.yaml"
    outside.write_text(K3_TINY.read_text())
    (spec_dir / "link.yaml").symlink_to(outside)
    (spec_dir / "deeper").mkdir()
    child = spec_dir / ("deeper/child.yaml" if target.startswith("../../..") else "child.yaml")
    child.write_text(f"extends: {target.replace('OUT', outside.name)}\nname: child\n")
    err = _one_error(cli, "check", child.relative_to(tmp_path))
    assert f"{child.relative_to(tmp_path)}:1:1: extends: " in err
    assert ("absolute path" if target.startswith("/") else "outside the spec root") in err
    assert "--extends-anywhere" in err


def test_extends_inside_the_root_and_the_opt_in_flag(cli, spec_dir, tmp_path):
    """`..` within the root is fine (specs/ablations/*.yaml extend ../k3-tiny.yaml); the flag allows the rest."""
    (spec_dir / "ablations").mkdir()
    (spec_dir / "ablations" / "a.yaml").write_text("extends: ../base.yaml\nname: a\n")
    rc, _, err = cli("check", "specs/ablations/a.yaml")
    assert (rc, err) == (0, "")
    outside = tmp_path.parent / f"{tmp_path.name}-base.yaml"
    outside.write_text(K3_TINY.read_text())
    (spec_dir / "far.yaml").write_text(f"extends: {outside}\nname: far\n")
    _one_error(cli, "check", "specs/far.yaml")
    rc, out, err = cli("check", "specs/far.yaml", "--extends-anywhere")
    assert (rc, err) == (0, "") and "valid spec 'far'" in out
    assert load_spec("specs/far.yaml", extends_anywhere=True).name == "far"


def test_a_spec_outside_the_working_directory_is_rooted_at_its_folder(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "base.yaml").write_text(K3_TINY.read_text())
    (tmp_path / "a" / "child.yaml").write_text("extends: ../base.yaml\nname: c\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(SpecError, match="outside the spec root"):
        load_spec(tmp_path / "a" / "child.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_spec(tmp_path / "a" / "child.yaml").name == "c"


@pytest.mark.parametrize("text", [NOT_A_SPEC, "{unclosed: [\n" + NOT_A_SPEC, "- " + NOT_A_SPEC, "!!binary aGk=\n"])
def test_a_file_that_is_not_a_spec_is_never_echoed(cli, spec_dir, text):
    """Reached through `extends:` (here with the opt-in), a non-spec file is named, its contents are not shown."""
    (spec_dir / "secret.txt").write_text(text)
    (spec_dir / "child.yaml").write_text("extends: secret.txt\nname: c\n")
    err = _one_error(cli, "check", "specs/child.yaml", "--extends-anywhere")
    assert "specs/child.yaml:1:1: extends: specs/secret.txt is not a k3compile spec" in err
    for secret in ("hunter2", "salt", "value", "aGk", "unclosed"):
        assert secret not in err


def test_an_unknown_top_level_field_of_an_extended_file_is_named_only(cli, spec_dir):
    (spec_dir / "almost.yaml").write_text(K3_TINY.read_text() + "hidden_sise: 99\n")
    (spec_dir / "child.yaml").write_text("extends: almost.yaml\nname: c\n")
    err = _one_error(cli, "check", "specs/child.yaml")
    assert "specs/almost.yaml is not a k3compile spec (unknown top-level field 'hidden_sise'; did you mean " in err
    assert "99" not in err
