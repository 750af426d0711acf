"""Bad specs: each problem is one line `file:line:col: field.path: what is wrong`, exit code 2, never a traceback.

Every case edits a small valid spec (BASE, line numbers below) and states where the error must point.
Most cases run `k3compile.cli.main` in-process; a few run the real command in a subprocess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

BASE_LINES = """\
name: t
vocab_size: 64
hidden_size: 64
num_layers: 4
context_length: 1024
layout:
  pattern: KKKM
kda:
  num_heads: 2
  head_dim: 32
  decay:
    form: lower_bounded_sigmoid
    lower_bound: -5.0
mla:
  num_heads: 2
  kv_lora_rank: 32
  qk_nope_head_dim: 16
  qk_rope_head_dim: 16
  v_head_dim: 32
dense_ffn:
  layers: [0]
  intermediate_size: 128
moe:
  num_experts: 8
  top_k: 2
  expert_intermediate_size: 64
activation:
  kind: situ_glu
  beta1: 4
  beta2: 25
quantization:
  rules:
    - match: "layers.*.moe.experts.*"
      weight: mxfp4
training:
  seq_len: 256
""".splitlines()
BASE = "\n".join(BASE_LINES) + "\n"

LINE_RE = re.compile(r"^error: (?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<path>\S+): (?P<msg>.+)$")


def edit(replace: dict[int, str] | None = None, delete: tuple[int, ...] = (), append: str = "") -> str:
    """BASE with 1-based lines replaced (a replacement may span several lines), deleted, or text appended."""
    out = []
    for n, line in enumerate(BASE_LINES, 1):
        if n in delete:
            continue
        out.append((replace or {}).get(n, line))
    return "\n".join(out) + "\n" + append


@dataclass
class Case:
    id: str
    files: dict[str, str | bytes]  # written under tmp_path (the working directory of the run)
    args: list[str]  # after `check`
    file: str
    line: int
    col: int
    path: str
    fragment: str  # part of the message


def spec_case(id, text, line, col, path, fragment, *, overrides=()):
    args = ["spec.yaml"] + [a for o in overrides for a in ("--set", o)]
    return Case(id, {"spec.yaml": text}, args, "spec.yaml", line, col, path, fragment)


def override_case(id, overrides, index, col, path, fragment):
    args = ["spec.yaml"] + [a for o in overrides for a in ("--set", o)]
    return Case(id, {"spec.yaml": BASE}, args, f"--set[{index}]", 1, col, path, fragment)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")
)

CASES = [
    # --- YAML level
    spec_case("yaml-syntax", edit({10: " head_dim: 32"}), 10, 2, "<yaml>", "invalid YAML"),
    spec_case("duplicate-key", edit({3: "hidden_size: 64\nhidden_size: 128"}), 4, 1, "hidden_size", "duplicate key"),
    spec_case("top-level-list", "- name: t\n- vocab_size: 64\n", 1, 1, "<spec>", "top level must be a mapping"),
    spec_case("top-level-scalar", "just some text\n", 1, 1, "<spec>", "top level must be a mapping"),
    spec_case("empty-file", "", 1, 1, "<spec>", "the file is empty"),
    spec_case("comments-only", "# nothing here\n\n", 1, 1, "<spec>", "the file is empty"),
    spec_case("alias-bomb", BOMB, 1, 8, "<spec>", "document too large"),
    spec_case("deep-nesting", "a: " + "[" * 2000 + "]" * 2000 + "\n", 1, 1, "<yaml>", "nesting too deep"),
    spec_case("python-tag", edit({1: "name: !!python/object/apply:os.system [ls]"}), 1, 7, "name", "unsupported YAML tag"),
    spec_case("timestamp", edit({1: "name: 2024-01-01"}), 1, 7, "name", "unsupported YAML value"),
    spec_case("huge-integer", edit({3: "hidden_size: " + "9" * 5000}), 3, 14, "hidden_size", "cannot read"),
    spec_case("bad-int-tag", edit({3: "hidden_size: !!int abc"}), 3, 14, "hidden_size", "cannot read"),
    Case("not-utf8", {"spec.yaml": b"name: \xff\xfe\n"}, ["spec.yaml"], "spec.yaml", 1, 1, "<spec>", "not UTF-8"),
    Case("directory", {"d/x.yaml": BASE}, ["d"], "d", 1, 1, "<spec>", "is a directory"),
    Case("missing-file", {}, ["nofile.yaml"], "nofile.yaml", 1, 1, "<spec>", "no such file"),
    # --- schema: keys and types
    spec_case("unknown-key", edit({3: "hidden_size: 64\nhidden_sise: 64"}), 4, 1, "hidden_sise",
              "unknown field 'hidden_sise'; did you mean 'hidden_size'?"),
    spec_case("unknown-nested-key", edit({25: "  top_k: 2\n  topk: 2"}), 26, 3, "moe.topk",
              "unknown field 'topk'; did you mean 'top_k'?"),
    spec_case("key-with-bracket", edit(append='"0[": 1\n'), 37, 1, "0[", "unknown field '0['"),
    spec_case("key-with-newline", edit(append='"a\\nb": 1\n'), 37, 1, "'a\\nb'", "unknown field 'a\\nb'"),
    spec_case("wrong-type", edit({3: "hidden_size: wide"}), 3, 1, "hidden_size", "valid integer"),
    spec_case("bool-for-number", edit({3: "hidden_size: yes"}), 3, 1, "hidden_size", "boolean"),
    spec_case("wrong-type-section", edit({6: "layout: KKKM", 7: ""}), 6, 1, "layout", "valid dictionary"),
    spec_case("missing-field", edit(delete=(2,)), 1, 1, "vocab_size", "required field is missing"),
    spec_case("missing-nested-field", edit(delete=(10,)), 8, 1, "kda.head_dim", "required field is missing"),
    spec_case("bad-enum", edit(append="target: tpu\n"), 37, 1, "target", "'h200'"),
    spec_case("bad-name", edit({1: "name: \"x'); import os; #\""}), 1, 1, "name", "should match pattern"),
    spec_case("absurd-size", edit({3: "hidden_size: 1000000000"}), 3, 1, "hidden_size", "less than or equal to 131072"),
    spec_case("negative", edit({9: "  num_heads: -2"}), 9, 3, "kda.num_heads", "greater than or equal to 1"),
    spec_case("positive-decay-bound", edit({13: "    lower_bound: 5.0"}), 13, 5, "kda.decay.lower_bound", "less than 0"),
    spec_case("nan-float", edit({36: "  seq_len: 256\n  lr: .nan"}), 37, 3, "training.lr", "finite number"),
    spec_case("infinite-float", edit({29: "  beta1: -.inf"}), 29, 3, "activation.beta1", "finite number"),
    spec_case("seq-len-one", edit({36: "  seq_len: 1"}), 36, 3, "training.seq_len", "greater than or equal to 2"),
    # --- cross-field checks
    spec_case("mx-block", edit({26: "  expert_intermediate_size: 48"}), 32, 3, "quantization.rules",
              "input dim 48 is not a multiple of the MX block 32"),
    spec_case("top-k-over-experts", edit({25: "  top_k: 9"}), 25, 3, "moe.top_k", "top_k (9) exceeds num_experts (8)"),
    spec_case("ep-not-dividing", edit(append="parallel:\n  ep: 3\n"), 38, 3, "parallel.ep",
              "parallel.ep (3) does not divide moe.num_experts (8)"),
    spec_case("tp-not-dividing", edit(append="parallel:\n  tp: 4\n"), 38, 3, "parallel.tp", "does not divide kda.num_heads"),
    spec_case("pattern-longer-than-layers", edit({4: "num_layers: 3"}), 7, 3, "layout.pattern", "longer (4) than num_layers (3)"),
    spec_case("layers-list-wrong-length", edit({7: "  layers: [K, K, M]"}), 7, 3, "layout.layers",
              "3 entries but num_layers is 4"),
    spec_case("pattern-and-layers", edit({7: "  pattern: KKKM\n  layers: [K, K, K, M]"}), 6, 1, "layout",
              "exactly one of"),
    spec_case("kda-layers-without-kda", edit(delete=tuple(range(8, 14))), 1, 1, "kda", "no `kda` section"),
    spec_case("situ-glu-without-betas", edit(delete=(29, 30)), 28, 3, "activation.kind", "situ_glu needs beta1 and beta2"),
    spec_case("seq-len-over-context", edit({36: "  seq_len: 4096"}), 36, 3, "training.seq_len",
              "training.seq_len (4096) exceeds context_length (1024)"),
    spec_case("dense-layer-out-of-range", edit({21: "  layers: [0, 4]"}), 21, 3, "dense_ffn.layers", "out of range"),
    spec_case("latent-wider-than-hidden", edit({26: "  expert_intermediate_size: 64\n  latent_size: 128"}), 27, 3,
              "moe.latent_size", "wider than hidden_size"),
    # --- extends
    Case("extends-cycle", {"a.yaml": "extends: b.yaml\nname: a\n", "b.yaml": "name: b\nextends: a.yaml\n"}, ["a.yaml"],
         "b.yaml", 2, 1, "extends", "extends cycle: a.yaml -> b.yaml -> a.yaml"),
    Case("extends-self", {"spec.yaml": "extends: spec.yaml\n"}, ["spec.yaml"], "spec.yaml", 1, 1, "extends", "cycle"),
    spec_case("extends-missing-file", "name: t\nextends: nope.yaml\n", 2, 1, "extends", "no such file"),
    spec_case("extends-not-a-path", "extends: [a.yaml]\n", 1, 1, "extends", "must be a relative path"),
    Case("error-in-base-file", {"base.yaml": edit({25: "  top_k: 9"}), "sub/child.yaml": "extends: ../base.yaml\nname: c\n"},
         ["sub/child.yaml"], "base.yaml", 25, 3, "moe.top_k", "exceeds num_experts"),
    # --- --set overrides
    override_case("override-syntax", ["moe.top_k"], 1, 1, "<spec>", "not of the form a.b=value"),
    override_case("override-empty-key", ["=3"], 1, 1, "<spec>", "not of the form a.b=value"),
    override_case("override-bad-path", ["moe..top_k=2"], 1, 1, "moe.''.top_k", "not a dotted field path"),
    override_case("override-unknown-field", ["moe.topk=3"], 1, 10, "moe.topk", "did you mean 'top_k'?"),
    override_case("override-unknown-section", ["moee.top_k=3"], 1, 12, "moee", "did you mean 'moe'?"),
    override_case("override-wrong-type", ["moe.top_k=many"], 1, 11, "moe.top_k", "valid integer"),
    override_case("override-bad-yaml", ["moe.top_k=[1"], 1, 11, "moe.top_k", "cannot parse override value"),
    override_case("override-into-value", ["hidden_size.x=1"], 1, 1, "hidden_size", "is a value, not a section"),
    override_case("override-second-fails", ["moe.top_k=4", "moe.top_k=99"], 2, 11, "moe.top_k", "exceeds num_experts"),
    override_case("override-null-required", ["moe.num_experts=null"], 1, 17, "moe.num_experts", "valid integer"),
]

SUBPROCESS_IDS = ("yaml-syntax", "unknown-key", "missing-file", "override-wrong-type")


def _write(tmp_path, files):
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())


def _check_one_line(case: Case, err: str) -> None:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    m = LINE_RE.match(lines[0])
    assert m, lines[0]
    assert (m["file"], int(m["line"]), int(m["col"]), m["path"]) == (case.file, case.line, case.col, case.path), lines[0]
    assert case.fragment in m["msg"], lines[0]


def test_at_least_fifteen_kinds():
    assert len({c.id for c in CASES}) == len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_spec_in_process(case, tmp_path, monkeypatch, cli):
    _write(tmp_path, case.files)
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("check", *case.args)
    assert rc == 2
    assert out == ""
    _check_one_line(case, err)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SUBPROCESS_IDS], ids=lambda c: c.id)
def test_bad_spec_subprocess(case, tmp_path, k3compile_cmd):
    _write(tmp_path, case.files)
    proc = k3compile_cmd("check", *case.args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    _check_one_line(case, proc.stderr)


def test_two_problems_give_two_lines(tmp_path, monkeypatch, cli):
    (tmp_path / "spec.yaml").write_text(edit({3: "hidden_size: wide", 25: "  top_k: 2\n  topk: 2"}))
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("check", "spec.yaml")
    assert rc == 2 and "Traceback" not in err
    where = sorted((m["line"], m["path"]) for m in map(LINE_RE.match, err.splitlines()))
    assert where == [("26", "moe.topk"), ("3", "hidden_size")]


def test_many_errors_are_capped_and_summarised(tmp_path, monkeypatch, cli):
    """20,000 bad list elements give a screenful, the last line counting what is not shown."""
    (tmp_path / "spec.yaml").write_text(edit({21: "  layers: [" + ", ".join(["x"] * 20_000) + "]"}))
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli("check", "spec.yaml")
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 20, len(lines)
    assert all(LINE_RE.match(line) for line in lines)
    assert "dense_ffn.layers[0]: Input should be a valid integer" in lines[0]
    assert lines[-1].endswith("dense_ffn.layers[19]: 19,981 more errors from here on, not shown")


def test_misspelled_key_reports_both_sides(tmp_path, monkeypatch, cli):
    """Renaming a required key is two problems: the unknown name (with a hint) and the missing field."""
    (tmp_path / "spec.yaml").write_text(edit({3: "hiden_size: 64"}))
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli("check", "spec.yaml")
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 2
    assert "spec.yaml:3:1: hiden_size: unknown field 'hiden_size'; did you mean 'hidden_size'?" in err
    assert "spec.yaml:1:1: hidden_size: required field is missing" in err


def test_base_spec_is_valid(tmp_path, monkeypatch, cli):
    (tmp_path / "spec.yaml").write_text(BASE)
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli("check", "spec.yaml")
    assert (rc, err) == (0, "")
    assert "valid spec 't'" in out
