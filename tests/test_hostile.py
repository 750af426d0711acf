"""Hostile input to every command (issue 32's cases and a variant of each): exit code 2 and one line naming the
file or argument, no traceback, nothing run from the input, nothing outside the output folder touched, memory
bounded and no hang (the `bounded` fixture). Distributed checkpoints: tests/runtime/test_dcp_reader.py;
Hugging Face folders: tests/hf/test_hostile_hf.py; the reader and writer themselves: tests/test_safe_io.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import k3compile
from k3compile.runtime import checkpoint as ckpt

from .conftest import K3_TINY, SMALL, assert_one_line_error

needs_posix = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs, /dev/zero and symbolic links")
TRAINING = [a for s in SMALL if s.startswith("training.") for a in ("--set", s)]
NOTES = "the user's notes\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of the user's outside every output folder: nothing may change it."""
    path = tmp_path / "notes.txt"
    path.write_text(NOTES)
    return path


@pytest.fixture(scope="module")
def trained(small_build, small_corpus, tmp_path_factory) -> Path:
    """A run folder of the small build trained one step (its checkpoint: checkpoints/step-000001.*)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    k3compile.train(small_build, 1, data=small_corpus, out=out, overrides=SMALL[-3:], progress=False)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _train(cli, build, out, corpus, *extra):
    return cli("train", build, "--steps", "2", "--out", out, "--data", corpus, *TRAINING, *extra)


def _usage_error(result, *names) -> str:
    """argparse's refusal: exit 2, its usage line and one error line naming `names`, no traceback."""
    rc, out, err = result
    lines = err.splitlines()
    assert rc == 2 and "Traceback" not in err and lines[0].startswith("usage:"), err
    assert [i for i, line in enumerate(lines) if "error:" in line] == [len(lines) - 1], err
    assert all(n in lines[-1] for n in names), (names, err)
    return lines[-1]


# ---------------------------------------------------------------- H2: reads bounded, regular files only


@needs_posix
@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_a_checkpoint_that_is_a_device_or_a_pipe_is_refused(cli, small_build, small_corpus, run, tmp_path, kind,
                                                            bounded):  # fmt: skip
    """generate --checkpoint, train --init-from and train --resume read the checkpoint's JSON bounded."""
    json_path = run / "checkpoints" / "step-000001.json"
    json_path.unlink()
    if kind == "fifo":
        os.mkfifo(json_path)
    else:
        json_path.symlink_to("/dev/zero")
    why = "is not a regular file"
    assert_one_line_error(cli("generate", small_build, "--checkpoint", json_path, "--prompt", "a"), json_path, why)
    assert_one_line_error(_train(cli, small_build, tmp_path / "new", small_corpus, "--init-from", json_path), why)
    assert_one_line_error(_train(cli, small_build, run, small_corpus, "--resume"), "step-000001.json", why)


@needs_posix
def test_a_checkpoint_s_tensor_file_that_is_a_link_is_refused(cli, small_build, small_corpus, run, bounded):
    tensors = run / "checkpoints" / "step-000001.safetensors"
    tensors.unlink()
    tensors.symlink_to("/dev/zero")
    err = assert_one_line_error(_train(cli, small_build, run, small_corpus, "--resume"), "step-000001.safetensors")
    assert "is a symbolic link" in err


@needs_posix
@pytest.mark.parametrize("kind", ["metrics-dev-zero", "metrics-fifo"])
def test_a_run_s_metrics_that_are_not_its_file_are_refused(cli, small_build, small_corpus, run, kind, bounded):
    metrics = run / "metrics.jsonl"
    metrics.unlink()
    if kind == "metrics-fifo":
        os.mkfifo(metrics)
    else:
        metrics.symlink_to("/dev/zero")
    err = assert_one_line_error(_train(cli, small_build, run, small_corpus, "--resume"), "metrics.jsonl")
    assert "symbolic link" in err or "not a regular file" in err


@pytest.fixture
def build_copy(small_build, tmp_path) -> Path:
    dest = tmp_path / "build" / small_build.name
    shutil.copytree(small_build, dest)
    shutil.rmtree(dest / "__pycache__", ignore_errors=True)
    return dest


def _marker(build: Path, edit) -> None:
    path = build / ".k3compile-build"
    marker = json.loads(path.read_text())
    marker["files"] = edit(marker["files"])
    path.write_text(json.dumps(marker))


