"""Byte-level training data: a corpus read deterministically, a train/validation split, seeded random windows.

The default corpus is the Python standard library's own `.py` sources (present on every machine), read in
sorted path order up to a cap. Any file or folder of text files may be used instead. Tokens are bytes
(vocabulary 256), read once into one buffer that the uint8 token tensors share (the corpus is held
once, not copied or widened); the training batches are random windows drawn from a torch.Generator whose state is part
of a checkpoint, so a resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import codecs
import math
import os
import stat
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3compile import safe_io

VOCAB = 256  # byte-level tokens
DEFAULT_CORPUS_BYTES = 8 << 20  # the stdlib corpus is cut here (about 8 MB)
MAX_DATA_BYTES = 1 << 30  # user data beyond this is cut (held in memory once, as one uint8 buffer)
VAL_FRACTION = 0.05  # the last 5% of the bytes are held out
SNIFF_BYTES = 8192  # a file is text when its first bytes hold no NUL and decode as UTF-8
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """Unusable training data (missing, empty, not text, too short); one line."""


@dataclass(frozen=True)
class Corpus:
    """The bytes to train on and where they came from (`source` is shown to the user and checkpointed)."""

    data: bytearray  # writable, so that torch.frombuffer shares it instead of copying
    source: str
    files: int
    tokens: Tensor | None = None  # token ids (a tokenized file, memory-mapped, or tokenized text); None: the bytes


def stdlib_files() -> list[Path]:
    """The standard library's .py files in sorted relative-path order (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_STDLIB)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_text_file(path: Path) -> bool:
    """No NUL byte and valid UTF-8 in the first SNIFF_BYTES (a character cut by that limit is allowed)."""
    try:
        with os.fdopen(safe_io.open_regular(path), "rb") as f:
            head = f.read(SNIFF_BYTES)
    except (OSError, safe_io.FileError):
        return False
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def _text_files(folder: Path) -> list[Path]:
    """Text files under `folder` in sorted relative-path order, hidden files and folders skipped."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    files.sort(key=lambda p: p.relative_to(folder).as_posix())
    return [p for p in files if p.is_file() and is_text_file(p)]


def _read_capped(files: list[Path], cap: int) -> tuple[bytearray, int]:
    """Concatenate the files in order until `cap` bytes (the last one cut); returns (bytes, files used).

    The bytes go straight into one buffer sized from the files' sizes: no chunks joined, no second copy.
    """
    sizes = []
    for path in files:
        try:
            st = path.stat()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path} is not a regular file (a device, pipe or socket); give a text file or folder")
        sizes.append(st.st_size)
    buffer = bytearray(min(cap, sum(sizes)))
    view, size, used = memoryview(buffer), 0, 0
    for path, want in zip(files, sizes):
        if size >= len(buffer):
            break
        try:  # the bounded reader's open: a regular file still, not a FIFO or device swapped in since the stat
            with os.fdopen(safe_io.open_regular(path), "rb") as f:
                got = f.readinto(view[size : min(size + want, len(buffer))])
        except safe_io.FileError as e:
            raise DataError(f"{e}; give a text file or folder") from None
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        if got:
            size += got
            used += 1
    view.release()
    del buffer[size:]  # a file that shrank since its size was read
    return buffer, used


def load_corpus(path: str | Path | None = None, max_bytes: int | None = None) -> Corpus:
    """Read the corpus: None = the stdlib sources (cut at DEFAULT_CORPUS_BYTES); a file; or a folder's text files."""
    if path is None:
        data, used = _read_capped(stdlib_files(), max_bytes or DEFAULT_CORPUS_BYTES)
        source = f"python stdlib sources ({sysconfig.get_paths()['stdlib']})"
    else:
        path = Path(path)
        try:
            exists, folder = path.exists(), path.is_dir()
        except (OSError, ValueError) as e:  # a name too long, a NUL byte
            raise DataError(f"cannot read {safe_io.shown(path)}: {getattr(e, 'strerror', None) or e}") from None
        if not exists:
            raise DataError(f"no such file or folder: {path}")
        if folder:
            files = _text_files(path)
            if not files:
                raise DataError(f"{path} holds no text files")
        else:
            files = [path]
        data, used = _read_capped(files, max_bytes or MAX_DATA_BYTES)
        source = str(path)
    if not data:
        raise DataError(f"{source} is empty (0 bytes)")
    return Corpus(data, source, used)


TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")  # a .bin file's element type
MAX_TOKENIZER_BYTES = 256 << 20


def _mapped_ids(path: Path, dtype: str | None) -> "np.ndarray":
    """A flat token-id array memory-mapped from a `.npy` file or a raw `.bin` file of `dtype` (a regular file)."""
    import numpy as np

    try:
        os.close(safe_io.open_regular(path))  # a regular file, not a FIFO or device, before mapping it
    except safe_io.FileError as e:
        raise DataError(str(e)) from None
    try:
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        elif dtype is None:
            raise DataError(f"{path}: a .bin token file needs its element type (--data-dtype {'/'.join(TOKEN_DTYPES)})")
        else:
            ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except (ValueError, OSError) as e:
        raise DataError(f"cannot read token ids from {path}: {' '.join(str(e).split())}") from None
    if ids.ndim != 1 or ids.dtype.name not in TOKEN_DTYPES:
        raise DataError(f"{path} holds a {ids.dtype.name} array of shape {ids.shape}; token ids are a flat array of "
                        f"one of {', '.join(TOKEN_DTYPES)}")  # fmt: skip
    return ids


