"""Launch configurations as data: bucket choice, the tuner's forcing and recording, the shipped tables."""

from __future__ import annotations

import importlib

import pytest

from k3compile.kernels import launch
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
    assert seen == [("k", {"N": 100})]
    assert launch.launch_config("k", "cpu", defaults, N=100)["BLOCK"] == 128  # forcing ended with the block


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
