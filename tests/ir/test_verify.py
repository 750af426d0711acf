"""Graph verification on hand-made tiny graphs: lint, dangling nodes, missing attributes, shapes via meta tensors."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from k3compile.ir.verify import GraphVerificationError, eliminate_dead_code, format_graph, verify_graph


class Tiny(nn.Module):
    """y = relu(x W^T) + x, summing x into a buffer in place (a side effect like the MoE load statistics)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        self.seen.add_(x.detach().reshape(-1, 4).sum(0))
        return F.relu(F.linear(x, self.w)) + x


def tiny_gm() -> fx.GraphModule:
    return fx.symbolic_trace(Tiny())


def only(gm: fx.GraphModule, target) -> fx.Node:
    (n,) = [n for n in gm.graph.nodes if n.target is target]
    return n


def test_valid_graph_passes_and_records_meta_shapes():
    gm = tiny_gm()
    verify_graph(gm, (torch.randn(2, 3, 4),))
    out = only(gm, operator.add).meta["val"]
    assert out.device.type == "meta" and tuple(out.shape) == (2, 3, 4) and out.dtype == torch.float32
    assert gm.w.device.type == "cpu"  # verification never replaces the real weights
    assert not gm.seen.any()  # ... nor runs the side effects on them


def test_accepts_meta_inputs_and_meta_weights():
    with torch.device("meta"):
        gm = fx.symbolic_trace(Tiny())
    verify_graph(gm, (torch.empty(5, 4, device="meta"),))
    assert tuple(only(gm, F.linear).meta["val"].shape) == (5, 4)


def test_dangling_node_is_rejected():
    gm = tiny_gm()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        gm.graph.call_function(torch.sigmoid, (x,))  # computed, never used
    gm.recompile()
    with pytest.raises(GraphVerificationError, match="dangling nodes.*sigmoid"):
        verify_graph(gm, (torch.randn(2, 4),))


def test_in_place_updates_are_not_dangling_and_survive_dead_code_elimination():
    gm = tiny_gm()
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        dead = gm.graph.call_function(torch.sigmoid, (x,))
    eliminate_dead_code(gm)
    names = [n.name for n in gm.graph.nodes]
    assert dead.name not in names
    assert any(n.op == "call_method" and n.target == "add_" for n in gm.graph.nodes)
    gm.recompile()
    verify_graph(gm, (torch.randn(2, 4),))


def test_shape_error_is_rejected():
    gm = tiny_gm()
    with pytest.raises(GraphVerificationError, match="shape propagation failed"):
        verify_graph(gm, (torch.randn(2, 5),))  # last dim 5 against a [4, 4] weight


def test_shape_error_inside_graph_is_rejected():
    """A rewrite that matmuls two values of incompatible shapes is caught with no real arithmetic."""
    gm = tiny_gm()
    relu = only(gm, F.relu)
    with gm.graph.inserting_after(relu):
        bad = gm.graph.call_function(torch.matmul, (relu, relu))  # [2, 4] @ [2, 4]
    relu.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)
    gm.recompile()
    with pytest.raises(GraphVerificationError, match="shape propagation failed"):
        verify_graph(gm, (torch.randn(2, 4),))


@pytest.mark.parametrize("target", ["nowhere.weight", "w_gone"])
def test_missing_attribute_is_rejected(target):
    gm = tiny_gm()
    gm.graph.find_nodes(op="get_attr")[0].target = target
    gm.recompile()
    with pytest.raises(GraphVerificationError, match=f"(nonexistent|missing) attribute {target.split('.')[0]}"):
        verify_graph(gm, (torch.randn(2, 4),))


def test_use_before_definition_fails_lint():
    gm = tiny_gm()
    relu = only(gm, F.relu)
    lin = only(gm, F.linear)
    lin.prepend(relu)  # relu now reads lin before lin is defined
    with pytest.raises(GraphVerificationError, match="lint"):
        verify_graph(gm, (torch.randn(2, 4),))


def test_format_graph_shows_ops_shapes_and_kernels():
    gm = tiny_gm()
    verify_graph(gm, (torch.randn(2, 4),))
    only(gm, F.relu).meta["kernel"] = {"op": "torch.relu", "impl": "native"}
    text = format_graph(gm)
    lines = text.splitlines()
    assert len(lines) == len(gm.graph.nodes)
    assert any(line.startswith("%linear: float32[2, 4] = call_function[linear](%x, %w)") for line in lines)
    assert any(line.startswith("%add_: float32[4] = call_method[add_](%seen, ") for line in lines)
    assert any(line.startswith("%relu: float32[2, 4]") and line.endswith("# kernel: native") for line in lines)
    assert lines[-1].startswith("%output:")


