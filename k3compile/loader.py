"""Importing an emitted package by path: `k3compile.load("build/k3_tiny")`."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from k3compile.emit.package import is_build_dir


def load(path: str | Path) -> ModuleType:
    """Import the emitted package at `path` (a build folder, or an output dir holding exactly one)."""
    path = Path(path)
    if not is_build_dir(path):
        # hidden siblings are a build in progress or being replaced (emit.package)
        builds = [p for p in path.iterdir() if is_build_dir(p) and not p.name.startswith(".")] if path.is_dir() else []
        if len(builds) != 1:
            raise FileNotFoundError(f"{path} is not a k3compile build (no {path}/.k3compile-build)")
        path = builds[0]
    # keyed by location and content: a rebuilt package imports afresh, an unchanged one is reused
    key = hashlib.sha256(str(path.resolve()).encode() + (path / "model.py").read_bytes()).hexdigest()[:16]
    name = f"k3compile_build_{path.name}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
