"""MQAR accuracy by query order while one spec trains: does it recall, or only eliminate?

    python bench/mqar_recall.py specs/ablations/all-mla.yaml --steps 150 \\
        --set num_layers=4 --set hidden_size=128 --set mla.rope=true --set training.batch_size=32 \\
        --set training.lr=0.01 --set training.schedule.warmup_steps=20
    python bench/mqar_recall.py specs/k3-tiny.yaml --mqar 4,16,4,16 --steps 150 --set num_layers=4 ...

Trains as a study's MQAR run does (the trainer's step, seed 0 unless --seed, one torch thread by default) and
prints, every --every steps, the held-out accuracy of the first, second, ... query of each sequence: a model that
binds keys gets every query right, one that binds none stays at chance (about 1 / num_kv_pairs) on each. Prints
the CPU capability, threads, CPU and wall seconds. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from k3compile.ablation.mqar import MQAR, accuracy_by_query, held_out
from k3compile.ablation.run import MQAR_HELD_OUT, mqar_run
from k3compile.runtime.device import to_device
from k3compile.runtime.train import EVAL_BATCHES, read_steps, train_step
from k3compile.training import build_package
from k3compile.spec.load import load_spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="the spec YAML to train")
    ap.add_argument("--mqar", default="2,16,2,16", help="num_kv_pairs,seq_len,num_queries,vocab (default 2,16,2,16)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    ap.add_argument("--every", type=int, default=25, help="evaluate every K steps (default 25)")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=VALUE", help="spec override (repeatable)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed (init, batches, held-out set; default 0)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = MQAR(*(int(x) for x in args.mqar.split(",")))
    spec = load_spec(args.spec, [*args.set, f"training.seq_len={task.seq_len}", f"training.seed={args.seed}"])
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{spec.name}, MQAR {task}")
    with tempfile.TemporaryDirectory() as tmp:
        package = build_package(spec, Path(tmp) / "build", lambda *a: None, mode="train")
        run = mqar_run(spec, package, task, Path(tmp) / "run")
        val = held_out(task, MQAR_HELD_OUT, spec.training.batch_size * EVAL_BATCHES, args.seed)
        val = to_device(tuple(val), run.layout.device)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in range(args.steps):
            pending = train_step(run, step, args.steps)
            if pending.step % args.every == 0 or pending.step == args.steps:
                (record,) = read_steps([pending])
                by_query = accuracy_by_query(run.model, val)
                mean = sum(by_query) / len(by_query)
                queries = " ".join(f"{a:.2f}" for a in by_query)
                print(f"step {record['step']:4d}  loss {record['loss']:.3f}  accuracy {mean:.3f}  by query {queries}  "
                      f"cpu {time.process_time() - cpu0:.0f} s  wall {time.perf_counter() - wall0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
