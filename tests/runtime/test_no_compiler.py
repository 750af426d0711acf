"""The runtime never imports the compiler (shared/ARCHITECTURE.md): importing every k3compile.runtime module, and
training a build, leaves k3compile.build, ir, emit and passes unimported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import k3compile.runtime

COMPILER = ("k3compile.build", "k3compile.ir", "k3compile.emit", "k3compile.passes", "k3compile.training")
RUNTIME = sorted(p.stem for p in Path(k3compile.runtime.__file__).parent.glob("*.py") if p.stem != "__init__")

PROBE = """
import importlib, sys
for name in sys.argv[1].split(","):
    importlib.import_module("k3compile.runtime." + name)
compiler = tuple(sys.argv[2].split(","))
print(",".join(sorted(m for m in sys.modules if m == compiler or m.startswith(compiler))))
"""


def test_every_runtime_module_imports_without_the_compiler():
    assert len(RUNTIME) > 10
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(RUNTIME), ",".join(COMPILER)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""


def test_no_runtime_module_names_the_compiler_in_its_source():
    """Function-level imports too: a runtime path that would import the compiler when it runs."""
    named = [(name, line.strip()) for name in RUNTIME
             for line in (Path(k3compile.runtime.__file__).parent / f"{name}.py").read_text().splitlines()
             if line.strip().startswith(("from k3compile.", "import k3compile."))
             and line.split()[1].startswith(COMPILER)]
    assert named == []
