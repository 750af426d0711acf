"""One process of tests/runtime/test_distributed.py's launches (torch.distributed.run, or plain python for one).

Runs the plan's jobs in order in one process group: `train` jobs train a prebuilt package and write
<out>/rank<R>.json (the per-step losses, the local expert parameters' element count and policy bytes, the
elements this process holds, where it resumed, and with "compile" what torch.compile(fullgraph=True) traced of
one train step: its graph's node targets); `generate` jobs decode greedily and write <out>/generate.rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
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


def train(job: dict, rank: int) -> None:
    from k3compile.runtime import train as train_mod

    train_mod.EVAL_BATCHES = 1  # the tests compare training losses: validate on one batch only
    report: dict = {}
    setup, resume_from = train_mod._setup, train_mod.resume_from

    def probe(*a, **k):  # the run as built, before training changes it
        run = setup(*a, **k)
        report["expert_numel"], report["expert_bytes"] = expert_bytes(run.model, run.spec)
        report["expert_shards"] = sorted(run.expert_shards)
        report["local_numel"] = local_numel(run.model)
        if job.get("compile"):
            report["compiled"] = compiled_targets(run)
        return run

    def resumed(*a, **k):
        report["resumed_at"] = resume_from(*a, **k)
        return report["resumed_at"]

    train_mod._setup, train_mod.resume_from = probe, resumed
    try:
        records = train_mod.train(job["build"], job["steps"], data=job["data"], out=job["out"],
                                  resume=job.get("resume", False), progress=False, eval_every=1000,
                                  stop_after=job.get("stop_after"), init_from=job.get("init_from"))  # fmt: skip
    finally:
        train_mod._setup, train_mod.resume_from = setup, resume_from
    report["losses"] = [r["loss"] for r in records]
    report["grad_norms"] = [r["grad_norm"] for r in records]
    (Path(job["out"]) / f"rank{rank}.json").write_text(json.dumps(report))


def generate(job: dict, rank: int) -> None:
    """`k3compile generate` greedy: its text, the token ids it chose and the expert rows of its InferenceModel."""
    import contextlib
    import io

    from k3compile.cli import main as cli
    from k3compile.runtime import generate as gen

    report: dict = {"tokens": []}
    load, tokens = gen.load_inference_model, gen.generate_tokens

    def loaded(*a, **k):
        model = load(*a, **k)
        report["expert_rows"] = {n: v.shape[0] for n, v in model.state_dict().items() if ".experts." in n and "shared" not in n}
        return model

    def chosen(*a, **k):
        for t in tokens(*a, **k):
            report["tokens"].append(t)
            yield t

    args = ["generate", job["build"], "--prompt", job["prompt"], "--max-new-tokens", str(job["tokens"]),
            "--temperature", "0", *(["--checkpoint", job["checkpoint"]] if job.get("checkpoint") else [])]  # fmt: skip
    text = io.StringIO()
    gen.load_inference_model, gen.generate_tokens = loaded, chosen
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
            assert cli(args) == 0
    finally:
        gen.load_inference_model, gen.generate_tokens = load, tokens
    report["text"] = text.getvalue()
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    (Path(job["out"]) / f"generate.rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    torch.set_num_threads(1)
    a = argparse.ArgumentParser()
    a.add_argument("plan", help="a JSON list of jobs")
    plan = json.loads(Path(a.parse_args().plan).read_text())
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one group for every job (each builds its own meshes)
        import torch.distributed as dist

        dist.init_process_group("gloo")
    times = []
    for job in plan:
        wall, cpu = time.perf_counter(), time.process_time()
        {"train": train, "generate": generate}[job["kind"]](job, rank)
        times.append({"job": Path(job["out"]).name, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
    Path(plan[0]["out"]).parent.joinpath(f"{Path(a.parse_args().plan).stem}.times.rank{rank}.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main()
