"""`k3compile train` on the emitted k3-tiny Model: logging, exact resume, checkpoint checks, bad input, the optimizer.

k3-tiny is built once for the module (by a first training run from the spec) and trained at batch 2 x 32.
"""

import errno
import json
import math
import os
import shutil
import signal

import pytest
import torch

import k3compile
from k3compile import safe_io
from k3compile.runtime import checkpoint as ckpt
from k3compile.runtime.data import load_corpus
from k3compile.runtime.muon import muon_precision
from k3compile.runtime.schedule import lr_at
from k3compile.runtime.train import TrainError, head_splits, make_optimizer
from k3compile.spec.load import SpecError, load_spec
from k3compile.spec.schema import Schedule

from ..conftest import K3_TINY

SMALL = ("training.seq_len=32", "training.batch_size=2")
FAST = (*SMALL, "training.optimizer=adamw")  # where Muon's cost (most of a tiny step) buys nothing


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(load_corpus(None, max_bytes=40_000).data)
    return path


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory, corpus_file):
    """(records, run folder) of `train(specs/k3-tiny.yaml, 2 steps)`: builds into <run>/build."""
    out = tmp_path_factory.mktemp("spec") / "run"
    records = k3compile.train(K3_TINY, 2, data=corpus_file, out=out, overrides=SMALL, eval_every=1, progress=False)
    return records, out


@pytest.fixture(scope="module")
def build(spec_run):
    return spec_run[1] / "build" / "k3_tiny"


def _train(build, out, steps, corpus_file, overrides=SMALL, **kw):
    return k3compile.train(build, steps, data=corpus_file, out=out, overrides=overrides, progress=False, **kw)


def test_a_spec_is_built_trained_logged_and_checkpointed(spec_run):
    records, out = spec_run
    assert (out / "build" / "k3_tiny" / "model.py").is_file()
    assert [r["step"] for r in records] == [1, 2]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    spec = load_spec(K3_TINY, list(SMALL))
    for r in records:
        assert {"loss", "lr", "tokens_per_s", "imbalance", "dropped", "grad_norm", "val_loss"} <= set(r)
        assert r["lr"] == lr_at(r["step"] - 1, 2, spec.training.lr, spec.training.schedule)
        assert math.isfinite(r["loss"]) and r["imbalance"] >= 1.0 and 0.0 <= r["dropped"] <= 1.0
    state = ckpt.load(out / "checkpoints")
    assert state.step == 2 and state.meta["spec_name"] == "k3-tiny"
    biases = [v for k, v in state.tensors.items() if k.endswith("moe.router.bias")]
    assert len(biases) == 7 and all(b.abs().sum() > 0 for b in biases)  # quantile balancing moved them
    assert "optim/layers.0.attn.q_proj.weight/momentum_buffer" in state.tensors
    assert {"rng/torch", "rng/data"} <= set(state.tensors)


def test_resume_reproduces_an_uninterrupted_run_exactly(build, tmp_path, corpus_file):
    straight = _train(build, tmp_path / "a", 6, corpus_file, eval_every=3)
    first = _train(build, tmp_path / "b", 6, corpus_file, eval_every=3, stop_after=3)
    assert [r["step"] for r in first] == [1, 2, 3] and ckpt.committed(tmp_path / "b" / "checkpoints") == [3]
    resumed = _train(build, tmp_path / "b", 6, corpus_file, eval_every=3, resume=True)
    assert resumed[-1]["loss"] == straight[-1]["loss"]  # step 6, bit for bit
    key = lambda r: (r["step"], r["loss"], r["lr"], r.get("val_loss"), r["imbalance"])  # noqa: E731
    assert list(map(key, resumed)) == list(map(key, straight))
    a, b = ckpt.load(tmp_path / "a" / "checkpoints"), ckpt.load(tmp_path / "b" / "checkpoints")
    assert a.step == b.step == 6 and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_disk_full_during_training_keeps_the_previous_checkpoint(build, tmp_path, corpus_file, monkeypatch):
    real, calls = safe_io._write_all, []

    def full_on_second_save(fd, data):
        calls.append(fd)
        if len(calls) > 2:  # the first save writes two files
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(safe_io, "_write_all", full_on_second_save)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device; the previous checkpoint step-000001"):
        _train(build, tmp_path / "run", 2, corpus_file, FAST, eval_every=1)
    assert ckpt.committed(tmp_path / "run" / "checkpoints") == [1]
    assert ckpt.load(tmp_path / "run" / "checkpoints").step == 1