@needs_posix
@pytest.mark.parametrize("case, what", [
    ("marker-lists-dev-zero", "leads outside"),
    ("marker-lists-parent", "leads outside"),
    ("marker-lists-a-fifo", "is not a regular file"),
    ("marker-lists-a-number", "does not list the build's files"),
    ("marker-omits-model-py", "does not record model.py"),
    ("manifest-links-dev-zero", "leads outside"),
    ("model-py-is-a-fifo", "is not a regular file"),
    ("graphs-link-outside", "leads outside"),
])  # fmt: skip
def test_a_build_s_files_are_read_bounded_and_inside_it(cli, build_copy, tmp_path, case, what, bounded):
    """The loader reads what the marker lists through the bounded reader, inside the build, before any code runs."""
    digest = "0" * 64
    if case == "marker-lists-dev-zero":
        _marker(build_copy, lambda f: {**f, "/dev/zero": digest})
    elif case == "marker-lists-parent":
        _marker(build_copy, lambda f: {**f, "../../notes.txt": digest})
    elif case == "marker-lists-a-fifo":
        os.mkfifo(build_copy / "pipe")
        _marker(build_copy, lambda f: {**f, "pipe": digest})
    elif case == "marker-lists-a-number":
        _marker(build_copy, lambda f: {**f, "model.py": 5})
    elif case == "marker-omits-model-py":
        _marker(build_copy, lambda f: {k: v for k, v in f.items() if k != "model.py"})
    elif case == "manifest-links-dev-zero":
        (build_copy / "manifest.json").unlink()
        (build_copy / "manifest.json").symlink_to("/dev/zero")
    elif case == "model-py-is-a-fifo":
        (build_copy / "model.py").unlink()
        os.mkfifo(build_copy / "model.py")
    else:
        shutil.move(build_copy / "graphs", tmp_path / "graphs")
        (build_copy / "graphs").symlink_to(tmp_path / "graphs")
    for argv in (["generate", build_copy, "--prompt", "a"], ["export", build_copy, "-o", tmp_path / "onnx"]):
        assert_one_line_error(cli(*argv), build_copy, what)
    assert not (tmp_path / "onnx").exists()


def test_a_planted_bytecode_cache_never_runs(build_copy, tmp_path):
    """M9: a __pycache__/model.*.pyc whose header matches model.py's mtime and size (what Python's import checks)
    holding other code: the loader compiles model.py's verified bytes, so the build works and the .pyc never runs."""
    sentinel = tmp_path / "PWNED"
    source = build_copy / "model.py"
    code = compile(f"open({str(sentinel)!r}, 'w').close()\n", str(source), "exec")
    st = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(importlib._bootstrap_external._code_to_timestamp_pyc(code, st.st_mtime, st.st_size))
    package = k3compile.load(build_copy)
    assert not sentinel.exists()
    assert package.Model().spec.name == "k3-tiny" and package.model.__file__ == str(source)


@needs_posix
@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "link-to-fifo"])
def test_a_study_or_data_that_is_a_device_or_pipe_is_refused(cli, small_build, tmp_path, kind, bounded):
    path = tmp_path / "input"
    if kind == "dev-zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    shown = "/dev/zero" if kind == "dev-zero" else "input"
    assert_one_line_error(cli("ablate", path, "--steps", "1", "--out", tmp_path / "out"), shown, "not a regular file")
    result = cli("train", small_build, "--steps", "1", "--out", tmp_path / "run", "--data", path, *TRAINING)
    assert_one_line_error(result, shown, "not a regular file")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- H3: writes never follow a link


