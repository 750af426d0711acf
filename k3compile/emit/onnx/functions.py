"""The k3 ops as ONNX local functions (domain `k3`), written in onnxscript over standard ONNX ops only.

Every function restates one op's PyTorch reference (k3compile.kernels) in standard ONNX, so any runtime
runs it and a viewer opens it. Conventions, the same as the references':
- inputs are upcast to float32 for the arithmetic and the result is cast back like the op's own
  output (CastLike), so a bf16 graph keeps fp32 statistics exactly where the reference does;
- numbers an op takes (eps, betas, block, chunk_size, ...) are function attributes;
- a string an op takes that selects a different formula (a GLU kind, a decay form, router scoring,
  GELU's approximation) selects a different function, named `<op>_<value>`: ONNX has no way to branch
  a function body on a string attribute. `Library.ops` maps every function name back to its op;
- optional tensors the op accepts as None (an initial state, a router bias) are always inputs here:
  the translation (k3compile.emit.onnx.translate) passes zeros, which gives the same result.

Functions reuse each other where the references do (add_rms_norm calls rms_norm, linear_glu calls the
activation, the MX expert GEMMs dequantise and call the plain ones), so a viewer shows the same
nesting the Python has. Every function is defined for one opset (the model's: ONNX requires a
function's imports to agree with the model's) and one MX representation:
- "fp4": packed MXFP4 weights are FLOAT4E2M1 tensors with FLOAT8E8M0 scales, decoded by
  DequantizeLinear(block_size=32) (FP4 data from opset 23, E8M0 scales from opset 24);
- "uint8": the packed bytes and the scale bytes stay UINT8 and are decoded by table lookups of
  standard ops, which onnxruntime's CPU provider runs (it has no FP4 DequantizeLinear kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnxscript
from onnx import numpy_helper
from onnxscript import BOOL, FLOAT, INT64, graph
from onnxscript.values import Opset

from k3compile.emit.onnx import FP4_MIN_OPSET, MIN_OPSET, MX_REPRESENTATIONS
from k3compile.kernels.mx.reference import E2M1_MAGNITUDES, E8M0_BIAS, MX_FORMATS

DOMAIN = "k3"

# ONNX element types, for Cast's `to`
F32 = onnx.TensorProto.FLOAT
F64 = onnx.TensorProto.DOUBLE
I64 = onnx.TensorProto.INT64
B1 = onnx.TensorProto.BOOL
NEG_INF = float("-inf")
NAN = float("nan")
TO_END = numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64))  # a Slice end past any dim

# Exact powers of two 2^e, e in [POW2_MIN, POW2_MAX] (fp32 subnormals included), looked up rather than
# computed: Pow(2, e) is not exact in every runtime, and MX scaling must be.
POW2_MIN, POW2_MAX = -149, 127
POW2_TABLE = numpy_helper.from_array(np.ldexp(np.float32(1), np.arange(POW2_MIN, POW2_MAX + 1)).astype(np.float32))
# e2m1 code (sign in bit 3) -> value, and E8M0 byte -> 2^(byte - 127) with 0xFF = NaN.
E2M1_TABLE = numpy_helper.from_array(np.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), np.float32))
E8M0_TABLE = numpy_helper.from_array(
    np.append(np.ldexp(np.float32(1), np.arange(255) - E8M0_BIAS).astype(np.float32), np.float32("nan"))
)
LOG2_E = 1.4426950408889634
ZERO_I64 = numpy_helper.from_array(np.array([0], np.int64))
ONE_I64 = numpy_helper.from_array(np.array([1], np.int64))
TRUE = numpy_helper.from_array(np.array(True))


# (payload input, scale input) pairs of the functions that read MXFP4 weights, by function name: the inputs
# that mx="fp4" gives the FLOAT4E2M1 and FLOAT8E8M0 types.
MX_OPERANDS = {
    "mx_dequantize_e2m1": ((0, 1),),
    "mx_expert_glu_situ_glu": ((1, 2), (3, 4)),
    "mx_expert_glu_swiglu": ((1, 2), (3, 4)),
    "mx_expert_matmul": ((1, 2),),
    "mx_linear": ((1, 2),),
    "mx_linear_act": ((1, 2),),
}


@dataclass(frozen=True)
class Library:
    """The k3 functions for one opset and MX representation.

    `functions`: every function by ONNX name (the ops, their variants and the helpers they call);
    `ops`: ONNX function name -> the k3 op it implements (helpers are absent).
    """

    opset: int
    mx: str
    functions: dict[str, onnxscript.OnnxFunction]
    ops: dict[str, str]

    def protos(self, names) -> list[onnx.FunctionProto]:
        """FunctionProtos of `names` and of every k3 function their bodies call, callees first."""
        done: dict[str, onnx.FunctionProto] = {}

        def visit(name: str) -> None:
            if name in done:
                return
            proto = self.functions[name].to_function_proto()
            for callee in _k3_calls(proto.node):
                visit(callee)
            done[name] = proto

        for name in sorted(names):
            visit(name)
        return list(done.values())


def _k3_calls(nodes) -> set[str]:
    """Names of the k3 functions called by `nodes`, subgraphs (Loop and Scan bodies) included."""
    found = set()
    for node in nodes:
        if node.domain == DOMAIN:
            found.add(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found |= _k3_calls(attr.g.node)
    return found


def define(opset: int, mx: str) -> Library:
    """Define every k3 function for `opset` and the MX representation `mx` ("fp4" or "uint8")."""
    if mx not in MX_REPRESENTATIONS:
        raise ValueError(f"mx must be one of {MX_REPRESENTATIONS}, got {mx!r}")
    if opset < MIN_OPSET or (mx == "fp4" and opset < FP4_MIN_OPSET):
        need = FP4_MIN_OPSET if mx == "fp4" else MIN_OPSET
        raise ValueError(f"opset {opset} is too low for mx={mx!r}: it needs opset {need} or higher")
    op = Opset("", opset)
    k3 = Opset(DOMAIN, 1)
    functions: dict[str, onnxscript.OnnxFunction] = {}
    ops: dict[str, str] = {}
    for family in (_norms, _activations, _projections, _mx, _kda, _mla, _moe):
        for name, (k3_op, fn) in family(op, k3, mx, functions).items():
            functions[name] = fn
            if k3_op is not None:
                ops[name] = k3_op
    return Library(opset, mx, functions, ops)


def _norms(op, k3, mx, lib):
    """rms_norm, l2_norm, rms_norm_gate, add_rms_norm, attn_res, rms_inv and attn_res_normed (kernels/norms/reference.py,
    kernels/attn_res/reference.py, kernels/attn_res_normed/reference.py)."""

    @onnxscript.script(k3, default_opset=op)
    def rms_norm(x, weight, eps: float) -> FLOAT:
        """k3::rms_norm: x / sqrt(mean(x^2, last dim) + eps) * weight, in fp32."""
        xf = op.Cast(x, to=F32)
        inv_rms = op.Reciprocal(op.Sqrt(op.ReduceMean(xf * xf, [-1], keepdims=1) + eps))
        return op.CastLike(xf * inv_rms * op.Cast(weight, to=F32), x)

    @onnxscript.script(k3, default_opset=op)
    def l2_norm(x, eps: float) -> FLOAT:
        """k3::l2_norm: x / sqrt(sum(x^2, last dim) + eps), in fp32."""
        xf = op.Cast(x, to=F32)
        return op.CastLike(xf * op.Reciprocal(op.Sqrt(op.ReduceSum(xf * xf, [-1], keepdims=1) + eps)), x)

    @onnxscript.script(k3, default_opset=op)
    def rms_norm_gate(x, weight, gate, eps: float) -> FLOAT:
        """k3::rms_norm_gate: RMSNorm(x) * sigmoid(gate), one fp32 pass."""
        xf = op.Cast(x, to=F32)
        inv_rms = op.Reciprocal(op.Sqrt(op.ReduceMean(xf * xf, [-1], keepdims=1) + eps))
        y = xf * inv_rms * op.Cast(weight, to=F32) * op.Sigmoid(op.Cast(gate, to=F32))
        return op.CastLike(y, x)

    @onnxscript.script(k3, default_opset=op)
    def add_rms_norm(x, residual, weight, eps: float) -> tuple[FLOAT, FLOAT]:
        """k3::add_rms_norm: (RMSNorm(x + residual), x + residual), the sum rounded to x's dtype first."""
        total = x + residual
        return rms_norm(total, weight, eps=eps), total

    @onnxscript.script(k3, default_opset=op)
    def attn_res(sources, query, norm_weight, eps: float) -> FLOAT:
        """k3::attn_res: sum_i softmax_i(query . RMSNorm(v_i)) v_i over the sources [S, B, T, D], in fp32."""
        v = op.Cast(sources, to=F32)
        logits = op.ReduceSum(rms_norm(v, norm_weight, eps=eps) * op.Cast(query, to=F32), [-1], keepdims=0)
        p = op.Softmax(logits, axis=0)
        return op.CastLike(op.ReduceSum(op.Unsqueeze(p, [-1]) * v, [0], keepdims=0), sources)

    @onnxscript.script(k3, default_opset=op)
    def rms_inv(x, eps: float) -> FLOAT:
        """k3::rms_inv: 1 / sqrt(mean(x^2, last dim) + eps) of one AttnRes source [B, T, D] -> [B, T], in fp32."""
        xf = op.Cast(x, to=F32)
        return op.Reciprocal(op.Sqrt(op.ReduceMean(xf * xf, [-1], keepdims=0) + eps))

    @onnxscript.script(k3, default_opset=op)
    def attn_res_normed(sources, rinv, query, norm_weight) -> FLOAT:
        """k3::attn_res_normed: attn_res with each source's rms_inv given ([S, B, T]), in fp32."""
        v = op.Cast(sources, to=F32)
        u = op.Cast(query, to=F32) * op.Cast(norm_weight, to=F32)
        logits = op.ReduceSum(v * u, [-1], keepdims=0) * op.Cast(rinv, to=F32)
        p = op.Softmax(logits, axis=0)
        return op.CastLike(op.ReduceSum(op.Unsqueeze(p, [-1]) * v, [0], keepdims=0), sources)

    return {
        "rms_norm": ("rms_norm", rms_norm),
        "l2_norm": ("l2_norm", l2_norm),
        "rms_norm_gate": ("rms_norm_gate", rms_norm_gate),
        "add_rms_norm": ("add_rms_norm", add_rms_norm),
        "attn_res": ("attn_res", attn_res),
        "rms_inv": ("rms_inv", rms_inv),
        "attn_res_normed": ("attn_res_normed", attn_res_normed),
    }