def test_ctrl_c_stops_after_the_step_with_a_checkpoint(build, tmp_path, corpus_file, monkeypatch):
    from k3compile.runtime import train as train_module

    real = train_module.train_step

    def step_then_interrupt(run, step, total):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step: the step still completes
        return real(run, step, total)

    monkeypatch.setattr(train_module, "train_step", step_then_interrupt)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        _train(build, tmp_path / "run", 5, corpus_file, FAST)
    assert ckpt.committed(tmp_path / "run" / "checkpoints") == [2]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert signal.getsignal(signal.SIGINT) is before


def test_resume_refuses_a_checkpoint_of_another_model(spec_run, build, tmp_path, corpus_file):
    state = ckpt.load(spec_run[1] / "checkpoints")
    tensors = dict(state.tensors)
    del tensors["model/layers.2.attn.q_proj.weight"]
    tensors["model/layers.8.attn.q_proj.weight"] = torch.zeros(2, 2)
    tensors["model/embed.weight"] = torch.zeros(512, 256)
    ckpt.save(tmp_path / "run" / "checkpoints", 2, tensors, {"spec_name": "other"})
    with pytest.raises(ckpt.CheckpointError) as e:
        _train(build, tmp_path / "run", 4, corpus_file, resume=True)
    message = str(e.value)
    assert "\n" not in message and "spec 'other'" in message
    assert "missing layers.2.attn.q_proj.weight" in message
    assert "unexpected layers.8.attn.q_proj.weight" in message
    assert "embed.weight [512, 256] vs [256, 256]" in message


def test_a_truncated_checkpoint_stops_resume_with_one_line(spec_run, build, tmp_path, cli):
    out = tmp_path / "run"
    shutil.copytree(spec_run[1] / "checkpoints", out / "checkpoints")
    tensor_file = ckpt.paths(out / "checkpoints", 2)[0]
    tensor_file.write_bytes(tensor_file.read_bytes()[:1000])
    rc, stdout, err = cli("train", build, "--steps", "3", "--out", out, "--resume", *[f"--set={s}" for s in SMALL])
    assert rc == 2 and err.count("\n") == 1 and "truncated" in err and err.startswith("error: checkpoint ")


def test_cli_trains_and_compares_with_the_unigram_entropy(build, tmp_path, corpus_file, cli):
    args = ["--steps", "1", "--data", corpus_file, "--out", tmp_path / "run", *[f"--set={s}" for s in FAST]]
    rc, out, err = cli("train", build, *args)
    assert rc == 0, err
    assert "unigram entropy of the training bytes" in out and "final validation loss" in out
    rc, out, err = cli("train", build, *args)
    assert rc == 2 and "already holds a checkpoint (step 1); pass --resume" in err


@pytest.mark.parametrize(
    "case", ["steps 0", "empty file", "no text", "too short", "out under a file", "small vocab", "architecture"]
)
def test_bad_input_is_one_line_exit_2_and_no_output(case, build, tmp_path, corpus_file, cli):
    out = tmp_path / "run"
    data, source, steps, extra = corpus_file, build, "2", list(SMALL)
    if case == "steps 0":
        steps = "0"
    elif case == "empty file":
        data = tmp_path / "empty.txt"
        data.write_bytes(b"")
    elif case == "no text":
        data = tmp_path / "blobs"
        data.mkdir()
        (data / "a.bin").write_bytes(b"\x00\xff" * 100)
    elif case == "too short":
        data = tmp_path / "short.txt"
        data.write_bytes(b"x" * 40)
    elif case == "out under a file":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "run"
    elif case == "small vocab":
        source, extra = K3_TINY, [*extra, "vocab_size=128"]
    else:
        extra = [*extra, "hidden_size=128"]
    sets = [f"--set={s}" for s in extra]
    rc, stdout, err = cli("train", source, "--steps", steps, "--data", data, "--out", out, *sets)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()
    expected = {
        "steps 0": "steps must be at least 1",
        "empty file": "is empty (0 bytes)",
        "no text": "holds no text files",
        "too short": "needs at least 66",
        "out under a file": "cannot write to output folder",
        "small vocab": "vocab_size 128; byte-level training needs at least 256",
        "architecture": "--set changes hidden_size",
    }[case]
    assert expected in err


