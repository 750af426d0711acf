"""Checkpoints: round trip, commit order, disk full, truncation and corruption, mismatch messages, optimizer state."""

import errno
import json

import pytest
import torch
from torch import nn

from k3compile import safe_io
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime.muon import PerHeadMuon


class Net(nn.Module):
    def __init__(self, width: int = 8, extra: bool = False):
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("bias", torch.arange(4.0))
        self.register_buffer("load", torch.zeros(4, dtype=torch.int64), persistent=False)
        if extra:
            self.more = nn.Linear(width, 2)


def _state(model: nn.Module, value: float = 0.0) -> dict:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return ckpt.model_tensors(model)


def test_round_trip_keeps_every_tensor_and_the_metadata(tmp_path):
    model = Net()
    torch.manual_seed(0)
    model.load.fill_(3)
    tensors = {**ckpt.model_tensors(model), "rng/torch": torch.get_rng_state()}
    path = ckpt.save(tmp_path, 7, tensors, {"spec_name": "net", "data": {"bytes": 10}})
    assert path.name == "step-000007.json" and ckpt.committed(tmp_path) == [7]
    loaded = ckpt.load(tmp_path)  # a folder means its newest checkpoint
    assert loaded.step == 7 and loaded.meta["spec_name"] == "net" and loaded.meta["data"] == {"bytes": 10}
    assert set(loaded.tensors) == set(tensors)
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors.items())
    other = Net()
    ckpt.restore_model(other, loaded)
    assert torch.equal(other.proj.weight, model.proj.weight) and torch.equal(other.load, model.load)


def test_a_new_checkpoint_replaces_the_previous_only_once_committed(tmp_path):
    model = Net()
    ckpt.save(tmp_path, 1, _state(model, 1.0), {})
    ckpt.save(tmp_path, 2, _state(model, 2.0), {})
    assert ckpt.committed(tmp_path) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002.json", "step-000002.safetensors"]
    # a tensor file without its JSON (a crash between the two writes) is not a checkpoint
    ckpt.paths(tmp_path, 3)[0].write_bytes(b"partial")
    assert ckpt.latest(tmp_path).name == "step-000002.json"
    # saving a step that is already committed keeps it as it is
    ckpt.save(tmp_path, 2, _state(model, 5.0), {})
    assert float(ckpt.load(tmp_path).tensors["model/proj.weight"][0, 0]) == 2.0


@pytest.mark.parametrize("fail_on", [1, 2])  # the tensor file's write, or the JSON's
def test_disk_full_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, fail_on):
    model = Net()
    ckpt.save(tmp_path, 1, _state(model, 1.0), {})
    before = sorted(p.name for p in tmp_path.iterdir())
    real, calls = safe_io._write_all, []

    def full(fd, data):
        calls.append(fd)
        if len(calls) == fail_on:
            real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(safe_io, "_write_all", full)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(tmp_path, 2, _state(model, 2.0), {})
    message = str(e.value)
    assert "\n" not in message and "No space left on device" in message and "step-000001 is intact" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary or half-written files
    assert float(ckpt.load(tmp_path).tensors["model/proj.weight"][0, 0]) == 1.0


def test_truncated_and_corrupted_checkpoints_fail_in_one_line(tmp_path):
    path = ckpt.save(tmp_path, 4, _state(Net(), 1.0), {})
    tensor_file = ckpt.paths(tmp_path, 4)[0]
    data = tensor_file.read_bytes()

    def error() -> str:
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    tensor_file.write_bytes(data[:-10])
    assert "truncated" in error()
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    tensor_file.write_bytes(bytes(flipped))
    assert "corrupted" in error() and "CRC" in error()
    tensor_file.write_bytes(data)
    path.write_text(path.read_text()[:20])
    assert "corrupted" in error()
    path.write_text(json.dumps({"format": "something else"}))
    assert "not a k3compile-checkpoint" in error()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
        ckpt.load(tmp_path / "empty")


def test_a_checkpoint_of_another_model_names_the_mismatching_tensors(tmp_path):
    ckpt.save(tmp_path, 1, ckpt.model_tensors(Net(width=8, extra=True)), {"spec_name": "big"})
    loaded = ckpt.load(tmp_path)
    model = Net(width=6)
    model.register_buffer("qb_bias", torch.zeros(4), persistent=False)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore_model(model, loaded)
    message = str(e.value)
    assert "\n" not in message and "spec 'big'" in message
    assert "missing qb_bias" in message
    unexpected = message.split("unexpected ")[1].split(";")[0]
    assert sorted(unexpected.split(", ")) == ["more.bias", "more.weight"]
    assert "proj.weight [8, 8] vs [6, 6]" in message
    assert torch.equal(model.bias, torch.arange(4.0))  # nothing was copied


