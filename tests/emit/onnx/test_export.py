"""Exporting k3-tiny's infer graph: traced once (the expensive half), then finished per MX representation and
weights mode, checked, and run in onnxruntime against the PyTorch InferenceModel it came from."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import onnx
import pytest
import torch

from k3compile.emit.onnx import check as k3check
from k3compile.emit.onnx import export as E
from k3compile.emit.onnx import functions as F

from flips import assert_flip_aware, assert_tight, near_ties, recorded


@pytest.fixture(scope="module")
def tiny(tiny_build):
    """(package dir, manifest, the infer ExportGraph, its traced ONNX model) of the shared k3-tiny build."""
    from k3compile.loader import load

    dest, manifest = tiny_build
    graph = E.graph_of(load(dest), "infer")
    return dest, manifest, graph, E.trace(graph)


def finished(tiny, out_dir, mx="uint8", weights="inline", opset=24):
    """Finish a copy of the traced model as asked and write it; returns (path, Library)."""
    _, manifest, graph, traced = tiny
    lib = F.define(opset, mx)
    files, _ = E.save(E.finish(traced.clone(), graph, lib, weights, manifest), out_dir, "infer", weights)
    return files, lib


@pytest.fixture(scope="module")
def uint8_model(tiny, tmp_path_factory):
    files, lib = finished(tiny, tmp_path_factory.mktemp("uint8"))
    return files[0], lib


def _onnx_and_torch(path, graph, reference: bool) -> tuple:
    """(the engine, the ONNX file's logits, the PyTorch module's, the tokens where its router has a near-tie) on
    --check's inputs: ONNX Runtime's routes cannot be recorded, so every near-tie of PyTorch's is excused."""
    (tokens,) = k3check.random_inputs(graph, int(graph.module.spec.vocab_size))
    want, routes = recorded(lambda: graph.module(tokens), tokens.shape[0], graph.module.spec)
    (got, *_), engine = k3check.run_onnx(path, {"tokens": tokens.numpy()}, reference)
    assert list(tokens.shape) == [3, 37]  # other sizes than traced: dynamic axes
    return engine, torch.from_numpy(got), want, near_ties(routes)


def test_infer_graph_runs_in_onnxruntime_like_pytorch(tiny, uint8_model):
    """Random tokens of other sizes than traced (dynamic axes) through onnxruntime and the InferenceModel.

    The experts' MXFP8 activation fake-quantisation turns last-bit differences at rounding midpoints into one grid
    step, so the logits agree up to e4m3 flips (tests/flips.py); the functions themselves are bit-exact
    (test_functions)."""
    path, lib = uint8_model
    assert k3check.check_file(path, tiny[2], lib, numerics=False)["checker"] == "passed (full check)"
    engine, got, want, excused = _onnx_and_torch(path, tiny[2], reference=False)
    assert engine == "onnxruntime"
    assert_flip_aware(got, want, excused_BT=excused)


def test_k3_function_calls_match_the_compiled_graph(tiny, uint8_model):
    """One call of an op's function per k3 node the compiler bound in the infer graph (manifest's binding table)."""
    path, lib = uint8_model
    compiled = Counter({row["op"].removeprefix("k3::"): row["nodes"]
                        for row in tiny[1]["binding_table"]["prefill"] if row["op"].startswith("k3::")})
    calls = k3check.k3_calls(onnx.load(path))
    assert Counter(lib.ops[name] for name in calls.elements()) == compiled
    assert sum(compiled.values()) == 169  # 152 before AttnRes normalised each source once (17 k3::rms_inv)


def layer_table_calls(spec, kind: str) -> Counter:
    """The layer-kind functions a graph should call, from the spec's layer table: one per token mixer (K: kda,
    M: mla) and one per FFN (MoE or dense); the infer graph is the prefill graph."""
    graph = "prefill" if kind == "infer" else kind
    mixers = Counter("kda" if m == "K" else "mla" for m in spec.mixers)
    ffns = Counter("moe" if spec.is_moe_layer(i) else "dense_ffn" for i in range(spec.num_layers))
    return Counter({f"{graph}_{name}": n for name, n in (mixers + ffns).items()})


DEPTH_MIXING = {"attn_res", "attn_res_normed", "rms_inv", "rms_norm"}  # final depth site and norm, rms_inv of sources


