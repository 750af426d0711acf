"""One run of a study (a variant, a task, a seed), through the trainer's own step, checkpoints and metrics log.

A run folder holds metrics.jsonl, checkpoints/ and, once finished, result.json (written last, atomically: a
run is finished exactly when it has one). An interrupted run resumes from its newest checkpoint, which restores
weights, optimizer, data generator and RNG, so its numbers are those of an uninterrupted run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from k3compile import safe_io
from k3compile.ablation.mqar import MQAR, MQARBatches, accuracy, held_out
from k3compile.ablation.study import RunKey, Variant
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime.balance import find_routers
from k3compile.runtime.data import Corpus, load_corpus, split
from k3compile.runtime.device import to_device
from k3compile.runtime.distributed import Layout
from k3compile.runtime.muon import muon_precision
from k3compile.runtime.precision import training_precision
from k3compile.runtime.train import (
    EVAL_BATCHES, MetricsLog, Run, _setup, default_log_every, evaluate, make_optimizer, read_metrics, read_steps,
    resume_from, run_device, save_checkpoint, train_step,
)  # fmt: skip
from k3compile.spec.load import load_spec

MQAR_HELD_OUT = 256  # held-out sequences per evaluation


def write_json(path: Path, obj) -> None:
    """Write JSON through safe_io.write_atomic: a reader sees all of it or nothing, a link there is replaced."""
    safe_io.write_text(path, json.dumps(obj, indent=2))


def mqar_run(spec, package, task: MQAR, out: Path) -> Run:
    """A Run on MQAR batches: the model initialised as `_setup` does, the task's parameters as its data fingerprint."""
    t = spec.training
    device = run_device(package)
    torch.manual_seed(t.seed)
    model = package.Model(device=device)
    if model.spec.training.seed != t.seed:
        model.spec = spec
        model.reset_parameters()
    model.train()
    named = list(model.named_parameters())
    ns_dtype, note = muon_precision(t.muon_precision, named[0][1].device)
    compute, precision_note = training_precision(t.precision, device)
    fingerprint = json.dumps(task.__dict__, sort_keys=True).encode()
    return Run(spec=spec, model=model, named=named, optimizer=make_optimizer(spec, named, ns_dtype),
               batches=MQARBatches(task, t.batch_size, t.seed), val=[], routers=find_routers(model), out=out,
               corpus=Corpus(bytearray(fingerprint), f"mqar {fingerprint.decode()}", 0), entropy=0.0, muon_note=note,
               layout=Layout(device=device), compute=compute, precision_note=precision_note)


def run_one(
    key: RunKey, variant: Variant, package, steps: int, eval_every: int, task: MQAR, data: str | None, out: Path,
    tick: Callable[[int], None] = lambda step: None, stopping=None,
) -> dict:  # fmt: skip
    """Train one run to `steps` (resuming its checkpoint), evaluate on its task; returns and writes result.json.

    `tick(step)` is called after every step; `stopping()` true ends the run after the current step with a
    checkpoint (returns None then).
    """
    spec = load_spec(variant.path, list(variant.run_spec(key.task, key.seed, task)))
    safe_io.make_dir(out)
    if key.task == "lm":
        corpus = load_corpus(data)
        train_tokens, val_tokens = split(corpus.data, spec.training.seq_len)
        run = _setup(spec, package, corpus, train_tokens, val_tokens, out, None)
        measure = lambda: {"val_loss": evaluate(run)}  # noqa: E731
    else:
        run = mqar_run(spec, package, task, out)
        val = to_device(tuple(held_out(task, MQAR_HELD_OUT, spec.training.batch_size * EVAL_BATCHES, key.seed)),
                        run.layout.device)
        measure = lambda: {"mqar_acc": accuracy(run.model, val)}  # noqa: E731
    start = resume_from(run, lambda *a, **k: None) if ckpt.committed(run.checkpoints) else 0
    so_far = read_metrics(out / "metrics.jsonl", start)
    records = so_far.records
    log = MetricsLog(out / "metrics.jsonl", so_far.size)
    tick(start)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    log_every, pending = default_log_every(run.layout.device), []
    try:
        for step in range(start, steps):
            pending.append(train_step(run, step, steps))
            n = step + 1
            evaluated = n % eval_every == 0 or n == steps
            stop = stopping is not None and stopping() and n < steps
            if evaluated or stop or n % log_every == 0:  # the steps' numbers, read from the device together
                done, pending = read_steps(pending), []
                if evaluated:
                    done[-1].update(measure())
                records += done
                for record in done:
                    log.append(record)
            if evaluated:
                save_checkpoint(run, n)
            tick(n)
            if stop:
                save_checkpoint(run, n)
                return None
    finally:
        log.close()
    result = summarise(key, records, steps)
    result["cpu_s_this_session"], result["wall_s_this_session"] = time.process_time() - cpu0, time.perf_counter() - wall0
    write_json(out / "result.json", result)
    return result


def summarise(key: RunKey, records: list[dict], steps: int) -> dict:
    """The run's curve (step, metric) and its final and best values."""
    metric = "val_loss" if key.task == "lm" else "mqar_acc"
    curve = [(r["step"], r[metric]) for r in records if metric in r]
    values = [v for _, v in curve]
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {
        "variant": key.variant, "task": key.task, "seed": key.seed, "steps": steps, "metric": metric,
        "final": values[-1], "best": min(values) if metric == "val_loss" else max(values), "curve": curve,
        "train_loss": [r["loss"] for r in records], "tokens_per_s": sum(speeds) / len(speeds),
    }  # fmt: skip
