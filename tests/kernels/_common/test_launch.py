"""Launch configurations as data: bucket choice, the tuner's forcing and recording, the shipped tables."""

from __future__ import annotations

import importlib

import pytest
import torch

from k3compile.kernels._common import launch
from k3compile.kernels.binding import TRITON_KERNELS

BUCKETS = [
    {"max": {"N": 128}, "config": {"BLOCK": 128, "num_warps": 2}},
    {"max": {"N": 4096, "M": 64}, "config": {"BLOCK": 1024}},
    {"config": {"BLOCK": 4096, "num_warps": 8}},
]


def test_first_bucket_whose_bounds_hold_wins():
    assert launch.pick(BUCKETS, {"N": 100, "M": 10**6}) == {"BLOCK": 128, "num_warps": 2}
    assert launch.pick(BUCKETS, {"N": 129, "M": 64}) == {"BLOCK": 1024}
    assert launch.pick(BUCKETS, {"N": 129, "M": 65}) == {"BLOCK": 4096, "num_warps": 8}  # the catch-all
    assert launch.pick(BUCKETS[:2], {"N": 10**6}) == {}


def test_launch_config_overlays_the_table_then_forcing(monkeypatch):
    monkeypatch.setattr(launch, "configs", lambda target: {"k": BUCKETS} if target == "cpu" else {})
    defaults = {"BLOCK": 64, "num_warps": 4, "num_stages": 2}
    assert launch.launch_config("k", "cpu", defaults, N=100) == {"BLOCK": 128, "num_warps": 2, "num_stages": 2}
    assert launch.launch_config("other", "cpu", defaults, N=100) == defaults
    with launch.recording() as seen, launch.forcing("k", {"num_stages": 4}):
        assert launch.launch_config("k", "cpu", defaults, N=100) == {"BLOCK": 64, "num_warps": 4, "num_stages": 4}
    assert seen == [("k", {"N": 100}, None, defaults)]
    assert launch.launch_config("k", "cpu", defaults, N=100)["BLOCK"] == 128  # forcing ended with the block


OPEN = [  # tuned at M = 4096 and M = 512 for bf16, at M = 512 for fp32: largest first, the smallest open below
    {"dtype": "bf16", "min": {"M": 4096}, "config": {"BLOCK": 256}},
    {"dtype": "bf16", "config": {"BLOCK": 128}},
    {"dtype": "fp32", "config": {"BLOCK": 32}},
]


def test_open_ended_buckets_by_dtype():
    bf, f32 = torch.bfloat16, torch.float32
    assert launch.pick(OPEN, {"M": 10**6}, bf) == {"BLOCK": 256}  # above the largest tuned size: still tuned
    assert launch.pick(OPEN, {"M": 4096}, bf) == {"BLOCK": 256}
    assert launch.pick(OPEN, {"M": 4095}, bf) == {"BLOCK": 128}  # up to the next tuned size
    assert launch.pick(OPEN, {"M": 1}, bf) == {"BLOCK": 128}  # below the smallest
    assert launch.pick(OPEN, {"M": 10**6}, f32) == launch.pick(OPEN, {"M": 1}, "fp32") == {"BLOCK": 32}
    assert launch.pick(OPEN, {"M": 1}, torch.float16) == {}  # no fp16 bucket: the defaults
    assert launch.pick(OPEN, {"M": 10**6}) == {"BLOCK": 256}  # a call naming no dtype matches any


def test_planning_a_target_and_fitting_shared_memory():
    assert launch.shared_limit("cpu") is None and launch.capability("cpu") == 0
    with launch.planning("a100"):
        assert launch.device_target("meta") == "a100" and launch.sm_count("cpu") == 108
        assert launch.shared_limit("meta") == 163 * 1024 and launch.capability("meta") == 80
    assert launch.device_target("meta") == "cpu"
    # 128 x 128 x 64 fp32, two operand pairs: 128 KiB a stage
    assert launch.gemm_shared(128, 128, 64, 3, 4, 4, pairs=2) == 3 * 2 * 64 * (128 * 4 + 128 * 4)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 4}

    def need(c):
        return launch.gemm_shared(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], 4, 4, pairs=2)

    fitted = launch.fit_shared(cfg, 227 * 1024, need)
    assert fitted == {**cfg, "num_stages": 2, "BLOCK_K": 32} and need(fitted) <= 227 * 1024
    assert launch.fit_shared(cfg, None, need) == cfg
    with pytest.raises(ValueError, match="unknown GPU target"):
        with launch.planning("cpu"):
            pass


def test_device_targets_and_unknown_target():
    assert launch.device_target("cpu") == "cpu" and launch.device_target("meta") == "cpu"
    assert launch.sm_count("cpu") == 1
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        launch.module_configs("tpu")


@pytest.mark.parametrize("target", launch.TARGETS)
def test_shipped_tables_name_tunable_kernels_of_bound_modules(target):
    modules = {path.rpartition(".")[0] for path in TRITON_KERNELS.values()}
    for module, kernels in launch.module_configs(target).items():
        assert module in modules, module
        tunable = importlib.import_module(f"k3compile.kernels.{module}").TUNABLE
        for kernel, buckets in kernels.items():
            assert kernel in tunable, (module, kernel)
            for bucket in buckets:
                assert set(bucket) <= {"max", "config"} and bucket["config"], (kernel, bucket)
                assert set(bucket["config"]) <= set(tunable[kernel]) | {"num_warps", "num_stages"}, (kernel, bucket)
