"""`k3compile ablate` end to end: a 2-variant, 2-step study on both tasks, its files, resuming, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import k3compile
from k3compile.ablation import run as run_module
from k3compile.cli import main

SPECS = Path(__file__).resolve().parents[2] / "specs"
TINY = ["num_layers=4", "hidden_size=128", "training.batch_size=2", "training.seq_len=32"]
MQAR = {"num_kv_pairs": 2, "seq_len": 16, "num_queries": 2, "vocab": 8}


def _study(out, **kw):
    return k3compile.ablate(SPECS / "k3-tiny.yaml", [SPECS / "ablations" / "no-delta-rule.yaml"], steps=kw.pop("steps", 2),
                            tasks=("lm", "mqar"), mqar=MQAR, overrides=TINY, eval_every=1, out=out, **kw)


def _numbers(doc: dict) -> dict:
    """Everything but the measured speeds."""
    return {e["variant"]: {t: e[t] for t in ("lm", "mqar")} | {"params": e["params_total"]} for e in doc["variants"]}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "s"
    return out, _study(out)


def test_two_variant_two_step_study_writes_results_and_plots(study):
    out, doc = study
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "loss.png", "mqar.png", "study.json"}
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(doc))
    by = {e["variant"]: e for e in doc["variants"]}
    assert set(by) == {"base", "no-delta-rule"}
    assert by["no-delta-rule"]["diff"] == {"kda.delta_rule": {"a": True, "b": False}}
    assert by["base"]["params_total"] - by["no-delta-rule"]["params_total"] == 3 * 128 * 4  # three KDA layers' b_proj
    for e in doc["variants"]:
        assert len(e["lm"]["curve"]) == 2 and 0 <= e["mqar"]["final"]["mean"] <= 1
        assert e["flops_per_token"] > 0 and e["decode_cache_bytes"] > 0 and e["tokens_per_s"] > 0
    md = (out / "results.md").read_text()
    assert "no-delta-rule" in md and "kda.delta_rule=False" in md


def test_same_seed_same_data_for_every_variant(study):
    """Both variants start from the same batches: their first-step losses agree at init to the model's spread."""
    out, _ = study
    first = [json.loads((out / "runs" / v / "mqar-seed0" / "metrics.jsonl").read_text().splitlines()[0])
             for v in ("base", "no-delta-rule")]
    assert abs(first[0]["loss"] - first[1]["loss"]) < 0.5


def test_a_killed_study_resumes_to_the_same_results(study, tmp_path, monkeypatch):
    _, whole = study
    real, calls = run_module.train_step, []

    def dies_on_the_fifth_step(*args):
        calls.append(1)
        if len(calls) == 5:  # the third run (no-delta-rule / lm), after its first step's checkpoint
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(run_module, "train_step", dies_on_the_fifth_step)
    out = tmp_path / "s"
    out.mkdir()  # the same study: its marker and builds are reused (only the training is redone)
    shutil.copytree(study[0] / "builds", out / "builds")
    shutil.copy(study[0] / "study.json", out / "study.json")
    with pytest.raises(KeyboardInterrupt):
        _study(out)
    finished = sorted(p.parent.name + "/" + p.parent.parent.name for p in out.glob("runs/*/*/result.json"))
    assert len(finished) == 2
    monkeypatch.setattr(run_module, "train_step", real)
    calls.clear()
    resumed = _study(out)
    assert _numbers(resumed) == _numbers(whole)


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: k3-tiny.yaml\nname: bad\nkda: {delta_rule: maybe}\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out = tmp_path / "out"
    cases = [
        ([str(SPECS / "k3-tiny.yaml"), str(SPECS / "ablations" / "all-mla.yaml"), "--grid", "moe.nope=1,2"], "moe.nope"),
        ([str(SPECS / "k3-tiny.yaml")], "empty study"),
        ([str(empty)], "empty study"),
    ]
    for argv, what in cases:
        assert main(["ablate", *argv, "--steps", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err and str(out) not in err
        assert not out.exists()
    assert main(["ablate", str(SPECS / "k3-tiny.yaml"), str(bad), "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and not out.exists()


def test_the_shipped_study_resolves():
    from k3compile.ablation.study import load_study

    study = load_study(SPECS / "studies" / "k3-tiny.yaml")
    assert study.base.name == "base" and len(study.variants) >= 3 and "mqar" in study.tasks
    assert {v.spec.kda.delta_rule for v in study.variants if v.spec.kda} == {True, False}
