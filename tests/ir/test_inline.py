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


class Pair(nn.Module):
    """(y, x): a structured output, indexed by getitem chains in the caller."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(x), x


class KeepPairs(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Pair) or super().is_leaf_module(m, qualname)


class Dense(nn.Module):
    """Each pair reads the previous one's outputs directly, and the sum reads every output (a depth site's reads)."""

    def __init__(self, n: int, d: int):
        super().__init__()
        self.pairs = nn.ModuleList(Pair(d) for _ in range(n))

    def forward(self, x):
        outs, h = [x], x
        for p in self.pairs:
            h, skip = p(h)
            outs += [h, skip]
        return torch.stack(outs).sum(0)


def test_inlining_many_calls_at_once_equals_inlining_them_one_by_one():
    torch.manual_seed(0)
    root, x = Dense(4, 3), torch.randn(2, 3)
    one, many = (fx.GraphModule(root, KeepPairs().trace(root)) for _ in range(2))
    for node in one.graph.find_nodes(op="call_module"):
        inline_call(one, node, root.get_submodule(node.target), node.target, node.args, node.kwargs)
    calls = [(n, root.get_submodule(n.target), n.target, n.args, n.kwargs) for n in many.graph.find_nodes(op="call_module")]
    inline.inline_calls(many, calls)
    for gm in (one, many):
        gm.graph.lint()
        gm.recompile()
    assert many.code == one.code and not many.graph.find_nodes(op="call_module")
    torch.testing.assert_close(many(x), root(x), rtol=0, atol=0)
