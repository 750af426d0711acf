"""`k3compile train`: train an emitted Model on bytes with Per-Head Muon, load balancing and resumable checkpoints.

One step: forward + mean next-token loss, backward, gradient-norm clip, optimizer step at the scheduled
learning rate, then the balancing rule turns this step's routing statistics into every router's bias for
the next step. Validation loss is measured at intervals and at the end, where it is compared with the
unigram entropy of the training bytes (the loss of a model that ignores context). A checkpoint is written
with every validation and when the run stops; `resume=True` continues exactly where it left off.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from k3compile.kernels.launch import interpreting
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime.balance import find_routers, restore_stats, snapshot_stats, update_balance
from k3compile.runtime.data import VOCAB, Batches, Corpus, eval_batches, load_corpus, split, unigram_entropy
from k3compile.runtime.muon import PerHeadMuon, default_use_muon, muon_precision
from k3compile.runtime.schedule import lr_at
from k3compile.spec.schema import MIXER_KDA, Spec

EVAL_BATCHES = 4  # validation batches of (batch_size, seq_len) per evaluation
LOG2E = 1.0 / math.log(2.0)


class TrainError(ValueError):
    """Bad training input or a run that cannot continue; one line."""


# ---------------------------------------------------------------- spec, build, output folder


def _spec_from_build(package: ModuleType, overrides: Sequence[str]) -> Spec:
    """The build's spec with `training.*` overrides applied (a build's architecture is fixed)."""
    from k3compile.spec.load import load_spec

    built = Spec.model_validate_json(package.SPEC_JSON)
    if not overrides:
        return built
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{built.name}.yaml"
        path.write_text(package.SPEC_JSON, encoding="utf-8")  # JSON is YAML
        spec = load_spec(path, list(overrides))
    old, new = built.model_dump(exclude={"training"}), spec.model_dump(exclude={"training"})
    changed = sorted(k for k in old if old[k] != new[k])
    if changed:
        raise TrainError(
            f"--set changes {', '.join(changed)}, but a build's architecture is fixed; "
            "train from the spec file instead, or set only training.* fields"
        )
    return spec


def resolve(spec_or_build: str | Path, overrides: Sequence[str] = ()) -> tuple[Spec, ModuleType | None]:
    """(spec, package): a spec file gives (spec, None); a build folder gives its spec and the loaded package."""
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    path = Path(spec_or_build)
    if not path.exists():
        raise TrainError(f"no such spec or build: {path}")
    if path.is_dir():
        try:
            package = load(path)
        except FileNotFoundError as e:
            raise TrainError(str(e)) from None
        if not hasattr(package, "Model"):
            raise TrainError(f"{path} has no training Model (built with --mode infer); rebuild with --mode train")
        target = getattr(package, "TARGET", "cpu")
        if target != "cpu" and not torch.cuda.is_available() and not interpreting():
            raise TrainError(
                f"{path} was built for {target} (Triton kernels) and this machine has no GPU; rebuild it with "
                "--target cpu, or set TRITON_INTERPRET=1 to run the kernels through Triton's interpreter (slow)"
            )
        return _spec_from_build(package, overrides), package
    return load_spec(path, list(overrides)), None


def _same_architecture(a: Spec, b: Spec) -> bool:
    return a.model_dump(exclude={"training"}) == b.model_dump(exclude={"training"})


def build_package(spec: Spec, build_dir: Path, say) -> ModuleType:
    """Build `spec` (train mode) into `build_dir`, reusing a build there of the same architecture and compiler."""
    from k3compile import __version__
    from k3compile.build import BuildOptions, build, package_name
    from k3compile.emit.package import is_build_dir
    from k3compile.loader import load

    dest = build_dir / package_name(spec)
    # Without a GPU, bind the PyTorch references whatever the spec's target (its Triton kernels need CUDA).
    target = spec.target if torch.cuda.is_available() else "cpu"
    if is_build_dir(dest):
        try:
            manifest = json.loads((dest / "manifest.json").read_text())
            built = Spec.model_validate(manifest["spec"]["fields"])
            same = manifest["compiler"] == f"k3compile {__version__}" and manifest["target"] == target
            if same and _same_architecture(built, spec):
                say(f"reusing the build in {dest}")
                return load(dest)
        except (OSError, ValueError, KeyError):
            pass
    say(f"building {spec.name} (train mode) into {build_dir}")
    try:
        dest, _ = build(spec, build_dir, BuildOptions(mode="train", target=target))
    except ValueError as e:
        raise TrainError(f"cannot build {spec.name}: {e}") from None
    return load(dest)


def prepare_out(out: Path, resume: bool) -> Path | None:
    """Check that `out` can hold this run; create it. Returns the top folder created (to undo), or None."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"output {out} exists and is not a folder")
    steps = ckpt.committed(out / "checkpoints")
    if steps and not resume:
        raise TrainError(
            f"{out} already holds a checkpoint (step {steps[-1]}); pass --resume to continue it or choose another --out"
        )
    top = None
    if not out.exists():
        top = out
        while not top.parent.exists():
            top = top.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        if top is not None and top.is_dir():
            shutil.rmtree(top, ignore_errors=True)
        raise TrainError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return top