def test_each_layer_kind_is_one_function(tiny, uint8_model):
    """k3-tiny's infer graph calls one k3.layer function per sublayer, one function per kind (the spec's layer
    table gives the counts); the main graph keeps only the depth mixing, and every weight is read in a layer
    function or by the embedding, final norm and head."""
    model = onnx.load(uint8_model[0])
    spec = tiny[2].module.spec
    assert k3check.layer_calls(model) == layer_table_calls(spec, "infer")
    layer_functions = {f.name for f in model.functions if f.domain == "k3.layer"}
    assert layer_functions == set(layer_table_calls(spec, "infer"))
    main = Counter(n.op_type for n in model.graph.node if n.domain == "k3")
    assert set(main) <= DEPTH_MIXING and main["rms_norm"] == 1
    calls = [n for n in model.graph.node if n.domain == "k3.layer"]
    assert [n.name for n in calls] == [f"{part}_{i}" for i in range(spec.num_layers) for part in ("attn", "ffn")]
    read_at_top = {i for n in model.graph.node if n.domain != "k3.layer" for i in n.input if i.startswith("layers.")}
    assert not read_at_top


def test_names_axes_and_metadata(tiny, uint8_model):
    model = onnx.load(uint8_model[0])
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    assert [(i.name, dims(i)) for i in model.graph.input] == [("tokens", ["batch", "seq"])]
    assert [(o.name, dims(o)) for o in model.graph.output] == [("logits", ["batch", "seq", 256])]
    meta = {p.key: p.value for p in model.metadata_props}
    manifest = tiny[1]
    assert meta["k3compile.spec_sha256"] == manifest["spec"]["sha256"]
    assert meta["k3compile.compiler"] == manifest["compiler"]
    assert (meta["k3compile.graph"], meta["k3compile.target"], meta["k3compile.mx"]) == ("infer", "cpu", "uint8")
    assert {o.domain: o.version for o in model.opset_import} == {"": 24, "k3": 1, "k3.layer": 1}
    assert {f.domain for f in model.functions} == {"k3", "k3.layer"}


def test_fp4_weights_are_float4_with_e8m0_scales(tiny, tmp_path):
    """--mx fp4: the packed expert buffers become FLOAT4E2M1 [..., n] (same bytes) with FLOAT8E8M0 scales, decoded
    by DequantizeLinear(block_size=32); the full checker and strict shape inference pass."""
    (path,), _ = finished(tiny, tmp_path, mx="fp4")
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    inits = {t.name: t for t in model.graph.initializer}
    buffers = dict(tiny[2].module.named_buffers())
    data, scale = "layers.1.moe.experts.gate_proj.weight_mx", "layers.1.moe.experts.gate_proj.weight_scale"
    assert inits[data].data_type == onnx.TensorProto.FLOAT4E2M1 and list(inits[data].dims) == [32, 128, 128]
    assert inits[data].raw_data == buffers[data].numpy().tobytes()
    assert inits[scale].data_type == onnx.TensorProto.FLOAT8E8M0
    assert inits[scale].raw_data == buffers[scale].numpy().tobytes()
    decode = next(f for f in model.functions if f.name == "mx_dequantize_e2m1")
    assert [n.op_type for n in decode.node] == ["DequantizeLinear"]


def test_weights_none_keeps_the_structure_only(tiny, tmp_path):
    (path,), _ = finished(tiny, tmp_path, weights="none")
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    state = dict(tiny[2].module.state_dict())
    inputs = {i.name: i for i in model.graph.input}
    assert set(state) <= set(inputs) and not set(state) & {t.name for t in model.graph.initializer}
    embed = inputs["embed.weight"].type.tensor_type
    assert embed.elem_type == onnx.TensorProto.FLOAT and [d.dim_value for d in embed.shape.dim] == [256, 256]
    assert path.stat().st_size < 2e6


def test_external_weights_beside_the_model(tiny, tmp_path, uint8_model):
    files, _ = finished(tiny, tmp_path, weights="external")
    assert [p.name for p in files] == ["infer.onnx", "infer.onnx.data"]
    onnx.checker.check_model(str(files[0]), full_check=True)
    assert files[0].stat().st_size < 2e6 and files[1].stat().st_size > 20e6


