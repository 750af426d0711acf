"""Generation: decode-after-prefill equals a full forward, checkpoint packing, sampling, streaming, bad input,
and the decode benchmark's cache-bytes facts (KDA constant in context, MLA linear in the cache length)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from k3compile.runtime import checkpoint as ckpt_io
from k3compile.runtime.generate import (
    GenerateError,
    generate_batch,
    generate_tokens,
    load_inference_model,
    sample_next,
    stream_text,
    top_p_filter,
)

ROOT = Path(__file__).resolve().parents[2]
K3_TINY = ROOT / "specs" / "k3-tiny.yaml"
ALL_MLA = ROOT / "specs" / "ablations" / "all-mla.yaml"
BENCH = ROOT / "bench" / "decode_cpu.py"
# k3-tiny's features (KKKM with a final M, block AttnRes, latent MoE with MXFP4 experts) at toy width
SMALL = [
    "hidden_size=64", "num_layers=4", "context_length=128", "training.seq_len=64",
    "kda.num_heads=2", "kda.head_dim=32",
    "mla.num_heads=2", "mla.q_lora_rank=32", "mla.kv_lora_rank=32", "mla.qk_nope_head_dim=16",
    "mla.qk_rope_head_dim=16", "mla.v_head_dim=32",
    "dense_ffn.intermediate_size=128", "moe.num_experts=8", "moe.top_k=2", "moe.expert_intermediate_size=64",
    "moe.shared_intermediate_size=64", "moe.latent_size=32",
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def small_spec():
    from k3compile.spec.load import load_spec

    return load_spec(K3_TINY, SMALL)


@pytest.fixture(scope="module")
def small_build(small_spec, tmp_path_factory):
    """The small spec built once (both modes): (package dir, imported package)."""
    from k3compile.build import build
    from k3compile.loader import load

    dest, _ = build(small_spec, tmp_path_factory.mktemp("gen") / "out")
    return dest, load(dest)


@pytest.fixture(scope="module")
def seeded(small_build):
    return load_inference_model(small_build[1])


@pytest.fixture(scope="module")
def trained_ckpt(small_build, tmp_path_factory):
    """A checkpoint as the trainer writes it, of a perturbed training Model (so it differs from the init)."""
    package = small_build[1]
    model = package.Model()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    meta = {"spec_name": model.spec.name, "spec": model.spec.model_dump(mode="json")}
    path = ckpt_io.save(tmp_path_factory.mktemp("ckpt") / "checkpoints", 7, ckpt_io.model_tensors(model), meta)
    return path, model.state_dict()


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- decode after prefill == full forward


def test_inference_model_decode_after_prefill_matches_full_forward(seeded):
    tokens = torch.tensor([prompt_ids(41)])
    with torch.no_grad():
        full = seeded(tokens)  # the prefill graph, MX-packed weights
        _, cache = seeded.prefill(tokens[:, :24], max_len=41)
        for t in range(24, 41):
            logits, cache = seeded.decode(tokens[:, t], cache)
    assert cache.lengths == [41]
    assert rel_err(logits[0, -1], full[0, -1]) < 1e-4


def test_generate_loop_prefill_and_decode_steps_match_full_forward(seeded):
    tokens = prompt_ids(44, seed=2)
    with torch.no_grad():
        full = seeded(torch.tensor([tokens]))[0]
        logits, cache = seeded.prefill(torch.tensor([tokens[:40]]), max_len=44)
        assert rel_err(logits[0, -1], full[39]) < 1e-4
        for t in range(40, 44):
            logits, cache = seeded.decode(torch.tensor([tokens[t]]), cache)
            assert rel_err(logits[0, -1], full[t]) < 1e-4


def test_greedy_generation_is_the_argmax_of_full_forwards(seeded):
    prompt = prompt_ids(10, seed=3)
    out = list(generate_tokens(seeded, prompt, 3, temperature=0.0))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(3):
            seq.append(int(seeded(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[10:]


def test_batched_generation_of_prompts_of_different_lengths_equals_one_at_a_time(seeded):
    prompts = [prompt_ids(n, seed=n) for n in (3, 11, 7)]
    together = generate_batch(seeded, prompts, 5)
    alone = [list(generate_tokens(seeded, p, 5)) for p in prompts]
    assert together == alone


def test_decoding_writes_only_the_new_row_of_the_static_cache(seeded):
    """The MLA cache is preallocated and updated in place: one decode step writes row `position` and no other."""
    with torch.no_grad():
        _, cache = seeded.prefill(torch.tensor([prompt_ids(12)]), max_len=20)
        before = {k: v.clone() for k, v in cache.tensors.items()}
        _, after = seeded.decode(torch.tensor([5]), cache)
    assert after is cache and cache.lengths == [13]
    for name, old in before.items():
        new = cache.tensors[name]
        assert new.shape == old.shape, name
        if name.startswith("mla_cache"):
            assert torch.equal(new[:, :12], old[:, :12]) and torch.equal(new[:, 13:], old[:, 13:]), name
            assert not torch.equal(new[:, 12], old[:, 12]), name


# ---------------------------------------------------------------- checkpoint conversion


def test_converting_the_seeded_training_weights_gives_the_seeded_inference_model(small_build, seeded, tmp_path):
    package = small_build[1]
    model = package.Model()
    path = ckpt_io.save(tmp_path, 1, ckpt_io.model_tensors(model), {"spec_name": model.spec.name})
    converted = load_inference_model(package, path).state_dict()
    expected = seeded.state_dict()
    assert converted.keys() == expected.keys()
    assert any(k.endswith("_mx") for k in expected)
    for k, v in expected.items():
        assert torch.equal(converted[k], v), k


def test_converted_checkpoint_dequantises_to_the_mx_rounded_training_weights(small_build, trained_ckpt):
    from k3compile.kernels.mx.op import mx_fake_quantize

    path, train_state = trained_ckpt
    model = load_inference_model(small_build[1], path)
    dec = model.dense_state_dict()
    assert model.PACKED
    for k, v in train_state.items():
        if k in model.PACKED:
            want = mx_fake_quantize(v, model.PACKED[k]["fmt"], model.PACKED[k]["block"])
            assert torch.equal(dec[k], want), k
            assert not torch.equal(dec[k], v)
        else:
            assert torch.equal(dec[k], v), k


def test_a_train_only_build_is_refused_for_serving(small_build, trained_ckpt):
    package = small_build[1]
    train_only = types.ModuleType("train_only")
    train_only.Model, train_only.SPEC_JSON = package.Model, package.SPEC_JSON
    with pytest.raises(GenerateError, match="train-only build has no InferenceModel"):
        load_inference_model(train_only, trained_ckpt[0])


def test_the_training_output_folder_finds_its_newest_checkpoint(small_build, trained_ckpt):
    path, _ = trained_ckpt
    out = path.parent.parent  # OUT/checkpoints/step-000007.json -> OUT
    a = load_inference_model(small_build[1], out).state_dict()
    b = load_inference_model(small_build[1], path.with_suffix(".safetensors")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- sampling and streaming


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    for top_p, kept in [
        (0.7, [False, True, False, True]),  # 0.5 + 0.3 reaches 0.7
        (0.5, [False, True, False, False]),  # 0.5 alone reaches 0.5
        (0.81, [False, True, True, True]),  # 0.95 is the first sum to reach 0.81
        (1.0, [True, True, True, True]),
    ]:
        assert torch.equal(top_p_filter(probs, top_p), probs * torch.tensor(kept)), top_p


def test_sampling_is_seeded_never_picks_outside_the_nucleus_and_follows_its_weights():
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()

    def draw(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample_next(logits, 1.0, 0.7, gen) for _ in range(2000)]

    a = draw(0)
    assert a == draw(0)
    assert set(a) == {1, 3}
    assert abs(a.count(1) / len(a) - 0.5 / 0.8) < 0.04  # renormalised nucleus: 0.625
    assert sample_next(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0.0, 0.1, torch.Generator()) == 1  # greedy, first max
    assert sample_next(torch.tensor([1.0, 2.0, 3.0, 0.0]), 1e-300, 1.0, torch.Generator()) == 2  # overflow: greedy


def test_generation_is_reproducible_by_seed(seeded):
    prompt = prompt_ids(6)
    run = lambda seed: list(generate_tokens(seeded, prompt, 6, temperature=1.0, top_p=0.9, seed=seed))
    first = run(4)
    assert first == run(4)
    assert first != run(5)


def test_stream_holds_bytes_until_they_form_a_character():
    writes, seen = [], []

    def tokens():
        for b in "a€b".encode() + b"\xff" + "é".encode()[:1]:
            seen.append(b)
            yield b

    stream_text(tokens(), lambda text: writes.append((len(seen), text)))
    # '€' is e2 82 ac: nothing is written until its third byte; 0xff is invalid; a dangling lead byte ends as U+FFFD
    assert writes == [(1, "a"), (4, "€"), (5, "b"), (6, "\ufffd"), (7, "\ufffd")]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "prompt, n, kwargs, message",
    [
        ([], 4, {}, "prompt is empty"),
        ([3, 256], 4, {}, "token id 256 is outside the vocabulary [0, 256)"),
        ([-1], 4, {}, "token id -1"),
        ([1] * 100, 29, {}, "= 129 exceeds the spec's context_length 128"),
        ([1], 4, {"temperature": -0.5}, "temperature"),
        ([1], 4, {"top_p": 0.0}, "top-p"),
    ],
)
def test_bad_requests_are_refused_before_any_work(seeded, prompt, n, kwargs, message):
    with pytest.raises(GenerateError) as e:
        next(generate_tokens(seeded, prompt, n, **kwargs))
    assert message in str(e.value)


def _one_line_error(cli, *argv) -> str:
    rc, out, err = cli("generate", *argv)
    assert rc == 2 and out == ""
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    return err


def test_cli_bad_input_is_one_line_and_exit_2(cli, small_build, trained_ckpt, tmp_path):
    build = small_build[0]
    assert "prompt is empty" in _one_line_error(cli, build, "--prompt", "")
    assert "exceeds the spec's context_length 128" in _one_line_error(cli, build, "--prompt", "x" * 100,
                                                                       "--max-new-tokens", "29")
    assert "is not a k3compile build" in _one_line_error(cli, tmp_path, "--prompt", "hi")
    ok = ("--prompt", "hi", "--max-new-tokens", "4")
    assert "does not exist" in _one_line_error(cli, build, *ok, "--checkpoint", tmp_path / "none")
    # a corrupted checkpoint: flip a byte of the tensor file (CRC), truncate it, or garble the JSON
    path, _ = trained_ckpt
    for damage, words in [("flip", "CRC-32"), ("truncate", "truncated"), ("json", "corrupted")]:
        bad = tmp_path / damage
        bad.mkdir()
        payload, record = path.with_suffix(".safetensors").read_bytes(), path.read_bytes()
        if damage == "flip":
            payload = payload[:-1] + bytes([payload[-1] ^ 1])
        elif damage == "truncate":
            payload = payload[: len(payload) // 2]
        else:
            record = record[:10]
        (bad / path.with_suffix(".safetensors").name).write_bytes(payload)
        (bad / path.name).write_bytes(record)
        assert words in _one_line_error(cli, build, *ok, "--checkpoint", bad / path.name)


def test_a_checkpoint_of_another_model_is_refused(small_build, tmp_path):
    from k3compile.spec.load import load_spec

    other = load_spec(K3_TINY, SMALL + ["num_layers=5"])
    model = small_build[1].Model()
    tensors = ckpt_io.model_tensors(model)
    tensors["model/layers.4.attn.A_log"] = torch.zeros(2)
    path = ckpt_io.save(tmp_path / "a", 1, tensors, {"spec_name": "other"})
    with pytest.raises(GenerateError, match=r"does not match the build: unexpected layers\.4\.attn\.A_log"):
        load_inference_model(small_build[1], path)
    path = ckpt_io.save(tmp_path / "b", 1, ckpt_io.model_tensors(model), {"spec": other.model_dump(mode="json")})
    with pytest.raises(GenerateError, match="whose num_layers differ"):
        load_inference_model(small_build[1], path)


# ---------------------------------------------------------------- the command


def test_cli_streams_the_greedy_continuation(cli, small_build, seeded, trained_ckpt):
    prompt = "Hi é"
    rc, out, err = cli("generate", small_build[0], "--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0")
    assert rc == 0, err
    assert "seeded initial weights" in err
    ids = list(generate_tokens(seeded, list(prompt.encode()), 4))
    text = []
    stream_text(ids, text.append)
    assert out == "".join(text) + "\n"
    path, _ = trained_ckpt
    rc, out2, err = cli("generate", small_build[0], "--checkpoint", path, "--prompt", prompt, "--max-new-tokens", "4",
                        "--temperature", "0.7", "--seed", "3")
    assert rc == 0 and "seeded" not in err and out2.endswith("\n")


# ---------------------------------------------------------------- the decode benchmark's cache facts


def _bench():
    spec = importlib.util.spec_from_file_location("decode_cpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def bench_models(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return {name: bench.build_model(path, out / name) for name, path in (("k3-tiny", K3_TINY), ("all-mla", ALL_MLA))}


def test_kda_cache_is_constant_in_context_and_all_mla_grows_linearly(bench, bench_models):
    contexts = [4, 8, 12]
    hybrid = bench.cache_bytes_by_context(bench_models["k3-tiny"], contexts)
    all_mla = bench.cache_bytes_by_context(bench_models["all-mla"], contexts)
    # k3-tiny: 6 KDA layers x (fp32 state 4 heads x 64 x 64, plus 3 conv tails of 256 channels x 3 taps, fp32)
    kda = 6 * (4 * 64 * 64 + 3 * 256 * 3) * 4
    # an MLA layer caches kv_lora_rank + qk_rope_head_dim = 64 + 32 fp32 values a token
    for n in contexts:
        assert hybrid[n] == {"kda_state": kda, "mla_latent": 2 * 96 * 4 * n, "total": kda + 2 * 96 * 4 * n}
        assert all_mla[n] == {"kda_state": 0, "mla_latent": 8 * 96 * 4 * n, "total": 8 * 96 * 4 * n}


def test_bench_rows_have_the_same_bytes_whether_the_cache_is_prefilled_or_tiled(bench, bench_models):
    model = bench_models["k3-tiny"]
    tiled = bench.measure(model, [6, 13], steps=1, fill="tile")
    real = bench.measure(model, [6, 13], steps=1, fill="prefill")
    assert [r["context"] for r in tiled] == [6, 13]
    keys = ("context", "kda_state", "mla_latent", "total")
    for a, b in zip(tiled, real, strict=True):
        assert [a[k] for k in keys] == [b[k] for k in keys]
        assert a["graph_tok_s"] > 0 and a["total"] == a["kda_state"] + a["mla_latent"]
    assert "| k3-tiny | 13 |" in bench.render({"k3-tiny": tiled})


def test_a_shapes_only_build_says_it_has_no_weights(cli, small_spec, tmp_path):
    """The README's headline build (kimi-k3) lowers on the meta device; here a small spec forced there."""
    from k3compile.build import BuildOptions, build

    dest, _ = build(small_spec, tmp_path, BuildOptions(device="meta"))
    err = _one_line_error(cli, dest, "--prompt", "hi", "--max-new-tokens", "4")
    assert "has no weights (a shapes-only build" in err and "--checkpoint" in err


def test_prompt_bytes_that_are_not_utf8_are_the_tokens_they_name(cli, small_build, seeded):
    """A shell passes undecodable argv bytes as surrogate escapes: they are the prompt's bytes, not an error."""
    from k3compile.runtime.generate import encode

    assert encode("a\udcff") == [97, 255]
    rc, out, err = cli("generate", small_build[0], "--prompt", "a\udcff", "--max-new-tokens", "2", "--temperature", "0")
    assert rc == 0 and "Traceback" not in err, err
    text = []
    stream_text(generate_tokens(seeded, [97, 255], 2), text.append)
    assert out == "".join(text) + "\n"
    with pytest.raises(GenerateError, match="not text: it holds a lone surrogate"):
        encode("\ud800")


@pytest.mark.parametrize("seed", [str(2**64), str(-(2**63) - 1)])
def test_a_seed_out_of_range_is_one_line(cli, small_build, seed):
    err = _one_line_error(cli, small_build[0], "--prompt", "hi", "--max-new-tokens", "4", f"--seed={seed}")
    assert "--seed must be an integer in [-2^63, 2^64)" in err