def test_format_graph_names_custom_ops_by_schema():
    from k3compile.kernels.norms.op import rms_norm  # noqa: F401  registers k3::rms_norm

    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    graph.output(graph.call_function(torch.ops.k3.rms_norm.default, (x, w, 1e-5)))
    gm = fx.GraphModule(nn.Module(), graph)
    verify_graph(gm, (torch.randn(3, 8), torch.ones(8)))
    assert "call_function[k3::rms_norm](%x, %w, 1e-05)" in format_graph(gm)


class Chain(nn.Module):
    """x -> linear(w1) -> relu -> linear(w2) -> + 1: a chain whose middle a test rewrites."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(6, 4))
        self.w2 = nn.Parameter(torch.randn(3, 6))

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1)), self.w2) + 1


def _vals(gm: fx.GraphModule) -> dict[str, object]:
    return {n.name: n.meta.get("val") for n in gm.graph.nodes}


def test_incremental_check_recomputes_only_what_a_rewrite_reaches():
    gm = fx.symbolic_trace(Chain())
    inputs = (torch.randn(2, 4),)
    verify_graph(gm, inputs)
    before = _vals(gm)
    verify_graph(gm, inputs, reuse=True)  # nothing changed: every value is the one recorded
    assert all(_vals(gm)[k] is v for k, v in before.items() if k not in ("x", "output"))

    # Rewrite: a bigger second weight changes the shape of everything after it, and nothing before.
    gm.w2 = nn.Parameter(torch.randn(5, 6))
    verify_graph(gm, inputs, reuse=True)
    after = _vals(gm)
    assert after["relu"] is before["relu"] and after["linear"] is before["linear"]
    assert tuple(after["linear_1"].shape) == (2, 5) and tuple(after["add"].shape) == (2, 5)

    # A new node between two old ones: computed, and its users follow.
    relu = only(gm, F.relu)
    with gm.graph.inserting_after(relu):
        doubled = gm.graph.call_function(torch.cat, ([relu, relu], -1))
    lin2 = next(n for n in gm.graph.nodes if n.name == "linear_1")
    lin2.replace_input_with(relu, doubled)
    gm.w2 = nn.Parameter(torch.randn(5, 12))
    verify_graph(gm, inputs, reuse=True)
    incremental = {k: (tuple(v.shape), v.dtype) for k, v in _vals(gm).items() if isinstance(v, torch.Tensor)}
    verify_graph(gm, inputs)  # a full propagation agrees
    full = {k: (tuple(v.shape), v.dtype) for k, v in _vals(gm).items() if isinstance(v, torch.Tensor)}
    assert incremental == full and full["cat"] == ((2, 12), torch.float32)


def test_incremental_check_still_rejects_a_shape_error():
    gm = fx.symbolic_trace(Chain())
    inputs = (torch.randn(2, 4),)
    verify_graph(gm, inputs)
    gm.w2 = nn.Parameter(torch.randn(3, 7))  # no longer matches relu's 6 features
    with pytest.raises(GraphVerificationError, match="shape propagation failed"):
        verify_graph(gm, inputs, reuse=True)


class Normed(nn.Module):
    """A k3 op between two plain ones: verification calls its fake impl directly."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.ops.k3.rms_norm.default(x.relu(), self.w, 1e-6) + 1


def test_k3_ops_propagate_through_their_fake_impls_and_a_backend_change_recomputes_nothing(monkeypatch):
    import k3compile.ops  # noqa: F401  (registers the k3 ops)
    from k3compile.ir.verify import MetaShapeProp

    gm = fx.symbolic_trace(Normed())
    (norm,) = [n for n in gm.graph.nodes if n.target is torch.ops.k3.rms_norm.default]
    inputs = (torch.randn(2, 3, 4, dtype=torch.float64),)
    verify_graph(gm, inputs)
    assert (tuple(norm.meta["val"].shape), norm.meta["val"].dtype) == ((2, 3, 4), torch.float64)
    before = _vals(gm)

    calls = []
    real = MetaShapeProp.call_function
    monkeypatch.setattr(MetaShapeProp, "call_function", lambda self, *a: calls.append(a[0]) or real(self, *a))
    norm.kwargs = {"backend": "c"}  # what bind_kernels does: no shape depends on it
    verify_graph(gm, inputs, reuse=True)
    assert calls == [] and all(_vals(gm)[k] is v for k, v in before.items() if k not in ("x", "output"))
    norm.args = (norm.args[0], norm.args[1], 1e-5)  # a changed argument is recomputed
    verify_graph(gm, inputs, reuse=True)
    assert calls == [torch.ops.k3.rms_norm.default]
