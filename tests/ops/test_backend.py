"""The `backend=` switch every k3 op takes: which implementation runs, and the errors for impossible choices."""

from __future__ import annotations

import pytest
import torch

import k3compile.ops as ops
from k3compile.kernels import binding
from k3compile.kernels._common.registry import BACKENDS, resolve


def calls(monkeypatch, op: str) -> list[str]:
    """Record 'triton' each time op's Triton implementation (or its backward) runs."""
    seen: list[str] = []
    real = binding.triton_function

    def spy(name, suffix=""):
        fn = real(name, suffix)
        if name != op or fn is None:
            return fn

        def wrapped(*args):
            seen.append("triton" + suffix)
            return fn(*args)

        return wrapped

    monkeypatch.setattr(binding, "triton_function", spy)
    return seen


def test_every_op_schema_ends_in_backend_auto():
    import importlib
    import pkgutil

    import k3compile.ops

    for info in pkgutil.iter_modules(k3compile.ops.__path__):  # every op family registers its ops on import
        importlib.import_module(f"k3compile.ops.{info.name}")
    packets = {n: getattr(torch.ops.k3, n) for n in dir(torch.ops.k3) if not n.startswith("_")}
    names = [n for n, p in packets.items() if isinstance(p, torch._ops.OpOverloadPacket)]
    assert len(names) > 30
    for name in names:
        arg = getattr(torch.ops.k3, name).default._schema.arguments[-1]
        assert (arg.name, str(arg.type), arg.default_value) == ("backend", "str", "auto"), name
    # An optional tensor argument goes before backend, with its default: the decode step's per-sequence lengths.
    args = torch.ops.k3.mla_decode_absorbed.default._schema.arguments
    assert [(a.name, str(a.type), a.default_value) for a in args[-2:]] == [
        ("lengths_B", "Optional[Tensor]", None), ("backend", "str", "auto")
    ]


def test_auto_runs_the_reference_on_cpu_and_triton_when_forced(monkeypatch):
    seen = calls(monkeypatch, "rms_norm")
    x = torch.randn(3, 40, requires_grad=True)
    w = torch.rand(40)
    y_auto = ops.rms_norm(x, w)
    assert seen == []
    y_triton = ops.rms_norm(x, w, backend="triton")
    assert seen == ["triton"]
    torch.testing.assert_close(y_triton, y_auto, rtol=1e-6, atol=1e-6)
    (g_triton,) = torch.autograd.grad(y_triton.square().sum(), x)
    assert seen == ["triton", "triton_bwd"]  # the backward follows the forward's backend
    (g_torch,) = torch.autograd.grad(ops.rms_norm(x, w, backend="torch").square().sum(), x)
    torch.testing.assert_close(g_triton, g_torch, rtol=1e-5, atol=1e-6)


def test_float64_always_runs_the_reference(monkeypatch):
    seen = calls(monkeypatch, "rms_norm")
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: ops.rms_norm(a, torch.ones(8, dtype=torch.float64), backend="triton"), (x,))
    assert seen == []


def test_resolve_rules(monkeypatch):
    cpu = (torch.ones(2),)
    assert BACKENDS == ("auto", "torch", "triton", "c")
    assert resolve("rms_norm", "auto", cpu) == "torch"
    assert resolve("rms_norm", "torch", cpu) == "torch"
    assert resolve("rms_norm", "triton", cpu) == "triton"  # CPU tensors under TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="k3::rms_norm: backend must be one of"):
        resolve("rms_norm", "cuda", cpu)
    with pytest.raises(ValueError, match="k3::moe_dispatch has no Triton kernel"):
        ops.moe_dispatch(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.long), 4, 1.0, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU, or TRITON_INTERPRET=1"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), backend="triton")
    assert resolve("rms_norm", "triton", (torch.ones(2, device="meta"),), fake=True) == "triton"


def test_kda_chunk_saves_what_its_backend_needs():
    """The Triton chunk kernel keeps its own saved tensors: the fake reports their shapes, and the backward
    reads them back on the same backend."""
    B, T, H, K, V = 1, 21, 2, 16, 16
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, requires_grad=True)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    outs, saved = {}, {}
    for backend in ("torch", "triton"):
        raw = torch.ops.k3.kda_chunk.default(q, k, v, g, beta, None, None, 16, backend=backend)
        saved[backend] = [tuple(t.shape) for t in raw[2:]]
        meta = [t.to("meta") for t in (q, k, v, g, beta)]
        fake = torch.ops.k3.kda_chunk.default(*meta, None, None, 16, backend=backend)
        assert [t.shape for t in fake] == [t.shape for t in raw]
        o, _ = ops.kda(q, k, v, g, beta, chunk_size=16, backend=backend)
        outs[backend] = o, torch.autograd.grad(o.square().sum(), v)[0]
    assert saved["torch"] != saved["triton"]  # each backend's own saved set
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_every_public_op_function_takes_a_backend_keyword():
    import inspect

    for name in ops.__all__:
        param = inspect.signature(getattr(ops, name)).parameters.get("backend")
        assert param is not None and param.kind is param.KEYWORD_ONLY and param.default == "auto", name


def test_triton_bound_ops_export_and_compile_as_one_op():
    """torch.export and torch.compile see each k3 op whole, whichever backend it runs (the custom op's fake
    impl gives the shapes); the exported program keeps backend='triton' and runs the kernels."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(40) + 0.5)

        def forward(self, x, gate):
            y = ops.rms_norm(x, self.w, backend="triton")
            return ops.situ_glu(gate, y, backend="triton")

    block = Block()
    x, gate = torch.randn(3, 40), torch.randn(3, 40)
    want = ops.situ_glu(gate, ops.rms_norm(x, block.w, backend="torch"), backend="torch")
    exported = torch.export.export(block, (x, gate))
    k3_nodes = [n for n in exported.graph.nodes if str(n.target).startswith("k3.")]
    assert [str(n.target) for n in k3_nodes] == ["k3.rms_norm.default", "k3.situ_glu.default"]
    assert all(n.kwargs.get("backend", n.args[-1]) == "triton" for n in k3_nodes)
    torch.testing.assert_close(exported.module()(x, gate), want, rtol=1e-5, atol=1e-6)
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x, gate), want, rtol=1e-5, atol=1e-6)
