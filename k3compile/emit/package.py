"""Writing a build directory atomically, and never over a directory k3compile did not make.

A build is staged in a hidden sibling `.NAME.tmp-<host>-<pid>-*`, every file and folder fsynced, then
swapped in. On Linux the swap is one renameat2(RENAME_EXCHANGE): whenever the process dies, the destination
holds the old build or the new one. Elsewhere the old build first moves to `.NAME.old-<host>-<pid>-*`. A
killed build leaves its staging folder behind; the next build of the same name deletes those whose process
is gone. The marker file records the SHA-256 of every file written, so that a later build can tell files it
did not write (a run's checkpoints) and `k3compile.load` can tell an edited build.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from k3compile import safe_io
from k3compile.loader import MARKER, file_hashes, is_build_dir, recorded_files  # noqa: F401  (the folder format)
from k3compile.safe_io import fsync_path

_OWN_CACHE = "__pycache__"  # importing a build writes bytecode there: not a foreign file


class BuildDirError(Exception):
    """The output directory cannot be written: it is not a previous build, or the disk refused."""


def foreign_files(build: Path) -> list[str]:
    """Files under the build folder `build` that no build wrote (bytecode caches aside), sorted."""
    try:
        recorded = recorded_files(build)
    except safe_io.FileError as e:
        raise BuildDirError(f"{e}; refusing to replace {build}") from None
    if recorded is None:
        return []  # a marker of an older k3compile: it did not list its files
    found = []
    for dirpath, dirnames, filenames in os.walk(build):
        dirnames[:] = sorted(d for d in dirnames if d != _OWN_CACHE)
        rel = Path(dirpath).relative_to(build)
        found += [(rel / f).as_posix() for f in filenames]
    return sorted(f for f in found if f not in recorded and f != MARKER)


def check_dest(dest: Path) -> None:
    """Raise BuildDirError unless `dest` can become a build: absent, or a previous build holding only its files.

    Called before compiling, so a bad `-o` fails at once: a file where the output folder should be, a
    symbolic link (dangling or not) at the destination, a foreign folder, or a build that holds files it
    did not write (a training run's checkpoints, which replacing it would delete).
    """
    dest = Path(dest)
    for folder in (dest.parent, *dest.parent.parents):
        if os.path.lexists(folder):
            if not folder.is_dir():
                raise BuildDirError(f"output folder {folder} exists and is not a folder")
            break
    if dest.is_symlink():
        raise BuildDirError(f"{dest} is a symbolic link; refusing to replace it (remove it or choose another -o)")
    if dest.exists() and not is_build_dir(dest):
        raise BuildDirError(f"{dest} exists and is not a k3compile build; refusing to overwrite it")
    foreign = foreign_files(dest) if dest.exists() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise BuildDirError(
            f"{dest} holds files the build did not write ({shown}); refusing to replace it: move them out first"
        )


def write_package(dest: Path, files: dict[str, bytes], marker: dict) -> Path:
    """Write `files` (relative path -> bytes) as directory `dest`, all or nothing.

    The files go to a hidden sibling first and replace `dest` only when complete and on disk; an
    existing `dest` is replaced only if `check_dest` allows it. `marker` gains the files' hashes.
    """
    dest = Path(dest)
    check_dest(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dest)
        tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(dest, "tmp"), dir=dest.parent))
    except OSError as e:
        raise BuildDirError(f"cannot write {dest}: {e.strerror or e}") from e
    try:
        _write_tree(tmp, {**files, MARKER: _marker_bytes(marker, files)})
        replaced = _swap_in(tmp, dest)
        fsync_path(dest.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise BuildDirError(f"cannot write {dest}: {e.strerror or e}") from e
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return dest


def _marker_bytes(marker: dict, files: dict[str, bytes]) -> bytes:
    return (json.dumps({**marker, "files": file_hashes(files)}, sort_keys=True, indent=2) + "\n").encode()


# ---------------------------------------------------------------- staging, fsync and the swap


def _host_tag() -> str:
    """8 hex digits naming this machine: a staging folder's process id means something only on its host."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def staging_prefix(dest: Path, kind: str) -> str:
    """`.NAME.tmp-<host>-<pid>-` (kind "tmp") or `.NAME.old-...`: hidden names that say who made them."""
    return f".{dest.name}.{kind}-{_host_tag()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale(dest: Path) -> None:
    """Delete the staging and set-aside folders of builds of `dest` whose process (on this host) is gone."""
    if os.name != "posix":
        return  # os.kill(pid, 0) would terminate the process on Windows
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:tmp|old)-{_host_tag()}-(\d+)-")
    for entry in dest.parent.iterdir():
        m = pattern.match(entry.name)
        if m and not _alive(int(m.group(1))) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    """Write every file under `root` and fsync it, then every folder, deepest first."""
    folders = {root}
    for rel, data in sorted(files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        folders.update(p for p in path.parents if p.is_relative_to(root))
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_path(folder)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False  # a C library older than glibc 2.28
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, dest: Path) -> Path | None:
    """Put the complete tree `tmp` at `dest`; returns where the previous build now is (to delete), or None."""
    if not dest.exists():
        try:
            os.rename(tmp, dest)
            return None
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            check_dest(dest)  # a concurrent build got there first: replace it if it may be replaced
    if _exchange(tmp, dest):
        return tmp
    old = Path(tempfile.mkdtemp(prefix=staging_prefix(dest, "old"), dir=dest.parent))
    os.replace(dest, old / dest.name)
    os.replace(tmp, dest)
    return old
