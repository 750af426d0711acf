"""`k3compile build` on the command line: summary, binding table, dumps, disabled passes, modes, targets, errors.

Two builds, each run once per module: train-only for h200 with every pass dumped and fuse disabled, and
infer-only (the prefill and decode graphs) with each graph dumped after interleave.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

import k3compile
from k3compile.analysis.stats import spec_stats
from k3compile.build import pipeline
from k3compile.kernels.binding import TRITON_KERNELS
from k3compile.report import human
from k3compile.spec.load import load_spec

K3_TINY = Path(__file__).resolve().parent.parent / "specs" / "k3-tiny.yaml"
PASSES = [p.name for p in pipeline()]


def _main(*argv) -> tuple[int, str, str]:
    """k3compile.cli.main in this process with stdout/stderr captured (usable from module-scoped fixtures)."""
    from k3compile.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def h200_train(tmp_path_factory):
    """(exit code, stdout, stderr, package dir) of a train-only h200 build, all passes dumped, fuse disabled."""
    out = tmp_path_factory.mktemp("h200") / "out"
    argv = ["build", K3_TINY, "-o", out, "--mode", "train", "--target", "h200", "--dump-after", "all",
            "--disable-pass", "fuse"]  # fmt: skip
    return (*_main(*argv), out / "k3_tiny")


@pytest.fixture(scope="module")
def infer_interleave(tmp_path_factory):
    out = tmp_path_factory.mktemp("infer") / "out"
    return (*_main("build", K3_TINY, "-o", out, "--mode", "infer", "--dump-after", "interleave"), out / "k3_tiny")


def test_build_help_explains_the_options(cli):
    rc, out, _ = cli("build", "--help")
    assert rc == 0
    text = " ".join(out.split())
    for phrase in ("-o OUT, --out OUT", "--target {cpu,a100,h100,h200,b200}", "--mode {train,infer,both}",
                   "--dump-after PASS|all", "--disable-pass NAME", "--verify-numerics", "--set A.B=VALUE",
                   "MX-packed weights", "atomic", "only replaces a previous build"):  # fmt: skip
        assert phrase in text, phrase


@pytest.mark.parametrize("option", ["--disable-pass", "--dump-after"])
def test_unknown_pass_is_one_line_exit_2(cli, tmp_path, option):
    rc, out, err = cli("build", K3_TINY, "-o", tmp_path / "out", option, "fusion")
    assert rc == 2 and out == ""
    assert err == f"error: unknown pass 'fusion'; passes are: {', '.join(PASSES)}\n"
    assert not (tmp_path / "out").exists()


def test_summary_and_binding_table_with_fallback_reasons(h200_train):
    rc, out, err, dest = h200_train
    assert rc == 0, err
    total = spec_stats(load_spec(K3_TINY))["params"]["total"]
    assert out.startswith(f"built {dest}")  # no progress output on stdout (or anywhere off a terminal)
    assert f"built {dest} (k3-tiny, target h200, modes train, {human(total)} parameters, " in " ".join(out.split())
    assert err == ""
    assert "train: passes" in out and "prefill:" not in out and "decode:" not in out
    assert re.search(r"│ fuse +│ disabled +│ +│", out)
    assert re.search(r"│ pack_mxfp4 +│ ran +│ weights_packed 0, weights_fake_quantized 21, ", out)
    assert "train: kernel binding (h200)" in out
    manifest = json.loads((dest / "manifest.json").read_text())
    k3_ops = sorted({b["op"] for b in manifest["bindings"]["train"].values() if b["op"].startswith("k3::")})
    assert "k3::kda_chunk" in k3_ops and "k3::mla_attention" in k3_ops
    for op in k3_ops:  # an op binds its Triton kernel, or falls back to the reference and says why
        name = re.escape(op)
        kernel = TRITON_KERNELS.get(op.removeprefix("k3::"))
        if kernel is None:
            assert re.search(rf"│ {name} +│ torch +│ +\d+ │ no Triton kernel for {name} ", out), op
        else:
            assert re.search(rf"│ {name} +│ triton:{re.escape(kernel)} +│ +\d+ │ kernel defaults \(no h200", out), op
    assert re.search(r"│ PyTorch built-ins +│ native +│ +\d+ │", out)


def test_dump_after_all_writes_every_pass_that_ran(h200_train):
    rc, _, _, dest = h200_train
    assert rc == 0
    names = [f"{i:02d}-{p}.txt" for i, p in enumerate(["lowered", *PASSES]) if p != "fuse"]
    assert sorted(p.name for p in (dest / "graphs" / "train").iterdir()) == names
    assert not (dest / "graphs" / "prefill").exists() and not (dest / "graphs" / "decode").exists()
    last = (dest / "graphs" / "train" / f"{len(PASSES):02d}-bind_kernels.txt").read_text()
    assert last == (dest / "graphs" / "train-final.txt").read_text()
    assert "k3::kda_chunk" not in (dest / "graphs" / "train" / "00-lowered.txt").read_text()  # interleave adds it
    assert "k3::kda_chunk" in (dest / "graphs" / "train" / "01-interleave.txt").read_text()


def test_disabled_pass_and_target_in_the_manifest(h200_train):
    rc, _, _, dest = h200_train
    assert rc == 0
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["modes"] == ["train"] and manifest["target"] == "h200"
    assert set(manifest["stats"]) >= {"params", "flops_per_token", "weight_bytes", "cache_bytes"}
    records = {r["name"]: r for r in manifest["passes"]["train"]}
    assert list(records) == PASSES
    assert records["fuse"]["status"] == "disabled" and records["fuse"]["statistics"] == {}
    assert all(r["status"] == "ran" and r["statistics"] for n, r in records.items() if n != "fuse")
    bindings = manifest["bindings"]["train"]
    bound = records["bind_kernels"]["statistics"]
    assert len(bindings) == bound["k3_ops"] + bound["native"] and bound["triton"] > 0
    assert "k3::linear_glu" not in {b["op"] for b in bindings.values()}  # made only by fuse
    for node, b in bindings.items():
        assert set(b) >= {"op", "impl", "reason"}, node
        if b["op"].startswith("k3::") and b["op"].removeprefix("k3::") not in TRITON_KERNELS:
            assert b["impl"] == "torch" and b["reason"] == f"no Triton kernel for {b['op']}"
    assert "# target: h200, mode: train" in (dest / "model.py").read_text()


def test_mode_train_emits_only_the_training_model(h200_train):
    rc, _, _, dest = h200_train
    assert rc == 0
    src = (dest / "model.py").read_text()
    assert "class Model(TrainingModule)" in src and "InferenceModel" not in src
    pkg = k3compile.load(dest)
    assert pkg.__all__ == ["SPEC_JSON", "TARGET", "Model"] and not hasattr(pkg, "InferenceModel")


def test_mode_infer_and_dump_after_one_pass(infer_interleave):
    rc, out, err, dest = infer_interleave
    assert rc == 0, err
    assert "train:" not in out
    for graph in ("prefill", "decode"):  # infer mode: two graphs, each with its passes and binding table
        assert f"{graph}: passes" in out and f"{graph}: kernel binding (cpu)" in out, graph
        dumps = sorted(p.name for p in (dest / "graphs" / graph).iterdir())
        assert dumps == ["00-lowered.txt", "01-interleave.txt"], graph
        assert (dest / "graphs" / f"{graph}-final.txt").exists()
    interleaved = {g: (dest / "graphs" / g / "01-interleave.txt").read_text() for g in ("prefill", "decode")}
    assert "k3::kda_chunk" in interleaved["prefill"] and "k3::kda_decode_step" not in interleaved["prefill"]
    assert "k3::kda_decode_step" in interleaved["decode"] and "k3::kda_chunk" not in interleaved["decode"]
    assert not (dest / "graphs" / "train").exists() and not (dest / "graphs" / "train-final.txt").exists()
    pkg = k3compile.load(dest)
    assert pkg.__all__ == ["SPEC_JSON", "TARGET", "InferenceModel"] and not hasattr(pkg, "Model")
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["modes"] == ["infer"] and manifest["graphs"] == ["prefill", "decode"]
    assert set(manifest["passes"]) == set(manifest["bindings"]) == {"prefill", "decode"}


@pytest.mark.parametrize("disabled", [["interleave"], ["attn_res"], PASSES])
def test_a_build_that_could_not_run_is_refused(cli, tmp_path, write_spec, hand_text, disabled):
    """Without interleave (or attn_res) the graph keeps the submodule calls only that pass inlines: no package."""
    spec = write_spec(hand_text)
    flags = [a for name in disabled for a in ("--disable-pass", name)]
    rc, out, err = cli("build", spec, "-o", tmp_path / "out", "--mode", "train", *flags)
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    needed = "interleave" if "interleave" in disabled else "attn_res"
    assert err.startswith("error: ") and f"needs the {needed} pass" in err and "could not run" in err
    assert not (tmp_path / "out").exists()


def test_an_output_path_that_looks_like_markup_is_printed_as_it_is(cli, tmp_path, write_spec, hand_text):
    out = tmp_path / "out[" / "x]"
    rc, stdout, err = cli("build", write_spec(hand_text), "-o", out, "--mode", "train")
    assert (rc, err) == (0, "") and f"built {out / 'hand'}" in stdout
