"""Files in places a user controls: bounded regular-file reads, writes that never follow a link, confined names.

Standard library only, so that every layer (the spec loader, the runtime, the build loader) reads and writes
through these few functions (docs/security.md):

- `read_bytes`/`read_text`/`read_json`: the path must be a regular file (a device, pipe, socket or folder is
  refused by its status before it is opened, and again by the open handle's, the open never blocking on a FIFO);
  at most `limit` bytes are read, counted as they arrive (a file's size is not trusted); `follow=False` also
  refuses a symbolic link at the path (files k3compile finds inside its own folders are never links);
- `write_atomic`: a hidden temporary opened O_CREAT|O_EXCL|O_NOFOLLOW, fsynced, then renamed over the target,
  which replaces a link there instead of writing through it; `open_append`: O_NOFOLLOW, a regular file with one
  name only; `make_dir`: a folder to write into, never a link to one;
- `confined`: a file name read from a file (a shard map, a build's file list) stays inside its folder.

Every refusal is a `FileError` whose text is one line naming the path.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)
MAX_JSON_BYTES = 64 << 20  # metadata, manifests, configs and indexes are kilobytes to megabytes
MAX_JSON_DEPTH = 64  # no metadata k3compile reads nests deeper than a few levels
_SHOWN = 200  # characters of a path or value shown in an error


class FileError(ValueError):
    """A path that cannot be read or written safely, or a name that leaves its folder; one line naming it."""


class MissingFile(FileError):
    """The path does not exist."""


def shown(value: object, limit: int = _SHOWN, *, quote: bool = False) -> str:
    """`value` for a one-line message: a path as text (repr when it holds control characters), anything else (and
    with `quote` a string too) as repr; clipped to about `limit` characters, so that a 5,000-digit number or a
    600 kB list is not echoed whole."""
    plain = isinstance(value, (str, os.PathLike)) and not quote
    text = str(value) if plain else repr(value)
    if plain and not text.isprintable():
        text = repr(text)
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]}...{text[-(limit - head - 3):]} ({len(text):,} characters)"


# ---------------------------------------------------------------- reading


def _refuse_status(path, mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise FileError(f"{shown(path)} is a symbolic link; refusing to follow it")
    if stat.S_ISDIR(mode):
        raise FileError(f"{shown(path)} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise FileError(f"{shown(path)} is not a regular file (a device, pipe or socket)")


def _os_error(path, e: OSError, doing: str = "read") -> FileError:
    if isinstance(e, FileNotFoundError):
        return MissingFile(f"{shown(path)} does not exist")
    return FileError(f"cannot {doing} {shown(path)}: {e.strerror or e}")


def open_regular(path: str | os.PathLike, *, follow: bool = True) -> int:
    """A read-only descriptor of the regular file at `path`; FileError for anything else (nothing is read).

    The status is checked before the open (a device is never opened) and again on the descriptor (the path
    may have changed in between); the open does not block (O_NONBLOCK: a FIFO would wait for a writer).
    """
    def opened(call, *args, **kw):
        try:
            return call(path, *args, **kw)
        except ValueError:  # a NUL byte
            raise FileError(f"{shown(path)!r} is not a usable path (it holds a NUL byte)") from None
        except OSError as e:
            if e.errno == errno.ELOOP and not follow:
                raise FileError(f"{shown(path)} is a symbolic link; refusing to follow it") from None
            raise _os_error(path, e) from None

    before = opened(os.stat, follow_symlinks=follow)
    _refuse_status(path, before.st_mode)
    fd = opened(os.open, os.O_RDONLY | _NONBLOCK | _CLOEXEC | _BINARY | (0 if follow else _NOFOLLOW))
    try:
        now = os.fstat(fd)
        _refuse_status(path, now.st_mode)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise FileError(f"{shown(path)} changed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: str | os.PathLike, limit: int, *, what: str = "it", follow: bool = True) -> bytes:
    """The bytes of the regular file at `path`, refused past `limit` bytes (`what` names it in that error)."""
    fd = open_regular(path, follow=follow)
    try:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            parts, total = [], 0
            want = min(os.fstat(fd).st_size, limit) + 1  # one read for a file of the size it says
            while total <= limit:
                chunk = f.read(min(want, limit + 1 - total))
                if not chunk:
                    break
                parts.append(chunk)
                total += len(chunk)
                want = 1 << 24
    except OSError as e:
        raise _os_error(path, e) from None
    finally:
        os.close(fd)
    if total > limit:
        raise FileError(f"{shown(path)} is over {limit} bytes; {what} may be at most {limit}")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_text(path: str | os.PathLike, limit: int, *, what: str = "it", follow: bool = True) -> str:
    """`read_bytes` decoded as UTF-8."""
    data = read_bytes(path, limit, what=what, follow=follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FileError(f"{shown(path)} is not UTF-8 text") from None


def depth(value: object) -> int:
    """How deeply lists and objects nest in parsed JSON (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def parse_json(data: bytes | str, where: str, max_depth: int = MAX_JSON_DEPTH) -> object:
    """JSON text as Python values; invalid JSON or nesting past `max_depth` is a FileError naming `where`."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise FileError(f"{where} nests deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise FileError(f"{where} is not valid JSON ({shown(str(e), 120)})") from None
    if depth(value) > max_depth:
        raise FileError(f"{where} nests deeper than {max_depth} levels")
    return value


def read_json(
    path: str | os.PathLike, limit: int = MAX_JSON_BYTES, *, follow: bool = True, max_depth: int = MAX_JSON_DEPTH
) -> object:
    """The JSON document in the regular file at `path` (at most `limit` bytes, `max_depth` levels)."""
    return parse_json(read_bytes(path, limit, follow=follow), shown(path), max_depth)


# ---------------------------------------------------------------- names read from files


def confined(folder: str | os.PathLike, name: object, *, source: str, root: str | os.PathLike | None = None) -> Path:
    """`folder / name` for a file `name` that `source` (a file) lists; FileError unless it stays inside `root`
    (default `folder`): a relative path without `..`, which after resolving symbolic links lies inside `root`."""
    folder = Path(folder)
    if not isinstance(name, str) or not name or "\0" in name:
        raise FileError(f"{source}: {shown(name, 80)} is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or name.startswith("\\") or ":" in parts[0]:
        raise FileError(f"{source}: {shown(name, 80)} leads outside {shown(folder)} (an absolute path or ..)")
    target = folder / name
    try:
        inside = target.resolve().is_relative_to(Path(root or folder).resolve())
    except (OSError, RuntimeError) as e:  # RuntimeError: a symbolic-link loop (before Python 3.13)
        raise FileError(f"{source}: cannot resolve {shown(name, 80)} in {shown(folder)}: {e}") from None
    if not inside:
        raise FileError(f"{source}: {shown(name, 80)} leads outside {shown(root or folder)} (through a symbolic link)")
    return target


# ---------------------------------------------------------------- writing


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def _create_new(path: Path, mode: int) -> int:
    """O_CREAT|O_EXCL|O_NOFOLLOW: a new file, never an existing one or a link's target. A leftover at the name
    (a stale temporary, or a link someone put there) is unlinked first: unlinking never follows a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | _BINARY
    try:
        return os.open(path, flags, mode)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, flags, mode)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a folder's entry list (so that a rename in it survives a power cut); platforms without
    folder handles, and folders that cannot be fsynced, are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | bytearray | memoryview, *, mode: int = 0o644,
                 sync_dir: bool = False) -> Path:  # fmt: skip
    """Write `data` to `path` through the hidden temporary `.NAME.tmp` beside it (created new, fsynced), renamed
    into place: a reader sees the old file or the new one, and a link at `path` is replaced, never written
    through. `sync_dir` also fsyncs the folder (the rename is then durable). OSError on failure, nothing left."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = _create_new(tmp, mode)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_dir:
        fsync_path(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str, **kw) -> Path:
    """`write_atomic` of UTF-8 text."""
    return write_atomic(path, text.encode("utf-8"), **kw)


def open_append(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write descriptor appending to the regular file `path` (created if absent): FileError for a link, a
    FIFO or device (the open does not block), or a file with other hard links (writing would change them too)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW | _NONBLOCK | _CLOEXEC | _BINARY
    try:
        fd = os.open(path, flags, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileError(f"{shown(path)} is a symbolic link; refusing to write through it") from None
        raise _os_error(path, e, "write") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileError(f"{shown(path)} is not a regular file (a device, pipe or socket); refusing to write to it")
        if st.st_nlink > 1:
            raise FileError(f"{shown(path)} has other hard links; refusing to write through them")
        if _NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(path: str | os.PathLike, *, inside: str | os.PathLike | None = None) -> Path:
    """`path` as a folder to write into, created with its parents when absent; FileError when it is a symbolic
    link (the files would land wherever it points) or not a folder, and with `inside` (a folder above it) when
    any folder from there down is. OSError when it cannot be created."""
    path = Path(path)
    chain = [path]
    if inside is not None:
        parts = path.relative_to(inside).parts
        chain = [Path(inside).joinpath(*parts[: i + 1]) for i in range(len(parts))]
    for folder in chain:
        if folder.is_symlink():
            raise FileError(f"{shown(folder)} is a symbolic link; refusing to write through it")
        if os.path.lexists(folder) and not folder.is_dir():
            raise FileError(f"{shown(folder)} exists and is not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        if folder.is_symlink() or not folder.is_dir():
            raise FileError(f"{shown(folder)} is not a folder k3compile can write into")
    return path


def remove_tree(path: str | os.PathLike) -> None:
    """Remove `path`: a folder with what it holds, or a file; a symbolic link is removed itself, never followed."""
    path = Path(path)
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
