"""export-hf: transformers reloads the export with identical tensors and logits; what Kimi Linear cannot
hold is a one-line error naming the spec field."""

from __future__ import annotations

import json

import pytest
import torch

from k3compile.hf.config import HFError, check_exportable
from k3compile.spec.load import load_spec


def test_export_reloads_in_transformers_identical(hf_model, imported, tmp_path, tokens, cli):
    from transformers import KimiLinearForCausalLM

    hf, hf_dir = hf_model
    out = tmp_path / "hf"
    rc, _, err = cli("export-hf", imported / "build" / "tiny_kimi", "--checkpoint", imported, "-o", out,
                     "--max-shard-size", "100KB")  # fmt: skip
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    source = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    # transformers saves the dense layer 0 under block_sparse_moe.; the published layout (and export) says mlp.
    assert set(index["weight_map"]) == {n.replace("layers.0.block_sparse_moe.", "layers.0.mlp.") for n in source}
    reloaded = KimiLinearForCausalLM.from_pretrained(out).eval()
    theirs, ours = hf.state_dict(), reloaded.state_dict()
    assert set(theirs) == set(ours)
    assert all(torch.equal(theirs[k], ours[k]) and theirs[k].dtype == ours[k].dtype for k in theirs)
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, hf(tokens).logits)


@pytest.mark.parametrize(
    "spec_file, field",
    [("k3-tiny.yaml", "residual.kind"), ("kimi-k3.yaml", "residual.kind"), ("ablations/no-attn-res.yaml", "activation.kind")],
)
def test_k3_features_kimi_linear_lacks_are_named(specs_dir, spec_file, field):
    with pytest.raises(HFError, match=rf"^spec field {field}="):
        check_exportable(load_spec(specs_dir / spec_file))


def test_the_shipped_kimi_linear_spec_is_exportable(specs_dir):
    check_exportable(load_spec(specs_dir / "kimi-linear-48b-a3b.yaml"))


@pytest.mark.parametrize("problem", ["no checkpoint", "output not empty"])
def test_export_errors_are_one_line_and_write_nothing(imported, tmp_path, cli, problem):
    out = tmp_path / "hf"
    checkpoint = tmp_path / "nothing-here" if problem == "no checkpoint" else imported
    if problem == "output not empty":
        out.mkdir()
        (out / "config.json").write_text("{}")
    rc, _, err = cli("export-hf", imported / "build" / "tiny_kimi", "--checkpoint", checkpoint, "-o", out)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert (not out.exists()) if problem == "no checkpoint" else [p.name for p in out.iterdir()] == ["config.json"]
