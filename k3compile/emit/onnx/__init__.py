"""ONNX export of a build's compiled graphs: the k3 ops as ONNX functions in domain `k3`.

- `functions`: every k3 op as an onnxscript function over standard ONNX, per opset and MX representation;
- `translate`: the translation table torch's ONNX exporter uses to call them;
- `export`: `export_onnx` (and `k3compile export`): a build's graph to `<graph>.onnx`;
- `check`: `--check`: checker, shape inference, numerics against PyTorch.

This module holds only the options (no torch or onnx import), so the command line can describe them cheaply.
"""

GRAPHS = ("infer", "prefill", "decode", "train")
WEIGHTS = ("inline", "external", "none")
MX_REPRESENTATIONS = ("fp4", "uint8")
MIN_OPSET = 18  # the opset torch's ONNX exporter writes its ATen translations for
FP4_MIN_OPSET = 24  # DequantizeLinear takes FLOAT4E2M1 data from opset 23 and FLOAT8E8M0 scales from 24
MAX_OPSET = 25  # the newest opset onnxscript's version converter writes
DEFAULT_OPSET = FP4_MIN_OPSET

