"""Importing an emitted package by path: `k3compile.load("build/k3_tiny")`.

A build is code: importing it runs its `model.py` (see docs/security.md). Before that, every file is read through
the bounded reader and checked against the SHA-256 the build recorded in its marker, so an edited or corrupted
build is refused before any of its code runs. The code that runs is then compiled from exactly those verified
bytes: Python's import machinery is not used, so neither a file changed after the check nor a bytecode cache
(`__pycache__/model.*.pyc`) planted beside `model.py` ever runs. After it, the spec in `model.py` must be the
one `manifest.json` describes.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from k3compile import safe_io

MAX_FILE_BYTES = 256 << 20  # a full-size model's model.py and graph dumps are megabytes
MAX_FILES = 10_000
CODE = ("__init__.py", "model.py")  # what runs; with the manifest, a build cannot be without them
REQUIRED = (*CODE, "manifest.json")

MARKER = ".k3compile-build"  # a build folder's marker: what it wrote (k3compile.emit.package writes it)


def is_build_dir(path: Path) -> bool:
    """Whether `path` is a build folder (holds the marker a build writes)."""
    return (path / MARKER).is_file()


def file_hashes(files: dict[str, bytes]) -> dict[str, str]:
    """relative path -> SHA-256 hex of its bytes: what the marker records."""
    return {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())}


def recorded_files(build: Path) -> dict[str, str] | None:
    """The files (relative path -> SHA-256) the build at `build` wrote, or None for a marker without the list.

    The marker is read through the bounded reader (never a link, a device or a FIFO); one that cannot be read,
    or whose list is not names to digests, is a safe_io.FileError.
    """
    marker_path = build / MARKER
    marker = safe_io.read_json(marker_path, safe_io.MAX_JSON_BYTES, follow=False)
    files = marker.get("files") if isinstance(marker, dict) else None
    if files is None:
        return None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise safe_io.FileError(f"{marker_path} does not list the build's files as names and SHA-256 digests")
    return files


class BuildLoadError(ValueError):
    """Not exactly one k3compile build, or a build that was changed after it was written or cannot import; one line."""


def find_build(path: Path) -> Path:
    """`path` itself when it is a build, else the one build inside it (hidden staging folders aside)."""
    if is_build_dir(path):
        return path
    try:
        inside = sorted(path.iterdir()) if path.is_dir() else []
    except OSError as e:
        raise BuildLoadError(f"cannot read {path}: {e.strerror or e}") from None
    builds = [p for p in inside if is_build_dir(p) and not p.name.startswith(".")]
    if len(builds) > 1:
        names = ", ".join(p.name for p in builds)
        raise BuildLoadError(f"{path} holds {len(builds)} builds ({names}); name one of them")
    if not builds:
        raise BuildLoadError(f"{path} is not a k3compile build (no {path}/{MARKER})")
    return builds[0]


def verify_files(path: Path) -> dict[str, bytes]:
    """The bytes of every file the build at `path` recorded, each checked against its recorded SHA-256.

    Names come from the marker, so each must stay inside the build (safe_io.confined) and be a regular file, not
    a link (builds hold none), read up to MAX_FILE_BYTES; anything else is a one-line BuildLoadError.
    """
    try:
        recorded = recorded_files(path)
    except safe_io.FileError as e:
        raise BuildLoadError(f"{e}; rebuild it") from None
    if recorded is None:
        raise BuildLoadError(f"{path} was written by an older k3compile that recorded no file hashes; rebuild it")
    absent = [name for name in REQUIRED if name not in recorded]
    if absent or len(recorded) > MAX_FILES:
        why = f"does not record {absent[0]}" if absent else f"lists over {MAX_FILES} files"
        raise BuildLoadError(f"{path}/{MARKER} {why}; rebuild it")
    files = {}
    for rel, digest in recorded.items():
        try:
            target = safe_io.confined(path, rel, source=f"{path}/{MARKER}")
            data = safe_io.read_bytes(target, MAX_FILE_BYTES, what="a build's file", follow=False)
        except safe_io.MissingFile:
            raise BuildLoadError(f"{path}/{safe_io.shown(rel)} is missing; rebuild it") from None
        except safe_io.FileError as e:
            raise BuildLoadError(f"{e}; rebuild it") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise BuildLoadError(f"{path}/{rel} is not the file the build wrote (edited or corrupted); rebuild it")
        files[rel] = data
    return files


def _check_manifest(path: Path, module: ModuleType, manifest: bytes) -> None:
    """The spec `model.py` carries is the one `manifest.json` records (both its hash and its fields)."""
    try:
        recorded = json.loads(manifest)["spec"]
        fields, digest = recorded["fields"], recorded["sha256"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise BuildLoadError(f"{path}/manifest.json does not record the build's spec; rebuild it") from None
    spec_json = getattr(module, "SPEC_JSON", "")
    try:
        same = hashlib.sha256(spec_json.encode()).hexdigest() == digest and json.loads(spec_json) == fields
    except (AttributeError, ValueError, RecursionError):
        same = False
    if not same:
        raise BuildLoadError(f"{path}: manifest.json and model.py record different specs; rebuild it")


def shapes_only(module: ModuleType) -> bool:
    """Whether a loaded build was lowered on the meta device (a full-size spec): it has shapes but no weights."""
    models = [getattr(module, name, None) for name in ("Model", "InferenceModel")]
    return any(getattr(m, "DEFAULT_DEVICE", None) == "meta" for m in models)


def check_target(module: ModuleType, path: Path | str) -> None:
    """A build for a GPU target calls Triton kernels: refuse it in one line where there is no GPU to run them
    (unless Triton's interpreter is on), rather than failing inside the first kernel."""
    from k3compile.runtime.device import DeviceError, runtime_device

    target = getattr(module, "TARGET", "cpu")
    try:
        runtime_device(target, f"{path} was built for {target}")
    except DeviceError as e:
        raise BuildLoadError(str(e)) from None


def _module(name: str, file: Path, package: bool) -> ModuleType:
    """An empty module `name` that reports `file` as its source; a package's submodules are never searched for."""
    spec = importlib.machinery.ModuleSpec(name, None, origin=str(file), is_package=package)
    spec.has_location = True
    return importlib.util.module_from_spec(spec)  # a package gets __path__ = []: nothing is imported from disk


def load(path: str | Path) -> ModuleType:
    """Import the emitted package at `path` (a build folder, or an output dir holding exactly one).

    Only load builds you trust: this runs their code. Raises BuildLoadError for anything else.
    """
    path = find_build(Path(path))
    files = verify_files(path)
    # keyed by location and content: a rebuilt package imports afresh, an unchanged one is reused
    key = hashlib.sha256(str(path.resolve()).encode() + files["model.py"]).hexdigest()[:16]
    name = f"k3compile_build_{path.name}_{key}"
    if name in sys.modules:
        return sys.modules[name]
    package, model = _module(name, path / "__init__.py", True), _module(f"{name}.model", path / "model.py", False)
    sys.modules[name], sys.modules[model.__name__] = package, model
    try:
        exec(compile(files["model.py"], str(path / "model.py"), "exec"), model.__dict__)
        package.model = model
        exec(compile(files["__init__.py"], str(path / "__init__.py"), "exec"), package.__dict__)  # `from .model import`
        _check_manifest(path, package, files["manifest.json"])
    except BaseException as e:
        del sys.modules[name], sys.modules[model.__name__]
        if isinstance(e, BuildLoadError) or not isinstance(e, Exception):
            raise
        why = " ".join(str(e).split()) or "no message"
        raise BuildLoadError(f"{path}: cannot import the build ({type(e).__name__}: {safe_io.shown(why)}); "
                             "rebuild it") from e
    return package
