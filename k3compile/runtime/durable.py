"""fsync for files and folders: what makes a write or a rename survive a power cut."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list, so that a rename in it is durable).

    Platforms without directory handles, and folders that cannot be fsynced, are skipped.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
