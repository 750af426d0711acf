"""The schema on its own: derived layer views, defaults, cross-field checks with their field paths, docs."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from k3compile.spec import schema
from k3compile.spec.load import SpecError, load_spec, load_spec_text
from k3compile.spec.schema import Spec
from k3compile.spec.weights import weight_inventory

MINIMAL = {
    "name": "m",
    "vocab_size": 64,
    "hidden_size": 64,
    "num_layers": 4,
    "context_length": 1024,
    "layout": {"pattern": "KKKM"},
    "kda": {"num_heads": 2, "head_dim": 32, "decay": {"form": "lower_bounded_sigmoid", "lower_bound": -5.0}},
    "mla": {"num_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32},
    "dense_ffn": {"layers": [0], "intermediate_size": 128},
    "moe": {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 64},
    "activation": {"kind": "swiglu"},
}


def make(**changes) -> Spec:
    """MINIMAL with top-level keys replaced (None deletes the key)."""
    data = {**MINIMAL, **changes}
    return Spec.model_validate({k: v for k, v in data.items() if v is not None})


def field_error(**changes) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as e:
        make(**changes)
    (err,) = e.value.errors()
    ctx = err.get("ctx", {}).get("error")
    path = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    return (path + tuple(ctx.path.split(".")) if isinstance(ctx, schema.FieldError) else path), str(ctx or err["msg"])


def test_minimal_spec_defaults():
    s = make()
    assert s.tie_embeddings is False and s.norm_eps == 1e-5 and s.target == "cpu"
    assert s.residual.kind == "plain" and s.quantization.default_weight == "bf16" and s.quantization.block_size == 32
    assert (s.parallel.dp, s.parallel.tp, s.parallel.ep, s.parallel.pp) == (1, 1, 1, 1)
    assert s.moe.router.scoring == "sigmoid" and s.moe.router.balancing == "quantile"
    assert s.kda.short_conv_size == 4 and s.mla.rope is False and s.mla.output_gate is True


def test_pattern_tiles_and_last_layer_is_forced():
    assert make(num_layers=6).mixers == tuple("KKKMKK")
    assert make(num_layers=6, layout={"pattern": "KKKM", "last_layer_full": True}).mixers == tuple("KKKMKM")
    assert make(layout={"layers": ["M", "K", "K", "K"]}).mixers == tuple("MKKK")
    assert make(layout={"layers": ["M", "K", "K", "K"], "last_layer_full": True}).mixers == tuple("MKKM")


def test_dense_and_moe_layers():
    s = make()
    assert s.dense_layers == {0}
    assert [s.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    all_dense = make(moe=None)
    assert all_dense.dense_layers == {0, 1, 2, 3}
    assert make(dense_ffn={"layers": [3, 1], "intermediate_size": 8}).dense_ffn.layers == (1, 3)


def test_frozen_and_hashable():
    s = make()
    with pytest.raises(ValidationError):
        s.hidden_size = 128
    assert hash(s) == hash(make()) and s == make()


@pytest.mark.parametrize(
    "changes, path, fragment",
    [
        ({"parallel": {"tp": 4}}, ("parallel", "tp"), "does not divide kda.num_heads"),
        ({"parallel": {"ep": 3}}, ("parallel", "ep"), "does not divide moe.num_experts"),
        ({"parallel": {"pp": 5}}, ("parallel", "pp"), "exceeds num_layers"),
        ({"num_layers": 2, "layout": {"pattern": "KKKM"}}, ("layout", "pattern"), "longer"),
        ({"layout": {"layers": ["K", "M"]}}, ("layout", "layers"), "2 entries"),
        ({"layout": {"pattern": "M"}, "mla": None}, ("mla",), "no `mla` section"),
        ({"moe": None, "dense_ffn": None}, ("moe",), "give `moe`, `dense_ffn` or both"),
        ({"dense_ffn": {"layers": [0, 1, 2, 3], "intermediate_size": 8}}, ("moe",), "every layer is dense"),
        ({"dense_ffn": {"layers": [7], "intermediate_size": 8}}, ("dense_ffn", "layers"), "out of range"),
        ({"residual": {"kind": "attn_res", "mode": "block", "block_size": 5}}, ("residual", "block_size"), "exceeds"),
        ({"residual": {"kind": "attn_res"}}, ("residual", "kind"), "needs mode"),
        ({"residual": {"kind": "attn_res", "mode": "block"}}, ("residual", "mode"), "need block_size"),
        ({"residual": {"kind": "plain", "block_size": 2}}, ("residual", "kind"), "only apply to kind attn_res"),
        ({"activation": {"kind": "situ_glu", "beta1": 4}}, ("activation", "kind"), "needs beta1 and beta2"),
        ({"activation": {"kind": "swiglu", "beta1": 4}}, ("activation", "kind"), "only apply to situ_glu"),
        ({"kda": {"num_heads": 2, "head_dim": 32, "decay": {"form": "softplus", "lower_bound": -5.0}}},
         ("kda", "decay", "lower_bound"), "only applies"),
        ({"kda": {"num_heads": 2, "head_dim": 32, "decay": {"form": "lower_bounded_sigmoid"}}},
         ("kda", "decay", "lower_bound"), "needs `lower_bound`"),
        ({"mla": {**MINIMAL["mla"], "rope": True, "qk_rope_head_dim": 15}}, ("mla", "qk_rope_head_dim"), "even"),
        ({"mla": {**MINIMAL["mla"], "qk_nope_head_dim": 0, "qk_rope_head_dim": 0}}, ("mla", "qk_nope_head_dim"), "positive"),
        ({"moe": {**MINIMAL["moe"], "num_shared_experts": 1}}, ("moe", "shared_intermediate_size"), "needs"),
        ({"moe": {**MINIMAL["moe"], "router": {"balancing": "aux_loss", "histogram_bins": 100}}},
         ("moe", "router", "histogram_bins"), "only applies to quantile"),
        ({"moe": {**MINIMAL["moe"], "latent_size": 65}}, ("moe", "latent_size"), "wider than hidden_size"),
        ({"training": {"seq_len": 2048}}, ("training", "seq_len"), "exceeds context_length"),
        ({"quantization": {"rules": [{"match": "layers.*.attn.kv_b_proj", "weight": "mxfp4"}], "block_size": 64}},
         ("quantization", "rules"), "input dim 32 is not a multiple of the MX block 64"),
    ],
)
def test_cross_field_checks_name_their_field(changes, path, fragment):
    got_path, msg = field_error(**changes)
    assert got_path == path
    assert fragment in msg


def test_mx_rule_on_dims_that_divide_is_accepted():
    """o_proj reads P = 2 x 32 (KDA) or H x v = 2 x 32 (MLA) = 64 values: one block of 64."""
    s = make(quantization={"rules": [{"match": "layers.*.attn.o_proj", "weight": "mxfp4"}], "block_size": 64})
    mx = [w.name for w in weight_inventory(s) if w.format == "mxfp4"]
    assert mx == [f"layers.{i}.attn.o_proj.weight" for i in range(4)]


@pytest.mark.parametrize("value", [True, False, "yes"])
def test_numbers_refuse_booleans_but_switches_take_them(value):
    """YAML 1.1 reads yes/no/on/off as booleans: a number field must not silently become 1 or 0."""
    with pytest.raises(ValidationError):
        make(hidden_size=value)
    with pytest.raises(ValidationError):
        make(dense_ffn={"layers": [value], "intermediate_size": 8})
    assert make(tie_embeddings=True).tie_embeddings is True


@pytest.mark.parametrize("target", ["cpu", "a100", "h100", "h200", "b200"])
def test_targets(target):
    assert make(target=target).target == target


@pytest.mark.parametrize("name", ["k3", "Kimi-K3.v2_1", "a" * 64])
def test_good_names(name):
    assert make(name=name).name == name


@pytest.mark.parametrize("name", ["", "-x", "a b", "x'); import os; #", "../etc", "a/b", "a" * 65, "név"])
def test_bad_names(name):
    with pytest.raises(ValidationError):
        make(name=name)


def _models() -> list[type[BaseModel]]:
    seen, todo = [], [Spec]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.append(m)
        for f in m.model_fields.values():
            todo.extend(_nested(f.annotation))
    return seen


def _nested(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested(a)]


def test_every_field_is_documented():
    models = _models()
    assert len(models) >= 14  # Spec and its sections
    undocumented = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert undocumented == []
    assert all(m.__doc__ for m in models)


def test_loader_agrees_with_schema_on_valid_text():
    import yaml

    assert load_spec_text(yaml.safe_dump(MINIMAL)) == make()
    with pytest.raises(SpecError):
        load_spec_text(yaml.safe_dump({**MINIMAL, "num_layers": 0}))


def test_shipped_specs_round_trip_through_model_dump(shipped_spec):
    spec = load_spec(shipped_spec)
    assert Spec.model_validate(spec.model_dump()) == spec
