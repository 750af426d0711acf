"""What the GPU would run, checked on CPU: kernels/_common/sm_check.py compiles Triton kernels for sm_80 / sm_90a / sm_100a.

The expert-GEMM, MX-GEMM and MLA-decode kernels at bench/gpu.py's K3 shapes, with each target's launch
configuration, must fit its shared memory and, on Hopper, run their products on wgmma with at most 256 bytes of
register spills per thread. Compiling needs TRITON_INTERPRET off from the first import, so both tests run a
child process (the suite sets it on).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SPILL_BOUND = 256  # bytes per thread
TENSOR_CORE_KERNELS = {"_gemm_kernel", "_glu_kernel", "_mx_kernel", "_mla_decode_kernel"}


def _child(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


_PROBE = """
import json, triton, triton.language as tl
from k3compile.kernels._common import sm_check

@triton.jit
def mm(a, b, c, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(a + r[:, None] * BLOCK + r[None, :])
    y = tl.load(b + r[:, None] * BLOCK + r[None, :])
    tl.store(c + r[:, None] * BLOCK + r[None, :], tl.dot(x, y))

out = {}
for target in ("sm_80", "h200"):
    rep = sm_check.compile(mm, {"a": "*bf16", "b": "*bf16", "c": "*fp32"}, {"BLOCK": 64}, target, num_warps=4)
    out[target] = {k: rep[k] for k in ("arch", "shared", "registers", "spill_bytes", "wgmma", "mma")}
    out[target]["ttgir"] = "warp_group_dot" in rep.ttgir
print(json.dumps(out))
"""


def test_compile_reports_a_small_dot_per_architecture(tmp_path):
    script = tmp_path / "probe.py"  # @triton.jit needs its source in a file
    script.write_text(_PROBE)
    done = _child([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    hopper, ampere = out["h200"], out["sm_80"]
    assert hopper["arch"] == 90 and hopper["wgmma"] and hopper["ttgir"] and hopper["mma"]
    assert ampere["arch"] == 80 and not ampere["wgmma"] and ampere["mma"]  # mma.sync
    for rep in (hopper, ampere):
        assert 0 < rep["registers"] <= 255 and rep["spill_bytes"] == 0 and rep["shared"] > 0


@pytest.mark.slow
def test_bench_shapes_fit_every_target_and_use_wgmma_on_hopper(tmp_path):
    """About 90 s of compiling (cold cache) for the three targets."""
    out = tmp_path / "structure.json"
    done = _child([str(BENCH / "gpu_structure.py"), "--json", str(out)], timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["target"] for r in rows} == {"a100", "h200", "b200"}
    cases = {r["case"] for r in rows}
    for case in ("expert_glu", "expert_matmul", "mx_expert_glu", "mx_expert_matmul", "expert_glu_bwd",
                 "expert_matmul_bwd", "mx_linear", "mla_decode_absorbed S=32768", "short_conv_bwd"):
        assert case in cases, case
    for r in rows:
        where = (r["case"], r["target"], r["kernel"])
        assert r["shared"] <= r["shared_limit"], where
        if r["target"] == "h200":
            assert r["spill_bytes"] <= SPILL_BOUND, where
            if r["kernel"] in TENSOR_CORE_KERNELS:
                assert r["wgmma"], where
                if "decode" not in r["case"]:  # a K3-shaped GEMM keeps its tensor cores overlapped
                    assert not r["serialized"], where
