"""`k3compile plan`: per-rank numbers of every dp x ep layout; where they overlap `stats`, they are equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3compile.analysis.memory import cache_bytes, weight_bytes
from k3compile.analysis.params import param_counts
from k3compile.analysis.plan import GPU_MEMORY, layouts, plan
from k3compile.analysis.stats import spec_stats
from k3compile.cli import main
from k3compile.spec.load import load_spec

K3 = Path(__file__).resolve().parents[2] / "specs" / "kimi-k3.yaml"


@pytest.fixture(scope="module")
def k3():
    return load_spec(K3)


@pytest.fixture(scope="module")
def k3_plan(k3):
    return plan(k3, 64, "h200")


def test_layouts_cover_every_divisor_of_the_experts(k3, k3_plan):
    eps = [r["ep"] for r in k3_plan["layouts"]]
    assert eps == [ep for ep in range(1, 65) if 64 % ep == 0 and k3.moe.num_experts % ep == 0]
    assert all(r["dp"] * r["ep"] == 64 for r in k3_plan["layouts"])
    assert layouts(k3, 6) == [(6 // ep, ep) for ep in (1, 2, 3, 6) if k3.moe.num_experts % ep == 0]


def test_numbers_shared_with_stats_are_equal(k3, k3_plan):
    counts = param_counts(k3)
    assert k3_plan["params"]["total"] == counts["total"]
    assert k3_plan["params"]["routed_experts"] == counts["by_component"]["routed_experts"]["total"]
    for r in k3_plan["layouts"]:
        st = spec_stats(load_spec(K3, [f"parallel.ep={r['ep']}"]), context=k3_plan["seq"], batch=1)
        assert r["routed_expert_bytes_per_rank"] == st["expert_parallel"]["routed_expert_bytes_per_rank"]
        assert r["experts_per_rank"] == st["expert_parallel"]["experts_per_rank"]
        assert r["serve_cache_bytes"] == st["cache_bytes"]["total"]  # one sequence per rank at 64 of 64
    one = next(r for r in k3_plan["layouts"] if r["ep"] == 1)
    assert one["serve_weight_bytes"] == weight_bytes(k3)["policy"]


def test_training_bytes_follow_the_layout(k3_plan):
    total, experts = k3_plan["params"]["total"], k3_plan["params"]["routed_experts"]
    for r in k3_plan["layouts"]:
        assert r["params_per_rank"] == -(-(experts // r["ep"]) // r["dp"]) + -(-(total - experts) // 64)
        assert r["param_bytes"] == r["grad_bytes"] == 4 * r["params_per_rank"]
        assert r["params_per_rank"] <= r["optimizer_bytes"] // 4 <= 2 * r["params_per_rank"]
        assert r["train_bytes"] == 2 * r["param_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
        assert r["train_bytes_gathered"] == r["train_bytes"] + 8 * (experts // r["ep"] + total - experts)
        assert r["train_fits"] == (r["train_bytes"] <= 0.9 * GPU_MEMORY["h200"])
        assert (r["all_to_all_bytes_per_step"] > 0) == (r["ep"] > 1)


def test_cache_scales_with_the_sequences_per_rank(k3):
    pl = plan(k3, 8, "b200", batch=32, seq=1024)
    for r in pl["layouts"]:
        assert r["serve_cache_bytes"] == cache_bytes(k3, 1024, 4)["total"]


def test_cli_prints_the_tables_and_json(capsys):
    assert main(["plan", str(K3), "--gpus", "64", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "64 x H200" in out and "1 x 64" in out and "serving, per rank" in out
    assert main(["plan", str(K3), "--gpus", "64", "--gpu", "h200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == 64 and len(doc["layouts"]) >= 2


def test_cli_rejects_an_unknown_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(K3), "--gpus", "64", "--gpu", "v100"])
    assert e.value.code == 2
