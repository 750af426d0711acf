"""CPU cost of `k3compile build`: the published Kimi K3 spec (meta device) and k3-tiny (real weights).

    python bench/build_cpu.py                              # this checkout, both specs, 2 runs each
    python bench/build_cpu.py --against /other/.venv/bin/python   # and another checkout's install, run by run
    python bench/build_cpu.py --spec specs/kimi-k3.yaml --runs 3

Each run is a fresh process (`k3compile build SPEC -o TMP` through the given Python), so import time is
included as a user pays it. Another checkout is run through its own environment: its editable install maps
k3compile.passes and k3compile.kernels to its own folders, which PYTHONPATH cannot redirect. CPU seconds
are the child's user + system time (`resource.getrusage(RUSAGE_CHILDREN)`), the number to compare on a
shared machine; wall seconds beside them. With --against, the two alternate run by run so machine load
hits both alike, and the table says whether their outputs are byte-identical. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
SPECS = ("specs/kimi-k3.yaml", "specs/k3-tiny.yaml")


def run_build(python: str, spec: Path, out: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one build of `spec` by the k3compile that `python` imports, into `out`."""
    code = "import sys; from k3compile.cli import main; sys.exit(main(sys.argv[1:]))"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    # cwd elsewhere: `python -c` puts the cwd first on sys.path, which would import this checkout's k3compile
    done = subprocess.run([python, "-c", code, "build", str(spec), "-o", str(out)], cwd=out.parent,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{python}: build {spec} failed: {done.stderr.strip().splitlines()[-1]}")
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def same_tree(a: Path, b: Path) -> bool:
    """Whether two build folders hold the same files with the same bytes."""
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[1:] != ([], []):
        return False
    return all(same_tree(a / d, b / d) for d in cmp.common_dirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", action="append", help="a spec to build (repeatable; default: Kimi K3 and k3-tiny)")
    parser.add_argument("--runs", type=int, default=2, help="builds per spec and tree (default 2)")
    parser.add_argument("--against", help="the Python of another checkout's environment, to build side by side")
    args = parser.parse_args()
    trees = {"this": sys.executable} | ({"against": args.against} if args.against else {})
    console = Console()
    console.print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, "
                  f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    table = Table("spec", "tree", "CPU s (median)", "CPU s (min)", "wall s (median)", "identical output")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.spec or SPECS:
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
            for run in range(args.runs):
                for name, python in trees.items():
                    out = Path(tmp) / f"{name}-{Path(spec).stem}-{run}"
                    times[name].append(run_build(python, ROOT / spec, out))
            first = {name: Path(tmp) / f"{name}-{Path(spec).stem}-0" for name in trees}
            for name in trees:
                cpu = [c for c, _ in times[name]]
                wall = [w for _, w in times[name]]
                reruns = all(same_tree(first[name], Path(tmp) / f"{name}-{Path(spec).stem}-{r}")
                             for r in range(1, args.runs))
                same = "rebuilds: " + ("yes" if reruns else "no")
                if name == "against":
                    same += ", vs this: " + ("yes" if same_tree(first["this"], first[name]) else "no")
                table.add_row(spec, name, f"{statistics.median(cpu):.1f}", f"{min(cpu):.1f}",
                              f"{statistics.median(wall):.1f}", same)
    console.print(table)


if __name__ == "__main__":
    main()
