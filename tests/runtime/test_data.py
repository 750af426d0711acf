"""Byte-level data: corpus reading (stdlib default, files, folders), the split, entropy, seeded resumable batches."""

import math
import subprocess
import sys

import pytest
import torch

from k3compile.runtime.data import (
    Batches,
    DataError,
    eval_batches,
    is_text_file,
    load_corpus,
    split,
    stdlib_files,
    unigram_entropy,
)


def test_stdlib_corpus_is_sorted_capped_and_deterministic():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    a, b = load_corpus(None, max_bytes=50_000), load_corpus(None, max_bytes=50_000)
    assert len(a.data) == 50_000 and a.data == b.data
    assert a.data.startswith(files[0].read_bytes()[:1000])
    assert "stdlib" in a.source


def test_folder_reads_text_files_in_path_order_and_skips_binary_and_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"second\n")
    (tmp_path / "a.txt").write_bytes("first é\n".encode())
    (tmp_path / "c.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / "d.lat1").write_bytes(b"caf\xe9")  # not UTF-8
    (tmp_path / ".hidden.txt").write_bytes(b"hidden")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_bytes(b"git")
    corpus = load_corpus(tmp_path)
    assert corpus.data == "first é\n".encode() + b"second\n"
    assert corpus.files == 2


def test_text_sniffing_allows_a_character_cut_at_the_sniff_boundary(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"a" * 8191 + "é".encode())  # the 2-byte character straddles byte 8192
    assert is_text_file(path)


@pytest.mark.parametrize("case", ["empty file", "no text", "missing"])
def test_unusable_data_is_one_clear_line(tmp_path, case):
    if case == "empty file":
        path = tmp_path / "empty.txt"
        path.write_bytes(b"")
    elif case == "no text":
        path = tmp_path / "bin"
        path.mkdir()
        (path / "x.bin").write_bytes(b"\x00" * 10)
    else:
        path = tmp_path / "nope"
    with pytest.raises(DataError) as e:
        load_corpus(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_split_holds_out_the_last_five_percent_and_refuses_short_data():
    data = bytes(range(256)) * 8  # 2048 bytes
    train, val = split(data, seq_len=16)
    assert val.numel() == math.ceil(2048 * 0.05) == 103
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
    train, val = split(data[:40], seq_len=16)  # 5% is 2 bytes: the split keeps one window (seq_len + 1)
    assert val.numel() == 17 and train.numel() == 23
    with pytest.raises(DataError, match="needs at least 34"):
        split(data[:33], seq_len=16)


def test_unigram_entropy_matches_hand_values():
    assert unigram_entropy(torch.tensor([7, 7, 7], dtype=torch.uint8)) == 0.0
    assert unigram_entropy(torch.tensor([1, 2, 1, 2], dtype=torch.uint8)) == pytest.approx(math.log(2))
    # p = (1/2, 1/4, 1/4): H = 1.5 bits
    h = unigram_entropy(torch.tensor([0, 0, 1, 2], dtype=torch.uint8))
    assert h / math.log(2) == pytest.approx(1.5)


def test_batches_are_windows_of_the_data_seeded_and_resumable():
    tokens = torch.arange(200, dtype=torch.uint8)
    a = Batches(tokens, batch_size=3, seq_len=10, seed=5)
    first = a.next()
    assert first.shape == (3, 10) and first.dtype == torch.int64
    assert torch.equal(first[:, 1:] - first[:, :-1], torch.ones(3, 9, dtype=torch.int64))  # contiguous windows
    state = a.state()
    expected = [a.next() for _ in range(3)]
    b = Batches(tokens, batch_size=3, seq_len=10, seed=5)
    assert torch.equal(b.next(), first)
    c = Batches(tokens, batch_size=3, seq_len=10, seed=999)
    c.load_state(state.clone())
    assert all(torch.equal(c.next(), e) for e in expected)


def test_batches_reach_the_last_window():
    tokens = torch.arange(12, dtype=torch.uint8)
    batches = Batches(tokens, batch_size=64, seq_len=10, seed=0)  # starts 0, 1 or 2
    starts = set(batches.next()[:, 0].tolist())
    assert starts == {0, 1, 2}


def test_eval_batches_are_fixed_non_overlapping_windows():
    tokens = torch.arange(100, dtype=torch.uint8)
    batches = eval_batches(tokens, batch_size=4, seq_len=10, max_batches=2)
    starts = torch.cat([b[:, 0] for b in batches]).tolist()
    assert [b.shape[0] for b in batches] == [4, 4]
    assert starts == sorted(set(starts)) and all(s % 10 == 0 and s + 10 <= 100 for s in starts)
    few = eval_batches(tokens[:25], batch_size=4, seq_len=10, max_batches=2)
    assert [b[:, 0].tolist() for b in few] == [[0, 10]]


PEAK_SCRIPT = """
import resource, sys, zlib
from k3compile.runtime.data import Batches, eval_batches, load_corpus, split, unigram_entropy

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, after the imports
corpus = load_corpus(sys.argv[1])
train, val = split(corpus.data, 64)
unigram_entropy(train)
zlib.crc32(corpus.data)
Batches(train, 8, 64, 0).next()
eval_batches(val, 8, 64, 4)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, len(corpus.data))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB (Linux)")
def test_the_data_path_holds_about_one_copy_of_the_corpus(tmp_path):
    """37 MB of text peaked at 750 MB (bytes joined, copied, widened to int64 for the entropy): now ~1x."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"def main(argv):\n    return len(argv) % 7\n" * 500_000)  # 20 MB
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown, size = map(int, proc.stdout.split())
    assert size == path.stat().st_size
    assert grown < 1.5 * size, f"peak memory grew by {grown / size:.1f}x the corpus"


def test_a_data_path_that_is_not_a_regular_file_is_refused():
    with pytest.raises(DataError, match="/dev/zero is not a regular file"):
        load_corpus("/dev/zero")