def _activations(op, k3, mx, lib):
    """situ_glu, swiglu and gelu (kernels/activations/reference.py)."""

    @onnxscript.script(k3, default_opset=op)
    def situ_glu(gate, up, beta1: float, beta2: float) -> FLOAT:
        """k3::situ_glu: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], in fp32."""
        g = op.Cast(gate, to=F32)
        u = op.Cast(up, to=F32)
        y = beta1 * op.Tanh(g / beta1) * op.Sigmoid(g) * (beta2 * op.Tanh(u / beta2))
        return op.CastLike(y, gate)

    @onnxscript.script(k3, default_opset=op)
    def swiglu(gate, up) -> FLOAT:
        """k3::swiglu: silu(g) * u, in fp32."""
        g = op.Cast(gate, to=F32)
        return op.CastLike(g * op.Sigmoid(g) * op.Cast(up, to=F32), gate)

    @onnxscript.script(k3, default_opset=op)
    def gelu_none(x) -> FLOAT:
        """k3::gelu, approximate="none": x/2 (1 + erf(x / sqrt 2)), in fp32."""
        xf = op.Cast(x, to=F32)
        return op.CastLike(0.5 * xf * (1.0 + op.Erf(xf * 0.7071067811865476)), x)

    @onnxscript.script(k3, default_opset=op)
    def gelu_tanh(x) -> FLOAT:
        """k3::gelu, approximate="tanh": x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in fp32."""
        xf = op.Cast(x, to=F32)
        inner = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
        return op.CastLike(0.5 * xf * (1.0 + op.Tanh(inner)), x)

    return {
        "situ_glu": ("situ_glu", situ_glu),
        "swiglu": ("swiglu", swiglu),
        "gelu_none": ("gelu", gelu_none),
        "gelu_tanh": ("gelu", gelu_tanh),
    }


