"""Reading a distributed checkpoint (DCP) without running code from it.

torch's FileSystemReader unpickles `step-N.dcp/.metadata` with `pickle.load`, which calls whatever the file
names. `SafeReader` is that reader with its `read_metadata` replaced: the file is read through the bounded
reader (k3compile.safe_io) and unpickled by `MetadataUnpickler`, which admits only DCP's metadata classes,
torch.Size, torch's dtypes and layouts and plain containers; then every field is type-checked, and checked
against the tensors the caller will load (names, shapes, dtypes) and the shard files (plain names in the
folder, regular files, long enough for every slice the metadata names). Entries stored as pickled objects
(BytesStorageMetadata, which DCP's planner loads with `torch.load(weights_only=False)`) are not admitted: a
k3compile checkpoint holds tensors only. The tensor data itself is read by torch's reader, each slice with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)  # fmt: skip

from k3compile import safe_io
from k3compile.runtime.checkpoint import CheckpointError

METADATA = ".metadata"  # DCP's file name for the global metadata
MAX_METADATA_BYTES = 256 << 20  # one entry per tensor shard: megabytes for the largest models
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """What torch pickles a layout as (torch.serialization._get_layout): a layout by name, nothing else."""
    return _LAYOUTS[name]


_ADMITTED = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (Metadata, TensorStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta,
                _MEM_FORMAT_ENCODING, _StorageInfo)  # fmt: skip
}
_ADMITTED.update({("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): _layout,
                  ("pathlib", "PosixPath"): pathlib.PurePosixPath, ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
                  ("pathlib", "Path"): pathlib.PurePath})  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: a global outside DCP's metadata types (os.system, builtins.eval,
    a class whose constructor acts) is refused before it is looked up, so no code the file names can run.
    Paths (StorageMeta.checkpoint_id) come back as pure paths, which touch no file."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ADMITTED:
            return _ADMITTED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{safe_io.shown(module, 60)}.{safe_io.shown(name, 60)} is not DCP metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id is not DCP metadata")


def _sizes(value, rank: int | None = None) -> bool:
    """A torch.Size of non-negative extents (of `rank` dimensions when given)."""
    return type(value) is torch.Size and all(n >= 0 for n in value) and (rank is None or len(value) == rank)


def _check_structure(md, where: str) -> None:
    """Every field of unpickled metadata has the type DCP writes; one line naming the first that does not."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: its {METADATA} is not a k3compile distributed checkpoint's ({what})")

    if type(md) is not Metadata or type(md.state_dict_metadata) is not dict:
        raise bad("not DCP metadata")
    for fqn, entry in md.state_dict_metadata.items():
        if type(fqn) is not str or type(entry) is not TensorStorageMetadata:
            raise bad(f"entry {safe_io.shown(fqn, 80, quote=True)} is not a tensor")
        p = entry.properties
        if type(p) is not TensorProperties or type(p.dtype) is not torch.dtype or not _sizes(entry.size):
            raise bad(f"{fqn}: properties or size")
        if type(entry.chunks) is not list or not all(
            type(c) is ChunkStorageMetadata and _sizes(c.offsets, len(entry.size)) and _sizes(c.sizes, len(entry.size))
            and all(o + n <= s for o, n, s in zip(c.offsets, c.sizes, entry.size)) for c in entry.chunks
        ):  # fmt: skip
            raise bad(f"{fqn}: chunks")
    if type(md.storage_data) is not dict:
        raise bad("storage_data")
    for index, info in md.storage_data.items():
        if (type(index) is not MetadataIndex or type(index.fqn) is not str
                or not (index.offset is None or _sizes(index.offset)) or type(info) is not _StorageInfo
                or type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0
                or info.transform_descriptors):  # fmt: skip
            raise bad("storage_data entry")
        name = info.relative_path
        if type(name) is not str or not name or name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
            raise bad(f"shard file {safe_io.shown(name, 80, quote=True)} is not a file name in the folder")
    if md.version is not None and type(md.version) is not str:
        raise bad("version")


def _check_against(md: Metadata, folder: Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   where: str) -> None:  # fmt: skip
    """The tensors the caller loads are in the metadata with their shapes and dtypes, every chunk of them has its
    storage entry, and every shard file read is a regular file in the folder holding the slices named."""
    missing = [k for k in expected if k not in md.state_dict_metadata]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where} does not match this model: missing {missing[0]}{more}")
    needed: dict[str, int] = {}
    for key, (shape, dtype) in expected.items():
        entry = md.state_dict_metadata[key]
        if tuple(entry.size) != tuple(shape) or entry.properties.dtype != dtype:
            raise CheckpointError(f"{where} does not match this model: {key} is {entry.properties.dtype} "
                                  f"{list(entry.size)} there, {dtype} {list(shape)} here")  # fmt: skip
        for chunk in entry.chunks:
            info = md.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{where}: its {METADATA} names no shard for a chunk of {key}")
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in needed.items():
        try:
            st = os.lstat(folder / name)
        except OSError as e:
            raise CheckpointError(f"{where}: cannot read its shard {name}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: its shard {name} is not a regular file (a link, device or pipe)")
        if st.st_size < end:
            raise CheckpointError(f"{where} is truncated ({name} has {st.st_size} of at least {end} bytes)")


def read_metadata(folder: Path) -> Metadata:
    """The DCP metadata of the checkpoint `folder`, unpickled by MetadataUnpickler and type-checked."""
    folder = Path(folder)
    where = f"checkpoint {folder}"
    try:
        raw = safe_io.read_bytes(folder / METADATA, MAX_METADATA_BYTES, what="DCP metadata", follow=False)
    except safe_io.FileError as e:
        raise CheckpointError(f"{where}: {e}") from None
    try:
        md = MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # only admitted constructors ran: any failure is a corrupted or hostile file
        raise CheckpointError(f"{where}: its {METADATA} is refused ({type(e).__name__}: "
                              f"{safe_io.shown(' '.join(str(e).split()), 120)})") from None  # fmt: skip
    _check_structure(md, where)
    md.planner_data, md.storage_meta = None, None  # neither is used to load; nothing of the file's is kept there
    return md


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, its metadata read by `read_metadata` (never by pickle.load) and checked against
    `expected` (name -> (shape, dtype) of every tensor the caller loads) before DCP plans any read."""

    def __init__(self, folder: str | Path, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        super().__init__(folder)
        self.folder, self.expected = Path(folder), expected
        self._metadata: Metadata | None = None

    def verified_metadata(self) -> Metadata:
        """The checkpoint's metadata once checked (read once); a CheckpointError in one line otherwise."""
        if self._metadata is None:
            md = read_metadata(self.folder)
            _check_against(md, self.folder, self.expected, f"checkpoint {self.folder}")
            self._metadata = md
        return self._metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:  # a rank-local `rank=` is not looked for: one file
        md = self.verified_metadata()
        md.storage_meta = StorageMeta(load_id=self.load_id)
        return md


def expected_tensors(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (whole shape, dtype) of a state dict about to be loaded (a DTensor's shape is the whole tensor's)."""
    return {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
