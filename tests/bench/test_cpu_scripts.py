"""Every script in bench/ runs with its smallest arguments, in a child process with a timeout, so a benchmark that
no longer runs fails CI (the GPU scripts' --dry-run runs are in test_gpu_scripts.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TINY = str(ROOT / "specs" / "k3-tiny.yaml")

# script -> (smallest arguments, a line its output must hold)
SMOKE = {
    "build_cpu.py": (["--spec", TINY, "--runs", "1"], "k3-tiny"),
    "decode_cpu.py": (["--tiny", "--variant", "k3-tiny", "--fill", "tile"], "| k3-tiny | 32 |"),
    "decode_ops.py": ([], "aten"),
    "mqar_recall.py": ([TINY, "--steps", "2", "--every", "1", "--set", "num_layers=4"], "capability"),
    "mqar_reference.py": (["--steps", "2", "--every", "1", "--layers", "1", "--hidden", "32", "--batch", "4"],
                          "capability"),
    "mx_cpu.py": (["--tiny", "--repeats", "1"], "capability"),
    "ops_cpu.py": (["--tiny", "--repeats", "1", "--ratio-repeats", "1"], "capability"),
    "train_cpu.py": (["--tiny", "--batch", "1", "--seq", "8"], "capability"),
    "gpu_structure.py": (["--target", "h200", "--only", "short_conv_bwd"], "| short_conv_bwd | h200 |"),
}
# run with --dry-run (or without a GPU) by test_gpu_scripts.py
GPU_TESTED = {"gpu.py", "tune_gpu.py", "gpu_e2e.py"}


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "250"}
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_every_bench_script_has_a_smoke_run():
    """A new script in bench/ (one with a __main__) must join SMOKE or GPU_TESTED."""
    scripts = {p.name for p in BENCH.glob("*.py") if re.search(r'__name__ == "__main__"', p.read_text())}
    assert scripts == set(SMOKE) | GPU_TESTED


# train_cpu.py spends minutes before its first step even at batch 1 x 8 (its build and first compiled step)
SLOW = {"train_cpu.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in sorted(SMOKE)])
def test_bench_script_runs_with_its_smallest_arguments(script):
    args, expect = SMOKE[script]
    done = run(script, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert expect in done.stdout + done.stderr, done.stdout[-2000:]


def test_decode_bench_runs_with_a_prefilled_cache():
    """--fill prefill serves real tokens up to each context (the default tiles a prompt's latents)."""
    done = run("decode_cpu.py", "--tiny", "--variant", "k3-tiny", "--fill", "prefill")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache fill: prefill" in done.stdout and "| k3-tiny | 32 |" in done.stdout
