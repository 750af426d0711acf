"""The seam: what emitted code imports at run time (ops, kernels, modules, the spec schema, the runtime)
never imports the compiler (k3compile.ir, k3compile.passes, the build driver)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPILER = ("k3compile.ir", "k3compile.passes", "k3compile.build")
RUN_TIME = [ROOT / "k3compile" / d for d in ("modules", "ops", "spec")] + [ROOT / "kernels"] + [
    ROOT / "k3compile" / "runtime" / f for f in ("generated.py", "generate.py", "checkpoint.py", "muon.py")
]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_run_time_code_never_imports_the_compiler():
    files = [f for p in RUN_TIME for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    assert len(files) > 20
    bad = {str(f.relative_to(ROOT)): sorted(n for n in _imports(f) if n.startswith(COMPILER)) for f in files}
    assert {f: names for f, names in bad.items() if names} == {}


def test_a_loaded_build_serves_and_trains_without_the_compiler(tmp_path):
    """In a fresh interpreter: build, then (compiler modules dropped) load, prefill, decode, train a step."""
    script = f"""
import sys, torch
from pathlib import Path
from k3compile.build import BuildOptions, build
from k3compile.spec.load import load_spec
spec = load_spec({str(ROOT / 'specs' / 'k3-tiny.yaml')!r}, ["num_layers=4", "hidden_size=64", "moe.latent_size=32",
    "kda.num_heads=2", "kda.head_dim=32", "mla.num_heads=2", "dense_ffn.intermediate_size=64"])
dest, _ = build(spec, Path({str(tmp_path)!r}))
for name in [m for m in sys.modules if m.startswith("k3compile")]:
    del sys.modules[name]
import k3compile
pkg = k3compile.load(dest)
model = pkg.InferenceModel().eval()
with torch.no_grad():
    _, cache = model.prefill(torch.zeros(1, 5, dtype=torch.long), 8)
    model.decode(torch.zeros(1, dtype=torch.long), cache)
train = pkg.Model()
tokens = torch.zeros(2, 8, dtype=torch.long)
train(tokens, tokens).backward()
print(sorted(m for m in sys.modules if m.startswith({COMPILER!r})))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
