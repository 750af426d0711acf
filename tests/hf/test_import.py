"""import-hf against transformers' Kimi Linear: every tensor taken, logits within 1e-5, greedy tokens equal,
the weights read by generate and train, MX packing for inference, and one-line errors that write nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3compile.hf.convert import ffn_prefixes
from k3compile.hf.layout import tensor_pairs
from k3compile.runtime.generate import load_build, load_inference_model, read_training_state
from k3compile.runtime.shards import ShardReader
from k3compile.spec.load import load_spec

NEW_TOKENS = 32


def _model(out):
    """The build's training Model holding the imported weights (strict load)."""
    module = load_build(out / "build" / "tiny_kimi")
    model = module.Model(device="meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = read_training_state(out, shapes, model.spec)
    model = module.Model()
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_every_tensor_is_taken_none_left_over(hf_model, imported):
    _, hf_dir = hf_model
    source = ShardReader(hf_dir, "model")
    assert len({source.shard[n] for n in source.names}) >= 2  # the checkpoint came in shards
    spec = load_spec(imported / "spec.yaml")
    pairs, orphans = tensor_pairs(spec, ffn_prefixes(source, spec))  # transformers saves layer 0 as block_sparse_moe
    assert not orphans
    assert sorted(h for p in pairs for h in p.hf) == sorted(source.names)  # no missing, no unexpected
    weights = ShardReader(imported, "weights")
    model = load_build(imported / "build" / "tiny_kimi").Model(device="meta")
    assert set(weights.names) == set(model.state_dict()) == {p.name for p in pairs}
    _model(imported)  # load_state_dict(strict=True) accepts them


def test_logits_match_transformers(hf_model, imported, tokens, rel_max):
    hf, _ = hf_model
    with torch.no_grad():
        ref = hf(tokens).logits
        train_logits = _model(imported)(tokens)
        infer_logits = load_inference_model(imported / "build" / "tiny_kimi", imported)(tokens)
    assert rel_max(train_logits, ref) < 1e-5
    assert rel_max(infer_logits, ref) < 1e-5


def test_capacity_binds_on_this_draw_and_set_overrides_the_drop_free_default(hf_model, imported, tokens, tmp_path, k3, rel_max):
    """The import is drop-free by default (n/k); with the schema's 1.25 these tokens overflow an expert buffer."""
    hf, hf_dir = hf_model
    assert load_spec(imported / "spec.yaml").moe.capacity_factor == 8 / 2
    binding = tmp_path / "binding"
    assert k3("import-hf", hf_dir, "-o", binding, "--mode", "train", "--set", "moe.capacity_factor=1.25") == 0
    assert load_spec(binding / "spec.yaml").moe.capacity_factor == 1.25
    with torch.no_grad():
        ref = hf(tokens).logits
        assert rel_max(_model(binding)(tokens), ref) > 1e-3  # dropped choices change the logits
        assert rel_max(_model(imported)(tokens), ref) < 1e-5


def test_greedy_generation_matches_transformers(hf_model, imported, tokens):
    hf, _ = hf_model
    prompt = tokens[:1, :10]
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:].tolist()
        model = load_inference_model(imported / "build" / "tiny_kimi", imported)
        logits, cache = model.prefill(prompt)
        got = []
        for _ in range(NEW_TOKENS):
            got.append(int(logits[0, -1].argmax()))
            logits, cache = model.decode(torch.tensor([got[-1:]]), cache)
    assert len(expected) == NEW_TOKENS
    assert got == expected


def test_generate_and_train_read_the_import(hf_model, imported, tmp_path, k3):
    build = imported / "build" / "tiny_kimi"
    assert k3("generate", build, "--checkpoint", imported, "--prompt", "def", "--max-new-tokens", 4,
              "--temperature", 0) == 0  # fmt: skip
    data = tmp_path / "data.txt"
    data.write_text("def main():\n    return 0\n" * 200)
    run = tmp_path / "run"
    assert k3("train", build, "--init-from", imported, "--steps", 1, "--data", data, "--out", run,
              "--set", "training.batch_size=2", "--set", "training.seq_len=32", "--set", "training.lr=1e-9") == 0  # fmt: skip
    # the run started from the imported weights: one step at lr 1e-9 leaves them where they were
    hf, _ = hf_model
    back = tmp_path / "hf"
    assert k3("export-hf", build, "--checkpoint", run, "-o", back) == 0
    from transformers import KimiLinearForCausalLM

    reloaded = KimiLinearForCausalLM.from_pretrained(back).state_dict()
    for name, t in hf.state_dict().items():
        tol = 2e-3 if name.endswith("e_score_correction_bias") else 1e-6  # one bias_sign step of 1e-3
        assert torch.allclose(reloaded[name], t, atol=tol), name


