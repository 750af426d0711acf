"""Metrics beyond metrics.jsonl: callbacks in k3compile.train, TensorBoard events under the run folder, and
--no-progress's plain lines."""

from __future__ import annotations

import json
import sys

import pytest

import k3compile


def test_callbacks_see_every_record_and_tensorboard_holds_the_same_numbers(small_build, small_corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen = []
    out = tmp_path / "run"
    records = k3compile.train(small_build, 2, data=small_corpus, out=out, eval_every=1, progress=False,
                              callbacks=[seen.append], log=["tensorboard"])  # fmt: skip
    assert seen == records and [r["step"] for r in seen] == [1, 2]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert seen == logged
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("loss", "val_loss", "lr", "grad_norm"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in records], rel=1e-6)  # float32 events


def test_tensorboard_missing_is_one_line_exit_2_before_anything_is_written(small_build, small_corpus, tmp_path, cli,
                                                                            monkeypatch):  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    rc, out, err = cli("train", small_build, "--steps", "2", "--data", small_corpus, "--out", tmp_path / "run",
                       "--log", "tensorboard")  # fmt: skip
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "pip install tensorboard" in err
    assert not (tmp_path / "run").exists()


def test_no_progress_prints_plain_lines(small_build, small_corpus, tmp_path, cli):
    rc, out, err = cli("train", small_build, "--steps", "2", "--data", small_corpus, "--out", tmp_path / "run",
                       "--no-progress")  # fmt: skip
    assert rc == 0, err
    lines = out.splitlines()
    assert any(line.startswith("final validation loss") for line in lines)
    assert "\r" not in out and "\x1b" not in out  # no bar redraws, no terminal codes
    assert not any("tok/s" in line for line in lines)  # the bar's line (printed once at the end off a terminal)