def test_translations_of_ops_outside_k3_tiny(tmp_path):
    """Ops the decode graph and other specs use, through the translation table (None states, default scales,
    variants chosen by strings), exported by torch and run in onnxruntime."""
    import onnxruntime as ort

    ops = torch.ops.k3

    class Ops(torch.nn.Module):
        def forward(self, x, q, k, v, g, beta, state, conv_w, q_mla, latent, w_kvb, logits, xe, w_gate, w_up, w_down,
                    x2, data, scale):
            o, s = ops.kda_decode_step.default(q, k, v, g, beta, state, None)
            normed, total = ops.add_rms_norm.default(x, x * 2, conv_w[:, 0], 1e-5)
            act = ops.gelu.default(x, "tanh") + ops.situ_glu.default(x, x, 4.0, 25.0) + ops.swiglu.default(x, x)
            conv, tail = ops.short_conv.default(x, conv_w, None)
            mla = ops.mla_decode_absorbed.default(q_mla, latent, w_kvb, 0.3)
            weights, idx, _ = ops.moe_route.default(logits, None, 2, "softmax", False, 1.5)
            hidden = ops.expert_glu.default(xe, w_gate, w_up, "swiglu", 0.0, 0.0)
            down = ops.expert_matmul.default(hidden, w_down)
            deq = ops.mx_dequantize.default(data, scale, "e2m1", 32, torch.float32)
            lin = ops.mx_linear.default(x2, data[0], scale[0], "e2m1", 32, "e4m3")
            return o, s, normed, total, act, conv, tail, mla, weights, idx, down, deq, lin

    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    unit = lambda *shape: torch.nn.functional.normalize(r(*shape), dim=-1)  # noqa: E731
    data, scale = ops.mx_quantize.default(r(2, 16, 64), "e2m1", 32)
    args = (r(2, 5, 16), unit(2, 3, 16), unit(2, 3, 16), r(2, 3, 16), -torch.rand(2, 3, 16, generator=gen),
            torch.rand(2, 3, generator=gen), r(2, 3, 16, 16), r(16, 4), r(2, 1, 3, 12), r(2, 7, 14), r(3 * 14, 10),
            r(6, 8), r(2, 4, 64), r(2, 16, 64), r(2, 16, 64), r(2, 64, 16), r(5, 64), data, scale)
    want = Ops()(*args)
    graph = E.ExportGraph("infer", Ops(), args, tuple(f"in{i}" for i in range(len(args))),
                          tuple(f"out{i}" for i in range(len(want))), None, {})
    manifest = {"spec": {"name": "ops", "sha256": "-"}, "compiler": "-", "target": "cpu"}
    lib = F.define(24, "uint8")
    (path,), _ = E.save(E.finish(E.trace(graph), graph, lib, "inline", manifest), tmp_path, "infer", "inline")
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {f"in{i}": a.numpy() for i, a in enumerate(args)})
    for name, a, b in zip(graph.output_names, got, want):
        b = b.numpy()
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(b).max(), 1e-30), name
    calls = Counter(lib.ops[n] for n in k3check.k3_calls(onnx.load(str(path))).elements())
    assert calls == Counter(["kda_decode_step", "add_rms_norm", "gelu", "situ_glu", "swiglu", "short_conv",
                             "mla_decode_absorbed", "moe_route", "expert_glu", "expert_matmul", "mx_dequantize",
                             "mx_linear"])


def test_a_mutating_graph_takes_the_exporters_decomposing_path(tmp_path):
    """An in-place op is not translatable as captured: trace hands the program to the exporter's own
    decomposition (functionalisation), and the k3 op still becomes its function."""
    import onnxruntime as ort
    from torch.onnx._internal.exporter import _registration

    class Mutating(torch.nn.Module):
        def forward(self, x):
            y = x.clone()
            y.add_(1.0)
            return torch.ops.k3.rms_norm.default(y, x[0, 0], 1e-5)

    x = torch.randn(2, 3, 4)
    captured = torch.export.export(Mutating(), (x,), strict=False)
    assert not E._translatable_as_captured(captured.graph, _registration.ONNXRegistry.from_torchlib())
    graph = E.ExportGraph("infer", Mutating(), (x,), ("x",), ("y",), None, {})
    manifest = {"spec": {"name": "mutating", "sha256": "-"}, "compiler": "-", "target": "cpu"}
    lib = F.define(24, "uint8")
    (path,), _ = E.save(E.finish(E.trace(graph), graph, lib, "inline", manifest), tmp_path, "infer", "inline")
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got, Mutating()(x).numpy(), rtol=1e-6, atol=1e-6)
    assert k3check.k3_calls(onnx.load(str(path))) == Counter(rms_norm=1)


