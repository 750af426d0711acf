"""Hugging Face folders from strangers: shard maps confined to their folder, config.json and metadata bounded and
type-checked, sizes bounded before per-layer work; every refusal one line, nothing read outside, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3compile.hf.io import hub_root, read_config
from k3compile.runtime.shards import ShardReader

from ..conftest import assert_one_line_error

needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs, /dev/zero and symbolic links")
INDEX = "model.safetensors.index.json"


@pytest.fixture
def hf_dir(hf_model, tmp_path) -> Path:
    """A copy of the tiny transformers checkpoint (sharded, with an index) to tamper with."""
    shutil.copytree(hf_model[1], tmp_path / "hf")
    return tmp_path / "hf"


def _edit_index(hf_dir: Path, edit) -> None:
    doc = json.loads((hf_dir / INDEX).read_text())
    (hf_dir / INDEX).write_text(json.dumps(edit(doc)))


def _edit_config(hf_dir: Path, edit) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(edit(config)))


def _first_shard(hf_dir: Path) -> str:
    return sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))[0]


@needs_posix
@pytest.mark.parametrize("case, what", [
    ("parent", "leads outside"),
    ("absolute", "leads outside"),
    ("link-outside", "through a symbolic link"),
    ("integer", "weight_map must map tensor names to file names"),
    ("not-a-map", "weight_map must map tensor names to file names"),
    ("metadata-list", "metadata must map names to strings or numbers"),
    ("fifo", "is not a readable safetensors file"),
    ("index-dev-zero", "holds neither model.safetensors.index.json"),  # not a file: no index
    ("index-deep", "nests deeper than"),
])  # fmt: skip
def test_a_shard_map_never_leads_a_read_outside_the_folder(cli, hf_dir, tmp_path, case, what, bounded):
    """H4: `weight_map` values were used as paths unchecked: ../outside/x.safetensors or an absolute path was read
    and the import exited 0. Here a real shard lies outside, so only the confinement stops it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    first = _first_shard(hf_dir)
    shutil.move(hf_dir / first, outside / first)
    if case == "parent":
        _edit_index(hf_dir, lambda d: {**d, "weight_map": {k: v.replace(first, f"../outside/{first}")
                                                            for k, v in d["weight_map"].items()}})  # fmt: skip
    elif case == "absolute":
        _edit_index(hf_dir, lambda d: {**d, "weight_map": {k: v.replace(first, str(outside / first))
                                                            for k, v in d["weight_map"].items()}})  # fmt: skip
    elif case == "link-outside":
        (hf_dir / first).symlink_to(outside / first)
    elif case == "integer":
        _edit_index(hf_dir, lambda d: {**d, "weight_map": {k: 5 for k in d["weight_map"]}})
    elif case == "not-a-map":
        _edit_index(hf_dir, lambda d: {**d, "weight_map": [first]})
    elif case == "metadata-list":
        _edit_index(hf_dir, lambda d: {**d, "metadata": {"total_size": [1, 2]}})
    elif case == "fifo":
        os.mkfifo(hf_dir / first)
    elif case == "index-dev-zero":
        (hf_dir / INDEX).unlink()
        (hf_dir / INDEX).symlink_to("/dev/zero")
    else:
        (hf_dir / INDEX).write_text('{"weight_map": ' + "[" * 10_000 + "]" * 10_000 + "}")
    result = cli("import-hf", hf_dir, "-o", tmp_path / "out")
    err = assert_one_line_error(result, what)
    assert str(hf_dir) in err
    assert not (tmp_path / "out").exists()


