"""Folders of safetensors shards, read lazily and written shard by shard; k3compile's weights folders.

A folder holds `<stem>.safetensors`, or shards `<stem>-00001-of-0000N.safetensors` listed by
`<stem>.safetensors.index.json` (`{"metadata": {...}, "weight_map": {tensor: shard}}`), the layout of
Hugging Face checkpoints (stem `model`) and of `k3compile import-hf` output (stem `weights`).

`ShardReader` reads every shard's header up front (names, shapes, dtypes) and a tensor's data only when
asked (with pread, so no shard is mapped into memory), so a converter holds one tensor at a time;
`release` closes a shard once it is done with.
`ShardWriter` keeps at most one shard of pending tensors (plus the one being added) before writing it.
Only safetensors is read or written: never pickle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from k3compile import safe_io

WEIGHTS = "weights"  # the stem of a k3compile weights folder (`k3compile import-hf` writes one)
FORMAT = "k3compile-weights/1"
DEFAULT_SHARD_BYTES = 5 * 10**9  # 5 GB, as Hugging Face's save_pretrained
MAX_INDEX_BYTES = 256 << 20  # an index lists every tensor once: megabytes for the largest checkpoints

# safetensors dtype codes, as safe_open reports them
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def permissions(mode: int) -> int:
    """`mode` under the process umask, as open() would create it."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


class ShardError(ValueError):
    """A shard folder that cannot be read or written; one line."""


def _read_index(path: Path, shown_as: Path) -> tuple[dict[str, str], dict]:
    """(weight_map, metadata) of a safetensors index, type-checked: tensor names to shard file names, and
    metadata of scalars."""
    try:
        doc = safe_io.read_json(path, MAX_INDEX_BYTES)
    except safe_io.FileError as e:
        raise ShardError(str(e)) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    metadata = (doc.get("metadata") if isinstance(doc, dict) else None) or {}
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ShardError(f"{shown_as} is not a safetensors index (weight_map must map tensor names to file names)")
    if not isinstance(metadata, dict) or not all(isinstance(v, (str, int, float, bool)) for v in metadata.values()):
        raise ShardError(f"{shown_as} is not a safetensors index (metadata must map names to strings or numbers)")
    return weight_map, dict(metadata)


def single_file(directory: Path, stem: str) -> Path:
    return Path(directory) / f"{stem}.safetensors"


def index_file(directory: Path, stem: str) -> Path:
    return Path(directory) / f"{stem}.safetensors.index.json"


