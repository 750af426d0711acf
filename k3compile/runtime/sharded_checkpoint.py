"""Distributed checkpoints (torch.distributed.checkpoint): written by every rank, loadable at another dp x ep layout.

`<checkpoints>/step-<N>.dcp/` holds DCP's shard files and `k3compile.json` (the training metadata). Expert
stacks and their optimiser state are saved as DTensors sharded on the expert dim over the mesh's "ep"
dimension, FSDP2's shards of each over "dp"; every other parameter as FSDP2's DTensor shard over all ranks,
every buffer as a plain tensor (written once), so DCP's
planner can read them back into any layout: fewer or more EP ranks, or one process holding every
expert. A checkpoint is written into a hidden `.step-<N>.dcp.tmp/` and renamed into place by rank 0
after every rank finished (a crash leaves no half checkpoint); older ones are deleted after that.
`consolidate` reads one into a single process and writes the single-file safetensors checkpoint
(k3compile.runtime.checkpoint) that `generate` and `--init-from` read.
Nothing runs from a checkpoint: DCP's metadata is read by k3compile.runtime.dcp_reader (a restricted unpickler,
checked against the tensors loaded), k3compile.json through the bounded reader and a strict schema.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from k3compile import safe_io
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime.dcp_reader import SafeReader, expected_tensors
from k3compile.runtime.distributed import Layout, barrier
from k3compile.runtime.fsdp import local
from k3compile.runtime.muon import _scalar_dtype
from k3compile.safe_io import fsync_path

META = "k3compile.json"
_NAME = re.compile(r"step-(\d{6,})\.dcp")


class _Layout(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    dp: int = Field(ge=1)
    ep: int = Field(ge=1)


class _Record(BaseModel):
    """What k3compile.json must hold, strictly typed (the training fields are checked again by train on resume)."""

    model_config = ConfigDict(extra="allow", strict=True)

    step: int = Field(ge=0)
    spec_name: str
    spec_sha256: str
    spec: dict
    layout: _Layout


def path(directory: Path, step: int) -> Path:
    """Where the distributed checkpoint of `step` lives in `directory`."""
    return Path(directory) / f"step-{step:06d}.dcp"


def committed(directory: Path) -> list[int]:
    """Steps with a complete distributed checkpoint in `directory`, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = [int(m.group(1)) for p in directory.iterdir() if (m := _NAME.fullmatch(p.name)) and (p / META).is_file()]
    return sorted(steps)


def _experts(layout: Layout, t: Tensor, full: tuple[int, ...]) -> Tensor:
    """An FSDP shard of this rank's expert stack as a DTensor of the whole stack `full`: rows split over "ep",
    then each EP rank's rows over "dp" (the chunks FSDP2 cut), so DCP knows every rank's rows of all E."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(local(t), layout.experts_mesh, [Shard(0), Shard(0)], run_check=False,
                              shape=torch.Size(full), stride=stride)  # fmt: skip


def state_of(layout: Layout, run) -> dict[str, Tensor]:
    """The run's checkpointed tensors by key: FSDP2's shards as DTensors (expert stacks over all E experts)."""
    shards = getattr(run.model, "expert_shards", set())
    split = layout.distributed and bool(shards)
    full = {n: run.model.full_shape(n, tuple(p.shape)) for n, p in run.named if n in shards}
    state = {}
    for key, t in ckpt.model_tensors(run.model).items():
        name = key.removeprefix("model/")
        state[key] = _experts(layout, t, full[name]) if split and name in shards else t
    for name, p in run.named:
        for slot, shape in run.optimizer.state_layout(p).items():
            slots = run.optimizer.state.setdefault(p, {})
            if slot not in slots:  # not stepped yet: load into zeros of the right shape (a shard, like p)
                slots[slot] = torch.zeros_like(p) if shape else torch.zeros((), dtype=_scalar_dtype(), device=p.device)
            t = slots[slot]
            state[f"optim/{name}/{slot}"] = _experts(layout, t, full[name]) if split and name in shards and shape else t
    state["rng/torch"] = torch.get_rng_state()
    state["rng/data"] = run.batches.state()
    return state


def save(layout: Layout, run, step: int, meta: dict) -> Path:
    """Write the run's state at `step` from every rank; rank 0 commits it and deletes the older ones."""
    directory = Path(run.checkpoints)
    final = path(directory, step)
    tmp = directory / f".{final.name}.tmp"
    if layout.main:
        safe_io.make_dir(directory)
        if os.path.lexists(tmp):
            safe_io.remove_tree(tmp)  # a link there is removed, not followed: DCP writes into a folder of its own
    barrier(layout)
    dcp.save(state_of(layout, run), checkpoint_id=str(tmp))
    barrier(layout)
    if layout.main:
        safe_io.write_text(tmp / META, json.dumps({**meta, "step": step, "layout": {"dp": layout.dp, "ep": layout.ep}},
                                                  indent=1, sort_keys=True))  # fmt: skip
        for f in tmp.iterdir():
            fsync_path(f)
        if os.path.lexists(final):
            safe_io.remove_tree(final)
        tmp.rename(final)
        fsync_path(directory)
        for old in committed(directory):
            if old != step:
                safe_io.remove_tree(path(directory, old))
        for old in ckpt.committed(directory):  # single-file checkpoints of an earlier one-process run
            for p in reversed(ckpt.paths(directory, old)):
                p.unlink(missing_ok=True)
    barrier(layout)
    return final