def _projections(op, k3, mx, lib):
    """The GLU projections: linear_glu (2-D weights) and expert_glu / expert_matmul (stacked expert weights).

    Expert GEMMs contract the last dims under any number of leading (expert, rank) dims, as Einsum "...".
    """
    situ_glu, swiglu = lib["situ_glu"], lib["swiglu"]

    @onnxscript.script(k3, default_opset=op)
    def linear_glu_situ_glu(x, w_gate, w_up, beta1: float, beta2: float) -> FLOAT:
        """k3::linear_glu, kind situ_glu: situ_glu(x W_gate^T, x W_up^T); the GEMMs in x's dtype."""
        gate = op.MatMul(x, op.Transpose(w_gate, perm=[1, 0]))
        up = op.MatMul(x, op.Transpose(w_up, perm=[1, 0]))
        return situ_glu(gate, up, beta1=beta1, beta2=beta2)

    @onnxscript.script(k3, default_opset=op)
    def linear_glu_swiglu(x, w_gate, w_up) -> FLOAT:
        """k3::linear_glu, kind swiglu: swiglu(x W_gate^T, x W_up^T); the GEMMs in x's dtype."""
        gate = op.MatMul(x, op.Transpose(w_gate, perm=[1, 0]))
        up = op.MatMul(x, op.Transpose(w_up, perm=[1, 0]))
        return swiglu(gate, up)

    @onnxscript.script(k3, default_opset=op)
    def expert_glu_situ_glu(x, w_gate, w_up, beta1: float, beta2: float) -> FLOAT:
        """k3::expert_glu, kind situ_glu: per expert, x [..., C, w] and weights [..., I, w] -> [..., C, I], fp32."""
        xf = op.Cast(x, to=F32)
        gate = op.Einsum(xf, op.Cast(w_gate, to=F32), equation="...cw,...iw->...ci")
        up = op.Einsum(xf, op.Cast(w_up, to=F32), equation="...cw,...iw->...ci")
        return op.CastLike(situ_glu(gate, up, beta1=beta1, beta2=beta2), x)

    @onnxscript.script(k3, default_opset=op)
    def expert_glu_swiglu(x, w_gate, w_up) -> FLOAT:
        """k3::expert_glu, kind swiglu: per expert, x [..., C, w] and weights [..., I, w] -> [..., C, I], fp32."""
        xf = op.Cast(x, to=F32)
        gate = op.Einsum(xf, op.Cast(w_gate, to=F32), equation="...cw,...iw->...ci")
        up = op.Einsum(xf, op.Cast(w_up, to=F32), equation="...cw,...iw->...ci")
        return op.CastLike(swiglu(gate, up), x)

    @onnxscript.script(k3, default_opset=op)
    def expert_matmul(x, w) -> FLOAT:
        """k3::expert_matmul: x W^T per expert, x [..., C, I] and w [..., w, I] -> [..., C, w], fp32."""
        y = op.Einsum(op.Cast(x, to=F32), op.Cast(w, to=F32), equation="...ci,...wi->...cw")
        return op.CastLike(y, x)

    return {
        "linear_glu_situ_glu": ("linear_glu", linear_glu_situ_glu),
        "linear_glu_swiglu": ("linear_glu", linear_glu_swiglu),
        "expert_glu_situ_glu": ("expert_glu", expert_glu_situ_glu),
        "expert_glu_swiglu": ("expert_glu", expert_glu_swiglu),
        "expert_matmul": ("expert_matmul", expert_matmul),
    }


