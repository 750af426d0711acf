"""config.json <-> spec: the published Kimi-Linear-48B-A3B config imports to the shipped spec's stats, the mapping
round-trips, layouts compact to patterns, and the package never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3compile.hf.config import HFError, hf_config, layout_fields, spec_fields
from k3compile.spec.load import load_spec
from k3compile.spec.schema import Spec

PUBLISHED = Path(__file__).resolve().parents[2] / "specs" / "hf" / "kimi-linear-48b-a3b"


def _published() -> dict:
    return json.loads((PUBLISHED / "config.json").read_text())


def test_published_config_imports_to_the_shipped_specs_stats(specs_dir, tmp_path, cli):
    rc, _, err = cli("import-hf", PUBLISHED, "-o", tmp_path / "out", "--spec-only")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["spec.yaml"]
    rc, imported, _ = cli("stats", tmp_path / "out" / "spec.yaml", "--json")
    rc2, shipped, _ = cli("stats", specs_dir / "kimi-linear-48b-a3b.yaml", "--json")
    assert rc == rc2 == 0
    assert json.loads(imported) == json.loads(shipped)


def test_published_config_and_the_shipped_spec_agree_both_ways(specs_dir):
    shipped = load_spec(specs_dir / "kimi-linear-48b-a3b.yaml")
    config = _published()
    written = hf_config(shipped, "bfloat16", {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    assert {k: v for k, v in written.items() if k in config} == {k: config[k] for k in written if k in config}
    again = Spec.model_validate(spec_fields(written, shipped.name))
    keep = {"training", "target"}  # not in a config: the shipped spec's own training settings and kernel target
    assert again.model_dump(exclude=keep) == shipped.model_dump(exclude=keep)


@pytest.mark.parametrize(
    "mixers, fields",
    [
        ("KKKMKKKMKKK" "M", {"pattern": "KKKM", "last_layer_full": False}),
        ("KKKMKKKMK" "M", {"pattern": "KKKM", "last_layer_full": True}),
        ("KKKK", {"pattern": "K", "last_layer_full": False}),
        ("KMMK", {"pattern": "KMM", "last_layer_full": False}),
        ("MKKK", {"layers": ["M", "K", "K", "K"]}),
        ("M", {"layers": ["M"]}),
    ],
)
def test_layouts_compact_to_the_shortest_pattern(mixers, fields):
    assert layout_fields(list(mixers)) == fields


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"n_group": 1, "num_expert_group": 2}, "n_group (1) and num_expert_group (2) disagree"),
        ({"layer_types": ["linear_attention"] * 27}, "layer_types and linear_attn_config.full_attn_layers disagree"),
        ({"first_k_dense_replace": 2, "mlp_layer_types": ["dense"] + ["sparse"] * 26}, "disagree"),
        ({"num_shared_experts": 0}, "always runs shared experts"),
        ({"torch_dtype": "float16"}, "dtype 'float16' cannot be expressed"),
        ({"num_key_value_heads": 8}, "num_key_value_heads (8) must equal num_attention_heads (32)"),
        ({"mla_use_nope": False}, "mla_use_nope=False"),
        ({"linear_attn_config": {**_published()["linear_attn_config"], "gate_rank": 64}}, "linear_attn_config.gate_rank"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_config_problems_name_the_field(edit, message):
    with pytest.raises(HFError, match="^config.json") as e:
        spec_fields({**_published(), **edit}, "x")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_package_never_imports_transformers():
    """transformers is a test dependency only: importing every k3compile module leaves it unloaded."""
    code = (
        "import importlib, pkgutil, sys, k3compile\n"
        "for m in pkgutil.walk_packages(k3compile.__path__, 'k3compile.'):\n"
        "    importlib.import_module(m.name)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "print(len(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    root = Path(__file__).resolve().parents[2]
    sources = [p for d in ("k3compile", "kernels", "passes") for p in (root / d).rglob("*.py")]
    assert not [p for p in sources if "import transformers" in p.read_text() or "from transformers" in p.read_text()]
