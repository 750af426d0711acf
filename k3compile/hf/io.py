"""Reading a Hugging Face folder's config, and output folders that appear whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from k3compile import safe_io
from k3compile.hf.config import HFError
from k3compile.runtime.shards import permissions

MAX_CONFIG_BYTES = 16 << 20  # a config is kilobytes; a per-layer list of 1,024 layers is tens of them


def hub_root(hf_dir: Path) -> Path:
    """Where the files of `hf_dir` may lie: the folder itself, or for a Hugging Face hub cache snapshot
    (`models--org--name/snapshots/<revision>/`, whose files are links to `../../blobs/`) that repository's cache."""
    hf_dir = Path(hf_dir).resolve()
    repo = hf_dir.parent.parent
    return repo if hf_dir.parent.name == "snapshots" and (repo / "blobs").is_dir() else hf_dir


def read_config(hf_dir: Path) -> dict:
    """`hf_dir/config.json` as a dict, through the bounded reader; anything else is a one-line HFError."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir} is not a folder")
    try:
        config = safe_io.read_json(safe_io.confined(hf_dir, "config.json", source=str(hf_dir), root=hub_root(hf_dir)),
                                   MAX_CONFIG_BYTES)  # fmt: skip
    except safe_io.MissingFile:
        raise HFError(f"{path} does not exist") from None
    except safe_io.FileError as e:
        raise HFError(str(e)) from None
    if not isinstance(config, dict):
        raise HFError(f"{path} does not hold a JSON object")
    return config


def check_out(out: Path) -> None:
    """An output folder must be absent or empty: nothing of a user's is ever replaced."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"{out} exists and is not an empty folder; choose another output")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden sibling of `out` to write into; renamed to `out` when the block succeeds, removed if it fails.

    Folders created above `out` are removed on failure too, so a failed run leaves nothing behind.
    """
    out = Path(out)
    check_out(out)
    top = None
    if not out.parent.exists():
        top = out.parent
        while not top.parent.exists():
            top = top.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        tmp.chmod(permissions(0o777))  # mkdtemp's 0700 is for the staging only
    except OSError as e:
        raise HFError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, as checked
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        if isinstance(e, OSError):
            raise HFError(f"cannot write {out}: {e.strerror or e}") from None
        raise
