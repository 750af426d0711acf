"""Inlining kept module calls: structurally identical modules share one trace; each keeps its own weights."""

from __future__ import annotations

import torch
from torch import fx, nn

from k3compile.ir import inline
from k3compile.ir.inline import inline_call


class Block(nn.Module):
    def __init__(self, d: int, scale: float):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.scale = scale

    def forward(self, x):
        return self.proj(x) * self.scale


class Two(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.a, self.b = blocks

    def forward(self, x):
        return self.b(self.a(x))


class KeepBlocks(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Block) or super().is_leaf_module(m, qualname)


def _inline_all(root: nn.Module) -> fx.GraphModule:
    gm = fx.GraphModule(root, KeepBlocks().trace(root))
    for node in [n for n in gm.graph.nodes if n.op == "call_module"]:
        inline_call(gm, node, root.get_submodule(node.target), node.target, node.args, node.kwargs)
    gm.recompile()
    return gm


def test_identical_modules_share_a_trace_and_keep_their_own_weights(monkeypatch):
    traces = []
    real = inline._with_arity

    def counting(n):
        traces.append(n)
        return real(n)

    monkeypatch.setattr(inline, "_with_arity", counting)
    monkeypatch.setattr(inline, "_TRACES", {})
    torch.manual_seed(0)
    same = Two([Block(4, 2.0), Block(4, 2.0)])
    x = torch.randn(3, 4)
    gm = _inline_all(same)
    assert len(traces) == 1  # the second block reused the first one's trace
    torch.testing.assert_close(gm(x), same(x))
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} == {"a.proj.weight", "b.proj.weight"}

    differ = Two([Block(4, 2.0), Block(4, 3.0)])  # the first as before (shared), the second traced anew
    torch.testing.assert_close(_inline_all(differ)(x), differ(x))
    assert len(traces) == 2