def test_the_hugging_face_hub_cache_layout_is_read(hf_model, tmp_path):
    """A hub snapshot's files are links into the repository's blobs/: inside the repository, so allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in hf_model[1].iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob-{f.name}")
    assert hub_root(snapshot) == repo.resolve()
    assert read_config(snapshot)["model_type"] == "kimi_linear"
    reader = ShardReader(snapshot, "model", root=hub_root(snapshot))
    assert reader.names and len(set(reader.shard.values())) >= 2
    reader.close()


@needs_posix
@pytest.mark.parametrize("case, what", [
    (lambda c: {**c, "linear_attn_config": {**c["linear_attn_config"], "full_attn_layers": 5}},
     "linear_attn_config.full_attn_layers must be a list of layer numbers, got 5"),
    (lambda c: {**c, "linear_attn_config": {**c["linear_attn_config"], "kda_layers": ["1", 2, 3]}},
     "kda_layers must be a list of layer numbers"),
    (lambda c: {**c, "dtype": []}, "dtype [] cannot be expressed"),
    (lambda c: {**c, "dtype": {"a": 1}}, "cannot be expressed"),
    (lambda c: {**c, "num_hidden_layers": 1_000_000_000}, "num_hidden_layers must be an integer in [1, 1024]"),
    (lambda c: {**c, "num_hidden_layers": True}, "num_hidden_layers must be an integer in [1, 1024]"),
    (lambda c: {**c, "num_hidden_layers": 4.0}, "num_hidden_layers must be an integer in [1, 1024]"),
    (lambda c: {**c, "layer_types": ["linear_attention"] * 30_000}, "layer_types must list 4 entries"),
    (lambda c: {**c, "first_k_dense_replace": True}, "first_k_dense_replace must be an integer"),
    (lambda c: {**c, "eos_token_id": {"a": 1}}, "eos_token_id must be a token id"),
    (lambda c: {**c, "hidden_act": "x" * 600_000}, "(600,002 characters)"),
    (lambda c: [c], "does not hold a JSON object"),
    ("deep", "nests deeper than"),
    ("dev-zero", "leads outside"),
    ("fifo", "is not a regular file"),
])  # fmt: skip
def test_a_hostile_config_is_one_line(cli, hf_dir, tmp_path, case, what, bounded):
    """M3 and H5: hostile JSON types were TypeError/AttributeError/RecursionError tracebacks; num_hidden_layers of
    10^9 built an 8 GB list, 30,000 layer_types hung a quadratic search. Refused before any of that."""
    config = hf_dir / "config.json"
    if case == "deep":
        config.write_text('{"model_type": "kimi_linear", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "dev-zero":
        config.unlink()
        config.symlink_to("/dev/zero")
    elif case == "fifo":
        config.unlink()
        os.mkfifo(config)
    else:
        _edit_config(hf_dir, case)
    for extra in ([], ["--spec-only"]):
        err = assert_one_line_error(cli("import-hf", hf_dir, "-o", tmp_path / "out", *extra), "config.json", what)
        assert len(err) < 600
    assert not (tmp_path / "out").exists()


@needs_posix
@pytest.mark.parametrize("case, what", [
    ("checkpoint-dev-zero", "is not a regular file"),
    ("token-ids-list", "hf_token_ids metadata is not an object"),
    ("token-ids-deep", "nests deeper than"),
    ("spec-list", "records no readable spec"),
])  # fmt: skip
def test_export_reads_the_checkpoint_bounded_and_its_metadata_typed(cli, imported, tmp_path, case, what, bounded):
    """export-hf --checkpoint a JSON linked to /dev/zero grew memory; a list `hf_token_ids` was an AttributeError."""
    weights = tmp_path / "weights"
    shutil.copytree(imported, weights, ignore=shutil.ignore_patterns("build"))
    checkpoint = weights
    if case == "checkpoint-dev-zero":
        checkpoint = tmp_path / "step-000001.json"
        checkpoint.symlink_to("/dev/zero")
    else:
        path = weights / "weights.safetensors"
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        edit = {"token-ids-list": ("hf_token_ids", "[1, 2]"), "token-ids-deep": ("hf_token_ids", "[" * 5000 + "]" * 5000),
                "spec-list": ("spec", "[1]")}[case]  # fmt: skip
        save_file(load_file(path), path, metadata={**metadata, edit[0]: edit[1]})
    result = cli("export-hf", imported / "build" / "tiny_kimi", "--checkpoint", checkpoint, "-o", tmp_path / "out")
    assert_one_line_error(result, what)
    assert not (tmp_path / "out").exists()
