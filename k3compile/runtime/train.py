"""`k3compile train`: train an emitted Model on bytes with Per-Head Muon, load balancing and resumable checkpoints.

One step: forward + mean next-token loss, backward, gradient-norm clip, optimizer step at the scheduled
learning rate, then the balancing rule turns this step's routing statistics into every router's bias for
the next step. Validation loss is measured at intervals and at the end, where it is compared with the
unigram entropy of the training bytes (the loss of a model that ignores context). A checkpoint is written
with every validation and when the run stops; `resume=True` continues exactly where it left off.
Started by torchrun, every process trains its rows of each batch in the spec's dp x ep layout
(k3compile.runtime.distributed) and checkpoints are distributed (k3compile.runtime.sharded_checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor, nn

from k3compile import safe_io
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime import distributed as dist_rt
from k3compile.runtime import fsdp
from k3compile.runtime import sharded_checkpoint as dcp_ckpt
from k3compile.runtime.balance import (
    BalanceReadings, BalanceStats, find_routers, restore_stats, snapshot_stats, update_balance,
)  # fmt: skip
from k3compile.runtime.data import (
    VOCAB, Batches, Corpus, eval_batches, load_corpus, load_tokens, split, unigram_entropy,
)  # fmt: skip
from k3compile.runtime.device import DeviceError, runtime_device, to_device
from k3compile.runtime.muon import PerHeadMuon, default_use_muon, muon_precision
from k3compile.runtime.precision import autocast, training_precision
from k3compile.runtime.readings import read
from k3compile.runtime.schedule import lr_at
from k3compile.spec.schema import MIXER_KDA, Spec

EVAL_BATCHES = 4  # validation batches of (batch_size, seq_len) per evaluation
MAX_METRICS_BYTES = 1 << 30  # metrics.jsonl is read whole on resume: about 200 bytes a step
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


def resolve(
    spec_or_build: str | Path, overrides: Sequence[str] = (), extends_anywhere: bool = False
) -> tuple[Spec, ModuleType | None]:
    """(spec, package): a spec file gives (spec, None); a build folder gives its spec and the loaded package."""
    from k3compile.loader import BuildLoadError, load, shapes_only
    from k3compile.spec.load import load_spec

    path = Path(spec_or_build)
    if not path.exists():
        raise TrainError(f"no such spec or build: {path}")
    if path.is_dir():
        try:
            package = load(path)
        except BuildLoadError as e:
            raise TrainError(str(e)) from None
        if not hasattr(package, "Model"):
            raise TrainError(f"{path} has no training Model (built with --mode infer); rebuild with --mode train")
        if shapes_only(package):
            raise TrainError(
                f"{path} has no weights (a shapes-only build: its spec was lowered on the meta device); "
                "train from the spec file, or build a spec small enough to initialise"
            )
        run_device(package, path=path)
        return _spec_from_build(package, overrides), package
    return load_spec(path, list(overrides), extends_anywhere), None


def run_device(package: ModuleType | None, spec: Spec | None = None, path: str | Path | None = None) -> torch.device:
    """The device the build `package` (at `path`), or before it is built `spec`'s target, trains on here
    (cuda:LOCAL_RANK for a GPU target, k3compile.runtime.device); a one-line TrainError where this machine cannot
    run it."""
    if package is not None:
        target = getattr(package, "TARGET", "cpu")
        what, fix = f"{path or 'the build'} was built for {target}", "rebuild it with --target cpu"
    else:
        target = spec.target
        what, fix = f"spec {spec.name!r} targets {target}", "set target: cpu (--set target=cpu)"
    try:
        return runtime_device(target, what, fix)
    except DeviceError as e:
        raise TrainError(str(e)) from None


def _enclosing_build(path: Path) -> Path | None:
    """The build folder `path` is (or lies inside), or None."""
    from k3compile.loader import is_build_dir

    path = path.absolute()
    return next((p for p in (path, *path.parents) if is_build_dir(p)), None)


def prepare_out(out: Path, resume: bool) -> Path | None:
    """Check that `out` can hold this run; create it. Returns the top folder created (to undo), or None."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"output {out} exists and is not a folder")
    inside = _enclosing_build(out)
    if inside is not None:  # the next build there would delete the run's checkpoints (or refuse to replace it)
        raise TrainError(f"output {out} is inside the build {inside}; choose an --out outside it")
    steps = sorted(ckpt.committed(out / "checkpoints") + dcp_ckpt.committed(out / "checkpoints"))
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
    layout: dist_rt.Layout = field(default_factory=dist_rt.Layout)  # this process's place in the dp x ep mesh (world 1: alone)
    compute: torch.dtype | None = None  # the forward's autocast dtype (training.precision); None: fp32
    precision_note: str = ""  # the compute precision chosen, and why

    @property
    def expert_shards(self) -> set[str]:
        return getattr(self.model, "expert_shards", set())

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def data_fingerprint(self) -> dict:
        c = self.corpus
        if c.tokens is not None:  # token ids: their bytes as stored
            raw = c.tokens.numpy().data
            return {"source": c.source, "bytes": raw.nbytes, "crc32": zlib.crc32(raw)}
        return {"source": c.source, "bytes": len(c.data), "crc32": zlib.crc32(c.data)}