FP32 = ["quantization.rules=[]", "num_layers=4"]  # k3-tiny without the MX policy (fp32 weights), layers KKKM


@pytest.fixture(scope="module")
def fp32(tiny_path, tmp_path_factory):
    """(manifest, Library, {graph: (path, ExportGraph)}) of k3-tiny's prefill and decode graphs with fp32 weights."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    dest, manifest = build(load_spec(tiny_path, overrides=FP32), tmp_path_factory.mktemp("fp32"), BuildOptions(mode="infer"))
    package, lib, out = load(dest), F.define(24, "uint8"), tmp_path_factory.mktemp("onnx")
    files = {}
    for kind in ("prefill", "decode"):
        graph = E.graph_of(package, kind)
        (path,), _ = E.save(E.finish(E.trace(graph), graph, lib, "inline", manifest), out, kind, "inline")
        files[kind] = path, graph
    return manifest, lib, files


def _session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _max_rel(got, want: torch.Tensor) -> float:
    want = want.numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_prefill_then_8_decode_steps_in_onnxruntime_match_pytorch(fp32):
    """An ONNX prefill into zeroed caches, then 8 ONNX decode steps fed their own caches back, against the PyTorch
    InferenceModel's prefill and decode of the same tokens: logits and caches within 1e-4 relative (fp32)."""
    from k3compile.modules.model import cache_shapes

    _, _, files = fp32
    model = files["prefill"][1].module
    B, T, S, steps = 2, 21, 32, 8
    tokens = torch.randint(0, model.spec.vocab_size, (B, T + steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, cache = model.prefill(tokens[:, :T], max_len=S)
        prefill = _session(files["prefill"][0])
        feeds = {name: np.zeros(shape, np.float32) for name, (shape, _) in cache_shapes(model.spec, B, S).items()}
        got, *state = prefill.run(None, {"tokens": tokens[:, :T].numpy(), **feeds})
        assert _max_rel(got, want) < 1e-4
        names = [o.name.removeprefix(E.NEW) for o in prefill.get_outputs()[1:]]
        assert names == list(feeds)
        for name, value in zip(names, state):
            assert _max_rel(value, cache.tensors[name]) < 1e-4, name
        decode = _session(files["decode"][0])
        for step in range(steps):
            token = tokens[:, T + step : T + step + 1]
            want, cache = model.decode(token, cache)
            positions = np.full(B, T + step, np.int64)
            got, *state = decode.run(None, {"tokens": token.numpy(), "positions": positions, **dict(zip(names, state))})
            assert _max_rel(got, want) < 1e-4, step
        for name, value in zip(names, state):
            assert _max_rel(value, cache.tensors[name]) < 1e-4, name


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_check_of_the_serving_graphs(fp32, kind):
    """--check feeds each graph what serving does: zeroed caches for prefill; for decode, caches PyTorch prefilled
    from prompts of different lengths, so each sequence attends over its own cache length."""
    _, lib, files = fp32
    path, graph = files[kind]
    found = k3check.check_file(path, graph, lib)
    assert found["engine"] == "onnxruntime" and found["max_relative_error"] < 1e-4
    assert set(found["errors"]) == {"logits"} | {E.NEW + n for n in graph.input_names if "." in n}
    want_inputs = {"tokens": [3, 37]} if kind == "prefill" else {"tokens": [3, 1], "positions": [3]}
    assert found["inputs"] == want_inputs


def test_serving_graphs_names_and_axes(fp32):
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]  # noqa: E731
    for kind, head in (("prefill", {"tokens": ["batch", "seq"]}), ("decode", {"tokens": ["batch", 1], "positions": ["batch"]})):
        model = onnx.load(fp32[2][kind][0])
        inputs = {i.name: dims(i) for i in model.graph.input if not i.name.startswith(("embed.", "layers.", "lm_head", "final_"))}
        assert inputs == {**head, "kda_state.0": ["batch", 4, 64, 64], "kda_conv_q.0": ["batch", 256, 3],
                          "kda_conv_k.0": ["batch", 256, 3], "kda_conv_v.0": ["batch", 256, 3],
                          **{f"{n}.{i}": inputs[f"{n}.0"] for n in ("kda_state", "kda_conv_q", "kda_conv_k", "kda_conv_v")
                             for i in (1, 2)}, "mla_cache.3": ["batch", "max_len", 96]}
        outputs = {o.name: dims(o) for o in model.graph.output}
        assert outputs.pop("logits") == ["batch", "seq" if kind == "prefill" else 1, 256]
        assert outputs == {E.NEW + name: shape for name, shape in inputs.items() if "." in name}
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta["k3compile.graph"] == kind


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_serving_graphs_k3_calls_match_the_compiled_graph(fp32, kind):
    manifest, lib, files = fp32
    compiled = Counter({row["op"].removeprefix("k3::"): row["nodes"]
                        for row in manifest["binding_table"][kind] if row["op"].startswith("k3::")})
    calls = k3check.k3_calls(onnx.load(files[kind][0]))
    assert Counter(lib.ops[name] for name in calls.elements()) == compiled
    # 4 layers: 9 depth sites, mixed by attn_res_normed on the CPU target's prefill, by attn_res at decode
    assert compiled["attn_res_normed" if kind == "prefill" else "attn_res"] == 9
    model = onnx.load(files[kind][0])
    assert k3check.layer_calls(model) == layer_table_calls(files[kind][1].module.spec, kind)


# MXFP4 experts with fp32 activations (no MXFP8 fake quantisation, whose rounding ties flip on last-bit differences),
# two layers (KDA + dense FFN, MLA + MoE): small enough for onnx.reference.
MXFP4_WEIGHTS = ['quantization.rules=[{match: "layers.*.moe.experts.*", weight: mxfp4, activation: fp32}]',
                 "num_layers=2", "layout.pattern=KM"]


@pytest.fixture(scope="module")
def mxfp4(tiny_path, tmp_path_factory):
    """(manifest, infer ExportGraph, its traced model) of the two-layer MXFP4 k3-tiny."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path, overrides=MXFP4_WEIGHTS)
    dest, manifest = build(spec, tmp_path_factory.mktemp("mxfp4"), BuildOptions(mode="infer"))
    graph = E.graph_of(load(dest), "infer")
    return manifest, graph, E.trace(graph)


@pytest.mark.parametrize("mx,engine", [("fp4", "onnx.reference"), ("uint8", "onnxruntime")])
def test_mxfp4_experts_match_pytorch(mxfp4, tmp_path, mx, engine):
    """FLOAT4E2M1 + E8M0 through DequantizeLinear(block_size=32): full checker, onnx.reference (onnxruntime's CPU
    provider has no FP4 DequantizeLinear); --mx uint8: onnxruntime. Both give PyTorch's logits to 1e-5 per token
    (the activations are not quantised), router near-ties aside."""
    manifest, graph, traced = mxfp4
    lib = F.define(24, mx)
    (path,), _ = E.save(E.finish(traced.clone(), graph, lib, "inline", manifest), tmp_path, "infer", "inline")
    found = k3check.check_file(path, graph, lib, numerics=False)
    assert found["checker"] == "passed (full check)"
    ran, got, want, excused = _onnx_and_torch(path, graph, reference=mx == "fp4")
    assert ran == engine
    assert_tight(got, want, excused_BT=excused)
    assert found["k3_ops"]["mx_expert_glu"] == 1 and found["k3_ops"]["mx_dequantize"] == 1
    model = onnx.load(str(path))
    fp4 = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT4E2M1]
    assert len(fp4) == (3 if mx == "fp4" else 0)  # gate, up and down projections of layer 1's experts
    if mx == "fp4":
        decode = next(f for f in model.functions if f.name == "mx_dequantize_e2m1")
        (node,) = decode.node
        assert node.op_type == "DequantizeLinear" and "block_size" in {a.name for a in node.attribute}
        bodies = [n for f in model.functions if f.domain == "k3.layer" for n in f.node]  # the MoE layer's function
        calls = [n for n in [*model.graph.node, *bodies] if n.op_type == "mx_dequantize_e2m1"]
        assert [a.i for n in calls for a in n.attribute if a.name == "block"] == [32]


def test_layer_functions_compute_what_the_flat_graph_does(mxfp4, tmp_path):
    """The same trace finished flat (every layer's ops in the main graph) and with layer functions (the two-layer
    k3-tiny: one KDA, one dense FFN, one MLA, one MoE): the same logits in onnxruntime, from a main graph of less
    than half the nodes."""
    manifest, graph, traced = mxfp4
    lib = F.define(24, "uint8")
    paths = {}
    for flat in (True, False):
        model = E.finish(traced.clone(), graph, lib, "inline", manifest, flat=flat)
        (paths[flat],), _ = E.save(model, tmp_path / str(flat), "infer", "inline")
    assert not k3check.layer_calls(onnx.load(str(paths[True])))
    assert k3check.layer_calls(onnx.load(str(paths[False]))) == layer_table_calls(graph.module.spec, "infer")
    tokens = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3)).numpy()
    (want,), _ = k3check.run_onnx(paths[True], {"tokens": tokens}, reference=False)
    (got,), _ = k3check.run_onnx(paths[False], {"tokens": tokens}, reference=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert len(onnx.load(str(paths[False])).graph.node) < len(onnx.load(str(paths[True])).graph.node) / 2


@pytest.mark.parametrize("argv,message", [
    (["/nonexistent/build"], "is not a k3compile build"),
    (["NOT_A_BUILD"], "is not a k3compile build"),
    (["BUILD", "--graph", "everything"], "unknown graph 'everything'"),
    (["BUILD", "--graph", "train"], "the train graph is not exported"),
    (["BUILD", "--opset", "17", "--mx", "uint8"], "opset 17 is not supported"),
    (["BUILD", "--opset", "21"], "opset 21 is too low for --mx fp4"),
    (["BUILD", "--weights", "half"], "unknown weights mode 'half'"),
    (["BUILD", "--mx", "int4"], "unknown MX representation 'int4'"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(cli, tiny_build, tmp_path, argv, message):
    out = tmp_path / "out"
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "model.py").write_text("")  # a folder, with a model.py, but not one a build wrote
    argv = [str(tiny_build[0]) if a == "BUILD" else str(tmp_path / "folder") if a == "NOT_A_BUILD" else a for a in argv]
    rc, stdout, stderr = cli("export", *argv, "-o", out)
    assert rc == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists()


def test_cli_prints_the_check(cli, monkeypatch, tiny, uint8_model, tmp_path):
    """The command's report: the file, the k3 functions with counts, the engine and the largest errors."""
    path, lib = uint8_model
    found = k3check.check_file(path, tiny[2], lib, numerics=False)
    layers = Counter(found["layers"])
    result = E.Exported("infer", path, [path], path.stat().st_size, 1.0, Counter(found["functions"]), layers, found)
    monkeypatch.setattr(E, "export_onnx", lambda *a, **k: [result])
    rc, stdout, _ = cli("export", tiny[0], "-o", tmp_path, "--check")
    assert rc == 0
    assert f"wrote {path}" in stdout and "169 k3 calls of 16 functions" in stdout
    kinds = layer_table_calls(tiny[2].module.spec, "infer")
    assert f"{sum(kinds.values())} layer calls of {len(kinds)} layer kinds" in stdout
    assert "k3.attn_res" in stdout and "17" in stdout and "numerics: skipped" in stdout
    assert re.search(rf"k3\.layer\.prefill_moe +{kinds['prefill_moe']}\n", stdout)


def test_type_promotion_without_rerunning_unpromoted_ops_gives_the_exporters_casts():
    """The captured path's type promotion skips re-running ops without a promotion rule (a k3 op, a view); the
    casts it inserts are those of the exporter's own pass (mixed dtypes, a Python scalar, an integer division)."""
    import copy

    from torch.onnx._internal.fx import passes

    class Mixed(torch.nn.Module):
        def forward(self, x, i):
            y = torch.ops.k3.rms_norm.default(x.view(2, 3, 4), x[0, :4], 1e-5)
            return y * 2 + i, torch.div(i, 3), (y.to(torch.float16) + x.view(2, 3, 4)).sum()

    program = torch.export.export(Mixed(), (torch.randn(6, 4), torch.arange(24).view(2, 3, 4)), strict=False)
    graphs = []
    for fast in (False, True):
        gm = copy.deepcopy(program.graph_module)
        promotion = passes.InsertTypePromotion(gm)
        if fast:
            promotion.interpreter.__class__ = E._PromotionOnly
        promotion.run()
        graphs.append([(n.op, str(n.target), str(n.args), str(n.meta["val"].dtype) if "val" in n.meta and
                        isinstance(n.meta["val"], torch.Tensor) else "") for n in gm.graph.nodes])
    assert graphs[0] == graphs[1]
    assert sum(t == "aten._to_copy.default" or "prims.convert" in t for _, t, _, _ in graphs[1]) >= 2