@needs_posix
def test_a_metrics_link_in_the_run_folder_is_refused_and_its_target_untouched(cli, small_build, small_corpus,
                                                                              tmp_path, victim):  # fmt: skip
    """The issue's repro: `ln -s ~/notes.txt r/metrics.jsonl; k3compile train ... --out r` emptied notes.txt."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(victim)
    assert_one_line_error(_train(cli, small_build, out, small_corpus), "metrics.jsonl", "symbolic link")
    assert victim.read_text() == NOTES


@needs_posix
def test_a_hard_linked_metrics_file_is_refused(cli, small_build, small_corpus, tmp_path, victim):
    out = tmp_path / "r"
    out.mkdir()
    os.link(victim, out / "metrics.jsonl")
    assert_one_line_error(_train(cli, small_build, out, small_corpus), "metrics.jsonl", "hard links")
    assert victim.read_text() == NOTES


@needs_posix
def test_a_planted_temporary_checkpoint_link_is_replaced_not_written_through(cli, small_build, small_corpus,
                                                                             tmp_path, victim):  # fmt: skip
    out = tmp_path / "r"
    (out / "checkpoints").mkdir(parents=True)
    for name in (".step-000002.safetensors.tmp", ".step-000002.json.tmp"):
        (out / "checkpoints" / name).symlink_to(victim)
    rc, _, err = _train(cli, small_build, out, small_corpus)
    assert rc == 0, err
    assert victim.read_text() == NOTES and ckpt.load(out / "checkpoints").step == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002.json", "step-000002.safetensors"]


@needs_posix
def test_a_checkpoints_folder_that_is_a_link_is_refused(cli, small_build, small_corpus, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "r"
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    assert_one_line_error(_train(cli, small_build, out, small_corpus), "checkpoints", "symbolic link")
    assert list(elsewhere.iterdir()) == []


@needs_posix
def test_study_results_replace_planted_links(tmp_path, victim):
    """The study's files (results.json, results.md, the plots, each run's result.json) go through write_atomic."""
    from k3compile.ablation.results import _save
    from k3compile.ablation.run import write_json

    for name in ("results.json", "loss.png"):
        (tmp_path / name).symlink_to(victim)
    write_json(tmp_path / "results.json", {"a": 1})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    _save(fig, tmp_path / "loss.png")
    plt.close(fig)
    assert victim.read_text() == NOTES
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1}
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "loss.png").is_symlink()


@needs_posix
def test_consolidate_into_a_link_is_refused(cli, tmp_path):
    """An output folder given as a link to an empty one: refused before anything is read."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "empty")
    assert_one_line_error(cli("consolidate", tmp_path / "nothing", "-o", tmp_path / "out"), "nothing")


# ---------------------------------------------------------------- H5, M2: sizes bounded before work


@pytest.mark.parametrize("argv, names", [
    (["stats", K3_TINY, "--context", "1" + "0" * 30], ["--context", "is more than"]),
    (["stats", K3_TINY, "--batch", "99999999999"], ["--batch", "is more than"]),
    (["diff", K3_TINY, K3_TINY, "--context", "123456789012"], ["--context", "is more than"]),
    (["stats", K3_TINY, "--context", "9" * 5000], ["--context", "(5,000 characters)"]),
    (["train", K3_TINY, "--steps", "9" * 5000], ["--steps", "(5,000 characters)"]),
    (["import-hf", "x", "-o", "y", "--max-shard-size", "9" * 5000 + "GB"], ["--max-shard-size", "(5,002 characters)"]),
])  # fmt: skip
def test_sizes_on_the_command_line_are_bounded_and_not_echoed_whole(cli, argv, names):
    err = _usage_error(cli(*argv), *names)
    assert len(err) < 1000


@pytest.mark.parametrize("argv, names", [
    (["--gpus", "1000000000000"], ["--gpus", "must be between"]),
    (["--gpus", "8", "--seq", "9" * 30], ["--seq", "must be between"]),
    (["--gpus", "8", "--batch", "1" + "0" * 20], ["--batch", "must be between"]),
])  # fmt: skip
def test_plan_bounds_its_sizes_before_any_layout(cli, argv, names):
    err = assert_one_line_error(cli("plan", K3_TINY, "--gpu", "h200", *argv), *names)
    assert len(err) < 1000


def test_plan_at_the_largest_gpu_count_is_quick(cli):
    """Layouts are found among divisors: the largest world plan takes (a power of two) costs what 8 GPUs do."""
    from k3compile.analysis.plan import MAX_GPUS

    rc, out, err = cli("plan", K3_TINY, "--gpu", "h200", "--gpus", str(MAX_GPUS), "--json", "--all")
    assert rc == 0, err
    assert sorted({r["ep"] for r in json.loads(out)["layouts"]}) == [1, 2, 4, 8, 16, 32]
    assert_one_line_error(cli("plan", K3_TINY, "--gpu", "h200", "--gpus", str(2**32)), "--gpus")


@pytest.mark.parametrize("grid", [["num_layers=" + ",".join(map(str, range(2, 1002))),
                                   "hidden_size=" + ",".join(map(str, range(64, 1064)))],
                                  [f"kda.num_heads={','.join(['1', '2'])}"] * 40])  # fmt: skip
def test_a_grid_past_the_run_limit_is_refused_before_any_point_is_made(cli, tmp_path, grid):
    argv = ["ablate", K3_TINY, "--steps", "1", "--out", tmp_path / "out"] + [a for g in grid for a in ("--grid", g)]
    assert_one_line_error(cli(*argv), "runs is more than 10,000")
    assert not (tmp_path / "out").exists()


def test_variants_past_the_run_limit_are_refused_before_any_is_read(cli, tmp_path):
    variants = [tmp_path / f"missing-{i}.yaml" for i in range(6000)]  # none exists: none is read
    assert_one_line_error(cli("ablate", K3_TINY, *variants, "--steps", "1", "--out", tmp_path / "o"), "is more than")


