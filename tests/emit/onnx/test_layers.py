"""Cutting layer kinds out of a flat ONNX graph, on small hand-built graphs (k3-tiny's and Kimi K3's exports are
tests/emit/onnx/test_export.py): what goes into a function, what stays at the top, and that the numbers stay."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from k3compile.emit.onnx.layers import DOMAIN, outline_layers

SPEC = SimpleNamespace(mixers=("K", "K", "M"), is_moe_layer=lambda i: i > 0)
D = 4


def _model(nodes, weights: dict[str, np.ndarray]) -> ir.Model:
    graph = helper.make_graph(
        nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", D])],
        [numpy_helper.from_array(w, name) for name, w in weights.items()])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


def _layers(n: int):
    """An embedding (x @ E), then n layers of: attn = h @ W1^T, relu, @ W2 (two readers); residual add; ffn =
    tanh(h @ W3) (the tanh is after the last reader); residual add. The adds are depth mixing: they read a
    sublayer's output and the stream before it."""
    rng = np.random.default_rng(0)
    weights = {"embed.w": rng.standard_normal((D, D)).astype(np.float32)}
    nodes, h = [helper.make_node("MatMul", ["x", "embed.w"], ["e"])], "e"
    for i in range(n):
        p = f"layers.{i}"
        for name in ("attn.w1", "attn.w2", "ffn.w3"):
            weights[f"{p}.{name}"] = rng.standard_normal((D, D)).astype(np.float32)
        nodes += [
            helper.make_node("Transpose", [f"{p}.attn.w1"], [f"t{i}"]),
            helper.make_node("MatMul", [h, f"t{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
            helper.make_node("MatMul", [f"r{i}", f"{p}.attn.w2"], [f"o{i}"]),
            helper.make_node("Add", [h, f"o{i}"], [f"h{i}"]),
            helper.make_node("MatMul", [f"h{i}", f"{p}.ffn.w3"], [f"f{i}"]),
            helper.make_node("Tanh", [f"f{i}"], [f"g{i}"]),
            helper.make_node("Add", [f"h{i}", f"g{i}"], [f"y{i}" if i < n - 1 else "y"]),
        ]
        h = f"y{i}"
    return nodes, weights


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_identical_layers_share_one_function_per_kind():
    nodes, weights = _layers(3)
    flat, outlined = _model(nodes, weights), _model(nodes, weights)
    calls = outline_layers(outlined, SPEC, "prefill", set(weights))
    # layer 2 is an M layer: the same nodes as the K layers' attn, but another kind of the layer table
    assert calls == {"prefill_kda": 2, "prefill_mla": 1, "prefill_dense_ffn": 1, "prefill_moe": 2}
    top = [(n.domain, n.op_type) for n in outlined.graph]
    assert top.count(("", "Add")) == 6 and len(top) == 13  # embedding, residual adds, one call per sublayer
    ffn = outlined.functions[DOMAIN, "prefill_dense_ffn", ""]
    assert [n.op_type for n in ffn] == ["MatMul", "Tanh"]  # the tanh after the reader belongs to the sublayer
    assert [v.name for v in ffn.inputs] == ["x", "ffn.w3"]
    attn = outlined.functions[DOMAIN, "prefill_kda", ""]
    assert [n.op_type for n in attn] == ["Transpose", "MatMul", "Relu", "MatMul"]
    x = np.random.default_rng(1).standard_normal((5, D)).astype(np.float32)
    np.testing.assert_allclose(_run(outlined, x), _run(flat, x), rtol=1e-6, atol=1e-6)


def test_a_sublayer_interleaved_with_another_stays_inline():
    """Layer 0's attn reads its second weight after a node that reads its ffn weight: neither is convex on its
    own, so both stay in the main graph; layer 1 is cut out as usual."""
    nodes, weights = _layers(2)
    at = next(i for i, n in enumerate(nodes) if n.output[0] == "r0")
    nodes[at] = helper.make_node("MatMul", ["a0", "layers.0.ffn.w3"], ["r0"])
    flat, outlined = _model(nodes, weights), _model(nodes, weights)
    calls = outline_layers(outlined, SPEC, "decode", set(weights))
    assert calls == {"decode_kda": 1, "decode_moe": 1}
    assert [n.name for n in outlined.graph if n.domain == DOMAIN] == ["attn_1", "ffn_1"]
    x = np.random.default_rng(2).standard_normal((3, D)).astype(np.float32)
    np.testing.assert_allclose(_run(outlined, x), _run(flat, x), rtol=1e-6, atol=1e-6)
