"""Tune the Triton kernels' launch configurations on this GPU and merge them into kernels/_common/configs/<target>.json.

    python bench/tune_gpu.py                               # every kernel bench/gpu.py runs, K3 shapes, ~7 minutes
    python bench/tune_gpu.py --only expert_matmul,mla      # cases or kernels whose name contains one of these
    python bench/tune_gpu.py --budget 120 --trials 8       # a shorter run
    python bench/tune_gpu.py --plan                        # print the plan and its time estimate, tune nothing
    python bench/tune_gpu.py --dry-run --out /tmp          # CPU, Triton interpreter, tiny shapes, seconds

For every case of bench/gpu.py, the kernels it launches are recorded with their sizes, input dtype and default
configuration; each kernel then runs candidate configurations from its module's TUNABLE space (the defaults
first, then a fixed-seed sample). A candidate whose shared memory (the module's `shared_bytes` estimate of its
pipelined tiles) exceeds the device's is rejected before it is compiled or timed; one that fails to launch or
whose outputs no longer match the reference is skipped. The plan (cases, kernels, trials, estimated time) is
printed first: the trials per kernel shrink to fit --budget seconds, and the run stops starting new kernels when
the budget is spent.

Results are written per kernel and dtype as open-ended buckets (k3compile.kernels._common.launch): one per tuned size,
largest first, each covering the sizes from its own up to the next larger tuned one, the smallest everything
below, so calls larger than any tuned size keep the largest one's configuration. Merging replaces only the
(kernel, dtype) pairs tuned in this run; the file is replaced atomically.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRIAL_S = 1.5  # estimated seconds a GPU trial costs: compiling a new configuration (~1 s), checking and timing it
DRY_TARGET = "h200"  # the device whose shared memory bounds the candidates in a dry run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU through TRITON_INTERPRET=1, tiny shapes, 2 trials")
    p.add_argument("--only", action="append", default=[], metavar="TEXT[,TEXT]",
                   help="cases or kernels whose name contains one of these (repeatable, comma-separated)")
    p.add_argument("--trials", type=int, help="most candidate configurations per kernel and size (default 12; 2 dry)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420: 7 minutes)")
    p.add_argument("--plan", action="store_true", help="print the plan and the time estimate, then stop")
    p.add_argument("--out", type=Path, default=ROOT / "kernels" / "configs", help="folder for <target>.json")
    args = p.parse_args(argv)
    args.only = [t for arg in args.only for t in arg.split(",") if t]
    if args.trials is None:
        args.trials = 2 if args.dry_run else 12
    if args.trials < 1 or args.budget <= 0:
        p.error("--trials and --budget must be positive")
    return args


def kernel_modules() -> dict[str, tuple[str, dict]]:
    """{kernel name: (module name, its search space)} over every Triton kernel module's TUNABLE table."""
    from k3compile.kernels.binding import TRITON_KERNELS

    found: dict[str, tuple[str, dict]] = {}
    for module in sorted({path.rpartition(".")[0] for path in TRITON_KERNELS.values()}):
        tunable = getattr(importlib.import_module(f"k3compile.kernels.{module}"), "TUNABLE", {})
        for kernel, space in tunable.items():
            if kernel in found:
                raise ValueError(f"kernel name {kernel!r} is in both {found[kernel][0]} and {module}")
            found[kernel] = (module, space)
    return found


def candidates(space: dict, defaults: dict, trials: int) -> list[dict]:
    """The defaults, then up to trials - 1 other configurations of the search space (a fixed-seed sample),
    each laid over the defaults."""
    keys = sorted(space)
    every = [{**defaults, **dict(zip(keys, values))} for values in itertools.product(*(space[k] for k in keys))]
    others = [c for c in every if c != defaults]
    sample = others if len(others) <= trials - 1 else random.Random(0).sample(others, trials - 1)
    return [dict(defaults)] + sample


@dataclass
class Job:
    """One kernel of one case to tune: its sizes, dtype and candidate configurations."""

    case: object
    kernel: str
    module: str
    sizes: dict
    dtype: str | None
    configs: list[dict]
    rejected: int = 0
    best: tuple[dict, float] | None = field(default=None)


def _torch_dtype(name: str | None):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(name or "", torch.float32)


def plan_jobs(cases, kernels: dict, only: list[str], trials: int, limit: int | None) -> list[Job]:
    """The (case, kernel) jobs: each case's launches recorded once; candidates over `limit` bytes of shared memory
    (the module's shared_bytes) left out."""
    from k3compile.kernels._common.launch import recording

    # A text that names no case names kernels: then every case runs once to see which kernels it launches.
    kernel_texts = [t for t in only if not any(t in c.name for c in cases)]
    jobs = []
    for case in cases:
        case_named = not only or any(t in case.name for t in only)
        if not case_named and not kernel_texts:
            continue
        with recording() as seen:
            case.triton()
        launched = {k: (sizes, dtype, defaults) for k, sizes, dtype, defaults in seen if k in kernels}
        for kernel, (sizes, dtype, defaults) in launched.items():
            if not case_named and not any(t in kernel for t in kernel_texts):
                continue
            module, space = kernels[kernel]
            estimate = getattr(importlib.import_module(f"k3compile.kernels.{module}"), "shared_bytes", None)
            configs, rejected = [], 0
            for config in candidates(space, defaults, trials):
                need = estimate(kernel, config, sizes, _torch_dtype(dtype)) if estimate else None
                if limit is not None and need is not None and need > limit:
                    rejected += 1
                else:
                    configs.append(config)
            jobs.append(Job(case, kernel, module, sizes, dtype, configs, rejected))
    return jobs


