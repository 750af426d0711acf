"""The run's device: a build for a GPU target runs on cuda:LOCAL_RANK, a CPU build on the CPU, and a GPU target on a
machine without a GPU is refused by every command (train, generate, ablate, the Python API) in one line."""

from __future__ import annotations

import pytest
import torch

import k3compile
from k3compile.runtime import device as device_rt
from k3compile.runtime.device import DeviceError, runtime_device, to_device
from k3compile.runtime.generate import GenerateError, load_inference_model
from k3compile.runtime.train import TrainError

from ..conftest import K3_TINY, TOY_K3


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("target", ["h200", "a100", "b200"])
def test_a_gpu_target_runs_on_the_local_ranks_gpu(monkeypatch, target):
    _gpus(monkeypatch, 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert runtime_device(target) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert runtime_device(target) == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(DeviceError, match="LOCAL_RANK is 4 but this machine has 4 GPU"):
        runtime_device(target)


def test_a_cpu_build_runs_on_the_cpu_even_beside_a_gpu(monkeypatch):
    _gpus(monkeypatch, 2)
    assert runtime_device("cpu") == torch.device("cpu")


def test_without_a_gpu_a_gpu_target_needs_the_interpreter(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime_device("h200") == torch.device("cpu")  # the Triton kernels run on CPU tensors, interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError) as e:
        runtime_device("h200", "spec 'x' targets h200", "set target: cpu")
    assert str(e.value).startswith("spec 'x' targets h200 (Triton kernels) and this machine has no GPU; set target: cpu")
    assert "\n" not in str(e.value)


def test_a_batch_already_on_its_device_is_not_copied():
    batch = torch.arange(6).view(2, 3)
    assert to_device(batch, torch.device("cpu")) is batch
    pair = (batch, batch + 1)
    assert all(a is b for a, b in zip(to_device(pair, torch.device("cpu")), pair))


def test_a_batch_for_another_device_is_copied_there_asynchronously(monkeypatch):
    """On CUDA a batch goes through pinned memory; elsewhere (here the meta device) it is a plain copy."""
    calls = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(k) or real_to(self, *a, **k))
    moved = to_device(torch.arange(6).view(2, 3), torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == (2, 3) and calls == [{"non_blocking": True}]


# ---------------------------------------------------------------- refusals, one line each, nothing written


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    """A toy k3-tiny built for h200 (both graphs, Triton kernels bound)."""
    from k3compile.build import BuildOptions, build
    from k3compile.spec.load import load_spec

    dest, _ = build(load_spec(K3_TINY, list(TOY_K3)), tmp_path_factory.mktemp("h200"), BuildOptions(target="h200"))
    return dest


@pytest.fixture
def no_gpu(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _one_line(rc: int, err: str, *expected: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert all(e in err for e in expected), err


def test_train_refuses_a_gpu_spec_without_a_gpu(no_gpu, cli, tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", K3_TINY, "--steps", "1", "--out", out, "--set", "target=h200")
    _one_line(rc, err, "spec 'k3-tiny' targets h200 (Triton kernels) and this machine has no GPU", "--set target=cpu")
    assert not out.exists()


def test_train_refuses_a_gpu_build_without_a_gpu(no_gpu, cli, gpu_build, tmp_path):
    out = tmp_path / "run"
    rc, _, err = cli("train", gpu_build, "--steps", "1", "--out", out)
    _one_line(rc, err, f"{gpu_build} was built for h200 (Triton kernels)", "rebuild it with --target cpu")
    assert not out.exists()


def test_generate_refuses_a_gpu_build_without_a_gpu(no_gpu, cli, gpu_build):
    rc, out, err = cli("generate", gpu_build, "--prompt", "def ", "--max-new-tokens", "2")
    _one_line(rc, err, f"{gpu_build} was built for h200 (Triton kernels) and this machine has no GPU")
    assert out == ""


def test_ablate_refuses_a_gpu_spec_without_a_gpu(no_gpu, cli, tmp_path):
    out = tmp_path / "study"
    rc, _, err = cli("ablate", K3_TINY, "--grid", "moe.top_k=2,4", "--steps", "1", "--out", out, "--set", "target=h200")
    _one_line(rc, err, "targets h200 (Triton kernels) and this machine has no GPU")
    assert not out.exists()


def test_the_python_api_refuses_in_one_line(no_gpu, gpu_build, tmp_path):
    with pytest.raises(TrainError, match="this machine has no GPU") as e:
        k3compile.train(K3_TINY, 1, out=tmp_path / "run", overrides=["target=h200"], progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()
    with pytest.raises(GenerateError, match="was built for h200 .* no GPU") as e:
        load_inference_model(gpu_build)
    assert "\n" not in str(e.value)


def test_a_torchrun_rank_beyond_the_gpus_is_one_line(monkeypatch, cli, gpu_build):
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_rt.local_rank() == 1
    rc, _, err = cli("generate", gpu_build, "--prompt", "x", "--max-new-tokens", "1")
    _one_line(rc, err, "LOCAL_RANK is 1 but this machine has 1 GPU")
