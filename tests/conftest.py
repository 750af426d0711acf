"""Shared fixtures: where the shipped specs live, writing spec files, running the CLI in-process or as a command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The suite runs Triton kernels on CPU tensors through the interpreter, with or without a GPU (GPU checks
# are bench/gpu.py's). Triton reads this when a kernel is decorated, so it is set before any test module
# imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process: CI runs two xdist workers on two cores, and small
# tensor ops stall badly when each worker also spreads them over both cores.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
# `python -m pytest` puts the working directory first on sys.path, where the repository's top-level kernels/
# folder would shadow the Hugging Face `kernels` package that transformers (5.25 and later) imports; the project
# imports its own as k3compile.kernels (installed), so the repository root leaves the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
# tests/ itself goes on the path: its shared helpers (flips.py) are imported as top-level modules.
sys.path.insert(0, str(ROOT / "tests"))
SPECS = ROOT / "specs"
K3 = SPECS / "kimi-k3.yaml"
KIMI_LINEAR = SPECS / "kimi-linear-48b-a3b.yaml"
K3_TINY = SPECS / "k3-tiny.yaml"
ALL_SPECS = sorted(p for p in SPECS.rglob("*.yaml") if "studies" not in p.parts)  # studies are not specs
ABLATIONS = sorted((SPECS / "ablations").glob("*.yaml"))


def pytest_generate_tests(metafunc):
    """`shipped_spec` runs a test once per spec under specs/, `ablation` once per specs/ablations/ file."""
    for name, paths in (("shipped_spec", ALL_SPECS), ("ablation", ABLATIONS)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, paths, ids=[str(p.relative_to(SPECS)) for p in paths])


@pytest.fixture
def specs_dir() -> Path:
    return SPECS


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(text, name="spec.yaml") -> Path: a spec file under tmp_path (str text, or raw bytes)."""

    def write(text: str | bytes, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def cli(capsys):
    """cli(*argv) -> (exit code, stdout, stderr) of `k3compile.cli.main` run in this process."""
    from k3compile.cli import main

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse: --help, --version, usage errors
            rc = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def run_k3compile(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The `k3compile` command as a separate process (the installed entry point's module)."""
    return subprocess.run(
        [sys.executable, "-m", "k3compile.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=120,
    )


@pytest.fixture
def k3compile_cmd():
    return run_k3compile


# A small spec whose every weight the analysis tests count by hand. Layers: 0 K+dense, 1 K+MoE, 2 M+MoE, 3 M+MoE
# (pattern KKM tiled over 4 layers gives KKMK; last_layer_full turns layer 3 into M).
HAND_SPEC = """\
name: hand
vocab_size: 32
hidden_size: 64
num_layers: 4
context_length: 4096
layout: {pattern: KKM, last_layer_full: true}
kda:
  num_heads: 2
  head_dim: 16
  short_conv_size: 3
  decay: {form: lower_bounded_sigmoid, lower_bound: -5.0, rank: 8}
  output_gate_rank: 4
mla: {num_heads: 2, q_lora_rank: 16, kv_lora_rank: 32, qk_nope_head_dim: 8, qk_rope_head_dim: 4, v_head_dim: 16}
dense_ffn: {layers: [0], intermediate_size: 96}
moe:
  num_experts: 8
  top_k: 2
  expert_intermediate_size: 32
  num_shared_experts: 2
  shared_intermediate_size: 16
  latent_size: 32
activation: {kind: situ_glu, beta1: 4, beta2: 25}
residual: {kind: attn_res, mode: block, block_size: 2}
quantization:
  block_size: 32
  rules: [{match: "layers.*.moe.experts.*", weight: mxfp4, activation: mxfp8}]
parallel: {ep: 4}
training: {seq_len: 128}
"""


@pytest.fixture
def hand_text() -> str:
    return HAND_SPEC


@pytest.fixture
def hand_spec():
    from k3compile.spec.load import load_spec_text

    return load_spec_text(HAND_SPEC, "hand.yaml")


@pytest.fixture(scope="session")
def k3_spec():
    from k3compile.spec.load import load_spec

    return load_spec(K3)


@pytest.fixture(scope="session")
def kimi_linear_spec():
    from k3compile.spec.load import load_spec

    return load_spec(KIMI_LINEAR)


# ---------------------------------------------------------------- hostile input (docs/security.md)


def assert_one_line_error(result: tuple[int, str, str], *names: str) -> str:
    """A `cli` result that is exit code 2 and one `error: ...` line naming each of `names`, no traceback."""
    rc, out, err = result
    assert rc == 2 and "Traceback" not in err, (rc, out, err[-2000:])
    assert err.startswith("error: ") and err.count("\n") == 1, err[-2000:]
    for name in names:
        assert str(name) in err, (name, err)
    return err


@pytest.fixture
def bounded():
    """While the test runs: a hang (a FIFO opened for reading) fails it after 60 s, and memory past what the
    process holds plus 4 GiB (/dev/zero read whole) is a MemoryError, not a machine brought down."""
    import resource
    import signal

    if not hasattr(signal, "SIGALRM") or not Path("/proc/self/status").exists():
        yield
        return

    def hung(signum, frame):
        pytest.fail("hung: a read that never ends (a FIFO or device)")

    held = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))  # fmt: skip
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = held + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# k3-tiny shrunk so that building it takes seconds and a training step milliseconds
SMALL = ("num_layers=4", "hidden_size=64", "moe.latent_size=32", "kda.num_heads=2", "kda.head_dim=32",
         "mla.num_heads=2", "dense_ffn.intermediate_size=64", "training.seq_len=32", "training.batch_size=2",
         "training.optimizer=adamw")  # fmt: skip


@pytest.fixture(scope="session")
def small_build(tmp_path_factory) -> Path:
    """The build (train and infer graphs, CPU) of k3-tiny with SMALL, made once per test process."""
    from k3compile.build import build
    from k3compile.spec.load import load_spec

    dest, _ = build(load_spec(K3_TINY, list(SMALL)), tmp_path_factory.mktemp("small") / "build")
    return dest


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """40 kB of the default corpus (the standard library's sources) as one text file."""
    from k3compile.runtime.data import load_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(load_corpus(None, max_bytes=40_000).data)
    return path


# k3-tiny's features (KKKM with a final M, block AttnRes, latent MoE with MXFP4 experts and quantile balancing)
# at toy width: builds and trains in seconds.
TOY_K3 = (
    "hidden_size=64", "num_layers=4", "context_length=128", "training.seq_len=32", "training.batch_size=2",
    "kda.num_heads=2", "kda.head_dim=32",
    "mla.num_heads=2", "mla.q_lora_rank=32", "mla.kv_lora_rank=32", "mla.qk_nope_head_dim=16",
    "mla.qk_rope_head_dim=16", "mla.v_head_dim=32",
    "dense_ffn.intermediate_size=128", "moe.num_experts=8", "moe.top_k=2", "moe.expert_intermediate_size=64",
    "moe.shared_intermediate_size=64", "moe.latent_size=32",
)  # fmt: skip