@dataclass
class PendingStep:
    """A step's metrics as the step left them: numbers still on the device, read by `read_steps`."""

    step: int  # 1-based
    lr: float
    tokens: int  # tokens of the global batch
    start: float  # time.perf_counter() when its forward was started
    loss: Tensor  # the global batch's mean loss, float64
    grad_norm: Tensor | None
    balance: BalanceReadings | None


def train_step(run: Run, step: int, total: int) -> PendingStep:
    """One optimizer step (0-based `step` of `total`) and the balance update. Nothing is read on the host, so on
    a GPU the host runs on to the next step while this one computes; `read_steps` turns it into metrics."""
    t = run.spec.training
    lr = lr_at(step, total, t.lr, t.schedule)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = run.batches.next()  # token windows (labels are the tokens), or (tokens, labels): a task's batches
    tokens, labels = batch if isinstance(batch, tuple) else (batch, batch)
    tokens, labels = run.layout.rows(tokens), run.layout.rows(labels)  # this rank's rows of the global batch
    device = run.layout.device  # the batch is copied there once (labels are usually the tokens themselves)
    tokens, labels = (to_device(tokens, device),) * 2 if labels is tokens else to_device((tokens, labels), device)
    start = time.perf_counter()
    with autocast(run.compute, device):
        loss = run.model(tokens, labels)
    value = dist_rt.mean(run.layout, loss)
    loss.backward()  # across processes FSDP2 reduce-scatters the gradients here (k3compile.runtime.fsdp)
    grad_norm = None
    if t.grad_clip is not None:
        grad_norm = fsdp.clip_grad_norm(run.layout, [p for _, p in run.named], t.grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    balance = None
    if run.routers:
        moe = run.spec.moe
        dist_rt.reduce_statistics(run.layout, run.routers)
        balance = update_balance(run.routers, moe.router, moe.top_k)
    return PendingStep(step + 1, lr, tokens.numel() * run.layout.world, start, value, grad_norm, balance)


def read_steps(pending: list[PendingStep]) -> list[dict]:
    """The metrics records of consecutive steps: their numbers read from the device together (one wait), each loss
    checked finite, tokens/s over the steps' wall time until now (the read waits for the last one to finish)."""
    values = read([(p.loss, p.grad_norm, p.balance.tensors() if p.balance else None) for p in pending])
    speed = sum(p.tokens for p in pending) / (time.perf_counter() - pending[0].start)
    records = []
    for p, (loss, grad_norm, balance) in zip(pending, values):
        if not math.isfinite(loss):
            raise TrainError(f"the loss is {loss} at step {p.step}; lower training.lr or check the data")
        record = {"step": p.step, "loss": loss, "lr": p.lr}
        if balance is not None:
            stats = BalanceStats.of(balance)
            record.update(imbalance=stats.imbalance, dropped=stats.dropped)
            if stats.aux_loss is not None:
                record["aux_loss"] = stats.aux_loss
        record["grad_norm"] = grad_norm
        record["tokens_per_s"] = speed
        records.append(record)
    return records


@torch.no_grad()
def evaluate(run: Run) -> float:
    """Mean next-token loss (nats) over the fixed validation windows; routing statistics are left untouched."""
    saved = snapshot_stats(run.routers)
    run.model.eval()
    try:
        total, count = 0.0, 0
        for batch in run.val:
            batch = run.layout.rows(batch)
            weight = batch.shape[0] * (batch.shape[1] - 1)
            with autocast(run.compute, run.layout.device):
                loss = run.model(batch, batch)
            total = loss.double() * weight + total  # summed on the device, read once
            count += weight
    finally:
        fsdp.reshard(run.model)
        run.model.train()
        restore_stats(run.routers, saved)
    return float(dist_rt.mean(run.layout, total / count))


def save_checkpoint(run: Run, step: int) -> Path:
    """The run's checkpoint at `step`: one safetensors file in one process, a DCP checkpoint across processes."""
    from k3compile import __version__
    from k3compile.spec.digest import spec_hash, spec_json

    meta = {
        "compiler": f"k3compile {__version__}",
        "spec_name": run.spec.name,
        "spec_sha256": spec_hash(run.spec),
        "spec": json.loads(spec_json(run.spec)),
        "optimizer": optimizer_layout(run.optimizer, run.named),
        "data": run.data_fingerprint(),
    }
    if run.layout.distributed:
        return dcp_ckpt.save(run.layout, run, step, meta)
    tensors = {**ckpt.model_tensors(run.model), **ckpt.optimizer_tensors(run.optimizer, run.named)}
    tensors["rng/torch"] = torch.get_rng_state()
    tensors["rng/data"] = run.batches.state()
    written = ckpt.save(run.checkpoints, step, tensors, meta)
    for old in dcp_ckpt.committed(run.checkpoints):  # a distributed run's, resumed here in one process
        shutil.rmtree(dcp_ckpt.path(run.checkpoints, old), ignore_errors=True)
    return written


class _DataFingerprint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    source: str
    bytes: int
    crc32: int


class _TrainingMeta(BaseModel):
    """What `save_checkpoint` adds to a checkpoint's JSON, strictly typed; checked before anything is restored."""

    model_config = ConfigDict(extra="allow", strict=True)

    compiler: str
    spec_name: str
    spec_sha256: str
    spec: dict
    optimizer: dict[str, str]
    data: _DataFingerprint


def _training_meta(state: ckpt.Checkpoint) -> _TrainingMeta:
    try:
        return _TrainingMeta.model_validate(state.meta)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(map(str, err["loc"]))
        raise ckpt.CheckpointError(f"{state.path} has bad training metadata: {field}: {err['msg']}") from None


def _check_rng_states(run: Run, state: ckpt.Checkpoint) -> None:
    """Both random-generator states are there, shaped like this machine's (uint8, 5056 bytes for mt19937) and
    valid: each is tried on a scratch generator, so nothing is restored from a checkpoint that would fail."""
    for key, live in (("rng/torch", torch.get_rng_state()), ("rng/data", run.batches.state())):
        found = state.tensors.get(key)
        if found is None:
            raise ckpt.CheckpointError(f"{state.path} is not a training checkpoint (no {key})")
        if found.dtype != live.dtype or found.shape != live.shape:
            raise ckpt.CheckpointError(
                f"{state.path}: {key} is not a random-generator state ({found.dtype} {list(found.shape)}, "
                f"expected {live.dtype} {list(live.shape)})"
            )
        try:
            torch.Generator().set_state(found)
        except RuntimeError as e:
            raise ckpt.CheckpointError(f"{state.path}: {key} is not a valid random-generator state ({e})") from None


def resume_from(run: Run, say) -> int:
    """Load the newest checkpoint into the run; returns its step (0 when there is none).

    Everything is checked before anything is restored: the record (checkpoint.load), the model's tensors,
    the training metadata's types, the optimizer layout and state, the RNG states, finiteness.
    """
    from k3compile.spec.digest import spec_hash

    sharded = dcp_ckpt.committed(run.checkpoints)
    if sharded and (not ckpt.committed(run.checkpoints) or sharded[-1] >= ckpt.committed(run.checkpoints)[-1]):
        return _resume_sharded(run, dcp_ckpt.path(run.checkpoints, sharded[-1]), say)
    path = ckpt.latest(run.checkpoints)
    if path is None:
        say(f"no checkpoint in {run.checkpoints}; starting from step 0")
        return 0
    if run.layout.distributed:
        raise TrainError(
            f"{path} is a one-process checkpoint; a run across processes resumes only distributed ones "
            "(start a new run with --init-from it for its weights, or resume it in one process)"
        )
    state = ckpt.load(path)
    ckpt.check_model(run.model, state)
    meta = _training_meta(state)
    layout = optimizer_layout(run.optimizer, run.named)
    saved = meta.optimizer
    differ = [f"{n} ({saved.get(n, 'absent')} -> {k})" for n, k in layout.items() if saved.get(n) != k]
    if differ:
        shown = ", ".join(differ[:4]) + (f" (+{len(differ) - 4} more)" if len(differ) > 4 else "")
        raise TrainError(f"{path} was written with another optimizer layout: {shown}")
    _check_rng_states(run, state)
    ckpt.check_finite(state)
    ckpt.restore_optimizer(run.optimizer, run.named, state)  # checks every slot before it changes anything
    ckpt.restore_model(run.model, state)
    run.batches.load_state(state.tensors["rng/data"])
    torch.set_rng_state(state.tensors["rng/torch"])
    if meta.spec_sha256 != spec_hash(run.spec):
        say(f"note: {path.name} was written with different spec settings; continuing with the current ones")
    if meta.data.model_dump() != run.data_fingerprint():
        say(f"note: the data differ from those {path.name} was trained on; the batches will differ too")
    say(f"resuming from {path} (step {state.step})")
    return state.step


def _resume_sharded(run: Run, path: Path, say) -> int:
    """Resume from a distributed checkpoint, at this run's dp x ep layout (whichever it was saved at)."""
    try:
        meta = _TrainingMeta.model_validate(dcp_ckpt.read_meta(path))
    except ValidationError as e:
        raise ckpt.CheckpointError(f"{path} has bad training metadata: {e.errors(include_url=False)[0]['msg']}") from None
    layout = optimizer_layout(run.optimizer, run.named)
    differ = [n for n, k in layout.items() if meta.optimizer.get(n) != k]
    if differ:
        raise TrainError(f"{path} was written with another optimizer layout: {', '.join(differ[:4])}")
    step = dcp_ckpt.load(run.layout, run, path)
    saved = dcp_ckpt.read_meta(path).get("layout", {})
    say(f"resuming from {path} (step {step}; saved at dp={saved.get('dp')} ep={saved.get('ep')}, "
        f"now dp={run.layout.dp} ep={run.layout.ep})")
    return step


# ---------------------------------------------------------------- metrics file


@dataclass
class MetricsSoFar:
    """What `read_metrics` keeps of a metrics file: the records up to a step, where they end, what was skipped."""

    records: list[dict]
    size: int  # bytes up to the end of the last kept record: the file is cut there and appended to
    skipped: list[int]  # 1-based numbers of the lines before that which are not records


def _record(line: bytes) -> dict | None:
    """A metrics record (a JSON object with an integer step >= 1), or None for anything else."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or a line cut by a crash
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if type(step) is int and step >= 1 else None


def read_metrics(path: Path, upto: int) -> MetricsSoFar:
    """The records of `path` up to the first one after step `upto` (a resumed run redoes those steps).

    Lines that are not records are skipped (and counted) where a kept record follows them; after the last
    kept record everything is cut: later steps, and a line a crash left half-written.
    """
    try:  # the run's own file: never a link, a FIFO or a device
        data = safe_io.read_bytes(path, MAX_METRICS_BYTES, what="a metrics log", follow=False)
    except safe_io.MissingFile:
        return MetricsSoFar([], 0, [])
    except safe_io.FileError as e:
        raise TrainError(str(e)) from None
    kept, skipped, pending, size, offset = [], [], [], 0, 0
    for number, line in enumerate(data.splitlines(keepends=True), 1):
        offset += len(line)
        record = _record(line) if line.endswith(b"\n") else None
        if record is None:
            pending.append(number)
        elif record["step"] > upto:
            break
        else:
            kept.append(record)
            skipped += pending
            pending, size = [], offset
    return MetricsSoFar(kept, size, skipped)


class MetricsLog:
    """metrics.jsonl, appended to one whole line per record: cut to `size` when opened (the records a resumed
    run redoes), and cut back to its last whole line when a write fails (a full disk), never rewritten."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        try:  # O_NOFOLLOW, a regular file with one name: a link planted in the run folder is refused
            self.fd = safe_io.open_append(path)
        except safe_io.FileError as e:
            raise TrainError(str(e)) from None
        os.ftruncate(self.fd, size)

    def append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        left = memoryview(line)
        try:
            while left:
                left = left[os.write(self.fd, left) :]
        except OSError as e:
            os.ftruncate(self.fd, self.size)
            why = e.strerror or os.strerror(e.errno or 0)
            hint = "--resume continues from the last checkpoint"
            raise TrainError(f"cannot append to {self.path}: {why}; {hint}") from None
        self.size += len(line)

    def close(self) -> None:
        os.close(self.fd)


class _NoMetrics:
    """The metrics file of ranks other than 0, which write none."""

    def append(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- loggers


class TensorBoardLog:
    """Each record's numbers as TensorBoard scalars (`train/loss`, `train/val_loss`, ...) at its step, written
    under OUT/tensorboard."""

    def __init__(self, out: Path):
        self.writer = self.writer_class()(log_dir=str(out / "tensorboard"))

    @staticmethod
    def writer_class() -> type:
        """torch's SummaryWriter; a one-line TrainError where the tensorboard package is missing."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrainError("--log tensorboard needs the tensorboard package: pip install tensorboard") from None
        return SummaryWriter

    def __call__(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


LOGGERS = {"tensorboard": TensorBoardLog}


# ---------------------------------------------------------------- console


class _Quiet:
    """Stands in for the progress display when progress=False."""

    def print(self, *args, **kwargs) -> None:
        pass

    def begin(self, step: int) -> None:
        pass

    def update(self, *args, **kwargs) -> None:
        pass


class _Plain(_Quiet):
    """The messages without a progress bar (progress="plain", `--no-progress`): one flushed line each."""

    def print(self, *args, **kwargs) -> None:
        print(*args, flush=True)


@contextlib.contextmanager
def _display(enabled: bool | str, total: int, name: str) -> Iterator:
    if not enabled:
        yield _Quiet()
        return
    if enabled == "plain":
        yield _Plain()
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


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after a checkpoint; `signum` is SIGINT (Ctrl-C) or SIGTERM (docker stop, ...)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopFlag:
    """Which stop signal arrived first (None: none yet)."""

    def __init__(self):
        self.signum: int | None = None


@contextlib.contextmanager
def _stop_flag() -> Iterator[_StopFlag]:
    """A first Ctrl-C or SIGTERM sets the flag (the run stops after the current step, with a checkpoint);
    a second one stops at once. Outside the main thread signals cannot be caught: the flag stays unset."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.signum is not None:
            raise Interrupted(signum)
        flag.signum = signum

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
    progress: bool | str = True,
    stop_after: int | None = None,
    init_from: str | Path | None = None,
    extends_anywhere: bool = False,
    log_every: int | None = None,
    callbacks: Sequence[Callable[[dict], None]] = (),
    log: Sequence[str] = (),
    tokenizer: str | Path | None = None,
    data_dtype: str | None = None,
    build: Callable[[Spec, Path, Callable], ModuleType] | None = None,
) -> list[dict]:
    """Train the spec's (or build's) Model for `steps` optimizer steps in total; returns the metrics records.

    `data`: a text file or folder (default: the Python stdlib's sources; bytes are the tokens), a token-id file
    (`.npy`, or `.bin` of `data_dtype`, memory-mapped), or with `tokenizer` (a `tokenizers` JSON, or a folder
    holding tokenizer.json such as import-hf's output) a text file or folder encoded by it; `out`: the run folder (default
    runs/<spec name>) with build/, checkpoints/ and metrics.jsonl; `resume`: continue from the newest
    checkpoint there; `overrides`: `a.b=value` spec overrides (only training.* for a build); `eval_every`:
    validate (and checkpoint) every this many steps; `stop_after`: end this call after that many steps
    (with a checkpoint) so a later `resume=True` call continues the same schedule; `init_from`: start from
    these weights instead of the seeded init (a weights folder such as `k3compile import-hf` output, or a
    checkpoint; resuming still restores the run's own checkpoint); `progress`: show a bar
    and messages on the console ("plain": the messages without the bar, for non-interactive runs; False: silent);
    `callbacks`: functions called with each metrics record as it is logged (rank 0); `log`: more loggers,
    "tensorboard" (events under OUT/tensorboard; needs the tensorboard package); `extends_anywhere`: let the spec's `extends:` leave its
    root (k3compile.spec.load.spec_root); `log_every`: read the steps' numbers from the device, log them and
    update the progress bar every this many steps (default: 1 on the CPU, 10 on a GPU). Records hold step, loss,
    lr, tokens_per_s, imbalance, dropped, grad_norm and, when validated, val_loss (nats per byte). A build for a
    GPU target trains on cuda:LOCAL_RANK (refused where there is no GPU). A first Ctrl-C or SIGTERM ends the run
    after the current step with a checkpoint and raises `Interrupted` (a KeyboardInterrupt carrying the signal).
    `build(spec, build_dir, say)` builds a spec into an importable package; the runtime does not import the
    compiler, so training a spec goes through `k3compile.training.train`, which passes the compiler's.
    """
    if steps < 1:
        raise TrainError(f"steps must be at least 1, got {steps}")
    for name, value in (("eval_every", eval_every), ("stop_after", stop_after), ("log_every", log_every)):
        if value is not None and value < 1:
            raise TrainError(f"{name} must be at least 1, got {value}")
    unknown = sorted(set(log) - set(LOGGERS))
    if unknown:
        raise TrainError(f"unknown logger {unknown[0]!r}; known: {', '.join(LOGGERS)}")
    if "tensorboard" in log:
        TensorBoardLog.writer_class()  # before anything is built or written
    spec, package = resolve(spec_or_build, overrides, extends_anywhere)
    if package is None and build is None:
        raise TrainError(f"{spec_or_build} is a spec: train it with k3compile.train (which builds it), or train a build")
    device = run_device(package, spec, spec_or_build)  # a GPU target without a GPU: refused before anything is written
    try:
        layout = dist_rt.start(spec, device=device)
    except dist_rt.LayoutError as e:
        raise TrainError(str(e)) from None
    try:
        return _train(spec, package, layout, steps, data, out, resume, eval_every, progress if layout.main else False,
                      stop_after, init_from, log_every, tuple(callbacks), tuple(log), (tokenizer, data_dtype), build)
    finally:
        dist_rt.stop(layout)


def _train(spec: Spec, package: ModuleType | None, layout: dist_rt.Layout, steps: int, data, out, resume: bool,
           eval_every: int | None, progress: bool | str, stop_after: int | None, init_from,
           log_every: int | None = None, callbacks: tuple = (), log: tuple = (),
           tokens: tuple = (None, None), build: Callable | None = None) -> list[dict]:  # fmt: skip
    """`train` in this process of the dp x ep layout: rank 0 prepares the folder and the build, every rank trains."""
    tokenizer, data_dtype = tokens
    tokenized = tokenizer is not None or (data is not None and Path(data).suffix in (".npy", ".bin"))
    if not tokenized and spec.vocab_size < VOCAB:
        raise TrainError(
            f"spec {spec.name!r} has vocab_size {spec.vocab_size}; byte-level training needs at least {VOCAB}"
        )
    t = spec.training
    if tokenized:
        corpus = load_tokens(data, spec.vocab_size, dtype=data_dtype, tokenizer=tokenizer)
    else:
        corpus = load_corpus(data)
    train_tokens, val_tokens = split(corpus.data if corpus.tokens is None else corpus.tokens, t.seq_len)
    out = Path(out) if out is not None else Path("runs") / spec.name
    created = prepare_out(out, resume) if layout.main else None
    with _display(progress, steps, spec.name) as display:
        say = display.print
        try:
            if package is None and layout.main:
                package = build(spec, out / "build", say)
            dist_rt.barrier(layout)  # the other ranks load the build rank 0 wrote
            if package is None:
                package = build(spec, out / "build", lambda *a, **k: None)
            dist_rt.use_experts(layout)  # after the build: its passes run each graph in one process
            run = _setup(spec, package, corpus, train_tokens, val_tokens, out, init_from, layout)
            loggers = [LOGGERS[name](out) for name in log] if layout.main else []
        except BaseException:
            if created is not None:
                shutil.rmtree(created, ignore_errors=True)
            raise
        try:
            return _loop(run, steps, resume, eval_every or default_eval_every(steps), stop_after, display, log_every,
                         (*callbacks, *loggers) if layout.main else ())
        finally:
            for logger in loggers:
                logger.close()


def _setup(
    spec: Spec, package: ModuleType, corpus: Corpus, train_tokens: Tensor, val_tokens: Tensor, out: Path,
    init_from: str | Path | None, layout: dist_rt.Layout | None = None,
) -> Run:  # fmt: skip
    t = spec.training
    layout = layout or dist_rt.Layout(device=run_device(package))
    torch.manual_seed(t.seed)
    model = package.Model(device=layout.device)
    if model.spec.training.seed != t.seed:  # a build's init follows its own seed; re-init with the requested one
        model.spec = spec
        model.reset_parameters()
    if init_from is not None:
        from k3compile.runtime.generate import GenerateError, read_training_state

        shapes = {k: model.full_shape(k, tuple(v.shape)) for k, v in model.state_dict().items()}  # whole experts
        try:
            state = read_training_state(init_from, shapes, spec)
        except GenerateError as e:
            raise TrainError(f"--init-from: {e}") from None
        model.load_state_dict({k: model.local_rows(k, v) for k, v in state.items()}, strict=True)  # this rank's rows
    model.train()
    fsdp.shard(layout, model)  # across processes: parameters become FSDP2 shards (DTensors)
    named = list(model.named_parameters())
    ns_dtype, muon_note = muon_precision(t.muon_precision, named[0][1].device)
    compute, precision_note = training_precision(t.precision, layout.device)
    return Run(
        spec=spec,
        model=model,
        named=named,
        optimizer=make_optimizer(spec, named, ns_dtype),
        batches=Batches(train_tokens, t.batch_size, t.seq_len, t.seed),
        val=[to_device(b, layout.device) for b in eval_batches(val_tokens, t.batch_size, t.seq_len, EVAL_BATCHES)],
        routers=find_routers(model),
        out=out,
        corpus=corpus,
        entropy=unigram_entropy(train_tokens),
        muon_note=muon_note,
        layout=layout,
        compute=compute,
        precision_note=precision_note,
    )


def default_log_every(device: torch.device) -> int:
    """Steps per log interval: 1 on the CPU (reading a loss costs nothing there), 10 on a GPU (each read waits for
    the GPU, which then idles until the host queues the next step)."""
    return 1 if device.type == "cpu" else 10


def _loop(run: Run, steps: int, resume: bool, eval_every: int, stop_after: int | None, display,
          log_every: int | None = None, callbacks: tuple = ()) -> list[dict]:  # fmt: skip
    say = display.print
    t = run.spec.training
    log_every = log_every or default_log_every(run.layout.device)
    start = resume_from(run, say) if resume else 0
    metrics_path = run.out / "metrics.jsonl"
    so_far = read_metrics(metrics_path, start)
    records = so_far.records
    if so_far.skipped:
        say(f"note: {metrics_path}: skipped {len(so_far.skipped)} lines that are not metrics records "
            f"(the first: line {so_far.skipped[0]})")
    params = sum(fsdp.local(p).numel() for _, p in run.named)  # across processes: this rank's FSDP2 shards
    say(
        f"{run.spec.name}: {params / 1e6:.2f}M parameters{' on this rank' if run.layout.distributed else ''}, {t.optimizer} lr {t.lr:g} ({t.schedule.kind}, "
        f"warmup {t.schedule.warmup_steps}), batch {t.batch_size} x {t.seq_len}, steps {start + 1}..{steps}"
    )
    if run.compute is not None or run.layout.device.type != "cpu" or t.precision != "auto":
        say(run.precision_note)
    if t.optimizer != "adamw":
        say(run.muon_note)
    if run.layout.distributed:
        lay, moe = run.layout, run.spec.moe
        experts = f", {moe.num_experts // lay.ep} of {moe.num_experts} experts per rank" if moe is not None else ""
        say(f"{lay.world} processes ({dist_rt.backend()}): dp {lay.dp} x ep {lay.ep}, "
            f"{t.batch_size // lay.world} of {t.batch_size} sequences per rank{experts}")
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
    log = MetricsLog(metrics_path, so_far.size) if run.layout.main else _NoMetrics()  # rank 0 writes
    with _stop_flag() as stopping, contextlib.closing(log):
        display.begin(start)
        pending: list[PendingStep] = []
        for step in range(start, stop):
            pending.append(train_step(run, step, steps))
            n = step + 1
            validate = n % eval_every == 0 or n == steps
            if not (validate or n % log_every == 0 or n == stop or stopping.signum is not None):
                continue  # the step's numbers stay on the device until the log interval ends
            done, pending = read_steps(pending), []
            record = done[-1]
            if validate:
                record["val_loss"] = evaluate(run)
                say(
                    f"step {n}: loss {record['loss']:.4f}, val loss {record['val_loss']:.4f} nats "
                    f"({record['val_loss'] * LOG2E:.3f} bits) per byte"
                )
            for r in done:
                records.append(r)
                log.append(r)  # before the checkpoint: a resume from it finds this step's record
                for callback in callbacks:
                    callback(dict(r))
            if validate:
                save_checkpoint(run, n)
                last_saved = n
            display.update(record)
            if stopping.signum is not None and n < stop:
                if last_saved != n:
                    save_checkpoint(run, n)
                name = signal.Signals(stopping.signum).name
                say(f"{name} at step {n}; checkpoint saved in {run.checkpoints}; continue with --resume")
                raise Interrupted(stopping.signum)
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
