"""`k3compile build specs/k3-tiny.yaml --target h200` binds Triton kernels, and they compute what the CPU build does.

The h200 package's k3 nodes carry backend="triton" wherever a kernel exists. The comparisons run k3-tiny cut to
its first four layers (KDA x 3 then MLA; the dense FFN then MoE: every layer kind), as the interpreter takes about
a second per layer and kernel launch. Run on CPU under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), its training loss and gradients for
one forward+backward step, and its inference logits (prefill, then decode steps through the decode graph's
kernels), must match the CPU build's (the PyTorch references).

One caveat is measured, not assumed. With QAT on (the shipped spec), activations pass through MXFP8
rounding, a step function: a 1e-7 difference upstream can move an element across a rounding boundary,
which changes it by a whole e4m3 step. The loss barely moves (1e-4 holds), but the gradients of the
last layers' experts differ at about 1e-3. With QAT off the same comparison holds every gradient to 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from k3compile.build import BuildOptions
from k3compile.kernels.binding import TRITON_KERNELS
from k3compile.kernels._common.compare import rel_rms

SEQ = 21  # ragged against KDA's chunk of 64 and every block size


def both(mode: str = "both") -> dict:
    """The CPU build over the PyTorch references (no C kernels) and the H200 build, by target."""
    return {target: BuildOptions(target=target, mode=mode, cpu_kernels="torch") for target in ("cpu", "h200")}


FOUR_LAYERS = ["num_layers=4"]  # KKKM: every layer kind, half the interpreter's time


@pytest.fixture(scope="module")
def packages(tmp_path_factory, tiny_path, build_variants):
    from k3compile.spec.load import load_spec

    return build_variants(load_spec(tiny_path, overrides=FOUR_LAYERS), tmp_path_factory, both())


@pytest.fixture(scope="module")
def packages_no_qat(tmp_path_factory, tiny_path, build_variants):
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path, overrides=[*FOUR_LAYERS, "quantization.qat=false"])
    return build_variants(spec, tmp_path_factory, both("train"))


def bound_ops(path) -> dict[str, dict[str, str]]:
    """{graph: {k3 op: implementation}} from the package's manifest binding tables."""
    manifest = json.loads((path / "manifest.json").read_text())
    tables = manifest["binding_table"]
    return {graph: {row["op"]: row["impl"] for row in rows if row["op"].startswith("k3::")} for graph, rows in tables.items()}


TRITON_AT_LEAST = {  # per graph, ops k3-tiny must run as Triton kernels on h200
    "train": {"k3::kda_chunk", "k3::attn_res", "k3::rms_norm", "k3::mx_fake_quantize"},
    "prefill": {"k3::kda_chunk", "k3::attn_res", "k3::rms_norm", "k3::mx_expert_glu"},
    "decode": {"k3::kda_decode_step", "k3::mla_decode_absorbed", "k3::attn_res", "k3::rms_norm", "k3::mx_expert_glu"},
}


def test_h200_binds_every_op_that_has_a_kernel(packages):
    path, _ = packages["h200"]
    bound = bound_ops(path)
    assert set(bound) == set(TRITON_AT_LEAST)  # manifest.json sorts its keys
    for graph, ops in bound.items():
        for op, impl in ops.items():
            name = op.removeprefix("k3::")
            expected = f"triton:{TRITON_KERNELS[name]}" if name in TRITON_KERNELS else "torch"
            assert impl == expected, (graph, op)
        triton = {op for op, impl in ops.items() if impl.startswith("triton")}
        assert TRITON_AT_LEAST[graph] <= triton, graph
    source = (path / "model.py").read_text()
    assert "backend = 'triton'" in source
    cpu_source = (packages["cpu"][0] / "model.py").read_text()
    assert "backend = 'triton'" not in cpu_source


def test_h200_training_step_matches_the_cpu_build(packages, step_differences):
    loss_err, errors = step_differences(packages, "cpu", "h200", 1, SEQ)
    worst = max(errors, key=errors.get)
    print(f"QAT: loss rel diff {loss_err:.1e}; worst gradient {worst} {errors[worst]:.1e}")
    assert loss_err <= 1e-4
    assert errors[worst] <= 1e-2  # MXFP8 rounding flips, see the module docstring
    assert sorted(errors.values())[len(errors) // 2] <= 1e-4  # the typical gradient agrees as without QAT


def test_h200_training_step_without_qat_matches_every_gradient(packages_no_qat, step_differences):
    loss_err, errors = step_differences(packages_no_qat, "cpu", "h200", 1, SEQ)
    worst = max(errors, key=errors.get)
    print(f"no QAT: loss rel diff {loss_err:.1e}; worst gradient {worst} {errors[worst]:.1e}")
    assert loss_err <= 1e-4 and errors[worst] <= 1e-4


def test_h200_prefill_and_decode_steps_match_the_cpu_build(packages):
    """One prefill through each build's prefill graph, then decode steps through its decode graph (the KDA and MLA
    decode kernels on h200): the prompt's logits and each step's match (one test: the interpreter's prefill is
    the expensive part, and each xdist worker would run its own)."""
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    prompt = SEQ - 3
    prefills, steps = {}, {}
    for target, (_, package) in packages.items():
        model = package.InferenceModel()
        with torch.no_grad():
            prefills[target], cache = model.prefill(tokens[:, :prompt], max_len=SEQ)
            outs = [prefills[target][:, -1:]]
            for t in range(prompt, SEQ):
                out, cache = model.decode(tokens[:, t], cache)
                outs.append(out)
        steps[target] = torch.cat(outs, dim=1)
    assert prefills["cpu"].shape == (2, prompt, 256) and steps["cpu"].shape == (2, 4, 256)
    for what, logits in (("prefill", prefills), ("decode", steps)):
        err = rel_rms(logits["h200"], logits["cpu"])
        print(f"{what} logits rel RMS {err:.2e}")
        assert err <= 1e-4, what
