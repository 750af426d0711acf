"""Training checkpoints: one safetensors file of tensors plus a JSON file that commits it.

`DIR/step-000300.safetensors` holds every tensor (weights, all buffers, optimizer state, RNG states);
`DIR/step-000300.json` holds the scalars (step, spec hash, data position, ...), the tensor file's size and
CRC-32, and a SHA-256 over all of that JSON: an edited field fails the checksum, and the fields are then
type-checked (a schema), so a checkpoint is safetensors plus validated metadata.
Both are written to a temporary file, fsynced and renamed into place, the JSON last: a checkpoint exists only
once its JSON does, and the previous one is deleted only after that. A truncated or corrupted file, or one
from another model, fails with a one-line error.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor, nn

from k3compile import safe_io
from k3compile.runtime.muon import PerHeadMuon

FORMAT = "k3compile-checkpoint/2"
OLD_FORMATS = ("k3compile-checkpoint/1",)  # without a metadata checksum: not read
_NAME = re.compile(r"^step-(\d+)\.json$")
_MODEL, _OPTIM = "model/", "optim/"
_CHECKSUM = "meta_sha256"
MAX_METADATA_BYTES = safe_io.MAX_JSON_BYTES


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, read or applied; one line."""


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint: its tensors by key and its JSON metadata."""

    path: Path  # the committing JSON file
    step: int
    tensors: dict[str, Tensor]
    meta: dict


class _Record(BaseModel):
    """The fields of every checkpoint's JSON, strictly typed; the caller's own fields (spec, ...) ride along."""

    model_config = ConfigDict(extra="allow", strict=True)

    step: int = Field(ge=0)
    tensors: str
    bytes: int = Field(ge=0)
    crc32: int = Field(ge=0, lt=1 << 32)


def metadata_checksum(record: Mapping) -> str:
    """SHA-256 of the record's canonical JSON, its own checksum field left out."""
    body = {k: v for k, v in record.items() if k != _CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(record: Mapping) -> dict:
    """`record` with its checksum field set: what `save` writes."""
    return {**record, _CHECKSUM: metadata_checksum(record)}


def paths(directory: Path, step: int) -> tuple[Path, Path]:
    """(tensor file, JSON file) of the checkpoint of `step` in `directory`."""
    stem = f"step-{step:06d}"
    return directory / f"{stem}.safetensors", directory / f"{stem}.json"


def committed(directory: Path) -> list[int]:
    """Steps with a committed checkpoint (JSON present) in `directory`, ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name)))


def latest(directory: Path) -> Path | None:
    """The JSON file of the newest committed checkpoint, or None."""
    steps = committed(directory)
    return paths(directory, steps[-1])[1] if steps else None


# ---------------------------------------------------------------- writing


def save(directory: Path, step: int, tensors: Mapping[str, Tensor], meta: Mapping) -> Path:
    """Commit a checkpoint of `step`, then delete every other one; returns its JSON path.

    On any failure (disk full, ...) the new files are removed, the previous checkpoint is left intact and a
    CheckpointError says so. A step that already has a committed checkpoint keeps it unchanged.
    """
    directory = Path(directory)
    tensor_path, json_path = paths(directory, step)
    previous = latest(directory)
    if json_path.is_file() and not json_path.is_symlink():
        return json_path
    try:
        safe_io.make_dir(directory)
        payload = st_save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata={"format": FORMAT})
        record = sealed({
            "format": FORMAT,
            **meta,
            "step": step,
            "tensors": tensor_path.name,
            "bytes": len(payload),
            "crc32": zlib.crc32(payload),
        })
        text = json.dumps(record, indent=1, sort_keys=True).encode()
        safe_io.write_atomic(tensor_path, payload)
        safe_io.write_atomic(json_path, text, sync_dir=True)
    except safe_io.FileError as e:
        raise CheckpointError(f"cannot write checkpoint {json_path.stem}: {e}") from None
    except OSError as e:
        json_path.unlink(missing_ok=True)
        tensor_path.unlink(missing_ok=True)
        why = e.strerror or os.strerror(e.errno or errno.EIO)
        kept = f"the previous checkpoint {previous.stem} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"cannot write checkpoint {json_path.stem} in {directory}: {why}; {kept}") from None
    for old in committed(directory):
        if old != step:
            for p in reversed(paths(directory, old)):  # uncommit first
                p.unlink(missing_ok=True)
    return json_path


# ---------------------------------------------------------------- reading


def load(json_path: Path) -> Checkpoint:
    """Read and verify a checkpoint (its JSON path, or the folder holding it: the newest there)."""
    json_path, named = Path(json_path), True
    if json_path.is_dir():
        found = latest(json_path)
        if found is None:
            raise CheckpointError(f"no checkpoint in {json_path}")
        json_path, named = found, False  # found in a folder: a file k3compile wrote, never a link
    where = f"checkpoint {json_path}"
    try:
        raw = safe_io.read_bytes(json_path, MAX_METADATA_BYTES, what="a checkpoint's metadata", follow=named)
    except safe_io.MissingFile:
        raise CheckpointError(f"{where} does not exist") from None
    except safe_io.FileError as e:
        raise CheckpointError(f"{where}: {e}") from None
    try:
        meta = safe_io.parse_json(raw, json_path.name)
    except safe_io.FileError as e:
        raise CheckpointError(f"{where} is corrupted (unreadable metadata: {e})") from None
    record = _verified_record(meta, json_path, where)
    tensor_path = json_path.with_name(record.tensors)
    try:  # at most the bytes the metadata records (+1 to tell a longer file), from a regular file beside it
        payload = safe_io.read_bytes(tensor_path, record.bytes + 1, what="its tensors", follow=False)
    except safe_io.FileError as e:
        raise CheckpointError(f"{where}: cannot read {tensor_path.name}: {e}") from None
    if len(payload) < record.bytes:
        have = f"{tensor_path.name} has {len(payload)} of {record.bytes} bytes"
        raise CheckpointError(f"{where} is truncated ({have})")
    if len(payload) > record.bytes:
        raise CheckpointError(f"{where} is corrupted ({tensor_path.name} is longer than its {record.bytes} bytes)")
    if zlib.crc32(payload) != record.crc32:
        raise CheckpointError(f"{where} is corrupted ({tensor_path.name} fails its CRC-32 check)")
    try:
        tensors = st_load(payload)
    except SafetensorError as e:
        raise CheckpointError(f"{where} is corrupted ({e})") from None
    return Checkpoint(json_path, record.step, tensors, meta)


def _verified_record(meta, json_path: Path, where: str) -> _Record:
    """The checkpoint JSON's own fields once its format, checksum, types and file names all check out."""
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt in OLD_FORMATS:
        raise CheckpointError(f"{where} is a {fmt} file (no metadata checksum); this k3compile reads {FORMAT} only")
    if fmt != FORMAT:
        raise CheckpointError(f"{where} is not a {FORMAT} file")
    if meta.get(_CHECKSUM) != metadata_checksum(meta):
        raise CheckpointError(f"{where}: its metadata fails its checksum (edited or corrupted)")
    try:
        record = _Record.model_validate(meta)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(map(str, err["loc"]))
        raise CheckpointError(f"{where} has bad metadata: {field}: {err['msg']}") from None
    name = Path(record.tensors)
    if name.name != record.tensors or record.tensors.startswith(".") or name.suffix != ".safetensors":
        raise CheckpointError(f"{where} has bad metadata: tensors: must name a file beside it (got {record.tensors!r})")
    m = _NAME.match(json_path.name)
    if m and int(m.group(1)) != record.step:
        raise CheckpointError(f"{where} records step {record.step} but is the file of step {int(m.group(1))}")
    return record


def check_finite(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint holding NaN or infinite values (weights, optimizer state): resuming would only diverge."""
    bad = next((k for k, t in ckpt.tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise CheckpointError(f"{ckpt.path} holds non-finite values in {bad}")


# ---------------------------------------------------------------- model and optimizer state


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _list(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def mismatches(expected: Mapping[str, tuple], found: Mapping[str, tuple]) -> str:
    """'' when both name->shape maps agree, else one line naming the missing, unexpected and reshaped tensors."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shaped = [f"{k} {list(found[k])} vs {list(v)}" for k, v in expected.items() if k in found and found[k] != v]
    parts = []
    if missing:
        parts.append(f"missing {_list(missing)}")
    if unexpected:
        parts.append(f"unexpected {_list(unexpected)}")
    if shaped:
        parts.append(f"shape (checkpoint vs model) {_list(shaped)}")
    return "; ".join(parts)


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer (persistent or not: router biases and statistics included) under 'model/'."""
    out = {f"{_MODEL}{k}": v for k, v in model.named_parameters()}
    out.update({f"{_MODEL}{k}": v for k, v in model.named_buffers()})
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The optimizer's per-parameter state, flattened to 'optim/<param name>/<key>' (tensors only)."""
    out = {}
    for name, p in names:
        for key, value in optimizer.state.get(p, {}).items():
            if not isinstance(value, Tensor):
                raise CheckpointError(f"optimizer state {name}/{key} is not a tensor")
            out[f"{_OPTIM}{name}/{key}"] = value
    return out


def check_model(model: nn.Module, ckpt: Checkpoint) -> None:
    """Fail, naming every tensor that differs, unless the checkpoint has exactly the model's tensors and shapes."""
    tensors = model_tensors(model)
    live = {k: tuple(v.shape) for k, v in tensors.items()}
    found = {k: tuple(v.shape) for k, v in ckpt.tensors.items() if k.startswith(_MODEL)}
    problem = mismatches(live, found)
    retyped = [f"{k} {ckpt.tensors[k].dtype} vs {t.dtype}" for k, t in tensors.items()
               if k in ckpt.tensors and ckpt.tensors[k].dtype != t.dtype]  # copying would cast them silently
    if retyped and not problem:
        problem = f"dtype (checkpoint vs model) {_list(retyped)}"
    if problem:
        spec = ckpt.meta.get("spec_name", "?")
        raise CheckpointError(f"{ckpt.path} (spec {spec!r}) does not match this model: {problem.replace(_MODEL, '')}")


@torch.no_grad()
def restore_model(model: nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's weights and buffers into `model` (after `check_model`)."""
    check_model(model, ckpt)
    for key, t in model_tensors(model).items():
        t.copy_(ckpt.tensors[key])


def restore_optimizer(optimizer: PerHeadMuon, names: list[tuple[str, Tensor]], ckpt: Checkpoint) -> None:
    """Replace the optimizer's per-parameter state by the checkpoint's ('optim/<param name>/<slot>' tensors).

    Every slot is checked first against what the optimizer keeps (PerHeadMuon.state_layout: names, shapes,
    all slots of a parameter or none), so a bad state fails here in one line rather than at the first step.
    """
    params = dict(names)
    state: dict[Tensor, dict[str, Tensor]] = {}
    unknown, bad = [], []
    for key, value in ckpt.tensors.items():
        if not key.startswith(_OPTIM):
            continue
        name, _, slot = key[len(_OPTIM) :].rpartition("/")
        if name not in params:
            unknown.append(name)
            continue
        want = optimizer.state_layout(params[name]).get(slot)
        retyped = bool(want) and value.dtype != params[name].dtype  # a moment or momentum: the parameter's dtype
        if want is None or tuple(value.shape) != want or not value.is_floating_point() or retyped:
            dtype = f" and dtype {params[name].dtype}" if want else ""
            expected = "no such state" if want is None else f"expected a float tensor of shape {list(want)}{dtype}"
            bad.append(f"{name}/{slot} {list(value.shape)} ({expected})")
            continue
        # AdamW's step counter stays on the host, as in torch.optim (reading it then waits for no device)
        device = "cpu" if slot == "step" else params[name].device
        state.setdefault(params[name], {})[slot] = value.clone().to(device)
    if unknown:
        names = _list(sorted(set(unknown)))
        raise CheckpointError(f"{ckpt.path} holds optimizer state for unknown parameters: {names}")
    names_of = {id(p): n for n, p in params.items()}
    bad += [f"{names_of[id(p)]} (only {', '.join(sorted(s))})" for p, s in state.items()
            if set(s) != set(optimizer.state_layout(p))]  # fmt: skip
    if bad:
        raise CheckpointError(f"{ckpt.path} holds optimizer state this optimizer cannot use: {_list(bad, 3)}")
    optimizer.state.clear()
    optimizer.state.update(state)