# ---------------------------------------------------------------- M1: path errors in spec loading


@needs_posix
@pytest.mark.parametrize("case, what", [
    ("loop", "symbolic-link loop"),
    ("long-name", "is too long to be a path"),
    ("extends-nul", "extends must be a relative path"),
    ("extends-loop", "symbolic-link loop"),
    ("extends-long", "File name too long"),
])  # fmt: skip
def test_path_errors_while_loading_a_spec_are_one_line(cli, tmp_path, monkeypatch, case, what):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    if case == "loop":
        spec.symlink_to(spec)
    elif case == "long-name":
        spec = tmp_path / ("s" * 5000 + ".yaml")
    else:
        target = {"extends-nul": "a\\0b.yaml", "extends-loop": "loop.yaml", "extends-long": "x" * 5000}[case]
        (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
        spec.write_text(f'extends: "{target}"\nname: x\n')
    for command in ("check", "stats", "build"):
        if case == "long-name":  # a path argument: refused by the parser, clipped
            _usage_error(cli(command, spec), "is too long to be a path")
        else:
            assert_one_line_error(cli(command, spec), what)


# ---------------------------------------------------------------- M4, M5: generate


def test_generate_with_garbage_weights_is_one_line(cli, small_build, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "weights.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0not a safetensors header")
    assert_one_line_error(cli("generate", small_build, "--checkpoint", weights, "--prompt", "a"), "weights.safetensors")
    (weights / "weights.safetensors").unlink()
    (weights / "weights.safetensors.index.json").write_text('{"weight_map": {"a": 5}}')
    assert_one_line_error(cli("generate", small_build, "--checkpoint", weights, "--prompt", "a"), "weight_map")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs a GPU build")
@pytest.mark.parametrize("target", ["h200", "b200"])
def test_generate_refuses_a_gpu_build_without_a_gpu_like_train(cli, small_build, small_corpus, tmp_path, monkeypatch,
                                                               target):  # fmt: skip
    """The build's TARGET decides (a GPU build binds Triton kernels); set here on the loaded build, which k3compile.load
    returns again, rather than building for the GPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(k3compile.load(small_build), "TARGET", target)
    for result in (cli("generate", small_build, "--prompt", "a"),
                   cli("train", small_build, "--steps", "1", "--out", tmp_path / "r", "--data", small_corpus)):
        assert_one_line_error(result, f"was built for {target}", "no GPU")


# ---------------------------------------------------------------- M7 and the study's low items


@pytest.mark.parametrize("text, what", [
    (b"base: \xff\xfe\n", "is not UTF-8 text"),
    (b"base: " + b"[" * 1500 + b"]" * 1500, "nesting too deep"),
    (b"base: !!python/object/apply:os.system ['touch PWNED']\n", "unsupported YAML tag"),
    (b"a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
     b"d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
     b"f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\nbase: x\n", "document too large"),
    (b"base: k3-tiny.yaml\nsteps: 1\njobs: many\n", "jobs: Input should be a valid integer"),
    (b"base: k3-tiny.yaml\nsteps: [1]\n", "steps: Input should be a valid integer"),
    (b"base: k3-tiny.yaml\nsteps: 1\nmqar: {bogus: 1}\n", "unknown mqar key 'bogus'"),
    (b"base: k3-tiny.yaml\nsteps: 1\nmqar: {vocab: eight}\n", "mqar.vocab: Input should be a valid integer"),
    (b"base: k3-tiny.yaml\nsteps: 1\njobs: 0\n", "jobs must be an integer of at least 1"),
    (b"base: k3-tiny.yaml\nsteps: 1\nseeds: 3\n", "seeds: Input should be a valid list"),
    (b"base: k3-tiny.yaml\nsteps: 1\ndata: \"a\\0b\"\n", "data: String should match pattern"),
])  # fmt: skip
def test_a_hostile_study_is_one_line(cli, tmp_path, monkeypatch, text, what, bounded):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "study.yaml").write_bytes(text)
    assert_one_line_error(cli("ablate", "study.yaml", "--out", tmp_path / "out"), "study.yaml", what)
    assert not (tmp_path / "out").exists() and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("argv, what", [
    (["--jobs", "0"], "jobs must be an integer of at least 1"),
    (["--jobs", "-3"], "jobs must be an integer of at least 1"),
    (["--mqar", "bogus=1"], "unknown mqar key 'bogus'"),
    (["--mqar", "num_kv_pairs"], "--mqar: expected KEY=N"),
    (["--seeds", "9" * 5000], "(5,000 characters)"),
])  # fmt: skip
def test_study_options_are_checked_as_the_study_file_s(cli, tmp_path, argv, what):
    """--jobs 0 is refused as `jobs: 0` is (it was silently 1); a bad --mqar key is named as such."""
    variant = tmp_path / "v.yaml"
    variant.write_text(f"extends: {K3_TINY}\nname: v\nnum_layers: 4\n")
    result = cli("ablate", K3_TINY, variant, "--steps", "1", "--out", tmp_path / "out", *argv)
    err = assert_one_line_error(result, what)
    assert len(err) < 400 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- M8: degenerate data


@pytest.mark.parametrize("data", [b"a" * 20_000, b"a" * 19_000 + bytes(range(256)) * 3])  # the other bytes held out
def test_data_of_one_byte_value_is_refused_before_training(cli, small_build, tmp_path, data):
    path = tmp_path / "data.txt"
    path.write_bytes(data)
    result = cli("train", small_build, "--steps", "1", "--out", tmp_path / "r", "--data", path, *TRAINING)
    assert_one_line_error(result, "one byte value (0x61) repeated")
    assert not (tmp_path / "r" / "checkpoints").exists()


# ---------------------------------------------------------------- low: a resume never casts silently


def test_resume_refuses_a_checkpoint_whose_weights_have_another_dtype(cli, small_build, small_corpus, run):
    path = run / "checkpoints" / "step-000001.json"
    state = ckpt.load(path)
    tensors = dict(state.tensors)
    tensors["model/embed.weight"] = tensors["model/embed.weight"].to(torch.int32)
    (run / "checkpoints" / "step-000001.safetensors").unlink()
    path.unlink()
    meta = {k: v for k, v in state.meta.items() if k not in ("step", "tensors", "bytes", "crc32", "meta_sha256")}
    ckpt.save(run / "checkpoints", 1, tensors, meta)
    result = _train(cli, small_build, run, small_corpus, "--resume")
    assert_one_line_error(result, "embed.weight torch.int32 vs torch.float32")


def test_the_shipped_study_still_resolves_through_the_typed_reader():
    from k3compile.ablation.study import load_study

    study = load_study(K3_TINY.parent / "studies" / "k3-tiny.yaml")
    assert study.jobs == 2 and study.steps["base"] == 300


# ---------------------------------------------------------------- M1's variants: path arguments of every command

LONG = "n" * 5000
COMMANDS_WITH_PATHS = [
    ["check", "{p}"], ["stats", "{p}"], ["plan", "{p}", "--gpus", "8", "--gpu", "h200"], ["diff", K3_TINY, "{p}"],
    ["build", K3_TINY, "-o", "{p}"], ["generate", "{p}", "--prompt", "a"],
    ["generate", "{build}", "--prompt", "a", "--checkpoint", "{p}"], ["train", "{p}", "--steps", "1"],
    ["train", "{build}", "--steps", "1", "--data", "{p}", "--out", "{tmp}/r"],
    ["train", "{build}", "--steps", "1", "--init-from", "{p}", "--out", "{tmp}/r"],
    ["consolidate", "{p}", "-o", "{tmp}/o"], ["import-hf", "{p}", "-o", "{tmp}/o"],
    ["export-hf", "{p}", "--checkpoint", "{tmp}", "-o", "{tmp}/o"], ["export", "{p}", "-o", "{tmp}/o"],
    ["ablate", "{p}", "--steps", "1", "--out", "{tmp}/o"],
]  # fmt: skip


def _id(template: list) -> str:
    return "-".join([template[0]] + [a for a in map(str, template) if a.startswith("--")][:1])


def _argv(template: list, path: str, build: Path, tmp: Path) -> list[str]:
    return [str(a).format(p=path, build=build, tmp=tmp) for a in template]


@pytest.mark.parametrize("template", COMMANDS_WITH_PATHS, ids=_id)
def test_a_path_argument_too_long_is_refused_and_clipped(cli, small_build, tmp_path, template):
    """A 5,000-character path was an OSError traceback (File name too long) in most commands."""
    err = _usage_error(cli(*_argv(template, LONG, small_build, tmp_path)), "is too long to be a path")
    assert "(5,000 characters)" in err and len(err) < 300


@needs_posix
@pytest.mark.parametrize("template", COMMANDS_WITH_PATHS, ids=_id)
def test_a_link_loop_as_a_path_argument_is_one_line(cli, small_build, tmp_path, monkeypatch, template):
    """A symbolic-link loop was a RuntimeError traceback where a path was resolved."""
    monkeypatch.chdir(tmp_path)
    Path("loop").symlink_to("loop")
    assert_one_line_error(cli(*_argv(template, "loop", small_build, tmp_path)), "loop")
