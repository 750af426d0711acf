"""bench/gpu.py, bench/tune_gpu.py and bench/gpu_e2e.py run end to end on CPU with --dry-run (Triton interpreter,
tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, env=env, timeout=540
    )


def test_gpu_bench_dry_run_checks_every_kernel_and_prints_the_table(tmp_path):
    md = tmp_path / "table.md"
    done = run("gpu.py", "--dry-run", "--markdown", str(md))
    assert done.returncode == 0, done.stderr[-3000:]
    for column in ("kernel", "max err", "triton ms", "TFLOP/s", "GB/s", "% bf16 peak", "% HBM", "% roofline", "x eager",
                   "x compile"):
        assert column in done.stdout, column
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ") and "max err" not in line]
    names = " ".join(line.split("|")[1] for line in rows)
    for kernel in ("kda", "mx_linear", "expert_glu", "rms_norm", "attn_res", "route", "mla_decode", "short_conv"):
        assert kernel in names, kernel
    assert all("| yes |" in line for line in rows), rows


def test_gpu_bench_times_torch_compile_of_the_reference():
    done = run("gpu.py", "--dry-run", "--compile", "--only", "swiglu 8x100")
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("│ swiglu 8x100")]
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[0] == "swiglu 8x100 bf16" and cells[2] == "yes"
    assert float(cells[-2]) > 0 and float(cells[-1]) > 0  # compile ms, speed-up over it


def test_tuner_dry_run_writes_a_config_file_the_kernels_read(tmp_path):
    (tmp_path / "cpu.json").write_text(json.dumps({"norms.triton": {"rms_norm": [
        {"dtype": "fp32", "config": {"BLOCK_M": 2}}, {"dtype": "bf16", "max": {"N": 1}, "config": {"BLOCK_M": 1}}]}}))
    done = run("tune_gpu.py", "--dry-run", "--only", "rms_norm 8x100", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("plan: ")
    table = json.loads((tmp_path / "cpu.json").read_text())
    assert set(table) == {"norms.triton"} and set(table["norms.triton"]) == {"rms_norm", "add_rms_norm"}
    for kernel, buckets in table["norms.triton"].items():
        # one tuned size per dtype: a single open-ended bf16 bucket; rms_norm's fp32 bucket is merged, kept
        assert [b for b in buckets if b.get("dtype") == "bf16"] == [
            {"dtype": "bf16", "config": buckets[-1]["config"]}], (kernel, buckets)
        assert buckets[-1]["config"] and "max" not in buckets[-1] and "min" not in buckets[-1]
    assert table["norms.triton"]["rms_norm"][0] == {"dtype": "fp32", "config": {"BLOCK_M": 2}}


def test_gpu_e2e_without_a_gpu_says_so_and_exits_0():
    done = run("gpu_e2e.py")
    assert done.returncode == 0 and "no CUDA GPU here" in done.stdout, done.stderr[-3000:]


@pytest.mark.slow
def test_gpu_e2e_dry_run_runs_every_section_and_prints_the_table(tmp_path):
    """Every section of the GPU half of issue 29 at toy sizes: builds, the cpu-vs-h200 comparisons (Triton kernels
    through the interpreter), the timed sections (the unbound graph), the K3 slice and a 1-step training run."""
    md = tmp_path / "e2e.md"
    done = run("gpu_e2e.py", "--dry-run", "--train-steps", "1", "--markdown", str(md))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = md.read_text()
    assert "FAILED" not in table and "| NO |" not in table, table
    for row in ("k3-tiny for h200", "loss, absolute difference", "largest gradient difference", "prefill logits",
                "greedy tokens", "k3-tiny training step", "batch 1, static buffers", "batch 1, eager",
                "k3-tiny prefill", "construct on cpu in bf16", "K3 slice train step", "final validation loss"):
        assert row in table, row


def test_tuner_plans_a_subset_and_rejects_configurations_over_shared_memory():
    # a case name, and a kernel name (the weight gradient of both expert backward cases)
    done = run("tune_gpu.py", "--dry-run", "--only", "rms_norm 8x100,expert_weight_grad", "--trials", "40", "--plan")
    assert done.returncode == 0, done.stderr[-3000:]
    plan = done.stdout.splitlines()
    rejected = int(plan[0].split("; ")[1].split(" candidates over 227 KiB")[0])
    assert rejected > 0  # e.g. 256 x 256 x 128 tiles in 5 stages
    kernels = [line.split(": ")[1].split()[0] for line in plan[1:]]
    assert sorted(kernels) == ["add_rms_norm", "expert_weight_grad", "expert_weight_grad", "rms_norm"]


def test_tuner_buckets_are_open_ended_and_merge_by_dtype():
    sys.path.insert(0, str(BENCH))
    import tune_gpu

    points = [({"B": 32, "S": 8192}, {"c": 1}), ({"B": 32, "S": 32768}, {"c": 3}), ({"B": 32, "S": 16384}, {"c": 2})]
    got = tune_gpu.buckets(points, "bf16")
    assert got == [{"dtype": "bf16", "min": {"S": 32768}, "config": {"c": 3}},
                   {"dtype": "bf16", "min": {"S": 16384}, "config": {"c": 2}},
                   {"dtype": "bf16", "config": {"c": 1}}]
    from k3compile.kernels._common.launch import pick

    assert pick(got, {"B": 1, "S": 10**6}, "bf16") == {"c": 3}  # larger than every tuned size
    assert pick(got, {"B": 32, "S": 20000}, "bf16") == {"c": 2} and pick(got, {"S": 5}, "bf16") == {"c": 1}
    same = tune_gpu.buckets([({"S": 1}, {"c": 1}), ({"S": 2}, {"c": 1})], None)
    assert same == [{"config": {"c": 1}}]
    table = {"m": {"k": [{"dtype": "fp32", "config": {"c": 9}}, {"dtype": "bf16", "config": {"c": 8}}]}}
    merged = tune_gpu.merge(table, {("m", "k", "bf16"): points})
    assert merged["m"]["k"][0] == {"dtype": "fp32", "config": {"c": 9}} and merged["m"]["k"][1:] == got
