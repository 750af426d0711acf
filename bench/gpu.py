"""Every Triton kernel against its PyTorch reference on one GPU: correctness, time, throughput, speed-ups.

    python bench/gpu.py                         # K3 shapes on the CUDA device (under 5 minutes on one H200)
    python bench/gpu.py --only kda --only mla   # rows whose name contains one of these
    python bench/gpu.py --markdown table.md     # also write the table as Markdown (for docs/benchmarks.md)
    python bench/gpu.py --dry-run               # CPU, Triton interpreter, tiny shapes: checks the script runs

Each row first checks the kernel's outputs against the eager reference (relative RMS error over every
floating-point output, integer outputs exactly), then times the kernel, the eager reference and
torch.compile of the reference (triton.testing.do_bench: CUDA events, warm-up, median). Throughput is
the case's useful work over the kernel's time; "% bf16 peak" is TFLOP/s over the GPU's peak dense bf16
tensor-core rate, "% HBM" GB/s over its memory bandwidth (data-sheet figures in PEAKS below, per GPU), and
"% roofline" the larger of the two, i.e. how close the kernel runs to whichever bound applies. Case definitions live next to this file in gpu_<topic>.py.
Exits 1 if any kernel disagrees with its reference. With --dry-run, timings are single CPU runs and
torch.compile is skipped unless --compile (its columns print "-"): the point is the checks and the table.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

CASE_MODULES = ("gpu_kda", "gpu_kda_layer", "gpu_decode", "gpu_mx", "gpu_moe", "gpu_norms", "gpu_routing")

# Data-sheet peaks per target: dense bf16 tensor-core TFLOP/s and HBM GB/s (SXM parts).
PEAKS = {
    "a100": (312.0, 2039.0),
    "h100": (989.0, 3350.0),
    "h200": (989.0, 4800.0),
    "b200": (2250.0, 8000.0),
}
COLUMNS = ("kernel", "max err", "ok", "triton ms", "TFLOP/s", "GB/s", "% bf16 peak", "% HBM", "% roofline",
           "eager ms", "x eager", "compile ms", "x compile")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="run on CPU through TRITON_INTERPRET=1 with tiny shapes")
    p.add_argument("--only", action="append", default=[], metavar="TEXT", help="keep rows whose name contains TEXT")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--compile", action="store_true", help="with --dry-run: time torch.compile on CPU too")
    p.add_argument("--markdown", type=Path, help="also write the table to this Markdown file")
    return p.parse_args(argv)


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: do_bench on a GPU, one timed call after one warm-up on CPU (the dry run)."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def once(fn):
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return once


def compiled(fn: Callable[[], object]) -> Callable[[], object]:
    import torch

    return torch.compile(fn, dynamic=False)


def measure(case, time_ms, use_compile: bool, peaks: tuple[float, float] | None) -> dict:
    from k3compile.kernels._common.compare import max_error

    err = max_error(case.triton(), case.reference())
    row = {"kernel": case.name, "max err": err, "ok": err <= case.rtol}
    t = time_ms(case.triton)
    eager = time_ms(case.reference)
    row.update({"triton ms": t, "eager ms": eager, "x eager": eager / t})
    row["TFLOP/s"] = case.flops / t / 1e9
    row["GB/s"] = case.bytes / t / 1e6
    if peaks is None:
        row["% bf16 peak"] = row["% HBM"] = row["% roofline"] = None
    else:
        row["% bf16 peak"] = 100 * row["TFLOP/s"] / peaks[0]
        row["% HBM"] = 100 * row["GB/s"] / peaks[1]
        row["% roofline"] = max(row["% bf16 peak"], row["% HBM"])
    row["compile ms"] = row["x compile"] = None
    if use_compile and case.compile:
        comp = compiled(case.reference)
        comp()  # compile outside the timing
        row["compile ms"] = time_ms(comp)
        row["x compile"] = row["compile ms"] / t
    return row


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value != value or math.isinf(value):
            return str(value)
        if value == 0 or abs(value) >= 0.01 and abs(value) < 1e5:
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.1e}"
    return str(value)


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"{title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch
    from rich.console import Console
    from rich.table import Table

    from k3compile.kernels._common.launch import device_target

    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("bench/gpu.py: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).parent))
    target = device_target(device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter, tiny shapes)"
    if target in PEAKS:
        gpu += f" (peaks as {target}: {PEAKS[target][0]:.0f} bf16 TFLOP/s, {PEAKS[target][1]:.0f} GB/s)"
    time_ms = timer(device)
    use_compile = not args.no_compile and (args.compile or not args.dry_run)
    rows = []
    console = Console(width=max(Console().width, 200))
    start = time.perf_counter()
    for module in CASE_MODULES:
        for case in importlib.import_module(module).cases(device, args.dry_run):
            if args.only and not any(text in case.name for text in args.only):
                continue
            rows.append(measure(case, time_ms, use_compile, PEAKS.get(target)))
            if device == "cuda":
                torch.cuda.empty_cache()  # each case's K3-sized inputs go before the next's
            console.log(f"{case.name}: err {fmt(rows[-1]['max err'])}, {fmt(rows[-1]['triton ms'])} ms")
    elapsed = time.perf_counter() - start
    table = Table(title=f"Triton kernels on {gpu} (torch {torch.__version__}), {elapsed:.0f} s", title_justify="left")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "kernel" else "right", no_wrap=True)
    for r in rows:
        table.add_row(*(fmt(r[c]) for c in COLUMNS))
    console.print(table)
    if args.markdown:
        args.markdown.write_text(markdown(rows, f"Triton kernels on {gpu}, torch {torch.__version__}, {elapsed:.0f} s"))
    bad = [r["kernel"] for r in rows if not r["ok"]]
    if bad:
        print(f"bench/gpu.py: {len(bad)} kernel(s) disagree with their reference: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
