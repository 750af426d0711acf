"""The emitted top levels are loops over the layers, and compute exactly what their bound graphs compute."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import fx

import k3compile
from k3compile.build import BuildOptions, compile_graphs
from k3compile.emit.outline import outline_graph
from k3compile.modules.model import empty_caches

METHODS = {"train": "graph", "prefill": "prefill_graph", "decode": "decode_graph"}


@pytest.fixture(scope="module")
def cpu_graphs(tiny_spec):
    """k3-tiny's three bound graphs with real (CPU) weights, compiled as the build compiles them."""
    return compile_graphs(tiny_spec, ("train", "infer"), BuildOptions(device="cpu"))


@pytest.fixture(scope="module")
def plain(tiny_path, tmp_path_factory):
    """The plain-residual variant (the loop's slot form): (spec, package dir, its three bound graphs)."""
    from k3compile.build import build
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path.parent / "ablations" / "no-attn-res.yaml")
    dest, _ = build(spec, tmp_path_factory.mktemp("plain") / "out")
    return spec, dest, compile_graphs(spec, ("train", "infer"), BuildOptions(device="cpu"))


def _methods(src: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(src)
    classes = [c for c in tree.body if isinstance(c, ast.ClassDef)]
    return {f.name: f for c in classes for f in c.body if isinstance(f, ast.FunctionDef)}


def test_each_top_level_is_a_loop_calling_every_sublayer_function_once(tiny_tree):
    src = tiny_tree["model.py"].decode()
    tree = ast.parse(src)
    kinds = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)]
    assert len(kinds) == len(set(kinds)) >= 8  # train/prefill/decode x kda, mla, moe, dense ffn
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert {k: calls.count(k) for k in kinds} == {k: 1 for k in kinds}
    methods = _methods(src)
    for graph, name in METHODS.items():
        loops = [n for n in ast.walk(methods[name]) if isinstance(n, ast.For)]
        assert len(loops) == 1, name
        assert ast.unparse(loops[0].iter) == f"{graph.upper()}_STEPS"
        called = {n.func.id for n in ast.walk(loops[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert called == {k for k in kinds if k.startswith(f"{graph}_")}
        assert "self.layers[i]" in ast.unparse(loops[0])
    assert "unrolled" not in src and "getattr(self.layers" not in src
    assert len(src.splitlines()) <= 800


def test_step_tables_name_each_layers_caches(tiny_build, tiny_spec):
    model = k3compile.load(tiny_build[0]).model
    for table in (model.PREFILL_STEPS, model.DECODE_STEPS):
        assert [row[0] for row in table] == [i for i in range(tiny_spec.num_layers) for _ in range(2)]
        for k, row in enumerate(table):
            i, names = row[0], row[-1]
            kinds = {n.rpartition(".")[0] for n in names}
            if k % 2:  # the FFN sublayer holds no cache
                assert names == ()
            else:
                assert kinds == ({"mla_cache"} if tiny_spec.mixers[i] == "M" else
                                 {"kda_state", "kda_conv_q", "kda_conv_k", "kda_conv_v"})  # fmt: skip
                assert all(n.endswith(f".{i}") for n in names)
    assert [row[:2] for row in model.TRAIN_STEPS] == [row[:2] for row in model.PREFILL_STEPS]


def _same(a, b, what):
    if isinstance(a, dict):
        assert list(a) == list(b), what
        for k in a:
            _same(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for k, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{k}]")
    else:
        assert torch.equal(a, b), what


@pytest.mark.parametrize("graph", ["train", "prefill", "decode"])
@pytest.mark.parametrize("variant", ["k3-tiny", "no-attn-res"])
def test_the_loop_computes_exactly_the_graph(request, variant, graph):
    """Same weights: the emitted method's outputs and updated buffers equal the fx interpreter's, bit for bit
    (block AttnRes: the list form; plain residuals: the slot form)."""
    if variant == "k3-tiny":
        spec, dest = request.getfixturevalue("tiny_spec"), request.getfixturevalue("tiny_build")[0]
        graphs = request.getfixturevalue("cpu_graphs")
    else:
        spec, dest, graphs = request.getfixturevalue("plain")
    gm = graphs[graph].gm
    pkg = k3compile.load(dest)
    model = (pkg.Model if graph == "train" else pkg.InferenceModel)()
    tensors = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name in tensors:  # a buffer only the other inference graph reads is not this graph's
                t.copy_(tensors[name])
    before = {k: v.clone() for k, v in tensors.items()}
    gen = torch.Generator().manual_seed(0)
    batch, tokens = (2, 1) if graph == "decode" else (2, 13)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    caches = empty_caches(spec, batch, 24, "cpu", torch.float32)
    for t in caches.values():
        t.normal_(generator=gen)
    args = {"train": (ids,), "prefill": (ids, caches),
            "decode": (ids, torch.tensor([5, 11]), caches)}[graph]  # fmt: skip
    clone = lambda a: {k: v.clone() for k, v in a.items()} if isinstance(a, dict) else a.clone()  # noqa: E731
    with torch.no_grad():
        expected = fx.Interpreter(gm).run(*[clone(a) for a in args])
        after = {k: v.clone() for k, v in gm.named_buffers()}
        for k, v in tensors.items():
            v.copy_(before[k])
        got = getattr(model, METHODS[graph])(*[clone(a) for a in args])
    _same(got, expected, graph)
    buffers = dict(model.named_buffers())
    _same({k: buffers[k] for k in after}, after, f"{graph} buffers")  # balancing statistics, selection bias


def test_a_graph_the_loop_cannot_express_stays_unrolled(tiny_spec):
    """The final mix reading a value that a later layer replaced (the first block's partial sum): no list holds it."""
    gm = compile_graphs(tiny_spec, ("infer",), BuildOptions(device="meta"))["decode"].gm
    stacks = [n for n in gm.graph.nodes if n.target is torch.stack]
    final, early = stacks[-1], stacks[1]  # the second sublayer reads the first's output as the open block
    partial = early.args[0][-1]
    final.args = ([*final.args[0], partial],)
    _, top, _ = outline_graph(gm, "decode", tiny_spec)
    reason = next(line for line in top.splitlines() if "# unrolled, not a loop over the layers: " in line)
    assert f"reads {partial.name}" in reason
    assert "for " not in top


@pytest.mark.parametrize("variant", ["all-mla", "attn-res-full", "no-attn-res"])
def test_variants_loop_over_their_layers(tiny_path, variant):
    """Full AttnRes opens a value at every step (no block column); plain residuals, whose fused add_rms_norm
    joins each sublayer's output with the next one's pre-norm, carry the sum and the last output in slots."""
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path.parent / "ablations" / f"{variant}.yaml")
    gm = compile_graphs(spec, ("infer",), BuildOptions(device="meta"))["decode"].gm
    functions, top, _ = outline_graph(gm, "decode", spec)
    assert "for i, kind" in top and "unrolled" not in top
    assert functions[-1].startswith("# DECODE_STEPS: per step")
    if variant == "attn-res-full":
        assert "for i, kind, names in DECODE_STEPS:" in top and "pop()" not in top
    if variant == "no-attn-res":
        assert "stream_0, stream_1 = embedding, None" in top and "torch.stack" not in top
        assert "add_rms_norm.default(stream_0, stream_1, self.final_norm.weight" in top
