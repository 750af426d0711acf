"""`k3compile build` end to end: reproducible bytes, refusing foreign directories, all-or-nothing failure, manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import keyword
import os
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3compile import __version__
from k3compile.analysis.stats import spec_stats
from k3compile.build import build, package_name, pipeline
from k3compile.emit.codegen import spec_hash
from k3compile.emit.package import BuildDirError, is_build_dir
from k3compile.kernels.binding import C_KERNELS
from k3compile.ir.pass_manager import PassFailure
from k3compile.spec.schema import NAME_RE


def _differences(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def test_rebuild_is_byte_identical_elsewhere_and_in_place(tiny_path, tiny_spec, tiny_tree, tmp_path, snapshot):
    # another process (other hash seed) into another out dir, then this process over that same dir
    out = tmp_path / "again"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run(
        [sys.executable, "-m", "k3compile.cli", "build", str(tiny_path), "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dest = out / "k3_tiny"
    assert _differences(snapshot(dest), tiny_tree) == []

    inode = (dest / "model.py").stat().st_ino
    dest2, _ = build(tiny_spec, out)
    assert dest2 == dest and (dest / "model.py").stat().st_ino != inode  # really rewritten
    assert _differences(snapshot(dest), tiny_tree) == []
    assert os.listdir(out) == ["k3_tiny"]  # the replaced build and the staging dir are gone


def test_build_writes_the_documented_files(tiny_build, tiny_tree):
    dest, _ = tiny_build
    assert dest.name == "k3_tiny" and is_build_dir(dest)
    assert sorted(tiny_tree) == [
        ".k3compile-build", "__init__.py", "graphs/decode-final.txt", "graphs/prefill-final.txt",
        "graphs/train-final.txt", "manifest.json", "model.py",
    ]  # fmt: skip
    marker = json.loads(tiny_tree[".k3compile-build"])
    hashes = {rel: hashlib.sha256(data).hexdigest() for rel, data in tiny_tree.items() if rel != ".k3compile-build"}
    assert marker == {"compiler": __version__, "spec": "k3-tiny", "files": hashes}


@pytest.mark.parametrize("occupant", ["foreign dir", "file"])
def test_building_over_a_foreign_path_is_refused_and_leaves_it_untouched(cli, tiny_path, tmp_path, snapshot, occupant):
    out = tmp_path / "out"
    out.mkdir()
    if occupant == "file":
        (out / "k3_tiny").write_text("not a build\n")
    else:
        (out / "k3_tiny").mkdir()
        (out / "k3_tiny" / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    rc, stdout, err = cli("build", tiny_path, "-o", out)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "not a k3compile build" in err
    assert "Traceback" not in err and stdout == ""
    assert snapshot(out) == before and os.listdir(out) == ["k3_tiny"]


@pytest.mark.parametrize("occupant", ["foreign dir", "-o is a file", "dangling symlink"])
def test_refusal_happens_before_compiling(tiny_spec, tmp_path, monkeypatch, occupant):
    out = tmp_path
    if occupant == "foreign dir":
        (tmp_path / "k3_tiny").mkdir()
    elif occupant == "-o is a file":
        out = tmp_path / "file"
        out.write_text("")
    else:
        (tmp_path / "k3_tiny").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr("k3compile.build.compile_graphs", lambda *a, **k: pytest.fail("compiled before refusing"))
    message = {"foreign dir": "refusing to overwrite", "-o is a file": "exists and is not a folder",
               "dangling symlink": "is a symbolic link"}[occupant]
    with pytest.raises(BuildDirError, match=message):
        build(tiny_spec, out)


@pytest.fixture
def failing_routing(monkeypatch, tmp_path):
    """Pass 'routing' raises in infer mode (on the prefill graph), after the train graph is finished: a build
    failing midway.

    Returns the temp dir the pass manager's reproducer goes to (redirected away from /tmp).
    """
    import k3compile.passes.routing as routing

    original = routing.PASS.run

    def run(gm, ctx):
        if ctx.mode == "infer":
            raise RuntimeError("injected failure")
        return original(gm, ctx)

    monkeypatch.setattr(routing, "PASS", dataclasses.replace(routing.PASS, run=run))
    repro = tmp_path / "system-tmp"
    repro.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(repro))
    return repro


def test_failed_build_leaves_nothing_behind(cli, tiny_path, tmp_path, failing_routing):
    out = tmp_path / "out"
    rc, stdout, err = cli("build", tiny_path, "-o", out)
    assert rc == 2 and stdout == ""
    assert err.startswith("error: pass 'routing' failed: RuntimeError: injected failure") and err.count("\n") == 1
    assert not out.exists()  # no package, no staging dir, not even the out dir
    # The reproducer is the one thing written, and only to the temp dir (torch makes its own inductor cache
    # dir there the first time a process imports torch._dynamo: not ours).
    (repro,) = [p for p in failing_routing.iterdir() if not p.name.startswith("torchinductor_")]
    assert repro.name.startswith("k3compile-repro-k3-tiny-")
    assert (repro / "passes.txt").read_text().split() == ["interleave", "attn_res", "shard_experts", "routing"]


def test_failed_rebuild_keeps_the_previous_build(tiny_build, tiny_tree, tiny_spec, tmp_path, failing_routing, snapshot):
    out = tmp_path / "out"
    shutil.copytree(tiny_build[0], out / "k3_tiny")
    with pytest.raises(PassFailure, match="pass 'routing' failed"):
        build(tiny_spec, out)
    assert os.listdir(out) == ["k3_tiny"]
    assert _differences(snapshot(out / "k3_tiny"), tiny_tree) == []


def test_manifest_records_spec_stats_passes_and_bindings(tiny_build, tiny_tree, tiny_spec):
    _, manifest = tiny_build
    assert json.loads(tiny_tree["manifest.json"]) == json.loads(json.dumps(manifest))
    fields = tiny_spec.model_dump(mode="json")
    assert manifest["spec"] == {"name": "k3-tiny", "sha256": spec_hash(tiny_spec), "fields": fields}
    assert manifest["stats"] == json.loads(json.dumps(spec_stats(tiny_spec)))
    assert manifest["modes"] == ["train", "infer"] and manifest["target"] == "cpu"
    graphs = ["train", "prefill", "decode"]  # infer mode: the prefill and decode graphs
    assert manifest["graphs"] == graphs
    assert set(manifest["passes"]) == set(manifest["bindings"]) == set(manifest["binding_table"]) == set(graphs)
    assert manifest["weights"] == "initialised (seeded)"
    declared = {p.name: set(p.statistics) for p in pipeline()}
    moe_layers = tiny_spec.num_layers - len(tiny_spec.dense_ffn.layers)  # 7 MoE layers x 3 expert projections
    for graph in graphs:
        records = {r["name"]: r for r in manifest["passes"][graph]}
        assert list(records) == list(declared)
        for name, r in records.items():
            assert r["status"] == "ran" and set(r["statistics"]) == declared[name], name
        bound = records["bind_kernels"]["statistics"]
        bindings = manifest["bindings"][graph]
        assert len(bindings) == bound["k3_ops"] + bound["native"]
        assert sum(row["nodes"] for row in manifest["binding_table"][graph]) == len(bindings)
        k3 = [b for b in bindings.values() if b["op"].startswith("k3::")]
        assert len(k3) == bound["k3_ops"] == bound["c"] + bound["reference"] and bound["triton"] == 0
        for b in k3:  # the CPU target: the C kernel of every op that has one (CI's machine builds them)
            op = b["op"].removeprefix("k3::")
            if op in C_KERNELS:
                assert (b["impl"], b["reason"]) == (f"c:{C_KERNELS[op]}", "C kernel built for this CPU"), op
            else:
                assert (b["impl"], b["reason"]) == ("torch", "PyTorch reference on CPU"), op
        assert bound["c"] >= 40
        routing = records["routing"]["statistics"]
        assert routing["drop_free"] == (moe_layers if graph != "train" else 0)
        assert routing["gathered"] == (moe_layers if graph == "decode" else 0)  # decode: only the picked experts
    train, *infer = ({r["name"]: r["statistics"] for r in manifest["passes"][g]} for g in graphs)
    assert (train["pack_mxfp4"]["weights_fake_quantized"], train["pack_mxfp4"]["weights_packed"]) == (3 * moe_layers, 0)
    for stats in infer:
        assert (stats["pack_mxfp4"]["weights_packed"], stats["pack_mxfp4"]["weights_fake_quantized"]) == (3 * moe_layers, 0)


@pytest.mark.parametrize(
    "name, package",
    [("k3-tiny", "k3_tiny"), ("a.b-c", "a_b_c"), ("1b", "k3_1b"), ("class", "k3_class"), ("None", "k3_None")],
)
def test_package_name_is_an_importable_identifier(name, package):
    assert package_name(SimpleNamespace(name=name)) == package


@pytest.mark.parametrize("name", ["torch", "os", "json", "yaml", "pydantic", "sys"])
def test_names_of_importable_modules_are_prefixed(name):
    """`-o .` with a spec named torch would create ./torch/, shadowing the real one for Python started there."""
    assert package_name(SimpleNamespace(name=name)) == f"k3_{name}"


@given(st.from_regex(NAME_RE, fullmatch=True))
def test_every_valid_spec_name_gives_an_importable_package(name):
    package = package_name(SimpleNamespace(name=name))
    assert package.isidentifier() and not keyword.iskeyword(package) and package not in sys.stdlib_module_names