def test_bf16_checkpoint_to_packed_inference_weights(make_hf_model, tmp_path, k3, tokens):
    """A bf16 checkpoint imported for an inference build with MXFP4 experts: packed on the fly, the tensors
    of quantization.keep_fp32 in fp32, the rest as stored; InferenceModel takes them as they are."""
    hf = make_hf_model(seed=2).to(torch.bfloat16)
    hf_dir, out = tmp_path / "bf16", tmp_path / "out"
    hf.save_pretrained(hf_dir, max_shard_size="100KB")
    assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "bfloat16"
    rule = '[{match: "layers.*.moe.experts.*", weight: mxfp4}]'
    assert k3("import-hf", hf_dir, "-o", out, "--name", "tiny-kimi", "--mode", "infer",
              "--set", f"quantization.rules={rule}") == 0
    weights = ShardReader(out, "weights")
    assert weights.metadata["class"] == "InferenceModel"
    assert weights.dtype["layers.1.moe.experts.up_proj.weight_mx"] == "U8"
    assert "layers.1.moe.experts.up_proj.weight" not in weights.names
    kept = {n for n in weights.names if n.endswith(("router.weight", "router.bias", "A_log", "dt_bias"))}
    assert kept and all(weights.dtype[n] == "F32" for n in kept)
    assert {weights.dtype[n] for n in weights.names if n not in kept and "_mx" not in n and "_scale" not in n} == {"BF16"}
    model = load_inference_model(out / "build" / "tiny_kimi", out)  # strict load of the packed state
    from k3compile.kernels.mx.op import mx_quantize

    up = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"][:, 32:]  # transformers' [E, gate | up, D]
    data, scale = mx_quantize(up.float(), "e2m1", 32)
    packed = dict(model.named_buffers())
    assert torch.equal(packed["layers.1.moe.experts.up_proj.weight_mx"], data.view(torch.uint8))
    assert torch.equal(packed["layers.1.moe.experts.up_proj.weight_scale"], scale.view(torch.uint8))
    both = tmp_path / "both"  # the same import for training: packed when the InferenceModel loads it instead
    assert k3("import-hf", hf_dir, "-o", both, "--name", "tiny-kimi", "--set", f"quantization.rules={rule}") == 0
    with torch.no_grad():
        assert torch.equal(model(tokens), load_inference_model(both / "build" / "tiny_kimi", both)(tokens))
    assert k3("generate", out / "build" / "tiny_kimi", "--checkpoint", out, "--prompt", "x",
              "--max-new-tokens", 2) == 0  # fmt: skip


def _break(kind: str, hf_dir):
    """Damage a copy of the checkpoint in one way."""
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    if kind == "missing shard":
        (hf_dir / index["model.layers.2.self_attn.q_proj.weight"]).unlink()
        return "is missing"
    if kind in ("wrong shape", "wrong dtype"):
        name = "model.layers.3.self_attn.kv_b_proj.weight"
        shard = hf_dir / index[name]
        tensors = load_file(shard)
        tensors[name] = tensors[name].t().contiguous() if kind == "wrong shape" else tensors[name].half()
        save_file(tensors, shard, metadata={"format": "pt"})
        return "shape (checkpoint vs model) model.layers.3.self_attn.kv_b_proj.weight" if kind == "wrong shape" else "F16"
    config = json.loads((hf_dir / "config.json").read_text())
    edit, needle = {
        "model type": ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        "unknown field": ({"sliding_window": 4096}, "'sliding_window'"),
        "group routing": ({"num_expert_group": 2, "topk_group": 1}, "num_expert_group=2"),
        "gelu": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    }[kind]
    (hf_dir / "config.json").write_text(json.dumps({**config, **edit}))
    return needle


@pytest.mark.parametrize(
    "kind", ["missing shard", "wrong shape", "wrong dtype", "model type", "unknown field", "group routing", "gelu"]
)
def test_bad_checkpoints_are_one_line_errors_and_write_nothing(hf_model, tmp_path, kind, cli):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_model[1], hf_dir)
    needle = _break(kind, hf_dir)
    out = tmp_path / "deep" / "out"
    rc, stdout, err = cli("import-hf", hf_dir, "-o", out)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert not (tmp_path / "deep").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_output_must_be_absent_or_empty(hf_model, tmp_path, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    rc, _, err = cli("import-hf", hf_model[1], "-o", out)
    assert rc == 2 and "not an empty folder" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_the_tokenizer_files_are_copied(hf_model, tmp_path, k3):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    _, hf_dir = hf_model
    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    Tokenizer(WordLevel({"[UNK]": 0, "def": 1, "main": 2}, unk_token="[UNK]")).save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    assert k3("import-hf", source, "-o", tmp_path / "out", "--mode", "train") == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes()
    assert not (tmp_path / "out" / "merges.txt").exists()