def _mx(op, k3, mx, lib):
    """MX formats (kernels/mx/reference.py): decoding MXFP4, the MX expert GEMMs and mx_linear on it, fake quantisation."""
    expert_glu_situ_glu, expert_glu_swiglu = lib["expert_glu_situ_glu"], lib["expert_glu_swiglu"]
    expert_matmul = lib["expert_matmul"]
    found = {}

    if mx == "fp4":

        @onnxscript.script(k3, default_opset=op)
        def mx_dequantize_e2m1(data, scale, block: int) -> FLOAT:
            """k3::mx_dequantize of MXFP4: FLOAT4E2M1 data [..., n], FLOAT8E8M0 scales [..., n/block] -> fp32."""
            return op.DequantizeLinear(data, scale, axis=-1, block_size=block, output_dtype=F32)

    else:

        @onnxscript.script(k3, default_opset=op)
        def mx_dequantize_e2m1(data, scale, block: int) -> FLOAT:
            """k3::mx_dequantize of MXFP4 as bytes: packed uint8 [..., n/2] (element 2i in the low nibble),
            E8M0 scale bytes [..., n/block] -> fp32 [..., n], by table lookups (0xFF scales give NaN)."""
            low = op.BitwiseAnd(data, op.CastLike(15, data))
            high = op.BitShift(data, op.CastLike(4, data), direction="RIGHT")
            codes = op.Concat(op.Unsqueeze(low, [-1]), op.Unsqueeze(high, [-1]), axis=-1)
            values = op.Gather(op.Constant(value=E2M1_TABLE), op.Cast(codes, to=I64))
            factor = op.Gather(op.Constant(value=E8M0_TABLE), op.Cast(scale, to=I64))
            lead = op.Shape(scale)
            blocks = op.Reshape(values, op.Concat(lead, op.Reshape(op.Constant(value_int=block), [1]), axis=0))
            n = op.Concat(op.Shape(data, end=-1), [-1], axis=0)
            return op.Reshape(blocks * op.Unsqueeze(factor, [-1]), n)

    found["mx_dequantize_e2m1"] = ("mx_dequantize", mx_dequantize_e2m1)

    @onnxscript.script(k3, default_opset=op)
    def mx_expert_glu_situ_glu(
        x, gate_data, gate_scale, up_data, up_scale, block: int, beta1: float, beta2: float
    ) -> FLOAT:
        """k3::mx_expert_glu, kind situ_glu: expert_glu on the dequantised MXFP4 gate and up weights."""
        w_gate = mx_dequantize_e2m1(gate_data, gate_scale, block=block)
        w_up = mx_dequantize_e2m1(up_data, up_scale, block=block)
        return expert_glu_situ_glu(x, w_gate, w_up, beta1=beta1, beta2=beta2)

    @onnxscript.script(k3, default_opset=op)
    def mx_expert_glu_swiglu(x, gate_data, gate_scale, up_data, up_scale, block: int) -> FLOAT:
        """k3::mx_expert_glu, kind swiglu: expert_glu on the dequantised MXFP4 gate and up weights."""
        w_gate = mx_dequantize_e2m1(gate_data, gate_scale, block=block)
        w_up = mx_dequantize_e2m1(up_data, up_scale, block=block)
        return expert_glu_swiglu(x, w_gate, w_up)

    @onnxscript.script(k3, default_opset=op)
    def mx_expert_matmul(x, data, scale, block: int) -> FLOAT:
        """k3::mx_expert_matmul: expert_matmul on the dequantised MXFP4 weight."""
        return expert_matmul(x, mx_dequantize_e2m1(data, scale, block=block))

    @onnxscript.script(k3, default_opset=op)
    def floor_log2(a) -> FLOAT:
        """floor(log2(a)) exactly, as fp32, for positive normal fp32 a: Log's estimate, corrected by one
        comparison with the exact power of two on each side (helper of mx_fake_quantize)."""
        e = op.Floor(op.Log(a) * LOG2_E)
        p = op.Gather(op.Constant(value=POW2_TABLE), op.Cast(e, to=I64) - POW2_MIN)
        too_high = op.Cast(op.Greater(p, a), to=F32)
        too_low = op.Cast(op.LessOrEqual(p + p, a), to=F32)
        return e - too_high + too_low

    @onnxscript.script(k3, default_opset=op)
    def mx_fake_quantize(x, block: int, mbits: int, emin: int, emax: int, max_value: float) -> FLOAT:
        """k3::mx_fake_quantize: the values an MX round trip leaves, for the element format given by its
        mantissa bits, exponent range [emin, emax] and largest value (the OCP rule of kernels/mx/reference.py).

        Per block of `block` values along the last dim: shared = clamp(floor(log2 amax) - emax, -127, 127)
        (-127 for an all-zero block); elements x / 2^shared saturated to +-max_value and rounded to nearest,
        ties to even, at the step 2^(max(floor(log2 |m|), emin) - mbits); a block holding NaN or Inf is NaN.
        Every product and quotient is by an exact power of two, so the only rounding is Round's.
        """
        xf = op.Cast(x, to=F32)
        xb = op.Reshape(xf, op.Concat(op.Shape(xf, end=-1), [-1], op.Reshape(op.Constant(value_int=block), [1]), axis=0))
        special = op.ReduceMax(op.Cast(op.Or(op.IsNaN(xb), op.IsInf(xb)), to=F32), [-1], keepdims=1)
        finite = op.Where(op.Cast(special, to=B1), 0.0, xb)
        amax = op.ReduceMax(op.Abs(finite), [-1], keepdims=1)
        nonzero = op.Greater(amax, 0.0)
        shared = op.Where(nonzero, floor_log2(op.Where(nonzero, amax, 1.0)) - op.Cast(emax, to=F32), -127.0)
        shared = op.Clip(shared, -127.0, 127.0)
        pow2 = op.Constant(value=POW2_TABLE)
        m = op.Clip(finite * op.Gather(pow2, op.Cast(-shared, to=I64) - POW2_MIN), -max_value, max_value)
        mag = op.Abs(m)
        big = op.Greater(mag, 0.0)
        exponent = op.Max(op.Where(big, floor_log2(op.Where(big, mag, 1.0)), -1000.0), op.Cast(emin, to=F32))
        ulp = op.Gather(pow2, op.Cast(exponent - op.Cast(mbits, to=F32), to=I64) - POW2_MIN)
        q = op.Round(m / ulp) * ulp * op.Gather(pow2, op.Cast(shared, to=I64) - POW2_MIN)
        y = op.Where(op.Cast(special, to=B1), op.CastLike(NAN, q), q)
        return op.CastLike(op.Reshape(y, op.Shape(xf)), x)

    @onnxscript.script(k3, default_opset=op)
    def mx_linear(x, data, scale, block: int) -> FLOAT:
        """k3::mx_linear (MXFP4 weight, no activation format): x @ dequant(W)^T in fp32."""
        w = mx_dequantize_e2m1(data, scale, block=block)
        return op.CastLike(op.MatMul(op.Cast(x, to=F32), op.Transpose(w, perm=[1, 0])), x)

    @onnxscript.script(k3, default_opset=op)
    def mx_linear_act(x, data, scale, block: int, mbits: int, emin: int, emax: int, max_value: float) -> FLOAT:
        """k3::mx_linear with an activation format: x is MX fake-quantised (format attributes as in
        mx_fake_quantize) before x @ dequant(W)^T in fp32."""
        w = mx_dequantize_e2m1(data, scale, block=block)
        xq = mx_fake_quantize(op.Cast(x, to=F32), block=block, mbits=mbits, emin=emin, emax=emax, max_value=max_value)
        return op.CastLike(op.MatMul(xq, op.Transpose(w, perm=[1, 0])), x)

    found.update(
        mx_expert_glu_situ_glu=("mx_expert_glu", mx_expert_glu_situ_glu),
        mx_expert_glu_swiglu=("mx_expert_glu", mx_expert_glu_swiglu),
        mx_expert_matmul=("mx_expert_matmul", mx_expert_matmul),
        floor_log2=(None, floor_log2),
        mx_fake_quantize=("mx_fake_quantize", mx_fake_quantize),
        mx_linear=("mx_linear", mx_linear),
        mx_linear_act=("mx_linear", mx_linear_act),
    )
    return found


def mx_format_attributes(fmt: str) -> dict:
    """The element format's parameters as the attributes of k3.mx_fake_quantize (and mx_linear_act)."""
    f = MX_FORMATS[fmt]
    return {"mbits": f.mbits, "emin": f.emin, "emax": f.emax, "max_value": f.max}