def read_meta(checkpoint: Path) -> dict:
    """k3compile.json of the distributed checkpoint `checkpoint`, through the bounded reader (the checkpoint's own
    file: never a link), strictly typed, its step the one the folder is named for."""
    checkpoint = Path(checkpoint)
    where = f"{checkpoint} is not a k3compile distributed checkpoint"
    try:
        meta = safe_io.read_json(checkpoint / META, follow=False)
        record = _Record.model_validate(meta)
    except safe_io.FileError as e:
        raise ckpt.CheckpointError(f"{where}: {e}") from None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        raise ckpt.CheckpointError(f"{where}: {META}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    m = _NAME.fullmatch(checkpoint.name)
    if m and int(m.group(1)) != record.step:
        raise ckpt.CheckpointError(f"{where}: {META} records step {record.step} in the folder of step {int(m.group(1))}")
    return meta


def _dcp_load(state: dict[str, Tensor], checkpoint: Path, no_dist: bool) -> None:
    """Load `state` in place from `checkpoint` through SafeReader: metadata checked before any read, and any
    failure of DCP's (multi-line CheckpointException, AssertionError, ...) one CheckpointError line."""
    reader = SafeReader(checkpoint, expected_tensors(state))
    reader.verified_metadata()
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point there
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # CheckpointException (a BaseException) wraps each rank's failure
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        first = (str(cause).strip().splitlines() or [""])[0]
        why = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
        raise ckpt.CheckpointError(f"cannot read {checkpoint}: {safe_io.shown(why, 200)}") from None


def load(layout: Layout, run, checkpoint: Path) -> int:
    """Read a distributed checkpoint (any layout it was saved at) into the run; returns its step."""
    meta = read_meta(checkpoint)
    state = state_of(layout, run)
    _dcp_load(state, checkpoint, not layout.distributed)
    with torch.no_grad():
        for key, t in ckpt.model_tensors(run.model).items():
            loaded, t = local(state[key]), local(t)
            if loaded.data_ptr() != t.data_ptr():
                t.copy_(loaded)
    run.batches.load_state(state["rng/data"])
    torch.set_rng_state(state["rng/torch"])
    return int(meta["step"])


def consolidate(checkpoint: Path, model, out_dir: Path) -> Path:
    """Read a distributed checkpoint into `model` (one process, every expert) and write its weights and buffers
    as the single-file safetensors checkpoint `generate` reads; returns that checkpoint's JSON path."""
    if dist.is_initialized():
        raise ckpt.CheckpointError("consolidate runs in one process (outside torchrun)")
    meta = read_meta(checkpoint)
    state = ckpt.model_tensors(model)
    _dcp_load(state, checkpoint, True)
    keep = {k: v for k, v in meta.items() if k not in ("step", "optimizer", "layout")}
    return ckpt.save(Path(out_dir), int(meta["step"]), state, keep)


def newest(where: Path) -> Path:
    """The distributed checkpoint `where` is, or the newest in it or in its `checkpoints/`."""
    where = Path(where)
    if (where / META).is_file():
        return where
    for folder in (where, where / "checkpoints"):
        steps = committed(folder)
        if steps:
            return path(folder, steps[-1])
    raise ckpt.CheckpointError(f"{where} holds no distributed checkpoint (step-NNNNNN.dcp/ with {META})")


def consolidate_run(checkpoint: Path, out: Path, build: Path | None = None) -> Path:
    """`k3compile consolidate`: the newest distributed checkpoint of a run (or the one named) as a single-file
    checkpoint in `out` (absent or empty), through the run's build (default RUN/build/<package>)."""
    from k3compile.spec.digest import package_name
    from k3compile.loader import BuildLoadError, load
    from k3compile.runtime.generate import SERVING_FIELDS
    from k3compile.spec.schema import Spec

    source = newest(checkpoint)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ckpt.CheckpointError(f"output {out} exists and is not an empty folder")
    meta = read_meta(source)
    try:
        spec = Spec.model_validate(meta["spec"])
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(map(str, err["loc"])) or "<spec>"
        raise ckpt.CheckpointError(f"{source}/{META} records a spec that does not validate: {where}: {err['msg']}") from None
    if build is None:
        build = source.parent.parent / "build" / package_name(spec)
    try:
        package = load(build)
    except BuildLoadError as e:
        raise ckpt.CheckpointError(str(e)) from None
    if not hasattr(package, "Model"):
        raise ckpt.CheckpointError(f"{build} has no training Model (built with --mode infer); name the run's build")
    built = Spec.model_validate_json(package.SPEC_JSON)
    if built.model_dump(exclude=SERVING_FIELDS) != spec.model_dump(exclude=SERVING_FIELDS):
        raise ckpt.CheckpointError(f"{source} was written for spec {spec.name!r}, whose architecture is not the one of "
                                   f"the build {build} ({built.name!r})")  # fmt: skip
    return consolidate(source, package.Model(), out)
