"""Mixed precision (training.precision): bf16 compute under torch.autocast over fp32 master weights, gradients and
optimizer state; fp32 on the CPU by default; QAT's MX weights exact in bf16."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3compile.runtime import muon
from k3compile.runtime.data import load_corpus, split
from k3compile.runtime.precision import BF16_OPS, autocast, training_precision
from k3compile.runtime.train import _setup
from k3compile.spec.load import SpecError, load_spec

from ..conftest import K3_TINY, TOY_K3


def test_auto_is_bf16_on_a_gpu_with_native_bf16_and_fp32_elsewhere(monkeypatch):
    assert training_precision("auto", "cpu")[0] is None  # the CPU default: numbers unchanged
    assert training_precision("fp32", "cpu")[0] is None
    assert training_precision("bf16", "cpu")[0] is torch.bfloat16
    monkeypatch.setattr(muon, "native_bf16_matmul", lambda device: (True, "an H200 has native bf16"))
    dtype, note = training_precision("auto", "cuda")
    assert dtype is torch.bfloat16 and note == (
        "precision bf16 compute over fp32 weights, gradients and optimizer state (auto: an H200 has native bf16)"
    )
    assert training_precision("fp32", "cuda")[0] is None
    monkeypatch.setattr(muon, "native_bf16_matmul", lambda device: (False, "a V100 emulates bf16"))
    assert training_precision("auto", "cuda") == (None, "precision fp32 (auto: a V100 emulates bf16)")
    assert load_spec(K3_TINY).training.precision == "auto"
    with pytest.raises(SpecError, match="training.precision: Input should be 'auto', 'fp32' or 'bf16'"):
        load_spec(K3_TINY, ["training.precision=fp16"])


def test_the_k3_matmul_ops_take_bf16_under_autocast():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    w = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    with autocast(torch.bfloat16, torch.device("cpu")):
        y = torch.ops.k3.expert_matmul.default(x, w, backend="torch")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32  # gradients reach the fp32 inputs through the casts
    expected = torch.bmm(x.detach().bfloat16(), w.detach().bfloat16().transpose(1, 2))
    assert torch.equal(y, expected)
    assert torch.ops.k3.expert_matmul.default(x, w, backend="torch").dtype == torch.float32  # outside: untouched


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_qat_weights_are_exact_in_bf16(fmt):
    """QAT is unchanged under bf16: the fake-quantised fp32 weights (MXFP4, MXFP8) survive the cast to bf16."""
    from k3compile.kernels.mx.op import mx_fake_quantize

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    q = mx_fake_quantize(w, fmt, 32, backend="torch")
    assert not torch.equal(q, w) and torch.equal(q.bfloat16().float(), q)


class _Dtypes(TorchDispatchMode):
    """The floating-point input dtypes of every matmul and of every k3 op of BF16_OPS."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS or (func.namespace == "k3" and func._opname in BF16_OPS):
            floats = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
            self.seen.setdefault(func._opname, set()).update(floats)
        return func(*args, **(kwargs or {}))


def test_bf16_training_computes_in_bf16_and_keeps_fp32_masters(tmp_path):
    """On the graph a GPU build trains (built for h200, ops left unbound: their references on CPU tensors)."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.runtime.train import read_steps, train_step

    corpus = load_corpus(None, max_bytes=20_000)
    train_tokens, val_tokens = split(corpus.data, 32)
    options = BuildOptions(mode="train", target="h200", disabled=frozenset({"bind_kernels"}))
    runs = {}
    for precision in ("fp32", "bf16"):
        spec = load_spec(K3_TINY, [*TOY_K3, f"training.precision={precision}"])
        package = load(build(spec, tmp_path / precision, options)[0])
        runs[precision] = _setup(spec, package, corpus, train_tokens, val_tokens, tmp_path / "run", None)
    run = runs["bf16"]
    assert run.compute is torch.bfloat16 and runs["fp32"].compute is None
    batch = run.batches.next()
    with autocast(run.compute, torch.device("cpu")), _Dtypes() as mode:
        loss = run.model(batch, batch)
    assert loss.dtype == torch.float32
    assert {"mm", "expert_glu", "expert_matmul", "mla_attention"} <= set(mode.seen), mode.seen
    assert all(dtypes == {torch.bfloat16} for dtypes in mode.seen.values()), mode.seen
    reference = runs["fp32"].model(batch, batch)
    assert abs(float(loss.detach()) - float(reference.detach())) < 1e-2 * float(reference.detach())

    records = {p: read_steps([train_step(r, 0, 2)])[0] for p, r in runs.items()}
    assert abs(records["bf16"]["loss"] - records["fp32"]["loss"]) < 1e-2 * records["fp32"]["loss"]
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    state = [t for s in run.optimizer.state.values() for t in s.values() if t.is_floating_point() and t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)  # Muon momentum, AdamW moments