def holds(directory: str | Path, stem: str) -> bool:
    """Whether `directory` holds a `stem` shard set (one file or an index)."""
    return single_file(directory, stem).is_file() or index_file(directory, stem).is_file()


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype ('F32', 'BF16', ...)."""
    return next(code for code, dt in DTYPES.items() if dt == dtype)


class ShardReader:
    """Names, shapes and dtypes of every tensor of a shard set, and each tensor's data on demand.

    The index is read through the bounded reader and type-checked; every shard it names must stay inside the
    folder (or `root`, for a Hugging Face hub cache snapshot whose files link into its `blobs/`) and be a
    regular file: a shard map never leads a read elsewhere.
    """

    def __init__(self, directory: str | Path, stem: str, root: str | Path | None = None):
        self.directory = Path(directory)
        self.root = root
        index = index_file(self.directory, stem)
        if index.is_file():
            weight_map, self.metadata = _read_index(self._path(index.name, str(self.directory)), index)
        elif single_file(self.directory, stem).is_file():
            weight_map, self.metadata = None, None
        else:
            raise ShardError(f"{self.directory} holds neither {index.name} nor {stem}.safetensors")
        files = sorted(set(weight_map.values())) if weight_map is not None else [f"{stem}.safetensors"]
        for f in files:
            self._path(f, str(index))
        missing = [f for f in files if not os.path.lexists(self.directory / f)]  # anything else: refused by _open
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ShardError(f"{self.directory}: shard {missing[0]}{more} listed in {index.name} is missing")
        self.shard: dict[str, str] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}  # safetensors codes: a dtype torch lacks is still reported by name
        for f in files:
            with self._open(f) as handle:
                if self.metadata is None:
                    self.metadata = dict(handle.metadata() or {})
                for name in handle.keys():
                    if weight_map is not None and weight_map.get(name) != f:
                        continue  # the index decides which shard a tensor is read from
                    view = handle.get_slice(name)
                    self.shard[name], self.shape[name], self.dtype[name] = f, tuple(view.get_shape()), view.get_dtype()
        if weight_map is not None:
            absent = sorted(n for n in weight_map if n not in self.shard)
            if absent:
                raise ShardError(f"{self.directory}: {absent[0]} is listed in {index.name} but absent from {weight_map[absent[0]]}")
        self._handles: dict[str, object] = {}

    def _path(self, name: str, source: str) -> Path:
        try:
            return safe_io.confined(self.directory, name, source=source, root=self.root)
        except safe_io.FileError as e:
            raise ShardError(str(e)) from None

    def _open(self, file: str):
        path = self.directory / file
        try:
            os.close(safe_io.open_regular(path))  # a FIFO or device would block or never end inside safetensors
            return safe_open(path, framework="pt", backend="pread")
        except (SafetensorError, OSError, safe_io.FileError) as e:
            raise ShardError(f"{path} is not a readable safetensors file ({safe_io.shown(str(e), 160)})") from None

    @property
    def names(self) -> list[str]:
        return list(self.shard)

    def get(self, name: str) -> Tensor:
        """The data of tensor `name` (its shard stays open until `release`)."""
        file = self.shard[name]
        if file not in self._handles:
            self._handles[file] = self._open(file).__enter__()
        try:
            return self._handles[file].get_tensor(name)
        except SafetensorError as e:
            raise ShardError(f"{self.directory / file}: cannot read {name} ({e})") from None

    def release(self, files: Iterable[str]) -> None:
        """Close shards no longer needed."""
        for file in files:
            handle = self._handles.pop(file, None)
            if handle is not None:
                handle.__exit__(None, None, None)

    def close(self) -> None:
        self.release(list(self._handles))


class ShardWriter:
    """Writes tensors into `directory` as `stem` shards of at most `max_shard_bytes` (a bigger tensor alone).

    `close()` names the shards `<stem>-0000i-of-0000N.safetensors` with an index, or `<stem>.safetensors`
    when one shard holds everything. `header` is every shard's safetensors metadata; `index_metadata` goes
    into the index with the total tensor bytes as `total_size`.
    """

    def __init__(self, directory: Path, stem: str, max_shard_bytes: int, header: dict[str, str],
                 index_metadata: dict[str, str | int] | None = None):  # fmt: skip
        if max_shard_bytes < 1:
            raise ShardError(f"the shard size must be at least 1 byte, got {max_shard_bytes}")
        self.directory, self.stem, self.max_bytes = Path(directory), stem, max_shard_bytes
        self.header, self.index_metadata = header, dict(index_metadata or {})
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.parts):
            raise ShardError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        tensor = tensor.detach().contiguous()
        if tensor.untyped_storage().nbytes() != nbytes:  # a view (a merged weight's rows): its own storage
            tensor = tensor.clone()
        self.pending[name] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        part = self.directory / f".{self.stem}-part-{len(self.parts) + 1:05d}.safetensors"
        save_file(self.pending, part, metadata=self.header)
        part.chmod(permissions(0o666))  # safetensors creates 0600 files; give the usual umask'd mode
        self.parts.append((part, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the shards, write the index when there are several; the files written."""
        if self.pending or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            path = single_file(self.directory, self.stem)
            self.parts[0][0].rename(path)
            return [path]
        n = len(self.parts)
        weight_map, written = {}, []
        for i, (part, names) in enumerate(self.parts, 1):
            path = self.directory / f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"
            part.rename(path)
            written.append(path)
            weight_map.update({name: path.name for name in names})
        index = {"metadata": {**self.index_metadata, "total_size": self.total_bytes}, "weight_map": weight_map}
        path = index_file(self.directory, self.stem)
        safe_io.write_text(path, json.dumps(index, indent=2) + "\n", mode=0o666)
        return [*written, path]


# ---------------------------------------------------------------- k3compile weights folders


def weights_header(spec_json: str, spec_name: str, model_class: str, extra: dict[str, str]) -> dict[str, str]:
    """The metadata a k3compile weights folder carries: which spec and which emitted class its names are for."""
    return {"format": "pt", "k3compile": FORMAT, "spec_name": spec_name, "spec": spec_json, "class": model_class,
            **extra}  # fmt: skip


def weights_class(path: str | Path | None) -> str | None:
    """'Model' or 'InferenceModel' for a k3compile weights folder (whose state_dict its tensors are), else None."""
    if path is None or not holds(path, WEIGHTS):
        return None
    return ShardReader(path, WEIGHTS).metadata.get("class")


def read_weights(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """(metadata with `spec` parsed, every tensor) of a k3compile weights folder."""
    reader = ShardReader(path, WEIGHTS)
    meta = dict(reader.metadata)
    if meta.get("k3compile") != FORMAT:
        raise ShardError(f"{path} is not a {FORMAT} folder (its metadata names no k3compile format)")
    spec = meta.get("spec")
    try:
        meta["spec"] = safe_io.parse_json(spec, "spec") if isinstance(spec, str) else None
    except safe_io.FileError:
        meta["spec"] = None
    if not isinstance(meta["spec"], dict):
        raise ShardError(f"{path}: the weights' metadata records no readable spec")
    try:
        return meta, {name: reader.get(name) for name in reader.names}
    finally:
        reader.close()