def _kda(op, k3, mx, lib):
    """Kimi Delta Attention (kernels/kda/reference.py): the decay gate, the chunked form and the decode step."""

    @onnxscript.script(k3, default_opset=op)
    def kda_gate_lower_bounded_sigmoid(f, A_log, dt_bias, lower_bound: float) -> FLOAT:
        """k3::kda_gate, form lower_bounded_sigmoid (K3): g = lower_bound * sigmoid(exp(A_log_h) (f + dt_bias))."""
        x = op.Cast(f, to=F32) + op.Reshape(op.Cast(dt_bias, to=F32), op.Shape(f, start=-2))
        a = op.Unsqueeze(op.Exp(op.Cast(A_log, to=F32)), [-1])
        return lower_bound * op.Sigmoid(a * x)

    @onnxscript.script(k3, default_opset=op)
    def kda_gate_softplus(f, A_log, dt_bias) -> FLOAT:
        """k3::kda_gate, form softplus (Kimi Linear): g = -exp(A_log_h) * softplus(f + dt_bias)."""
        x = op.Cast(f, to=F32) + op.Reshape(op.Cast(dt_bias, to=F32), op.Shape(f, start=-2))
        a = op.Unsqueeze(op.Exp(op.Cast(A_log, to=F32)), [-1])
        return op.Neg(a) * op.Softplus(x)

    @onnxscript.script(k3, default_opset=op)
    def kda_to_chunks(x, chunk_size: int) -> FLOAT:
        """[B, T, H, X] -> chunk-major fp32 [N, B, H, C, X], zero-padded to N = ceil(T / C) chunks (helper)."""
        c = op.Reshape(op.Constant(value_int=chunk_size), [1])
        t = op.Shape(x, start=1, end=2)
        n = op.Div(t + c - 1, c)
        pads = op.Concat(op.Constant(value_ints=[0, 0, 0, 0, 0]), n * c - t, op.Constant(value_ints=[0, 0]), axis=0)
        padded = op.Pad(op.Cast(x, to=F32), pads)
        shape = op.Concat(op.Shape(x, end=1), n, c, op.Shape(x, start=2), axis=0)
        return op.Transpose(op.Reshape(padded, shape), perm=[1, 0, 3, 2, 4])

    @onnxscript.script(k3, default_opset=op)
    def kda_chunk(q, k, v, g, beta, initial_state, scale: float, chunk_size: int) -> tuple[FLOAT, FLOAT]:
        """k3::kda_chunk: chunkwise-parallel KDA (the UT transform), (o [B, T, H, V] like v, final state fp32).

        Per chunk of C tokens, G the in-chunk cumulative log decay:
          A_qk[i,j] = sum_d q_id k_jd exp(G_id - G_jd) (j <= i), A_kk the same with k for q (j < i),
          [W | U] = (I + Diag(beta) A_kk)^-1 Diag(beta) [exp(G) * K | V]   (forward substitution, a Loop),
          S <- (Diag(exp(G_C)) - Kc^T W) S + Kc^T U with Kc = exp(G_C - G) * K   (a Scan over the chunks),
          O = scale ((exp(G) * Q) S + A_qk (U - W S)), S the state entering the chunk.
        exp(G_i - G_j) is taken pairwise and masked before the exp, so no factor ever exceeds 1; that holds
        N B H C C K floats at once (the kernels' blockwise factoring is not restated here).
        Padded tokens (k = 0, g = 0) leave the state alone.
        """
        qc = kda_to_chunks(q, chunk_size=chunk_size)
        kc = kda_to_chunks(k, chunk_size=chunk_size)
        vc = kda_to_chunks(v, chunk_size=chunk_size)
        gc = kda_to_chunks(g, chunk_size=chunk_size)
        bc = kda_to_chunks(op.Unsqueeze(beta, [-1]), chunk_size=chunk_size)
        G = op.CumSum(gc, op.Constant(value_int=-2))
        decay_in = op.Exp(G)
        G_last = op.Slice(G, [-1], op.Constant(value=TO_END), [-2])
        decay_out = op.Exp(G_last - G)

        steps = op.Range(op.Constant(value_int=0), op.Constant(value_int=chunk_size), op.Constant(value_int=1))
        rows = op.Unsqueeze(steps, [1])
        cols = op.Unsqueeze(steps, [0])
        exponent = op.Where(op.Unsqueeze(op.LessOrEqual(cols, rows), [-1]),
                            op.Unsqueeze(G, [-2]) - op.Unsqueeze(G, [-3]), NEG_INF)
        pair_decay = op.Exp(exponent)  # [N, B, H, C, C, K]: exp(G_i - G_j) for j <= i, else 0
        A_qk = op.ReduceSum(op.Unsqueeze(qc, [-2]) * op.Unsqueeze(kc, [-3]) * pair_decay, [-1], keepdims=0)
        A_kk = op.ReduceSum(op.Unsqueeze(kc, [-2]) * op.Unsqueeze(kc, [-3]) * pair_decay, [-1], keepdims=0)
        L = bc * op.Where(op.Less(cols, rows), A_kk, 0.0)

        Y = op.Concat(kc * decay_in * bc, vc * bc, axis=-1)

        @graph()  # solves (I + L) X = Y: the rows of X are final one step after the rows above them
        def substitute(step: INT64, go: BOOL, X):
            return op.Identity(go), Y - op.MatMul(L, X)

        # C - 1 steps solve it exactly (L^C = 0); an explicit condition, which onnx.reference's Loop needs
        X = op.Loop(op.Constant(value_int=chunk_size) - 1, op.Constant(value=TRUE), Y, body=substitute)
        K = op.Shape(qc, start=-1)
        W = op.Slice(X, [0], K, [-1])
        U = op.Slice(X, K, op.Constant(value=TO_END), [-1])
        KcT = op.Transpose(kc * decay_out, perm=[0, 1, 2, 4, 3])
        eye = op.EyeLike(op.ConstantOfShape(op.Concat(K, K, axis=0)))
        transition = eye * op.Transpose(op.Slice(decay_in, [-1], op.Constant(value=TO_END), [-2]), perm=[0, 1, 2, 4, 3])
        transition = transition - op.MatMul(KcT, W)
        inject = op.MatMul(KcT, U)

        @graph()  # typed: onnxruntime requires the shapes of a Scan body's outputs
        def chunk_step(
            S: FLOAT["B", "H", "K", "V"], transition_n: FLOAT["B", "H", "K", "K"], inject_n: FLOAT["B", "H", "K", "V"]
        ) -> tuple[FLOAT["B", "H", "K", "V"], FLOAT["B", "H", "K", "V"]]:
            return op.MatMul(transition_n, S) + inject_n, op.Identity(S)

        S_final, S_in = op.Scan(op.Cast(initial_state, to=F32), transition, inject, body=chunk_step, num_scan_inputs=2)
        v_new = U - op.MatMul(W, S_in)
        O = scale * (op.MatMul(qc * decay_in, S_in) + op.MatMul(A_qk, v_new))
        tokens = op.Transpose(O, perm=[1, 0, 3, 2, 4])  # [B, N, C, H, V]
        merged = op.Concat(op.Shape(tokens, end=1), [-1], op.Shape(tokens, start=3), axis=0)
        o = op.Slice(op.Reshape(tokens, merged), [0], op.Shape(q, start=1, end=2), [1])
        return op.CastLike(o, v), S_final

    @onnxscript.script(k3, default_opset=op)
    def kda_decode_step(q, k, v, g, beta, state, scale: float) -> tuple[FLOAT, FLOAT]:
        """k3::kda_decode_step: one token, q, k, g [B, H, K], v [B, H, V], beta [B, H], state [B, H, K, V] fp32.

        S <- Diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = scale S^T q.  Returns (o like v, S).
        """
        kf = op.Cast(k, to=F32)
        S = op.Cast(state, to=F32) * op.Unsqueeze(op.Exp(op.Cast(g, to=F32)), [-1])
        residual = op.Cast(v, to=F32) - op.Squeeze(op.MatMul(op.Unsqueeze(kf, [-2]), S), [-2])
        beta_k = op.Unsqueeze(op.Cast(beta, to=F32), [-1]) * kf
        S = S + op.Unsqueeze(beta_k, [-1]) * op.Unsqueeze(residual, [-2])
        o = op.Squeeze(op.MatMul(op.Unsqueeze(op.Cast(q, to=F32) * scale, [-2]), S), [-2])
        return op.CastLike(o, v), S

    @onnxscript.script(k3, default_opset=op)
    def short_conv(x, weight, initial_state, channels: int) -> tuple[FLOAT, FLOAT]:
        """k3::short_conv: SiLU(causal depthwise conv(x)) over time, x [B, T, C], weight [C, W], state [B, C, W-1].

        Returns (y [B, T, C] like x, the last W - 1 inputs [B, C, W - 1] like x): the next call's state.
        """
        history = op.Concat(op.Cast(initial_state, to=F32), op.Transpose(op.Cast(x, to=F32), perm=[0, 2, 1]), axis=-1)
        y = op.Conv(history, op.Unsqueeze(op.Cast(weight, to=F32), [1]), group=channels)
        y = y * op.Sigmoid(y)
        keep = op.Shape(history, start=-1) - op.Shape(weight, start=-1) + 1
        state = op.Slice(history, keep, op.Constant(value=TO_END), [-1])
        return op.CastLike(op.Transpose(y, perm=[0, 2, 1]), x), op.CastLike(state, x)

    return {
        "kda_gate_lower_bounded_sigmoid": ("kda_gate", kda_gate_lower_bounded_sigmoid),
        "kda_gate_softplus": ("kda_gate", kda_gate_softplus),
        "kda_to_chunks": (None, kda_to_chunks),
        "kda_chunk": ("kda_chunk", kda_chunk),
        "kda_decode_step": ("kda_decode_step", kda_decode_step),
        "short_conv": ("short_conv", short_conv),
    }


