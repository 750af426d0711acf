"""`k3compile build specs/k3-tiny.yaml --target h200` binds Triton kernels, and they compute what the CPU build does.

The h200 package's k3 nodes carry backend="triton" wherever a kernel exists; run on CPU under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), its training loss and gradients for
one forward+backward step, and its inference logits, must match the CPU build's (PyTorch references) to 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

import k3compile
from k3compile.build import BuildOptions, build
from k3compile.kernels.binding import TRITON_KERNELS

SEQ = 21  # ragged against KDA's chunk of 64 and every block size


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).double().pow(2).mean() / b.double().pow(2).mean().clamp_min(1e-30)).sqrt().item()


@pytest.fixture(scope="module")
def packages(tmp_path_factory, tiny_spec):
    """{target: loaded package} for the CPU and H200 builds of k3-tiny."""
    out = {}
    for target in ("cpu", "h200"):
        path, _ = build(tiny_spec, tmp_path_factory.mktemp(target), BuildOptions(target=target))
        out[target] = (path, k3compile.load(path))
    return out


def bound_ops(path) -> dict[str, dict[str, str]]:
    """{mode: {k3 op: implementation}} from the package's manifest binding tables."""
    manifest = json.loads((path / "manifest.json").read_text())
    tables = manifest["binding_table"]
    return {mode: {row["op"]: row["impl"] for row in rows if row["op"].startswith("k3::")} for mode, rows in tables.items()}


def test_h200_binds_every_op_that_has_a_kernel(packages):
    path, _ = packages["h200"]
    for mode, ops in bound_ops(path).items():
        for op, impl in ops.items():
            name = op.removeprefix("k3::")
            expected = f"triton:{TRITON_KERNELS[name]}" if name in TRITON_KERNELS else "torch"
            assert impl == expected, (mode, op)
        triton = {op for op, impl in ops.items() if impl.startswith("triton")}
        assert {"k3::kda_chunk", "k3::attn_res", "k3::rms_norm", "k3::mx_fake_quantize" if mode == "train" else
                "k3::mx_expert_glu"} <= triton, mode
    source = (path / "model.py").read_text()
    assert "backend = 'triton'" in source
    cpu_source = (packages["cpu"][0] / "model.py").read_text()
    assert "backend = 'triton'" not in cpu_source


def test_h200_training_step_matches_the_cpu_build(packages):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(0))
    results = {}
    for target, (_, package) in packages.items():
        model = package.Model()  # seeded per-name init: both builds start from the same weights
        loss = model(tokens, tokens)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[target] = loss.detach(), grads
    (loss_cpu, g_cpu), (loss_h200, g_h200) = results["cpu"], results["h200"]
    print(f"loss cpu {loss_cpu.item():.6f} h200-on-interpreter {loss_h200.item():.6f}")
    assert abs(loss_h200.item() - loss_cpu.item()) <= 1e-4 * abs(loss_cpu.item())
    assert g_cpu.keys() == g_h200.keys() and len(g_cpu) > 50
    worst = max(g_cpu, key=lambda n: rel_rms(g_h200[n], g_cpu[n]))
    print(f"worst gradient: {worst} rel RMS {rel_rms(g_h200[worst], g_cpu[worst]):.2e}")
    assert rel_rms(g_h200[worst], g_cpu[worst]) <= 1e-4


def test_h200_inference_logits_match_the_cpu_build(packages):
    tokens = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    logits = {target: package.InferenceModel()(tokens) for target, (_, package) in packages.items()}
    err = rel_rms(logits["h200"], logits["cpu"])
    print(f"inference logits rel RMS {err:.2e}")
    assert err <= 1e-4
