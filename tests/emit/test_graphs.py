"""Every build lowers one model definition to its graphs (train; prefill and decode), runs every pass on each,
binds the decode kernels in the decode graph, and `generate` serves through the compiled decode graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3compile.build import BuildOptions, build, pipeline
from k3compile.spec.load import load_spec

K3_TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"


@pytest.fixture(scope="module")
def h200_infer(tmp_path_factory):
    dest, manifest = build(load_spec(K3_TINY), tmp_path_factory.mktemp("h200"), BuildOptions(mode="infer", target="h200"))
    return dest, manifest


def test_manifest_lists_the_three_graphs_with_their_passes_and_bindings(tmp_path):
    dest, manifest = build(load_spec(K3_TINY), tmp_path)
    assert manifest["graphs"] == ["train", "prefill", "decode"]
    names = [p.name for p in pipeline()]
    for graph in manifest["graphs"]:
        assert [r["name"] for r in manifest["passes"][graph]] == names
        assert all(r["status"] == "ran" for r in manifest["passes"][graph])
        assert manifest["binding_table"][graph] and manifest["bindings"][graph]
        assert (dest / "graphs" / f"{graph}-final.txt").is_file()
    assert json.loads((dest / "manifest.json").read_text())["graphs"] == manifest["graphs"]


def test_h200_decode_graph_binds_the_kda_and_mla_decode_kernels(h200_infer):
    _, manifest = h200_infer
    bound = {r["op"]: r["impl"] for r in manifest["binding_table"]["decode"]}
    assert bound["k3::kda_decode_step"] == "triton:kda.decode_triton.kda_decode_step"
    assert bound["k3::mla_decode_absorbed"] == "triton:mla.triton.mla_decode_absorbed"
    assert not {"k3::kda_chunk", "k3::mla_attention", "k3::moe_dispatch"} & set(bound)
    prefill = {r["op"] for r in manifest["binding_table"]["prefill"]}
    assert {"k3::kda_chunk", "k3::mla_attention", "k3::moe_dispatch"} <= prefill
    assert "k3::kda_decode_step" not in prefill


def test_generate_decodes_through_the_compiled_decode_graph(tmp_path):
    dest, _ = build(load_spec(K3_TINY), tmp_path, BuildOptions(mode="infer"))
    script = f"""
import sys
import k3compile.runtime.generated as g
calls = []
original = g.InferenceModule.decode
def spy(self, tokens, cache):
    calls.append(type(self).decode_graph is not g.InferenceModule.decode_graph)
    return original(self, tokens, cache)
g.InferenceModule.decode = spy
from k3compile.cli import main
rc = main(["generate", {str(dest)!r}, "--prompt", "def f(", "--max-new-tokens", "5"])
print("decode steps through the emitted graph:", calls.count(True), "of", len(calls), file=sys.stderr)
sys.exit(rc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decode steps through the emitted graph: 4 of 4" in out.stderr
