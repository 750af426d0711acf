"""aten calls of one decode step through the compiled decode graph, grouped by the k3 op that makes them.

    python bench/decode_ops.py                    # build k3-tiny (--mode infer) into a temp dir, count
    python bench/decode_ops.py --build build/k3_tiny --batch 3

Counts every `aten::` event torch.profiler records for one `InferenceModel.decode` step (nested calls
included, as the issue's ~7,750 for the eager decoder was counted), after a 20-token prefill and two
warm-up steps; the graph's own calls are those outside any k3 op. Also prints the step's CPU and wall
milliseconds (best of 10, one torch thread) and the CPU capability. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent


def outer_op(event) -> str:
    """The outermost non-aten event around `event` (a k3 op), or "graph" for the graph's own calls."""
    name, parent = "graph", event
    while parent is not None:
        if not parent.name.startswith("aten::"):
            name = parent.name
        parent = parent.cpu_parent
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, help="an infer build's package folder (default: build k3-tiny)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from k3compile.runtime.generate import load_inference_model

    with tempfile.TemporaryDirectory() as tmp:
        package = args.build
        if package is None:
            from k3compile.build import BuildOptions, build
            from k3compile.spec.load import load_spec

            package, _ = build(load_spec(ROOT / "specs" / "k3-tiny.yaml"), Path(tmp), BuildOptions(mode="infer"))
        model = load_inference_model(package)
    tokens = torch.randint(0, 256, (args.batch, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = model.prefill(tokens, max_len=64)
        step = logits[:, -1:].argmax(-1)
        for _ in range(2):
            logits, cache = model.decode(step, cache)
        best_cpu = best_wall = float("inf")
        for _ in range(10):
            cpu, wall = time.process_time(), time.perf_counter()
            model.decode(step, cache)
            best_cpu, best_wall = min(best_cpu, time.process_time() - cpu), min(best_wall, time.perf_counter() - wall)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.decode(step, cache)
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    by_op = collections.Counter(outer_op(e) for e in aten)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread, batch {args.batch}: "
          f"{len(aten):,} aten calls per decode step; best step {best_cpu * 1e3:.2f} CPU ms, {best_wall * 1e3:.2f} wall ms")
    for name, n in by_op.most_common():
        print(f"{n:7,d}  {name}")


if __name__ == "__main__":
    main()
