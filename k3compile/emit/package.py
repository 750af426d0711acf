"""Writing a build directory atomically, and never over a directory k3compile did not make."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

MARKER = ".k3compile-build"


class BuildDirError(Exception):
    """The output directory cannot be written: it is not a previous build, or the disk refused."""


def is_build_dir(path: Path) -> bool:
    return (path / MARKER).is_file()


def check_dest(dest: Path) -> None:
    """Raise BuildDirError unless `dest` is absent or a previous build (safe to replace)."""
    if dest.exists() and not is_build_dir(dest):
        raise BuildDirError(f"{dest} exists and is not a k3compile build; refusing to overwrite it")


def write_package(dest: Path, files: dict[str, bytes], marker: dict) -> Path:
    """Write `files` (relative path -> bytes) as directory `dest`, all or nothing.

    The files go to a hidden sibling first and replace `dest` only when complete; an
    existing `dest` is replaced only if it carries the build marker.
    """
    dest = Path(dest)
    check_dest(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as e:
        raise BuildDirError(f"cannot write {dest}: {e.strerror or e}") from e
    old = None
    try:
        for rel, data in sorted(files.items()):
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True, indent=2) + "\n")
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
        os.replace(tmp, dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not dest.exists():
            os.replace(old, dest)
        if isinstance(e, OSError):
            raise BuildDirError(f"cannot write {dest}: {e.strerror or e}") from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return dest