def run_job(job: Job, reference, time_ms, max_error, deadline: float, log) -> None:
    """Time each candidate of `job` that still matches the reference; keep the fastest."""
    from k3compile.kernels._common.launch import forcing

    for config in job.configs:
        if time.perf_counter() > deadline:
            log(f"  {job.kernel}: budget spent after {job.configs.index(config)} of {len(job.configs)} candidates")
            break
        with forcing(job.kernel, config):
            try:
                if max_error(job.case.triton(), reference) > job.case.rtol:
                    log(f"  {job.kernel} {config}: wrong result, skipped")
                    continue
                ms = time_ms(job.case.triton)
            except Exception as e:  # an unlaunchable candidate (registers, resources): skip it
                log(f"  {job.kernel} {config}: {type(e).__name__}")
                continue
        if job.best is None or ms < job.best[1]:
            job.best = (config, ms)


def buckets(points: list[tuple[dict, dict]], dtype: str | None) -> list[dict]:
    """Open-ended buckets for one kernel and dtype from its (sizes, config) tuning points: largest sizes first,
    each with a `min` on the sizes that differ between points, the smallest without one."""
    varying = sorted({k for s, _ in points for k in s if len({p[0].get(k) for p in points}) > 1})
    ordered = sorted(points, key=lambda p: [p[0].get(k, 0) for k in varying], reverse=True)
    out = []
    for i, (sizes, config) in enumerate(ordered):
        if i + 1 < len(ordered) and ordered[i + 1][1] == config:
            continue  # the next smaller point's bucket covers these sizes with the same configuration
        bucket = {} if dtype is None else {"dtype": dtype}
        if i + 1 < len(ordered) and varying:
            bucket["min"] = {k: sizes[k] for k in varying if k in sizes}
        bucket["config"] = config
        out.append(bucket)
    return out


def merge(table: dict, found: dict[tuple[str, str, str | None], list[tuple[dict, dict]]]) -> dict:
    """`table` with each tuned (module, kernel, dtype)'s buckets replaced by the new ones, other dtypes and kernels
    kept; a kernel's buckets stay grouped by dtype in the order first seen."""
    for (module, kernel, dtype), points in found.items():
        old = table.setdefault(module, {}).get(kernel, [])
        kept = [b for b in old if b.get("dtype") != dtype]
        table[module][kernel] = kept + buckets(points, dtype)
    return table


def write_atomically(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def trial_timer(device: str):
    """Milliseconds per call for a trial: a short do_bench on a GPU, one call after a warm-up on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=20)
    import gpu

    return gpu.timer(device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu

    from k3compile.kernels._common.compare import max_error
    from k3compile.kernels._common.launch import DEVICES, device_target

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/tune_gpu.py: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    target = device_target(device)
    limit = DEVICES[DRY_TARGET if args.dry_run else target].shared
    kernels = kernel_modules()
    start = time.perf_counter()
    cases = [c for m in gpu.CASE_MODULES for c in importlib.import_module(m).cases(device, args.dry_run)]
    jobs = plan_jobs(cases, kernels, args.only, args.trials, limit)
    if not jobs:
        print(f"bench/tune_gpu.py: no tunable kernel matches {args.only}", file=sys.stderr)
        return 2
    # Fit the trials to the budget: the same cap for every job, at least the defaults and one other.
    per_trial = TRIAL_S if device == "cuda" else max(0.05, (time.perf_counter() - start) / max(1, len(cases)))
    left = args.budget - (time.perf_counter() - start)
    cap = max(2, min(args.trials, math.floor(left / per_trial / len(jobs))))
    for job in jobs:
        job.configs = job.configs[:cap]
    trials = sum(len(j.configs) for j in jobs)
    print(f"plan: {len(jobs)} kernel launches in {len({id(j.case) for j in jobs})} cases, {trials} trials "
          f"(at most {cap} each; {sum(j.rejected for j in jobs)} candidates over {limit // 1024} KiB of shared "
          f"memory rejected), about {trials * per_trial:.0f} s of a {args.budget:.0f} s budget, target {target}")
    if args.plan:
        for job in jobs:
            print(f"  {job.case.name}: {job.kernel} {job.dtype or ''} {job.sizes}: {len(job.configs)} trials")
        return 0
    time_ms = trial_timer(device)
    deadline = start + args.budget
    found: dict[tuple[str, str, str | None], list[tuple[dict, dict]]] = {}
    references: dict[int, object] = {}
    for job in jobs:
        if time.perf_counter() > deadline:
            print(f"budget spent: {job.case.name} {job.kernel} and the rest left untuned")
            break
        if id(job.case) not in references:
            print(job.case.name)
            references[id(job.case)] = job.case.reference()
        run_job(job, references[id(job.case)], time_ms, max_error, deadline, print)
        if job.best is not None:
            config, ms = job.best
            print(f"  {job.kernel} {job.dtype or ''} at {job.sizes}: {config} {ms:.3g} ms")
            points = found.setdefault((job.module, job.kernel, job.dtype), [])
            if all(p[0] != job.sizes for p in points):
                points.append((job.sizes, config))
    path = args.out / f"{target}.json"
    table = merge(json.loads(path.read_text()) if path.is_file() else {}, found)
    write_atomically(path, table)
    elapsed = time.perf_counter() - start
    print(f"wrote {path}: {len(found)} (kernel, dtype) pair(s) tuned for {target} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
