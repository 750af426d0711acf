"""A spec's identity outside the compiler: its canonical JSON and hash, and the package folder its build gets.

The build writes these into the manifest and the folder name; the runtime reads them back (checkpoints record the
spec's hash, a sharded checkpoint finds the run's build by the package name) without importing the compiler.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import keyword
import sys

from k3compile.spec.schema import Spec


def spec_json(spec: Spec) -> str:
    """Canonical JSON of a spec: the same spec always gives the same text (and hash)."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def spec_hash(spec: Spec) -> str:
    """SHA-256 hex of `spec_json`."""
    return hashlib.sha256(spec_json(spec).encode()).hexdigest()


def package_name(spec: Spec) -> str:
    """The emitted package's folder, an importable identifier: 'k3-tiny' -> 'k3_tiny', 'class' -> 'k3_class'.

    A name Python already imports something by ('torch', 'json', 'os') is prefixed too: `-o .` would
    otherwise create ./torch/, which shadows the real package for any Python started in that folder.
    """
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in spec.name)
    clear = name[0].isalpha() and not keyword.iskeyword(name) and name not in importable_module_names()
    return name if clear else f"k3_{name}"


@functools.cache
def importable_module_names() -> frozenset[str]:
    """Top-level modules importable here whatever the working folder: the standard library's, the built-in
    ones and those of every installed distribution (the same set on each call, unlike a sys.path search)."""
    installed = importlib.metadata.packages_distributions()
    return frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names) | frozenset(installed)
