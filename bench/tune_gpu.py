"""Tune the Triton kernels' launch configurations on this GPU and write kernels/configs/<target>.json.

    python bench/tune_gpu.py                       # every kernel bench/gpu.py runs, K3 shapes
    python bench/tune_gpu.py --only rms_norm       # cases whose name contains this text
    python bench/tune_gpu.py --dry-run --out /tmp  # CPU, Triton interpreter, tiny shapes, 2 trials per kernel

For every case of bench/gpu.py, the kernels it launches are recorded with their sizes; each kernel then
runs with candidate configurations drawn from its module's TUNABLE search space (at most --trials per
kernel, always including the defaults). A candidate counts only if the case's outputs still agree with
the reference; the fastest one is stored as a bucket bounded by the sizes it was tuned at. Buckets are
ordered smallest first, so a kernel uses the tightest bucket that covers its call (see
k3compile.kernels.launch). The file is replaced atomically; existing entries for other kernels are kept.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU through TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--only", action="append", default=[], metavar="TEXT", help="cases whose name contains TEXT")
    p.add_argument("--trials", type=int, help="candidate configurations per kernel (default 24; 2 with --dry-run)")
    p.add_argument("--out", type=Path, default=ROOT / "kernels" / "configs", help="folder for <target>.json")
    args = p.parse_args(argv)
    if args.trials is None:
        args.trials = 2 if args.dry_run else 24
    return args


def kernel_modules() -> dict[str, dict]:
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


def candidates(space: dict, trials: int) -> list[dict]:
    """Up to `trials` configurations from the product of the search space, sampled with a fixed seed."""
    keys = sorted(space)
    every = [dict(zip(keys, values)) for values in itertools.product(*(space[k] for k in keys))]
    return every if len(every) <= trials else random.Random(0).sample(every, trials)


def tune_case(case, kernels: dict, trials: int, time_ms, max_error, log) -> dict[str, tuple[dict, dict, float]]:
    """{kernel: (sizes, best config, its ms)} for the tunable kernels this case launches."""
    from k3compile.kernels.launch import forcing, recording

    with recording() as seen:
        case.triton()
    best: dict[str, tuple[dict, dict, float]] = {}
    for kernel, sizes in {k: s for k, s in seen}.items():
        if kernel not in kernels:
            continue
        trial_configs = [{}] + candidates(kernels[kernel][1], trials)
        for config in trial_configs:
            with forcing(kernel, config):
                try:
                    if max_error(case.triton(), case.reference()) > case.rtol:
                        continue
                    ms = time_ms(case.triton)
                except Exception as e:  # an unlaunchable candidate (too many registers, shared memory...)
                    log(f"  {kernel} {config}: {type(e).__name__}")
                    continue
            if kernel not in best or ms < best[kernel][2]:
                best[kernel] = (sizes, config, ms)
        if kernel in best:
            log(f"  {kernel} at {sizes}: {best[kernel][1] or 'defaults'} {best[kernel][2]:.3g} ms")
    return best


def write_atomically(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    import gpu

    from k3compile.kernels.compare import max_error
    from k3compile.kernels.launch import device_target

    if not args.dry_run and not torch.cuda.is_available():
        print("bench/tune_gpu.py: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    target = device_target(device)
    kernels = kernel_modules()
    time_ms = gpu.timer(device)
    found: dict[tuple[str, str], list] = {}
    for module in gpu.CASE_MODULES:
        for case in importlib.import_module(module).cases(device, args.dry_run):
            if args.only and not any(text in case.name for text in args.only):
                continue
            print(case.name)
            for kernel, (sizes, config, _) in tune_case(case, kernels, args.trials, time_ms, max_error, print).items():
                if config:  # the defaults won: nothing to store
                    found.setdefault((kernels[kernel][0], kernel), []).append({"max": sizes, "config": config})
    path = args.out / f"{target}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    for (module, kernel), buckets in found.items():
        table.setdefault(module, {})[kernel] = sorted(buckets, key=lambda b: sorted(b["max"].items()))
    write_atomically(path, table)
    print(f"wrote {path}: {sum(len(k) for k in table.values())} kernel(s) tuned for {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