def _mla(op, k3, mx, lib):
    """Gated MLA's attention cores (kernels/mla/reference.py): expanded (prefill) and absorbed (decode over the latent cache).

    Queries are the last T of the S key positions: query i sits at S - T + i and sees keys 0 .. S - T + i.
    """

    @onnxscript.script(k3, default_opset=op)
    def causal_softmax(scores) -> FLOAT:
        """Softmax over the keys of scores [..., T, S] with the causal mask for the last T positions (helper)."""
        s = op.Shape(scores, start=-1)
        t = op.Shape(scores, start=-2, end=-1)
        zero = op.Constant(value_int=0)
        one = op.Constant(value_int=1)
        key_pos = op.Range(zero, op.Squeeze(s, [0]), one)
        query_pos = op.Range(op.Squeeze(s - t, [0]), op.Squeeze(s, [0]), one)
        visible = op.LessOrEqual(op.Unsqueeze(key_pos, [0]), op.Unsqueeze(query_pos, [1]))
        return op.Softmax(op.Where(visible, scores, NEG_INF), axis=-1)

    @onnxscript.script(k3, default_opset=op)
    def mla_attention(q, k_nope, k_pe, v, scale: float) -> FLOAT:
        """k3::mla_attention: causal attention with per-head keys [k_nope_h, k_pe], k_pe [B, S, R] shared by all
        heads; q [B, T, H, N + R], k_nope [B, S, H, N], v [B, S, H, V] -> o [B, T, H, V] like q, fp32 inside."""
        qf = op.Transpose(op.Cast(q, to=F32), perm=[0, 2, 1, 3])  # [B, H, T, K]
        n = op.Shape(k_nope, start=-1)
        q_nope = op.Slice(qf, [0], n, [-1])
        q_pe = op.Slice(qf, n, op.Constant(value=TO_END), [-1])
        scores = op.MatMul(q_nope, op.Transpose(op.Cast(k_nope, to=F32), perm=[0, 2, 3, 1]))
        scores = scores + op.MatMul(q_pe, op.Unsqueeze(op.Transpose(op.Cast(k_pe, to=F32), perm=[0, 2, 1]), [1]))
        p = causal_softmax(scores * scale)
        o = op.MatMul(p, op.Transpose(op.Cast(v, to=F32), perm=[0, 2, 1, 3]))
        return op.CastLike(op.Transpose(o, perm=[0, 2, 1, 3]), q)

    @onnxscript.script(k3, default_opset=op)
    def offset_softmax(scores, first) -> FLOAT:
        """Softmax over the keys of scores [B, H, T, S] where query t sits at position first + t and sees keys up
        to it; `first` broadcasts against [B, 1, 1, 1] (helper)."""
        s = op.Squeeze(op.Shape(scores, start=-1), [0])
        t = op.Squeeze(op.Shape(scores, start=-2, end=-1), [0])
        zero = op.Constant(value_int=0)
        one = op.Constant(value_int=1)
        key_pos = op.Unsqueeze(op.Range(zero, s, one), [0])  # [1, S]
        query_pos = op.Unsqueeze(op.Range(zero, t, one), [1]) + first  # [T, 1] or [B, 1, T, 1]
        return op.Softmax(op.Where(op.LessOrEqual(key_pos, query_pos), scores, NEG_INF), axis=-1)

    @onnxscript.script(k3, default_opset=op)
    def mla_absorbed(q, latent, w_kvb, first, scale: float) -> FLOAT:
        """Absorbed attention over the latent cache [c_kv | k_pe] [B, S, L + R], query t at position first + t:
        kv_b_proj [H (N + V), L] folded into the query (q_lat = W_uk^T q_nope) and applied after (o = W_uv P c_kv)."""
        qf = op.Transpose(op.Cast(q, to=F32), perm=[0, 2, 1, 3])  # [B, H, T, N + R]
        lat = op.Unsqueeze(op.Cast(latent, to=F32), [1])  # [B, 1, S, L + R]
        width = op.Shape(w_kvb, start=1)  # L
        rope = op.Shape(latent, start=-1) - width
        n = op.Shape(q, start=-1) - rope
        heads = op.Shape(q, start=2, end=3)
        w = op.Reshape(op.Cast(w_kvb, to=F32), op.Concat(heads, [-1], width, axis=0))  # [H, N + V, L]
        w_uk = op.Slice(w, [0], n, [1])
        w_uv = op.Slice(w, n, op.Constant(value=TO_END), [1])
        c_kv = op.Slice(lat, [0], width, [-1])
        k_pe = op.Slice(lat, width, op.Constant(value=TO_END), [-1])
        q_lat = op.MatMul(op.Slice(qf, [0], n, [-1]), w_uk)  # [B, H, T, L]
        scores = op.MatMul(q_lat, op.Transpose(c_kv, perm=[0, 1, 3, 2]))
        scores = scores + op.MatMul(op.Slice(qf, n, op.Constant(value=TO_END), [-1]), op.Transpose(k_pe, perm=[0, 1, 3, 2]))
        o_lat = op.MatMul(offset_softmax(scores * scale, first), c_kv)  # [B, H, T, L]
        o = op.MatMul(o_lat, op.Transpose(w_uv, perm=[0, 2, 1]))  # [B, H, T, V]
        return op.CastLike(op.Transpose(o, perm=[0, 2, 1, 3]), q)

    @onnxscript.script(k3, default_opset=op)
    def mla_decode_absorbed(q, latent, w_kvb, scale: float) -> FLOAT:
        """k3::mla_decode_absorbed over a full cache: the T queries are the last T of the S positions."""
        first = op.Shape(latent, start=1, end=2) - op.Shape(q, start=1, end=2)
        return mla_absorbed(q, latent, w_kvb, first, scale=scale)

    @onnxscript.script(k3, default_opset=op)
    def mla_decode_absorbed_lengths(q, latent, w_kvb, lengths, scale: float) -> FLOAT:
        """k3::mla_decode_absorbed over a preallocated cache: sequence b holds lengths[b] valid rows, its T
        queries the last T of them."""
        first = op.Reshape(lengths - op.Shape(q, start=1, end=2), op.Constant(value_ints=[-1, 1, 1, 1]))
        return mla_absorbed(q, latent, w_kvb, first, scale=scale)

    return {
        "causal_softmax": (None, causal_softmax),
        "mla_attention": ("mla_attention", mla_attention),
        "offset_softmax": (None, offset_softmax),
        "mla_absorbed": (None, mla_absorbed),
        "mla_decode_absorbed": ("mla_decode_absorbed", mla_decode_absorbed),
        "mla_decode_absorbed_lengths": ("mla_decode_absorbed", mla_decode_absorbed_lengths),
    }


