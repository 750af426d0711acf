"""Reading a Hugging Face folder's config, and output folders that appear whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from k3compile.hf.config import HFError
from k3compile.runtime.shards import permissions


def read_config(hf_dir: Path) -> dict:
    """`hf_dir/config.json` as a dict; a missing or unreadable file is a one-line HFError."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFError(f"{hf_dir} is not a folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path} is not readable JSON ({type(e).__name__}: {e})") from None
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
