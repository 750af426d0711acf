"""Importing an emitted package by path: `k3compile.load("build/k3_tiny")`.

A build is code: importing it runs its `model.py` (see docs/security.md). Before that, every file is checked
against the SHA-256 the build recorded in its marker, so an edited or corrupted build is refused before any
of its code runs; after it, the spec in `model.py` must be the one `manifest.json` describes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from k3compile.emit.package import MARKER, is_build_dir, recorded_files


class BuildLoadError(ValueError):
    """Not exactly one k3compile build, or a build that was changed after it was written or cannot import; one line."""


def find_build(path: Path) -> Path:
    """`path` itself when it is a build, else the one build inside it (hidden staging folders aside)."""
    if is_build_dir(path):
        return path
    inside = sorted(path.iterdir()) if path.is_dir() else []
    builds = [p for p in inside if is_build_dir(p) and not p.name.startswith(".")]
    if len(builds) > 1:
        names = ", ".join(p.name for p in builds)
        raise BuildLoadError(f"{path} holds {len(builds)} builds ({names}); name one of them")
    if not builds:
        raise BuildLoadError(f"{path} is not a k3compile build (no {path}/{MARKER})")
    return builds[0]


def verify_files(path: Path) -> None:
    """Every file the build at `path` recorded is there with the bytes it wrote; else a one-line BuildLoadError."""
    recorded = recorded_files(path)
    if recorded is None:
        raise BuildLoadError(f"{path} was written by an older k3compile that recorded no file hashes; rebuild it")
    for rel, digest in recorded.items():
        try:
            data = (path / rel).read_bytes()
        except FileNotFoundError:
            raise BuildLoadError(f"{path}/{rel} is missing; rebuild it") from None
        except OSError as e:
            raise BuildLoadError(f"cannot read {path}/{rel}: {e.strerror}") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise BuildLoadError(f"{path}/{rel} is not the file the build wrote (edited or corrupted); rebuild it")


def _check_manifest(path: Path, module: ModuleType) -> None:
    """The spec `model.py` carries is the one `manifest.json` records (both its hash and its fields)."""
    try:
        recorded = json.loads((path / "manifest.json").read_text(encoding="utf-8"))["spec"]
        fields, digest = recorded["fields"], recorded["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BuildLoadError(f"{path}/manifest.json does not record the build's spec; rebuild it") from None
    spec_json = getattr(module, "SPEC_JSON", "")
    try:
        same = hashlib.sha256(spec_json.encode()).hexdigest() == digest and json.loads(spec_json) == fields
    except (AttributeError, ValueError):
        same = False
    if not same:
        raise BuildLoadError(f"{path}: manifest.json and model.py record different specs; rebuild it")


def shapes_only(module: ModuleType) -> bool:
    """Whether a loaded build was lowered on the meta device (a full-size spec): it has shapes but no weights."""
    models = [getattr(module, name, None) for name in ("Model", "InferenceModel")]
    return any(getattr(m, "DEFAULT_DEVICE", None) == "meta" for m in models)


def load(path: str | Path) -> ModuleType:
    """Import the emitted package at `path` (a build folder, or an output dir holding exactly one).

    Only load builds you trust: this runs their code. Raises BuildLoadError for anything else.
    """
    path = find_build(Path(path))
    verify_files(path)
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
        _check_manifest(path, module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, BuildLoadError) or not isinstance(e, Exception):
            raise
        why = " ".join(str(e).split()) or "no message"
        raise BuildLoadError(f"{path}: cannot import the build ({type(e).__name__}: {why}); rebuild it") from e
    return module
