"""Loading: `extends:` (relative to the file, deep merge, chains), `--set` overrides (typed, lists, null), text loading."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from k3compile.spec.load import SpecError, load_spec, load_spec_text
from k3compile.spec.schema import Spec


@pytest.fixture
def tiny(specs_dir, tmp_path):
    """A copy of specs/k3-tiny.yaml beside the test's specs (`extends:` stays inside the spec's folder)."""
    path = tmp_path / "k3-tiny.yaml"
    path.write_text((specs_dir / "k3-tiny.yaml").read_text())
    return path


def test_every_shipped_spec_loads(shipped_spec):
    spec = load_spec(shipped_spec)
    assert isinstance(spec, Spec)
    assert spec.name == yaml.safe_load(shipped_spec.read_text())["name"]


def test_text_and_file_give_the_same_spec(tiny):
    assert load_spec_text(tiny.read_text()) == load_spec(tiny)


def test_text_refuses_extends():
    with pytest.raises(SpecError, match=r"<string>:1:1: extends: extends needs a spec file"):
        load_spec_text("extends: k3-tiny.yaml\n")


def test_spec_is_frozen(tiny):
    spec = load_spec(tiny)
    with pytest.raises(ValidationError):
        spec.hidden_size = 1
    assert hash(spec) == hash(load_spec(tiny))


# ------------------------------------------------------------------ extends


def test_extends_is_relative_to_the_file_not_the_cwd(tiny, write_spec, tmp_path, monkeypatch):
    child = write_spec("extends: ../k3-tiny.yaml\nname: child\n", "a/child.yaml")
    grand = write_spec("extends: ../a/child.yaml\nname: grand\n", "b/grand.yaml")
    monkeypatch.chdir(tmp_path)  # from here ../a/child.yaml names a file that does not exist
    spec = load_spec(grand)
    assert spec.name == "grand"
    assert spec.hidden_size == load_spec(tiny).hidden_size
    assert load_spec(child).name == "child"


def test_extends_deep_merges_mappings(tiny, write_spec):
    base = load_spec(tiny)
    spec = load_spec(write_spec(f"extends: {tiny.name}\nname: c\nmoe:\n  top_k: 2\n  router:\n    scoring: softmax\n"))
    assert spec.moe.top_k == 2 and spec.moe.router.scoring == "softmax"
    # siblings at every level survive the merge
    assert spec.moe.num_experts == base.moe.num_experts
    assert spec.moe.router.balancing == base.moe.router.balancing
    assert spec.moe.latent_size == base.moe.latent_size
    assert spec.model_copy(update={"name": base.name, "moe": base.moe}) == base


def test_extends_replaces_lists_and_null_clears(tiny, write_spec):
    text = f"extends: {tiny.name}\nname: c\ndense_ffn:\n  layers: [1, 2]\nmla:\n  q_lora_rank: null\n"
    spec = load_spec(write_spec(text))
    assert spec.dense_ffn.layers == (1, 2)  # replaced, not appended to [0]
    assert spec.mla.q_lora_rank is None
    assert spec.dense_ffn.intermediate_size == load_spec(tiny).dense_ffn.intermediate_size


def test_extends_chain_applies_in_order(write_spec, tiny):
    write_spec(f"extends: {tiny.name}\nname: one\nhidden_size: 512\nmoe:\n  top_k: 2\n", "one.yaml")
    write_spec("extends: one.yaml\nname: two\nmoe:\n  top_k: 8\n", "two.yaml")
    three = write_spec("name: three\nextends: two.yaml\nnum_layers: 12\n", "three.yaml")
    spec = load_spec(three)
    assert (spec.name, spec.hidden_size, spec.moe.top_k, spec.num_layers) == ("three", 512, 8, 12)


def test_extends_error_points_at_the_file_that_wrote_the_value(write_spec, tiny):
    write_spec(f"extends: {tiny.name}\nname: mid\n\nmoe:\n  top_k: 99\n", "mid.yaml")
    child = write_spec("extends: mid.yaml\nname: leaf\n", "leaf.yaml")
    with pytest.raises(SpecError) as e:
        load_spec(child)
    (line,) = e.value.lines
    assert line.startswith(f"{(child.parent / 'mid.yaml').resolve()}:5:3: moe.top_k: top_k (99) exceeds")


def test_extends_depth_is_bounded(write_spec):
    for i in range(20):
        write_spec(f"extends: s{i + 1}.yaml\n", f"s{i}.yaml")
    with pytest.raises(SpecError, match="extends chain deeper than"):
        load_spec(write_spec("name: x\n", "s20.yaml").parent / "s0.yaml")


# ------------------------------------------------------------------ --set overrides


def test_override_scalar_is_type_checked(tiny):
    assert load_spec(tiny, ["moe.top_k=8"]).moe.top_k == 8
    assert load_spec(tiny, ["training.lr=0.5"]).training.lr == 0.5
    assert load_spec(tiny, ["tie_embeddings=true"]).tie_embeddings is True
    with pytest.raises(SpecError, match=r"^--set\[1\]:1:11: moe\.top_k: .*valid integer"):
        load_spec(tiny, ["moe.top_k=8.5"])


def test_override_list_and_null(tiny):
    spec = load_spec(tiny, ["dense_ffn.layers=[0, 1]", "mla.q_lora_rank=null", "training.grad_clip="])
    assert spec.dense_ffn.layers == (0, 1)
    assert spec.mla.q_lora_rank is None
    assert spec.training.grad_clip is None
    rules = load_spec(tiny, ["quantization.rules=[]"]).quantization.rules
    assert rules == ()


def test_override_whole_section_and_new_section(tiny):
    spec = load_spec(tiny, ["parallel.ep=4", "moe.router={scoring: softmax, balancing: aux_loss}"])
    assert spec.parallel.ep == 4 and spec.parallel.dp == 1
    assert spec.moe.router.scoring == "softmax" and spec.moe.router.histogram_bins is None


def test_later_override_wins_and_overrides_beat_extends(tiny, write_spec):
    child = write_spec(f"extends: {tiny.name}\nname: c\nmoe:\n  top_k: 2\n")
    assert load_spec(child).moe.top_k == 2
    assert load_spec(child, ["moe.top_k=8"]).moe.top_k == 8
    assert load_spec(child, ["moe.top_k=8", "moe.top_k=1"]).moe.top_k == 1


def test_override_error_names_the_override(tiny):
    with pytest.raises(SpecError) as e:
        load_spec(tiny, ["moe.top_k=2", "moe.top_k=64"])
    assert e.value.lines == ["--set[2]:1:11: moe.top_k: top_k (64) exceeds num_experts (32)"]


def test_override_value_cannot_smuggle_an_alias_bomb(tiny):
    bomb = "[&a [1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b], " \
           "&d [*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e]]"
    with pytest.raises(SpecError, match="document too large"):
        load_spec(tiny, [f"dense_ffn.layers={bomb}"])


def test_override_huge_integer_is_a_spec_error(tiny):
    with pytest.raises(SpecError, match=r"moe\.top_k: cannot read"):
        load_spec(tiny, ["moe.top_k=" + "9" * 5000])
