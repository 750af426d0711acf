"""The published conventions as spec fields: MLA latent-norm epsilon and the fp32 tensors of a bf16 policy."""

from __future__ import annotations

import pytest
import torch

from k3compile.modules.mla import MLAMixer
from k3compile.modules.model import make_mixer
from k3compile.runtime.generate import load_build
from k3compile.spec.load import load_spec
from k3compile.spec.schema import MLA, Quantization
from k3compile.spec.weights import keeps_fp32, weight_inventory

KEPT = ("router.weight", "router.bias", "A_log", "dt_bias")


def test_latent_norm_eps_default_is_the_published_one():
    assert MLA.model_fields["latent_norm_eps"].default == 1e-6


@pytest.mark.parametrize(
    "spec_file, eps", [("kimi-linear-48b-a3b.yaml", 1e-6), ("kimi-k3.yaml", 1e-5), ("k3-tiny.yaml", 1e-5)]
)
def test_shipped_specs_latent_norm_eps_reaches_the_mixer(specs_dir, spec_file, eps):
    spec = load_spec(specs_dir / spec_file)
    assert spec.mla.latent_norm_eps == eps
    layer = spec.mixers.index("M")
    with torch.device("meta"):
        mixer = make_mixer(spec, layer)
    norms = [mixer.kv_a_norm] + ([mixer.q_a_norm] if spec.mla.q_lora_rank else [])
    assert all(n.eps == eps for n in norms)
    assert spec.norm_eps == 1e-5  # the other norms keep norm_eps


def test_mla_module_latent_eps_defaults_to_norm_eps():
    m = MLAMixer(16, 2, 8, 8, 4, 4, 6, norm_eps=1e-3)
    assert m.q_a_norm.eps == m.kv_a_norm.eps == 1e-3
    assert MLAMixer(16, 2, 8, 8, 4, 4, 6, norm_eps=1e-3, latent_norm_eps=1e-6).kv_a_norm.eps == 1e-6


def test_keep_fp32_defaults_to_transformers_convention(specs_dir):
    assert Quantization().keep_fp32 == tuple(f"*.{k}" for k in KEPT)
    spec = load_spec(specs_dir / "kimi-linear-48b-a3b.yaml")
    formats = {w.name: w.format for w in weight_inventory(spec)}
    assert {n for n, f in formats.items() if f == "fp32"} == {n for n in formats if n.endswith(KEPT)}
    assert {f for n, f in formats.items() if not n.endswith(KEPT)} == {"bf16"}
    assert keeps_fp32(spec, "layers.1.moe.router.bias")  # a buffer, named all the same
    plain = load_spec(specs_dir / "kimi-linear-48b-a3b.yaml", ["quantization.keep_fp32=[]"])
    assert {w.format for w in weight_inventory(plain)} == {"bf16"}
    mx_router = load_spec(specs_dir / "kimi-linear-48b-a3b.yaml",
                          ['quantization.rules=[{match: "layers.*.moe.router", weight: mxfp8}]'])  # fmt: skip
    assert {w.format for w in weight_inventory(mx_router) if w.name.endswith("router.weight")} == {"mxfp8"}


def test_bf16_models_keep_the_named_tensors_fp32(imported, tokens):
    module = load_build(imported / "build" / "tiny_kimi")
    reference = module.Model()
    made = module.Model(dtype=torch.bfloat16)
    cast = module.Model().to(torch.bfloat16)
    for model in (made, cast):
        dtypes = {n: t.dtype for n, t in model.state_dict().items()}
        assert {n for n, d in dtypes.items() if d == torch.float32} == {n for n in dtypes if n.endswith(KEPT)}
        assert {d for n, d in dtypes.items() if not n.endswith(KEPT)} == {torch.bfloat16}
        assert model(tokens).dtype == torch.bfloat16
    kept = {n: t for n, t in cast.state_dict().items() if n.endswith(KEPT)}
    assert all(torch.equal(t, reference.state_dict()[n]) for n, t in kept.items())  # exact, not rounded to bf16
    assert cast.double().state_dict()["layers.1.moe.router.weight"].dtype == torch.float64  # wider casts apply