# ---------------------------------------------------------------- optimizer


def head_splits(spec: Spec) -> dict[str, int]:
    """Per-head Muon blocks: KDA q/k/v projections by kda.num_heads; MLA's query projection (q_b_proj, or q_proj
    without q_lora) and kv_b_proj (per head: k_nope then v rows) by mla.num_heads."""
    out = {}
    for i, mixer in enumerate(spec.mixers):
        if mixer == MIXER_KDA:
            names, heads = ("q_proj", "k_proj", "v_proj"), spec.kda.num_heads
        else:
            names, heads = ("q_b_proj" if spec.mla.q_lora_rank else "q_proj", "kv_b_proj"), spec.mla.num_heads
        out.update({f"layers.{i}.attn.{name}.weight": heads for name in names})
    return out


def make_optimizer(
    spec: Spec, named: list[tuple[str, Tensor]], ns_dtype: torch.dtype | None = None
) -> PerHeadMuon:
    """The spec's optimizer: per_head_muon (Muon, Q/K/V cut per head), muon (whole matrices) or adamw (AdamW only).

    Matrices routed to Muon get training.weight_decay; AdamW takes the embedding, output head, short-conv
    kernels (decayed) and every vector parameter (norm gains, decay-gate parameters, AttnRes queries; not decayed).
    Muon's Newton-Schulz runs in `ns_dtype`, by default the one training.muon_precision picks for the parameters'
    device (`muon_precision`).
    """
    t = spec.training
    splits = head_splits(spec) if t.optimizer == "per_head_muon" else {}
    muon: dict[int, list[Tensor]] = {}
    adam_decay, adam_plain = [], []
    for name, p in named:
        if t.optimizer != "adamw" and default_use_muon(name, p):
            muon.setdefault(splits.get(name, 1), []).append(p)
        else:
            (adam_decay if p.ndim >= 2 else adam_plain).append(p)
    groups = [{"params": ps, "use_muon": True, "head_split": s} for s, ps in muon.items()]
    groups += [{"params": adam_decay, "use_muon": False}] if adam_decay else []
    groups += [{"params": adam_plain, "use_muon": False, "weight_decay": 0.0}] if adam_plain else []
    if ns_dtype is None:
        ns_dtype = muon_precision(t.muon_precision, named[0][1].device)[0]
    return PerHeadMuon(groups, lr=t.lr, weight_decay=t.weight_decay, ns_dtype=ns_dtype)


def optimizer_layout(optimizer: PerHeadMuon, named: list[tuple[str, Tensor]]) -> dict[str, str]:
    """param name -> 'muon/<head split>' or 'adamw': what a checkpoint's optimizer state must have been made by."""
    kind = {}
    for g in optimizer.param_groups:
        tag = f"muon/{g['head_split']}" if g["use_muon"] else "adamw"
        kind.update({id(p): tag for p in g["params"]})
    return {name: kind[id(p)] for name, p in named}


# ---------------------------------------------------------------- the run


