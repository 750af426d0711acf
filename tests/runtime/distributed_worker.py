"""One process of tests/runtime/test_distributed.py's runs, started by torch.distributed.run.

Trains the small spec for the given steps and writes rank<R>.json: the per-step losses, the local expert
parameters' element count and policy bytes, and (with --compile) what torch.compile(fullgraph=True)
traced of one train step: the node targets of its graph.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def expert_bytes(model, spec) -> tuple[int, int]:
    """(elements, bytes under the quantisation policy) of this rank's routed-expert parameters."""
    from k3compile.analysis.formats import storage_bytes
    from k3compile.spec.weights import weight_inventory

    formats = {w.name: w.format for w in weight_inventory(spec) if w.component == "routed_experts"}
    numel = nbytes = 0
    for name, p in model.named_parameters():
        if name in formats:
            numel += p.numel()  # an FSDP2 DTensor's numel: this EP rank's whole stack
            nbytes += storage_bytes(p.numel(), formats[name], spec.quantization.block_size)
    return numel, nbytes


def local_numel(model) -> dict[str, int]:
    """Elements this process holds of the parameters: FSDP2 shards (DTensors) and whole ones."""
    from torch.distributed.tensor import DTensor

    out = {"sharded": 0, "whole": 0}
    for _, p in model.named_parameters():
        out["sharded" if isinstance(p, DTensor) else "whole"] += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return out


def compiled_targets(run) -> list[str]:
    """Compile one forward + loss with fullgraph=True, run its backward, return the traced graph's node targets."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    step = torch.compile(run.model, fullgraph=True, backend=backend)
    t = run.spec.training
    tokens = run.layout.rows(run.batches.tokens[: t.batch_size * t.seq_len].long().view(t.batch_size, t.seq_len))
    loss = step(tokens, tokens)
    loss.backward()
    run.optimizer.zero_grad(set_to_none=True)
    return seen


def main() -> None:
    torch.set_num_threads(1)
    a = argparse.ArgumentParser()
    a.add_argument("--out", required=True)
    a.add_argument("--steps", type=int, required=True)
    a.add_argument("--stop-after", type=int)
    a.add_argument("--resume", action="store_true")
    a.add_argument("--compile", action="store_true")
    a.add_argument("--data", required=True)
    a.add_argument("--set", dest="overrides", action="append", default=[])
    args = a.parse_args()
    from k3compile.runtime import train as train_mod

    report: dict = {}
    setup = train_mod._setup

    def probe(*a, **k):  # the run as built, before training changes it
        run = setup(*a, **k)
        report["expert_numel"], report["expert_bytes"] = expert_bytes(run.model, run.spec)
        report["expert_shards"] = sorted(run.expert_shards)
        report["local_numel"] = local_numel(run.model)
        if args.compile:
            report["compiled"] = compiled_targets(run)
        return run

    train_mod._setup = probe
    resume_from = train_mod.resume_from

    def resumed(*a, **k):
        report["resumed_at"] = resume_from(*a, **k)
        return report["resumed_at"]

    train_mod.resume_from = resumed
    records = train_mod.train("specs/k3-tiny.yaml", args.steps, data=args.data, out=args.out, resume=args.resume,
                              overrides=args.overrides, progress=False, eval_every=1000, stop_after=args.stop_after)
    report["losses"] = [r["loss"] for r in records]
    rank = int(os.environ.get("RANK", "0"))
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