def load_tokens(path: str | Path, vocab_size: int, *, dtype: str | None = None, tokenizer: str | Path | None = None,
                max_bytes: int | None = None) -> Corpus:  # fmt: skip
    """Token ids to train on: a tokenized file (`.npy`, or `.bin` of `dtype`), or a text file or folder encoded with
    a `tokenizers` JSON (`tokenizer`: the file, or a folder holding tokenizer.json). Every id must be < vocab_size."""
    path = Path(path)
    if tokenizer is None:
        ids = _mapped_ids(path, dtype)
        if ids.size == 0:
            raise DataError(f"{path} holds no token ids")
        with warnings.catch_warnings():  # a read-only mapping: the token tensors are only ever read
            warnings.simplefilter("ignore", UserWarning)
            tokens, files = torch.from_numpy(ids), 1
        if ids.dtype.name in ("uint16", "uint32"):  # torch reads these by index only: ids checked through numpy
            top, low = int(ids.max()), 0
        else:
            top, low = int(tokens.max()), int(tokens.min())
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("--tokenizer needs the tokenizers package: pip install tokenizers") from None
        where = Path(tokenizer)
        where = where / "tokenizer.json" if where.is_dir() else where
        try:
            encoder = Tokenizer.from_str(safe_io.read_text(where, MAX_TOKENIZER_BYTES, what="a tokenizer"))
        except safe_io.FileError as e:
            raise DataError(str(e)) from None
        except Exception as e:  # the tokenizers library's parse error
            raise DataError(f"{where} is not a tokenizers JSON: {' '.join(str(e).split())[:200]}") from None
        text = load_corpus(path, max_bytes)
        ids = encoder.encode(text.data.decode("utf-8", "replace"), add_special_tokens=False).ids
        if not ids:
            raise DataError(f"{path} encodes to no tokens with {where}")
        tokens, files = torch.tensor(ids, dtype=torch.int64), text.files
        top, low = max(ids), min(ids)
    if low < 0 or top >= vocab_size:
        bad = low if low < 0 else top
        raise DataError(f"{path} holds token id {bad}, outside the model's vocabulary [0, {vocab_size})")
    source = f"{path} ({'tokenized by ' + str(tokenizer) if tokenizer is not None else 'token ids'})"
    return Corpus(bytearray(), source, files, tokens)


def split(data: bytes | bytearray | Tensor, seq_len: int, val_fraction: float = VAL_FRACTION) -> tuple[Tensor, Tensor]:
    """(train, validation) tensors: the last `val_fraction` of the bytes or token ids, at least one window, is held out.

    A bytearray (what load_corpus reads) is shared, not copied: the tensors are views of it.
    """
    need = 2 * (seq_len + 1)
    unit = "tokens" if isinstance(data, Tensor) else "bytes"
    if len(data) < need:
        raise DataError(
            f"data has {len(data)} {unit}; training at seq_len {seq_len} needs at least {need} "
            f"(one window for training and one for validation)"
        )
    n_val = max(math.ceil(len(data) * val_fraction), seq_len + 1)
    if isinstance(data, Tensor):  # token ids: views, in their stored dtype
        return data[: len(data) - n_val], data[len(data) - n_val :]
    tokens = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
    train = tokens[: len(data) - n_val]
    if bool((train == train[0]).all()):  # nothing to learn, and a unigram entropy of 0 to compare the loss with
        raise DataError(f"the training part of the data ({train.numel()} bytes) is one byte value ({int(train[0]):#04x}) "
                        "repeated; training needs at least two distinct bytes")
    return train, tokens[len(data) - n_val :]


def unigram_entropy(tokens: Tensor) -> float:
    """Entropy of the byte distribution in nats: the loss of the best model that ignores context."""
    if tokens.dtype in (torch.uint16, torch.uint32):  # torch counts these only widened
        tokens = tokens.long()
    counts = torch.bincount(tokens.flatten(), minlength=VOCAB).double()  # uint8 counted as is: never widened
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def windows(tokens: Tensor, starts: Tensor, seq_len: int) -> Tensor:
    """int64 [len(starts), seq_len] token windows beginning at `starts`."""
    return tokens[starts[:, None] + torch.arange(seq_len)].long()


class Batches:
    """Random (batch_size, seq_len) training windows from a seeded generator; `state()`/`load_state()` resume it."""

    def __init__(self, tokens: Tensor, batch_size: int, seq_len: int, seed: int):
        if tokens.numel() < seq_len + 1:
            raise DataError(f"training split has {tokens.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> Tensor:
        """The next batch of token windows, int64 [batch_size, seq_len]."""
        high = self.tokens.numel() - self.seq_len + 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        return windows(self.tokens, starts, self.seq_len)

    def state(self) -> Tensor:
        return self.generator.get_state()

    def load_state(self, state: Tensor) -> None:
        self.generator.set_state(state.to(torch.uint8))


def eval_batches(tokens: Tensor, batch_size: int, seq_len: int, max_batches: int) -> list[Tensor]:
    """Fixed validation batches: up to `max_batches` x `batch_size` non-overlapping windows spread evenly."""
    count = (tokens.numel() - 1) // seq_len
    take = min(count, batch_size * max_batches)
    starts = (torch.arange(take) * count // take) * seq_len
    return [windows(tokens, chunk, seq_len) for chunk in starts.split(batch_size)]
