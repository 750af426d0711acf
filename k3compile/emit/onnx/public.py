"""The k3 ops for torch's own ONNX exporter: `torch.onnx.export(..., dynamo=True, custom_translation_table=...)`.

`translations` is the table to pass; `add_functions` then puts in the exported model the k3 functions that other
k3 functions call. torch 2.13's exporter adds to the model only the functions a translation calls directly
(`mx_expert_glu_situ_glu`, say), not those their bodies call (`mx_dequantize_e2m1`, `expert_glu_situ_glu`), and
offers no hook to add them during the export; without them onnxruntime refuses the file, and an opset
conversion (any `opset_version` but 18) fails in onnxscript's InlinePass. Hence the public recipe exports at opset
18 with `optimize=False` and completes the model afterwards (docs/onnx.md, "torch.onnx.export").
"""

from __future__ import annotations

from functools import lru_cache

import onnx_ir as ir
from onnx_ir.traversal import RecursiveGraphIterator

from k3compile.emit.onnx import MIN_OPSET
from k3compile.emit.onnx import functions as k3fn
from k3compile.emit.onnx import translate

PUBLIC_OPSET = MIN_OPSET  # the exporter's own opset: torch.onnx.export converts (and inlines) at any other
PUBLIC_MX = "uint8"  # FLOAT4E2M1 payloads need opset 24 and a retyping of the weights (k3compile export --mx fp4)


@lru_cache(maxsize=None)
def _library(opset: int, mx: str) -> k3fn.Library:
    return k3fn.define(opset, mx)


def translations(opset: int = PUBLIC_OPSET, mx: str = PUBLIC_MX) -> dict:
    """{torch.ops.k3.<op>.<overload>: its translation}, each a call of the op's k3 function for `opset` and `mx`."""
    return translate.table(_library(opset, mx))


def add_functions(model, opset: int = PUBLIC_OPSET, mx: str = PUBLIC_MX) -> None:
    """Add to `model` (an ONNXProgram or an onnx_ir Model, changed in place) every k3 function its graph calls and
    every one those call, as `translations(opset, mx)` wrote them; k3 functions it holds are kept."""
    model = getattr(model, "model", model)
    called = {n.op_type for n in RecursiveGraphIterator(model.graph) if n.domain == k3fn.DOMAIN}
    called |= {f.name for f in model.functions.values() if f.domain == k3fn.DOMAIN}
    for proto in _library(opset, mx).protos(called):
        function = ir.serde.deserialize_function(proto)
        model.functions.setdefault(function.identifier(), function)
    model.opset_imports.setdefault(k3fn.DOMAIN, 1)