def test_a_gpu_build_without_a_gpu_is_one_line_exit_2(tmp_path, corpus_file, cli, monkeypatch):
    """A package bound to Triton kernels cannot train on a CPU unless the interpreter is asked for."""
    from k3compile.build import BuildOptions
    from k3compile.build import build as build_package

    path, _ = build_package(load_spec(K3_TINY), tmp_path / "gpu", BuildOptions(mode="train", target="h200"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "run"
    rc, _, err = cli("train", path, "--steps", "1", "--data", corpus_file, "--out", out)
    assert rc == 2 and err.count("\n") == 1 and "was built for h200 (Triton kernels)" in err, err
    assert not out.exists()


def test_schedule_by_hand():
    cosine = Schedule(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(s, 7, 1.0, cosine) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(4, 7, 1.0, cosine) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lr_at(6, 7, 1.0, cosine) == pytest.approx(0.1)
    linear = Schedule(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lr_at(s, 5, 2.0, linear) for s in range(5)] == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0])
    assert lr_at(3, 10, 2.0, Schedule(kind="constant", warmup_steps=1)) == 2.0
    assert lr_at(0, 1, 2.0, Schedule(kind="cosine")) == 2.0  # a single update is at the peak


@pytest.mark.parametrize("optimizer", ["per_head_muon", "muon", "adamw"])
def test_optimizer_groups_follow_the_spec(build, optimizer):
    spec = load_spec(K3_TINY, [f"training.optimizer={optimizer}"])
    model = k3compile.load(build).Model(device="meta")
    named = list(model.named_parameters())
    opt = make_optimizer(spec, named)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    g = {name: group_of[id(p)] for name, p in named}
    assert sum(len(x["params"]) for x in opt.param_groups) == len(named)
    assert not g["embed.weight"]["use_muon"] and g["embed.weight"]["weight_decay"] == 0.1
    assert not g["layers.0.attn_norm.weight"]["use_muon"] and g["layers.0.attn_norm.weight"]["weight_decay"] == 0.0
    muon = {n for n in g if g[n]["use_muon"]}
    if optimizer == "adamw":
        assert not muon
        return
    assert {"layers.0.attn.q_proj.weight", "layers.1.moe.experts.up_proj.weight", "layers.3.attn.kv_b_proj.weight"} <= (
        muon
    )
    splits = {n: g[n]["head_split"] for n in muon if g[n]["head_split"] != 1}
    if optimizer == "muon":
        assert not splits
    else:
        assert splits == head_splits(spec)  # every listed projection exists in k3-tiny (no q_proj in MLA: q_lora)
        assert splits["layers.0.attn.v_proj.weight"] == 4 and splits["layers.3.attn.q_b_proj.weight"] == 4
        assert "layers.3.attn.q_proj.weight" not in splits


def test_train_rejects_bad_arguments_before_anything_else(tmp_path):
    with pytest.raises(TrainError, match="eval_every must be at least 1"):
        k3compile.train(K3_TINY, 1, out=tmp_path / "x", eval_every=0, progress=False)
    with pytest.raises(TrainError, match="no such spec or build"):
        k3compile.train(tmp_path / "missing.yaml", 1, out=tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- which builds a run may use, and where it writes


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


def _copy_build(build, dest, edit=lambda files, manifest: None):
    """A copy of `build` at `dest` written through write_package (its marker agrees) after `edit`."""
    from k3compile.emit.package import MARKER, write_package

    files = {str(p.relative_to(build)): p.read_bytes() for p in build.rglob("*") if p.is_file()}
    marker = json.loads(files.pop(MARKER))
    manifest = json.loads(files["manifest.json"])
    edit(files, manifest)
    files["manifest.json"] = json.dumps(manifest).encode()
    return write_package(dest, files, marker)


def _infer_only(files, manifest):
    manifest["modes"], manifest["passes"] = ["infer"], {"infer": manifest["passes"]["train"]}


def _fuse_disabled(files, manifest):
    next(r for r in manifest["passes"]["train"] if r["name"] == "fuse")["status"] = "disabled"


def _older_compiler(files, manifest):
    manifest["compiler"] = "k3compile 0.0.1"


@pytest.mark.parametrize("edit", [None, _infer_only, _fuse_disabled, _older_compiler],
                         ids=lambda e: getattr(e, "__name__", "same"))
def test_the_run_folders_build_is_reused_only_when_mode_passes_and_compiler_match(build, tmp_path, monkeypatch, edit):
    from k3compile import training

    _copy_build(build, tmp_path / "build" / "k3_tiny", edit or (lambda files, manifest: None))

    class Rebuilt(Exception):
        pass

    def rebuild(*args, **kwargs):
        raise Rebuilt

    monkeypatch.setattr("k3compile.build.build", rebuild)
    said = []
    spec = load_spec(K3_TINY, list(SMALL))
    if edit is None:
        package = training.build_package(spec, tmp_path / "build", said.append)
        assert hasattr(package, "Model") and said == [f"reusing the build in {tmp_path / 'build' / 'k3_tiny'}"]
        return
    with pytest.raises(Rebuilt):
        training.build_package(spec, tmp_path / "build", said.append)
    assert not any("reusing" in s for s in said)
    reason = {"_infer_only": "no training Model", "_fuse_disabled": "passes disabled (fuse)",
              "_older_compiler": "built by k3compile 0.0.1"}[edit.__name__]
    assert any(reason in s for s in said), said


@pytest.mark.parametrize("where", ["build", "build/run"])
def test_a_run_folder_inside_a_build_is_refused(build, tmp_path, corpus_file, cli, where):
    """Checkpoints there would be deleted by the next build (or stop it): refuse before writing anything."""
    copy = _copy_build(build, tmp_path / "k3_tiny")
    before = _tree(copy)
    out = copy / where.removeprefix("build").lstrip("/") if where != "build" else copy
    rc, _, err = cli("train", copy, "--steps", "1", "--data", corpus_file, "--out", out, *[f"--set={s}" for s in FAST])
    assert rc == 2 and err.count("\n") == 1 and f"is inside the build {copy}" in err, err
    assert _tree(copy) == before


def test_a_build_without_weights_or_whose_code_fails_is_one_line_exit_2(build, tmp_path, corpus_file, cli):
    from k3compile.build import BuildOptions
    from k3compile.build import build as build_package

    shapes_only, _ = build_package(load_spec(K3_TINY), tmp_path / "meta", BuildOptions(mode="train", device="meta"))
    broken = _copy_build(build, tmp_path / "broken" / "k3_tiny",
                         lambda files, manifest: files.__setitem__("model.py", files["model.py"] + b"\ndef (:\n"))
    for path, message in [(shapes_only, "has no weights (a shapes-only build"), (broken, "SyntaxError")]:
        out = tmp_path / f"run-{path.parent.name}"
        rc, _, err = cli("train", path, "--steps", "1", "--data", corpus_file, "--out", out)
        assert rc == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err, err
        assert not out.exists()


@pytest.mark.parametrize("damage", ["optimizer shape", "optimizer slot", "rng size", "rng state", "nan weight",
                                    "meta type"])
def test_resume_checks_every_tensor_and_field_before_the_first_step(spec_run, build, tmp_path, corpus_file, damage):
    """Each of these gave a traceback (some only at the first step) or was accepted; now one line at resume."""
    state = ckpt.load(spec_run[1] / "checkpoints")
    tensors, meta = dict(state.tensors), dict(state.meta)
    if damage == "optimizer shape":
        tensors["optim/layers.0.attn.q_proj.weight/momentum_buffer"] = torch.zeros(3, 3)
    elif damage == "optimizer slot":  # the embedding is AdamW's: no momentum buffer
        tensors["optim/embed.weight/momentum_buffer"] = torch.zeros_like(tensors["model/embed.weight"])
    elif damage == "rng size":
        tensors["rng/data"] = torch.zeros(10, dtype=torch.uint8)
    elif damage == "rng state":
        tensors["rng/torch"] = torch.zeros_like(tensors["rng/torch"])
    elif damage == "nan weight":
        embed = tensors["model/embed.weight"].clone()
        embed[3, 0] = math.nan
        tensors["model/embed.weight"] = embed
    else:
        meta["optimizer"] = "adamw"
    ckpt.save(tmp_path / "run" / "checkpoints", 2, tensors, meta)
    with pytest.raises(ckpt.CheckpointError) as e:
        _train(build, tmp_path / "run", 3, corpus_file, resume=True)
    expected = {
        "optimizer shape": "layers.0.attn.q_proj.weight/momentum_buffer [3, 3] (expected a float tensor of shape [",
        "optimizer slot": "embed.weight/momentum_buffer [256, 256] (no such state)",
        "rng size": "rng/data is not a random-generator state",
        "rng state": "rng/torch is not a valid random-generator state (Invalid mt19937 state)",
        "nan weight": "holds non-finite values in model/embed.weight",
        "meta type": "has bad training metadata: optimizer: Input should be a valid dictionary",
    }[damage]
    assert "\n" not in str(e.value) and expected in str(e.value), str(e.value)


# ---------------------------------------------------------------- the metrics log: appended, never rewritten

GARBAGE = [b"\xff\xfe not utf-8\n", b'{"step": null}\n', b'{"step": "2"}\n', b"[1, 2]\n", b'{"loss": 1.0}\n']


def _copy_run(spec_run, out):
    """A copy of the module's 2-step run (checkpoint at step 2, metrics of steps 1 and 2) to resume."""
    shutil.copytree(spec_run[1] / "checkpoints", out / "checkpoints")
    return (spec_run[1] / "metrics.jsonl").read_bytes().splitlines(keepends=True)


def test_unreadable_metrics_lines_are_skipped_and_reported_on_resume(spec_run, build, tmp_path, corpus_file, cli):
    out = tmp_path / "run"
    first, second = _copy_run(spec_run, out)
    kept = first + b"".join(GARBAGE) + second
    # after the checkpoint's step: a record of a step the resumed run redoes, and a line cut by a crash
    (out / "metrics.jsonl").write_bytes(kept + b'{"step": 3, "loss": 9.0}\n{"ste')
    sets = [f"--set={s}" for s in SMALL]
    rc, stdout, err = cli("train", build, "--steps", "3", "--data", corpus_file, "--out", out, "--resume", *sets)
    assert rc == 0 and "Traceback" not in err, err
    assert "skipped 5 lines that are not metrics records (the first: line 2)" in " ".join(stdout.split())
    final = (out / "metrics.jsonl").read_bytes()
    assert final.startswith(kept)  # nothing before the checkpoint rewritten
    assert [json.loads(line)["step"] for line in final[len(kept) :].splitlines()] == [3]


def test_disk_full_while_logging_is_one_line_and_leaves_whole_lines(spec_run, build, tmp_path, corpus_file,
                                                                    monkeypatch):
    out = tmp_path / "run"
    (out / "metrics.jsonl").write_bytes(b"".join(_copy_run(spec_run, out)))
    real = os.write

    def full_at_step_three(fd, data):
        if b'"step": 3' in bytes(data) and b'"loss"' in bytes(data):
            real(fd, data[:10])  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_at_step_three)
    with pytest.raises(TrainError, match=r"cannot append to .*metrics.jsonl: No space left on device"):
        _train(build, out, 4, corpus_file, resume=True)
    assert sorted(os.listdir(out)) == ["checkpoints", "metrics.jsonl"]  # no temporary file
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert ckpt.committed(out / "checkpoints") == [2]


# ---------------------------------------------------------------- SIGTERM (docker stop, Kubernetes, SLURM)


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM")
def test_sigterm_finishes_the_step_checkpoints_and_exits_143(tmp_path, corpus_file, write_spec, hand_text):
    """Like a first Ctrl-C: the step completes, a checkpoint is written, the exit code says SIGTERM (128 + 15).

    The hand-sized spec keeps the child's build and checkpoint small."""
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    sets = ["vocab_size=256", "training.seq_len=16", "training.batch_size=2", "training.optimizer=adamw"]
    argv = [sys.executable, "-m", "k3compile.cli", "train", str(write_spec(hand_text)), "--steps", "100000",
            "--data", str(corpus_file), "--out", str(out), "--eval-every", "100000", *[f"--set={s}" for s in sets]]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        for _ in range(1200):  # up to 2 minutes for the first step (a loaded machine)
            if metrics.exists() and metrics.read_text().count("\n") >= 1 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and ckpt.committed(out / "checkpoints") == [steps[-1]]
@pytest.mark.parametrize("precision", ["auto", "bf16", "fp32"])
def test_muon_precision_follows_the_spec(build, precision):
    spec = load_spec(K3_TINY, [f"training.muon_precision={precision}"])
    named = list(k3compile.load(build).Model().named_parameters())
    opt = make_optimizer(spec, named)
    want = muon_precision(precision, "cpu")[0]
    assert {g["ns_dtype"] for g in opt.param_groups if g["use_muon"]} == {want}
    with pytest.raises(SpecError, match="training.muon_precision: Input should be 'auto', 'bf16' or 'fp32'"):
        load_spec(K3_TINY, ["training.muon_precision=fp16"])


def test_the_run_prints_the_muon_precision(build, tmp_path, corpus_file, cli):
    overrides = [f"--set={s}" for s in (*SMALL, "training.muon_precision=fp32")]
    rc, out, err = cli("train", build, "--steps", "1", "--data", corpus_file, "--out", tmp_path / "run", *overrides)
    assert rc == 0, err
    assert "Muon's Newton-Schulz in fp32 (training.muon_precision)" in out