def _moe(op, k3, mx, lib):
    """The router and fixed-capacity dispatch / combine (kernels/moe/reference.py, kernels/fused/reference.py)."""

    @onnxscript.script(k3, default_opset=op)
    def route_weights(scores, bias, top_k: int, renormalize: int, routed_scale: float) -> tuple[FLOAT, INT64]:
        """Top-k of scores + bias chooses; the weights are the chosen unbiased scores, divided by their sum
        (at least 1e-20) when renormalize is nonzero, times routed_scale (helper of the routers)."""
        choice = scores + op.Cast(bias, to=F32)
        _, indices = op.TopK(choice, op.Reshape(op.Constant(value_int=top_k), [1]), axis=1, largest=1, sorted=1)
        weights = op.GatherElements(scores, indices, axis=1)  # scores are [T, E]
        total = op.Max(op.ReduceSum(weights, [-1], keepdims=1), 1e-20)
        denominator = op.Where(op.Cast(op.Constant(value_int=renormalize), to=B1), total, 1.0)
        return weights / denominator * routed_scale, indices

    @onnxscript.script(k3, default_opset=op)
    def moe_route_sigmoid(logits, bias, top_k: int, renormalize: int, routed_scale: float) -> tuple[FLOAT, INT64, FLOAT]:
        """k3::moe_route, scoring sigmoid: (weights [T, K] fp32, indices [T, K], scores [T, E] fp32)."""
        scores = op.Sigmoid(op.Cast(logits, to=F32))
        weights, indices = route_weights(scores, bias, top_k=top_k, renormalize=renormalize, routed_scale=routed_scale)
        return weights, indices, scores

    @onnxscript.script(k3, default_opset=op)
    def moe_route_softmax(logits, bias, top_k: int, renormalize: int, routed_scale: float) -> tuple[FLOAT, INT64, FLOAT]:
        """k3::moe_route, scoring softmax: (weights [T, K] fp32, indices [T, K], scores [T, E] fp32)."""
        scores = op.Softmax(op.Cast(logits, to=F32), axis=-1)
        weights, indices = route_weights(scores, bias, top_k=top_k, renormalize=renormalize, routed_scale=routed_scale)
        return weights, indices, scores

    @onnxscript.script(k3, default_opset=op)
    def linear_route_sigmoid(x, weight, bias, top_k: int, renormalize: int, routed_scale: float) -> tuple[FLOAT, INT64, FLOAT]:
        """k3::linear_route, scoring sigmoid: moe_route_sigmoid of the router logits x W^T."""
        logits = op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
        weights, indices, scores = moe_route_sigmoid(logits, bias, top_k=top_k, renormalize=renormalize,
                                                  routed_scale=routed_scale)
        return weights, indices, scores

    @onnxscript.script(k3, default_opset=op)
    def linear_route_softmax(x, weight, bias, top_k: int, renormalize: int, routed_scale: float) -> tuple[FLOAT, INT64, FLOAT]:
        """k3::linear_route, scoring softmax: moe_route_softmax of the router logits x W^T."""
        logits = op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
        weights, indices, scores = moe_route_softmax(logits, bias, top_k=top_k, renormalize=renormalize,
                                                  routed_scale=routed_scale)
        return weights, indices, scores

    @onnxscript.script(k3, default_opset=op)
    def moe_dispatch(x, indices, num_experts: int, capacity_factor: float) -> tuple[FLOAT, INT64, INT64, INT64]:
        """k3::moe_dispatch: tokens x [T, D] into expert buffers [E, C, D] (unused rows zero).

        C = T when capacity_factor <= 0 (drop-free), else min(T, max(1, ceil(capacity_factor T K / E))).
        A choice's slot is expert * C + its rank among that expert's choices in token-major order, found by
        a stable sort (TopK breaks ties by index); ranks >= C are dropped to the sentinel slot E * C.
        Returns (buffer, slots [T, K], load [E] counted before dropping, dropped choices []).
        """
        t = op.Shape(x, end=1)
        flat = op.Reshape(indices, [-1])
        n = op.Shape(flat)
        e = op.Reshape(op.Constant(value_int=num_experts), [1])
        per_token = op.Shape(indices, start=1, end=2)
        wanted = op.Ceil(op.Cast(op.Constant(value_float=capacity_factor), to=F64) * op.Cast(t * per_token, to=F64)
                         / op.Cast(e, to=F64))
        bounded = op.Min(t, op.Max(op.Cast(wanted, to=I64), op.Constant(value_ints=[1])))
        c = op.Where(op.Greater(op.Constant(value_float=capacity_factor), 0.0), bounded, t)
        load = op.ScatterElements(op.ConstantOfShape(e, value=ZERO_I64), flat, op.ConstantOfShape(n, value=ONE_I64),
                                  axis=0, reduction="add")
        start = op.CumSum(load, op.Constant(value_int=0), exclusive=1)
        _, order = op.TopK(flat, n, axis=0, largest=0, sorted=1)
        zero = op.Constant(value_int=0)
        one = op.Constant(value_int=1)
        position = op.Range(zero, op.Squeeze(n, [0]), one)
        rank = op.ScatterElements(flat, order, position - op.Gather(start, op.Gather(flat, order)), axis=0)
        keep = op.Less(rank, c)
        slots = op.Where(keep, flat * c + rank, e * c)
        dropped = op.ReduceSum(op.Cast(op.Not(keep), to=I64), keepdims=0)
        token = op.Div(position, op.Squeeze(per_token, [0]))
        holder = op.Expand(t, e * c + 1)  # the token in each slot; T (a zero row) where none
        holder = op.ScatterElements(holder, slots, token, axis=0, reduction="min")
        rows = op.Gather(op.Pad(x, op.Constant(value_ints=[0, 0, 1, 0])), op.Slice(holder, [0], e * c, [0]))
        buffer = op.Reshape(rows, op.Concat(e, c, op.Shape(x, start=1), axis=0))
        return buffer, op.Reshape(slots, op.Shape(indices)), load, dropped

    @onnxscript.script(k3, default_opset=op)
    def moe_combine(expert_out, weights, slots) -> FLOAT:
        """k3::moe_combine: y_t = sum_k w_tk out[slot_tk] [T, D] like expert_out, summed in fp32; the sentinel
        slot E * C (a dropped choice) reads a zero row."""
        rows = op.Reshape(expert_out, op.Concat([-1], op.Shape(expert_out, start=-1), axis=0))
        gathered = op.Cast(op.Gather(op.Pad(rows, op.Constant(value_ints=[0, 0, 1, 0])), slots), to=F32)
        y = op.ReduceSum(op.Unsqueeze(op.Cast(weights, to=F32), [-1]) * gathered, [1], keepdims=0)
        return op.CastLike(y, expert_out)

    @onnxscript.script(k3, default_opset=op)
    def moe_combine_ordered(expert_out, weights) -> FLOAT:
        """k3::moe_combine without slots: expert_out holds one row per (token, choice) in that order,
        [T * K, 1, D]; y_t = sum_k w_tk out[t K + k], summed in fp32."""
        rows = op.Reshape(op.Cast(expert_out, to=F32), op.Concat(op.Shape(weights), op.Shape(expert_out, start=-1),
                                                                  axis=0))
        y = op.ReduceSum(op.Unsqueeze(op.Cast(weights, to=F32), [-1]) * rows, [1], keepdims=0)
        return op.CastLike(y, expert_out)

    return {
        "route_weights": (None, route_weights),
        "moe_route_sigmoid": ("moe_route", moe_route_sigmoid),
        "moe_route_softmax": ("moe_route", moe_route_softmax),
        "linear_route_sigmoid": ("linear_route", linear_route_sigmoid),
        "linear_route_softmax": ("linear_route", linear_route_softmax),
        "moe_dispatch": ("moe_dispatch", moe_dispatch),
        "moe_combine": ("moe_combine", moe_combine),
        "moe_combine_ordered": ("moe_combine", moe_combine_ordered),
    }