@dataclass
class Run:
    """Everything one training run holds; built by `setup`, advanced by `step`."""

    spec: Spec
    model: nn.Module
    named: list[tuple[str, Tensor]]
    optimizer: PerHeadMuon
    batches: Batches
    val: list[Tensor]
    routers: list
    out: Path
    corpus: Corpus
    entropy: float
    muon_note: str  # the Newton-Schulz precision chosen for this run, and why

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def data_fingerprint(self) -> dict:
        return {"source": self.corpus.source, "bytes": len(self.corpus.data), "crc32": zlib.crc32(self.corpus.data)}


def train_step(run: Run, step: int, total: int) -> dict:
    """One optimizer step (0-based `step` of `total`) and the balance update; returns its metrics."""
    t = run.spec.training
    lr = lr_at(step, total, t.lr, t.schedule)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    tokens = run.batches.next()
    start = time.perf_counter()
    loss = run.model(tokens, tokens)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainError(f"the loss is {value} at step {step + 1}; lower training.lr or check the data")
    loss.backward()
    grad_norm = None
    if t.grad_clip is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in run.named], t.grad_clip))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    record = {"step": step + 1, "loss": value, "lr": lr}
    if run.routers:
        moe = run.spec.moe
        stats = update_balance(run.routers, moe.router, moe.top_k)
        record.update(imbalance=stats.imbalance, dropped=stats.dropped)
        if stats.aux_loss is not None:
            record["aux_loss"] = stats.aux_loss
    record["grad_norm"] = grad_norm
    record["tokens_per_s"] = tokens.numel() / (time.perf_counter() - start)
    return record


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean next-token loss (nats) over the fixed validation windows; routing statistics are left untouched."""
    saved = snapshot_stats(run.routers)
    run.model.eval()
    try:
        total = count = 0.0
        for batch in run.val:
            weight = batch.shape[0] * (batch.shape[1] - 1)
            total += float(run.model(batch, batch)) * weight
            count += weight
    finally:
        run.model.train()
        restore_stats(run.routers, saved)
    return total / count


def save_checkpoint(run: Run, step: int) -> Path:
    from k3compile import __version__
    from k3compile.emit.codegen import spec_hash, spec_json

    tensors = {**ckpt.model_tensors(run.model), **ckpt.optimizer_tensors(run.optimizer, run.named)}
    tensors["rng/torch"] = torch.get_rng_state()
    tensors["rng/data"] = run.batches.state()
    meta = {
        "compiler": f"k3compile {__version__}",
        "spec_name": run.spec.name,
        "spec_sha256": spec_hash(run.spec),
        "spec": json.loads(spec_json(run.spec)),
        "optimizer": optimizer_layout(run.optimizer, run.named),
        "data": run.data_fingerprint(),
    }
    return ckpt.save(run.checkpoints, step, tensors, meta)


def resume_from(run: Run, say) -> int:
    """Load the newest checkpoint into the run; returns its step (0 when there is none)."""
    from k3compile.emit.codegen import spec_hash

    path = ckpt.latest(run.checkpoints)
    if path is None:
        say(f"no checkpoint in {run.checkpoints}; starting from step 0")
        return 0
    state = ckpt.load(path)
    ckpt.restore_model(run.model, state)
    missing = [k for k in ("rng/torch", "rng/data") if k not in state.tensors]
    if missing:
        raise ckpt.CheckpointError(f"{path} is not a training checkpoint (no {', '.join(missing)})")
    layout = optimizer_layout(run.optimizer, run.named)
    saved = state.meta.get("optimizer", {})
    differ = [f"{n} ({saved.get(n, 'absent')} -> {k})" for n, k in layout.items() if saved.get(n) != k]
    if differ:
        shown = ", ".join(differ[:4]) + (f" (+{len(differ) - 4} more)" if len(differ) > 4 else "")
        raise TrainError(f"{path} was written with another optimizer layout: {shown}")
    ckpt.restore_optimizer(run.optimizer, run.named, state)
    run.batches.load_state(state.tensors["rng/data"])
    torch.set_rng_state(state.tensors["rng/torch"])
    if state.meta.get("spec_sha256") != spec_hash(run.spec):
        say(f"note: {path.name} was written with different spec settings; continuing with the current ones")
    if state.meta.get("data") != run.data_fingerprint():
        say(f"note: the data differ from those {path.name} was trained on; the batches will differ too")
    say(f"resuming from {path} (step {state.step})")
    return state.step


# ---------------------------------------------------------------- metrics file


def read_metrics(path: Path, upto: int) -> list[dict]:
    """The records of `path` with step <= upto (a resumed run drops what came after its checkpoint)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(record, dict) and record.get("step", upto + 1) <= upto:
            out.append(record)
    return out


