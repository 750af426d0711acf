"""Shard folders: bounded output shards, each source tensor read once, every shard closed, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from k3compile.runtime.shards import ShardError, ShardReader, ShardWriter


def test_writer_keeps_at_most_one_shard_pending(tmp_path):
    limit = 1000
    writer = ShardWriter(tmp_path, "w", limit, {"format": "pt"})
    most = 0
    sizes = [100, 600, 500, 2000, 10, 990, 20]  # bytes (uint8 tensors); 2000 is alone in its shard
    for i, n in enumerate(sizes):
        writer.add(f"t{i}", torch.full((n,), i, dtype=torch.uint8))
        most = max(most, writer.pending_bytes)
    files = writer.close()
    assert most <= limit + max(sizes)
    index = json.loads((tmp_path / "w.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes)
    reader = ShardReader(tmp_path, "w")
    by_shard: dict[str, int] = {}
    for name in reader.names:
        by_shard[reader.shard[name]] = by_shard.get(reader.shard[name], 0) + reader.shape[name][0]
    assert all(b <= limit or b == 2000 for b in by_shard.values())
    assert len(files) == len(by_shard) + 1  # the shards and the index
    assert all(torch.equal(reader.get(f"t{i}"), torch.full((n,), i, dtype=torch.uint8)) for i, n in enumerate(sizes))


def test_one_shard_is_a_single_file(tmp_path):
    writer = ShardWriter(tmp_path, "w", 10**6, {"format": "pt"})
    writer.add("x", torch.ones(3))
    assert [p.name for p in writer.close()] == ["w.safetensors"]
    assert ShardReader(tmp_path, "w").metadata == {"format": "pt"}


def test_conversion_reads_each_tensor_once_and_closes_every_shard(hf_model, tmp_path, monkeypatch, k3):
    reads: list[str] = []
    open_at_most = [0]
    original = ShardReader.get

    def counting(self, name):
        reads.append(name)
        out = original(self, name)
        open_at_most[0] = max(open_at_most[0], len(self._handles))
        return out

    closed = []
    monkeypatch.setattr(ShardReader, "get", counting)
    monkeypatch.setattr(ShardReader, "close", lambda self: closed.append(dict(self._handles)))
    assert k3("import-hf", hf_model[1], "-o", tmp_path / "out", "--max-shard-size", "100KB") == 0
    source = ShardReader(hf_model[1], "model")
    assert sorted(reads) == sorted(source.names)  # every tensor once, nothing else
    assert closed == [{}]  # each shard was released after its last tensor
    assert open_at_most[0] <= 3  # tensors are converted in shard order (a stacked expert may span two)


def test_truncated_shard_is_a_one_line_error(tmp_path):
    writer = ShardWriter(tmp_path, "w", 10**6, {})
    writer.add("x", torch.ones(1000))
    (path,) = writer.close()
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match="is not a readable safetensors file") as e:
        ShardReader(tmp_path, "w")
    assert "\n" not in str(e.value)
