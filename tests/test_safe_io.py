"""k3compile.safe_io: the one bounded reader, the one link-refusing writer and the confinement of names read
from files, on the hostile files they exist for (devices, FIFOs, links, hard links, oversized and deep files)."""

from __future__ import annotations

import json
import os

import pytest

from k3compile import safe_io
from k3compile.safe_io import FileError, MissingFile

needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs, /dev/zero and O_NOFOLLOW")


@pytest.fixture
def victim(tmp_path):
    """A file outside the folder a command writes into, which nothing may change."""
    path = tmp_path / "victim.txt"
    path.write_text("the user's notes\n")
    return path


def test_reads_a_regular_file_up_to_its_cap(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b'{"a": [1, 2]}')
    assert safe_io.read_bytes(path, 13) == b'{"a": [1, 2]}'
    assert safe_io.read_json(path) == {"a": [1, 2]}
    with pytest.raises(FileError, match=r"a\.json is over 12 bytes; the index may be at most 12"):
        safe_io.read_bytes(path, 12, what="the index")


@needs_posix
@pytest.mark.parametrize("kind", ["dev-zero", "link-to-dev-zero", "fifo", "link-to-fifo", "directory", "socket"])
def test_anything_but_a_regular_file_is_refused_before_a_byte_is_read(tmp_path, kind):
    """/dev/zero would fill memory and a FIFO would block the open; both fail at once, whatever the cap."""
    import socket

    path = tmp_path / "x"
    if kind == "dev-zero":
        path = "/dev/zero"
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind in ("fifo", "link-to-fifo"):
        os.mkfifo(tmp_path / "fifo")
        path = tmp_path / "fifo" if kind == "fifo" else path
        if kind == "link-to-fifo":
            path.symlink_to(tmp_path / "fifo")
    elif kind == "directory":
        path.mkdir()
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    why = "is a directory" if kind == "directory" else "is not a regular file"
    with pytest.raises(FileError, match=why):
        safe_io.read_bytes(path, 1 << 40)


@needs_posix
def test_a_link_is_refused_where_links_are_not_followed(tmp_path):
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert safe_io.read_json(tmp_path / "link.json") == {}  # a path the user names may be a link
    with pytest.raises(FileError, match="link.json is a symbolic link; refusing to follow it"):
        safe_io.read_json(tmp_path / "link.json", follow=False)


def test_missing_nul_and_unreadable_paths_are_one_line_errors(tmp_path):
    with pytest.raises(MissingFile, match="does not exist"):
        safe_io.read_bytes(tmp_path / "absent", 10)
    with pytest.raises(FileError, match="holds a NUL byte"):
        safe_io.read_bytes(str(tmp_path / "a\0b"), 10)
    with pytest.raises(FileError, match="File name too long"):
        safe_io.read_bytes(tmp_path / ("n" * 5000), 10)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(FileError, match="cannot read .*loop"):
        safe_io.read_bytes(tmp_path / "loop", 10)


@pytest.mark.parametrize("text, why", [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than 64 levels"),  # past the interpreter's recursion limit
    ("[" * 65 + "]" * 65, "nests deeper than 64 levels"),  # under it, but deeper than any metadata
    ('{"a": ', "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
])  # fmt: skip
def test_json_that_is_invalid_or_too_deep_is_refused(tmp_path, text, why):
    path = tmp_path / "deep.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(FileError, match=why) as e:
        safe_io.read_json(path)
    assert "\n" not in str(e.value)


def test_shown_clips_long_values_and_escapes_control_characters():
    assert safe_io.shown("9" * 5000).startswith("9" * 66 + "...") and "(5,000 characters)" in safe_io.shown("9" * 5000)
    assert len(safe_io.shown(list(range(100_000)))) < 260
    assert safe_io.shown("a\nb") == "'a\\nb'"


@pytest.mark.parametrize("name", ["../outside/x.safetensors", "/etc/passwd", "a/../../x", "", 7, None, ["a"],
                                  "a\0b", "link/x.safetensors", "loop/x"])  # fmt: skip
def test_names_read_from_files_stay_in_their_folder(tmp_path, name):
    folder = tmp_path / "hf"
    folder.mkdir()
    (tmp_path / "outside").mkdir()
    (folder / "link").symlink_to(tmp_path / "outside")
    (folder / "loop").symlink_to(folder / "loop")
    with pytest.raises(FileError, match=r"^index\.json: ") as e:
        safe_io.confined(folder, name, source="index.json")
    assert "\n" not in str(e.value)


def test_a_name_inside_the_folder_or_its_declared_root_is_kept(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/abc")  # how the Hugging Face hub cache lays files out
    assert safe_io.confined(snapshot, "sub/x.safetensors", source="i") == snapshot / "sub" / "x.safetensors"
    with pytest.raises(FileError, match="through a symbolic link"):
        safe_io.confined(snapshot, "config.json", source="i")
    assert safe_io.confined(snapshot, "config.json", source="i", root=repo) == snapshot / "config.json"


@needs_posix
def test_an_atomic_write_replaces_a_planted_link_and_never_writes_through_it(tmp_path, victim):
    out = tmp_path / "run"
    out.mkdir()
    (out / "result.json").symlink_to(victim)
    (out / ".result.json.tmp").symlink_to(victim)  # the temporary's name planted too
    safe_io.write_atomic(out / "result.json", b"{}")
    assert victim.read_text() == "the user's notes\n"
    assert not (out / "result.json").is_symlink() and (out / "result.json").read_bytes() == b"{}"
    assert sorted(p.name for p in out.iterdir()) == ["result.json"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    path.write_text("old")

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        safe_io.write_atomic(path, b"new")
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


@needs_posix
@pytest.mark.parametrize("kind, why", [("symlink", "is a symbolic link"), ("hardlink", "has other hard links"),
                                       ("fifo", "cannot write|not a regular file")])  # fmt: skip
def test_an_append_refuses_links_and_pipes(tmp_path, victim, kind, why):
    path = tmp_path / "metrics.jsonl"
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "hardlink":
        os.link(victim, path)
    else:
        os.mkfifo(path)
    with pytest.raises(FileError, match=why):
        safe_io.open_append(path)
    assert victim.read_text() == "the user's notes\n"


def test_an_append_creates_and_appends(tmp_path):
    fd = safe_io.open_append(tmp_path / "m.jsonl")
    os.write(fd, b'{"step": 1}\n')
    os.close(fd)
    fd = safe_io.open_append(tmp_path / "m.jsonl")
    os.write(fd, b'{"step": 2}\n')
    os.close(fd)
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [1, 2]


@needs_posix
def test_folders_to_write_into_are_never_links(tmp_path, victim):
    (tmp_path / "checkpoints").symlink_to(tmp_path)
    with pytest.raises(FileError, match="is a symbolic link"):
        safe_io.make_dir(tmp_path / "checkpoints")
    assert safe_io.make_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "tree")
    safe_io.remove_tree(tmp_path / "link")  # the link goes, not what it points at
    assert not os.path.lexists(tmp_path / "link") and (tmp_path / "tree" / "f").exists()
    safe_io.remove_tree(tmp_path / "tree")
    assert not (tmp_path / "tree").exists() and victim.exists()