def test_mismatches_lists_are_capped():
    expected = {f"w{i}": (1,) for i in range(10)}
    assert ckpt.mismatches(expected, dict(expected)) == ""
    assert ckpt.mismatches(expected, {}) == "missing w0, w1, w2, w3, w4, w5 (+4 more)"


def test_optimizer_state_round_trip_continues_identically(tmp_path):
    def make():
        torch.manual_seed(0)
        model = Net()
        named = list(model.named_parameters())
        return model, named, PerHeadMuon.from_named_parameters(named, head_splits={"proj.weight": 2}, lr=0.01)

    def step(model, opt, seed):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        model.norm(model.proj(x)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    a, a_named, a_opt = make()
    for s in range(2):
        step(a, a_opt, s)
    ckpt.save(tmp_path, 2, {**ckpt.model_tensors(a), **ckpt.optimizer_tensors(a_opt, a_named)}, {})
    b, b_named, b_opt = make()
    loaded = ckpt.load(tmp_path)
    ckpt.restore_model(b, loaded)
    ckpt.restore_optimizer(b_opt, b_named, loaded)
    assert set(loaded.tensors) >= {"optim/proj.weight/momentum_buffer", "optim/norm.weight/exp_avg_sq"}
    for m, opt in ((a, a_opt), (b, b_opt)):
        step(m, opt, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    b_named.pop()
    with pytest.raises(ckpt.CheckpointError, match="unknown parameters: norm.bias"):
        ckpt.restore_optimizer(b_opt, b_named, loaded)


def test_restored_optimizer_state_follows_its_parameters_but_adamw_steps_stay_on_the_host(tmp_path):
    """Moments go where their parameter lives (here the meta device stands in for a GPU); AdamW's step counters stay
    CPU tensors, as torch.optim keeps them, so reading one never waits for a device."""
    model = Net()
    named = list(model.named_parameters())
    opt = PerHeadMuon.from_named_parameters(named, lr=0.01)
    model.norm(model.proj(torch.randn(3, 8))).sum().backward()
    opt.step()
    ckpt.save(tmp_path, 1, {**ckpt.model_tensors(model), **ckpt.optimizer_tensors(opt, named)}, {})
    with torch.device("meta"):
        far = Net()
    far_named = list(far.named_parameters())
    far_opt = PerHeadMuon.from_named_parameters(far_named, lr=0.01)
    ckpt.restore_optimizer(far_opt, far_named, ckpt.load(tmp_path))
    slots = {slot: t.device.type for state in far_opt.state.values() for slot, t in state.items()}
    assert slots == {"momentum_buffer": "meta", "step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}


# ---------------------------------------------------------------- the metadata: checksummed, then type-checked


def _error(path) -> str:
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_edited_metadata_file_fails_its_checksum(tmp_path):
    """`step` changed from 8 to 5 (valid JSON, valid types) was accepted: the checksum covers every field."""
    path = ckpt.save(tmp_path, 8, _state(Net(), 1.0), {"spec_name": "net"})
    record = json.loads(path.read_text())
    record["step"] = 5
    path.write_text(json.dumps(record))
    assert "metadata fails its checksum (edited or corrupted)" in _error(path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("step", "8", "step: Input should be a valid integer"),
        ("step", None, "step: Input should be a valid integer"),
        ("step", True, "step: Input should be a valid integer"),
        ("step", 5, "records step 5 but is the file of step 8"),
        ("tensors", "../other/step-000008.safetensors", "tensors: must name a file beside it"),
        ("tensors", "sub/step-000008.safetensors", "tensors: must name a file beside it"),
        ("bytes", -1, "bytes: Input should be greater than or equal to 0"),
        ("crc32", 1.5, "crc32: Input should be a valid integer"),
    ],
)
def test_metadata_fields_are_type_checked_even_with_a_valid_checksum(tmp_path, field, value, message):
    path = ckpt.save(tmp_path, 8, _state(Net(), 1.0), {})
    record = json.loads(path.read_text())
    record[field] = value
    path.write_text(json.dumps(ckpt.sealed(record)))
    assert message in _error(path)
    del record[field]
    path.write_text(json.dumps(ckpt.sealed(record)))
    assert f"{field}: Field required" in _error(path)


def test_an_older_format_is_named(tmp_path):
    path = ckpt.save(tmp_path, 1, _state(Net(), 1.0), {})
    record = json.loads(path.read_text())
    record["format"] = "k3compile-checkpoint/1"
    path.write_text(json.dumps(record))
    assert "is a k3compile-checkpoint/1 file (no metadata checksum)" in _error(path)


def test_non_finite_tensors_are_named(tmp_path):
    tensors = _state(Net(), 1.0)
    tensors["model/norm.weight"] = torch.tensor([1.0, float("nan")] * 4)
    with pytest.raises(ckpt.CheckpointError, match=r"holds non-finite values in model/norm.weight"):
        ckpt.check_finite(ckpt.load(ckpt.save(tmp_path, 1, tensors, {})))