def write_metrics(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


# ---------------------------------------------------------------- console


class _Quiet:
    """Stands in for the progress display when progress=False."""

    def print(self, *args, **kwargs) -> None:
        pass

    def begin(self, step: int) -> None:
        pass

    def update(self, *args, **kwargs) -> None:
        pass


@contextmanager
def _display(enabled: bool, total: int, name: str) -> Iterator:
    if not enabled:
        yield _Quiet()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    )  # fmt: skip

    columns = (
        TextColumn(f"[bold]{name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[speed]} tok/s  imbalance {task.fields[imb]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=140)
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=total, loss="-", speed="-", imb="-")

        class Bar:
            def __init__(self):
                self.print = progress.console.print

            def begin(self, step: int) -> None:
                """Start counting at `step` (a resumed run), so the time estimate ignores the steps done before."""
                progress.reset(task, completed=step)

            def update(self, record: dict) -> None:
                imb = record.get("imbalance")
                progress.update(
                    task,
                    completed=record["step"],
                    loss=f"{record['loss']:.3f}" if "loss" in record else "-",
                    speed=f"{record['tokens_per_s']:.0f}" if "tokens_per_s" in record else "-",
                    imb="-" if imb is None else f"{imb:.2f}",
                )

        yield Bar()


@contextmanager
def _interrupt_flag() -> Iterator[threading.Event]:
    """A first Ctrl-C sets the flag (the run stops after the current step, with a checkpoint); a second one kills."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------- entry point


def default_eval_every(steps: int) -> int:
    """About six validations per run."""
    return max(1, steps // 6)


def train(
    spec_or_build: str | Path,
    steps: int,
    data: str | Path | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    overrides: Sequence[str] = (),
    eval_every: int | None = None,
    progress: bool = True,
    stop_after: int | None = None,
) -> list[dict]:
    """Train the spec's (or build's) Model for `steps` optimizer steps in total; returns the metrics records.

    `data`: a text file or folder (default: the Python stdlib's sources); `out`: the run folder (default
    runs/<spec name>) with build/, checkpoints/ and metrics.jsonl; `resume`: continue from the newest
    checkpoint there; `overrides`: `a.b=value` spec overrides (only training.* for a build); `eval_every`:
    validate (and checkpoint) every this many steps; `stop_after`: end this call after that many steps
    (with a checkpoint) so a later `resume=True` call continues the same schedule; `progress`: show a bar
    and messages on the console (False: silent). Records hold step, loss, lr, tokens_per_s, imbalance,
    dropped, grad_norm and, when validated, val_loss (nats per byte).
    """
    if steps < 1:
        raise TrainError(f"steps must be at least 1, got {steps}")
    for name, value in (("eval_every", eval_every), ("stop_after", stop_after)):
        if value is not None and value < 1:
            raise TrainError(f"{name} must be at least 1, got {value}")
    spec, package = resolve(spec_or_build, overrides)
    if spec.vocab_size < VOCAB:
        raise TrainError(
            f"spec {spec.name!r} has vocab_size {spec.vocab_size}; byte-level training needs at least {VOCAB}"
        )
    t = spec.training
    corpus = load_corpus(data)
    train_tokens, val_tokens = split(corpus.data, t.seq_len)
    out = Path(out) if out is not None else Path("runs") / spec.name
    created = prepare_out(out, resume)
    with _display(progress, steps, spec.name) as display:
        say = display.print
        try:
            if package is None:
                package = build_package(spec, out / "build", say)
            run = _setup(spec, package, corpus, train_tokens, val_tokens, out)
        except BaseException:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            raise
        return _loop(run, steps, resume, eval_every or default_eval_every(steps), stop_after, display)


def _setup(spec: Spec, package: ModuleType, corpus: Corpus, train_tokens: Tensor, val_tokens: Tensor, out: Path) -> Run:
    t = spec.training
    torch.manual_seed(t.seed)
    model = package.Model()
    if model.spec.training.seed != t.seed:  # a build's init follows its own seed; re-init with the requested one
        model.spec = spec
        model.reset_parameters()
    model.train()
    named = list(model.named_parameters())
    ns_dtype, muon_note = muon_precision(t.muon_precision, named[0][1].device)
    return Run(
        spec=spec,
        model=model,
        named=named,
        optimizer=make_optimizer(spec, named, ns_dtype),
        batches=Batches(train_tokens, t.batch_size, t.seq_len, t.seed),
        val=eval_batches(val_tokens, t.batch_size, t.seq_len, EVAL_BATCHES),
        routers=find_routers(model),
        out=out,
        corpus=corpus,
        entropy=unigram_entropy(train_tokens),
        muon_note=muon_note,
    )


def _loop(run: Run, steps: int, resume: bool, eval_every: int, stop_after: int | None, display) -> list[dict]:
    say = display.print
    t = run.spec.training
    start = resume_from(run, say) if resume else 0
    metrics_path = run.out / "metrics.jsonl"
    records = read_metrics(metrics_path, start)
    write_metrics(metrics_path, records)
    params = sum(p.numel() for _, p in run.named)
    say(
        f"{run.spec.name}: {params / 1e6:.2f}M parameters, {t.optimizer} lr {t.lr:g} ({t.schedule.kind}, "
        f"warmup {t.schedule.warmup_steps}), batch {t.batch_size} x {t.seq_len}, steps {start + 1}..{steps}"
    )
    if t.optimizer != "adamw":
        say(run.muon_note)
    say(
        f"data: {run.corpus.source}: {len(run.corpus.data) / 1e6:.2f} MB from {run.corpus.files} file(s); "
        f"train {run.batches.tokens.numel() / 1e6:.2f} MB, validation {sum(b.numel() for b in run.val)} tokens"
    )
    say(f"unigram entropy of the training bytes: {run.entropy * LOG2E:.3f} bits = {run.entropy:.3f} nats per byte")
    if t.qk_clip_tau is not None:
        say("note: training.qk_clip_tau is not applied (the emitted model does not report attention logits)")
    if start >= steps:
        say(f"already at step {start} of {steps}; nothing to train")
        return records
    stop = steps if stop_after is None else min(steps, start + stop_after)
    last_saved = start
    with _interrupt_flag() as interrupted, open(metrics_path, "a") as log:
        display.begin(start)
        for step in range(start, stop):
            record = train_step(run, step, steps)
            n = record["step"]
            if n % eval_every == 0 or n == steps:
                record["val_loss"] = evaluate(run)
                say(
                    f"step {n}: loss {record['loss']:.4f}, val loss {record['val_loss']:.4f} nats "
                    f"({record['val_loss'] * LOG2E:.3f} bits) per byte"
                )
                save_checkpoint(run, n)
                last_saved = n
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            display.update(record)
            if interrupted.is_set() and n < stop:
                if last_saved != n:
                    save_checkpoint(run, n)
                say(f"interrupted at step {n}; checkpoint saved in {run.checkpoints}; continue with --resume")
                raise KeyboardInterrupt
    if last_saved != stop:
        save_checkpoint(run, stop)
    if stop < steps:
        say(f"stopped at step {stop} of {steps}; checkpoint saved; continue with --resume")
        return records
    final = records[-1]["val_loss"]
    say(
        f"final validation loss {final:.4f} nats ({final * LOG2E:.3f} bits) per byte vs unigram entropy "
        f"{run.entropy:.4f} nats ({run.entropy * LOG2E:.3f} bits): {final / run.entropy:.2f}x"
    )
    return records
