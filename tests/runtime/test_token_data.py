"""Training on tokens: token-id files (.npy, .bin with its dtype; memory-mapped) and text encoded by a tokenizers
JSON; ids outside the vocabulary and unusable files are one-line errors (exit 2)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from k3compile.runtime.data import load_tokens

IDS = np.random.default_rng(0).integers(0, 256, 3000)  # the small build's vocabulary is 256


def _trained(cli, build, out, *args) -> list[dict]:
    rc, _, err = cli("train", build, "--steps", "2", "--out", out, "--no-progress", *args)
    assert rc == 0, err
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trains_two_steps_on_a_npy_and_on_a_bin_token_file(small_build, tmp_path, cli):
    np.save(tmp_path / "ids.npy", IDS.astype(np.int32))
    IDS.astype(np.uint16).tofile(tmp_path / "ids.bin")
    for data, extra in (("ids.npy", ()), ("ids.bin", ("--data-dtype", "uint16"))):
        records = _trained(cli, small_build, tmp_path / data.replace(".", "-"), "--data", tmp_path / data, *extra)
        assert [r["step"] for r in records] == [1, 2] and np.isfinite(records[-1]["val_loss"])
    mapped = load_tokens(tmp_path / "ids.bin", 256, dtype="uint16").tokens
    assert mapped.numel() == IDS.size and mapped[:10].long().tolist() == IDS[:10].tolist()


def test_trains_two_steps_on_text_through_a_tokenizer(small_build, small_corpus, tmp_path, cli):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = re.findall(r"\w+|[^\w\s]", small_corpus.read_text())
    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(sorted(set(words))[:200])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    folder = tmp_path / "tok"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    corpus = load_tokens(small_corpus, 256, tokenizer=folder)
    assert corpus.tokens.tolist()[:50] == tokenizer.encode(small_corpus.read_text()).ids[:50]
    records = _trained(cli, small_build, tmp_path / "run", "--data", small_corpus, "--tokenizer", folder)
    assert [r["step"] for r in records] == [1, 2]


@pytest.mark.parametrize("case", ["id past the vocabulary", "negative id", "bin without dtype", "2-d array",
                                  "not a tokenizer"])  # fmt: skip
def test_bad_token_data_is_one_line_exit_2(case, small_build, small_corpus, tmp_path, cli):
    args = []
    if case == "id past the vocabulary":
        np.save(tmp_path / "ids.npy", np.append(IDS, 256).astype(np.int32))
        args = ["--data", tmp_path / "ids.npy"]
    elif case == "negative id":
        np.save(tmp_path / "ids.npy", np.append(IDS, -1).astype(np.int64))
        args = ["--data", tmp_path / "ids.npy"]
    elif case == "bin without dtype":
        IDS.astype(np.uint16).tofile(tmp_path / "ids.bin")
        args = ["--data", tmp_path / "ids.bin"]
    elif case == "2-d array":
        np.save(tmp_path / "ids.npy", IDS.reshape(2, -1))
        args = ["--data", tmp_path / "ids.npy"]
    else:
        (tmp_path / "tok.json").write_text("{}")
        args = ["--data", small_corpus, "--tokenizer", tmp_path / "tok.json"]
    rc, _, err = cli("train", small_build, "--steps", "2", "--out", tmp_path / "run", *args)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
