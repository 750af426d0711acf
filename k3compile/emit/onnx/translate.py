"""The translation table torch's ONNX exporter uses for the k3 ops: op overload -> a call of its k3 function.

Each translation receives the fx node's arguments as the exporter converts them (tensors as ONNX values,
numbers and strings as Python values, dtypes as ONNX type numbers) and records one call of the op's
function from the `Library` (k3compile.emit.onnx.functions). It settles what the op decides in Python
before any tensor is touched: which variant a string selects, the default scale K**-0.5 from the static
head dim, zeros for an optional tensor passed as None. The `backend` argument only picks a kernel,
never the math, so every backend exports the same function.

A few ops have no translation (`UNTRANSLATED`, with the reason): they update training statistics or
shape gradients, and no graph that inference or export runs contains them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from onnxscript import opset18 as op

import k3compile.ops  # noqa: F401  registers torch.ops.k3
from k3compile.emit.onnx.functions import Library, mx_format_attributes

K3 = torch.ops.k3

UNTRANSLATED = {
    "attach_aux_loss": "training only: passes x through and adds the auxiliary loss's gradient",
    "moe_aux_loss": "training only: the load-balancing auxiliary loss",
    "quantile_balance_update": "training only: next step's router bias (Quantile Balancing)",
    "qb_histogram": "training only: Quantile Balancing's margin histogram",
    "qb_update_from_histogram": "training only: Quantile Balancing from a summed histogram",
    "sign_balance_update": "training only: DeepSeek-V3's bias update",
    "glu_train": "training only: CPU train graphs' GLU saving its derivatives (inference keeps the fused GLUs)",
    "moe_dispatch_rows": "training only: CPU train graphs' dispatch to the experts' rows (group_experts)",
    "expert_rows_matmul": "training only: CPU train graphs' expert GEMMs on the experts' rows (group_experts)",
    "expert_rows_ffn": "training only: CPU train graphs' expert FFNs on the experts' rows (group_experts)",
    "mx_quantize": "builds MX weights, which the graphs receive already packed",
    "kda_recurrent": "no graph uses it (KDA runs chunked, and one token at a time through kda_decode_step)",
    "gla_chunk": "not exported yet: gated linear attention (kda.delta_rule false), an ablation",
    "gla_decode_step": "not exported yet: gated linear attention (kda.delta_rule false), an ablation",
    "mla_rope": "no shipped spec rotates its MLA keys (rope: false); no graph uses it",
    "mla_rope_at": "no shipped spec rotates its MLA keys (rope: false); no graph uses it",
}


def _zeros(shape):
    """An fp32 zero tensor of the ONNX shape (a 1-D int64 value)."""
    return op.ConstantOfShape(shape)


def _static_last(x) -> int:
    """The static size of x's last dim (head dims, channels and expert counts are static in every graph)."""
    return int(x.shape[-1])


def _scale(scale: float | None, x) -> float:
    return _static_last(x) ** -0.5 if scale is None else float(scale)


def _glu(kind: str, functions: dict, prefix: str):
    """The `<prefix>_<kind>` function, and whether it takes the SiTU betas."""
    if kind not in ("situ_glu", "swiglu"):
        raise ValueError(f"k3::{prefix}: no ONNX translation for GLU kind {kind!r}")
    return functions[f"{prefix}_{kind}"], kind == "situ_glu"


def table(lib: Library) -> dict[Callable, Callable]:
    """{torch.ops.k3.<op>.default: translation} for every translated op, calling `lib`'s functions, and the
    one ATen op (aten.to.dtype) the captured k3 graphs hold that torchlib has no translation for."""
    f = lib.functions

    def rms_norm(x, weight, eps: float, backend: str = "auto"):
        return f["rms_norm"](x, weight, eps=eps)

    def l2_norm(x, eps: float, backend: str = "auto"):
        return f["l2_norm"](x, eps=eps)

    def rms_norm_gate(x, weight, gate, eps: float, backend: str = "auto"):
        return f["rms_norm_gate"](x, weight, gate, eps=eps)

    def add_rms_norm(x, residual, weight, eps: float, backend: str = "auto"):
        return f["add_rms_norm"](x, residual, weight, eps=eps)

    def attn_res(sources, query, norm_weight, eps: float, backend: str = "auto"):
        return f["attn_res"](sources, query, norm_weight, eps=eps)

    def rms_inv(x, eps: float, backend: str = "auto"):
        return f["rms_inv"](x, eps=eps)

    def attn_res_normed(sources, rinv, query, norm_weight, backend: str = "auto"):
        return f["attn_res_normed"](sources, rinv, query, norm_weight)

    def situ_glu(gate, up, beta1: float, beta2: float, backend: str = "auto"):
        return f["situ_glu"](gate, up, beta1=beta1, beta2=beta2)

    def swiglu(gate, up, backend: str = "auto"):
        return f["swiglu"](gate, up)

    def gelu(x, approximate: str, backend: str = "auto"):
        return f[f"gelu_{approximate}"](x)

    def linear_glu(x, w_gate, w_up, kind: str, beta1: float, beta2: float, backend: str = "auto"):
        fn, betas = _glu(kind, f, "linear_glu")
        return fn(x, w_gate, w_up, beta1=beta1, beta2=beta2) if betas else fn(x, w_gate, w_up)

    def expert_glu(x, w_gate, w_up, kind: str, beta1: float, beta2: float, backend: str = "auto"):
        fn, betas = _glu(kind, f, "expert_glu")
        return fn(x, w_gate, w_up, beta1=beta1, beta2=beta2) if betas else fn(x, w_gate, w_up)

    def expert_matmul(x, w, backend: str = "auto"):
        return f["expert_matmul"](x, w)

    def mx_expert_glu(x, gate_data, gate_scale, up_data, up_scale, block: int, kind: str, beta1: float,
                      beta2: float, backend: str = "auto"):
        fn, betas = _glu(kind, f, "mx_expert_glu")
        args = (x, gate_data, gate_scale, up_data, up_scale)
        return fn(*args, block=block, beta1=beta1, beta2=beta2) if betas else fn(*args, block=block)

    def mx_expert_matmul(x, data, scale, block: int, backend: str = "auto"):
        return f["mx_expert_matmul"](x, data, scale, block=block)

    def mx_dequantize(data, scale, fmt: str, block: int, dtype: int, backend: str = "auto"):
        if fmt != "e2m1":
            raise ValueError(f"k3::mx_dequantize: only MXFP4 (e2m1) payloads are translated, got {fmt!r}")
        return op.Cast(f["mx_dequantize_e2m1"](data, scale, block=block), to=dtype)

    def mx_fake_quantize(x, fmt: str, block: int, backend: str = "auto"):
        return f["mx_fake_quantize"](x, block=block, **mx_format_attributes(fmt))

    def mx_linear(x, data, scale, fmt: str, block: int, act_fmt: str | None = None, backend: str = "auto"):
        if fmt != "e2m1":
            raise ValueError(f"k3::mx_linear: only MXFP4 (e2m1) weights are translated, got {fmt!r}")
        if act_fmt is None:
            return f["mx_linear"](x, data, scale, block=block)
        return f["mx_linear_act"](x, data, scale, block=block, **mx_format_attributes(act_fmt))

    def kda_gate(f_proj, A_log, dt_bias, form: str, lower_bound: float, backend: str = "auto"):
        if form == "lower_bounded_sigmoid":
            return f["kda_gate_lower_bounded_sigmoid"](f_proj, A_log, dt_bias, lower_bound=lower_bound)
        if form == "softplus":
            return f["kda_gate_softplus"](f_proj, A_log, dt_bias)
        raise ValueError(f"k3::kda_gate: no ONNX translation for decay form {form!r}")

    def kda_chunk(q, k, v, g, beta, scale: float | None, initial_state, chunk_size: int, backend: str = "auto"):
        if initial_state is None:
            heads_and_keys = op.Shape(q, start=2)
            initial_state = _zeros(op.Concat(op.Shape(q, end=1), heads_and_keys, op.Shape(v, start=-1), axis=0))
        o, state = f["kda_chunk"](q, k, v, g, beta, initial_state, scale=_scale(scale, q), chunk_size=chunk_size)
        return [o, state]  # the op's further outputs are what its backward reuses; no graph here reads them

    def kda_decode_step(q, k, v, g, beta, state, scale: float | None, backend: str = "auto"):
        return f["kda_decode_step"](q, k, v, g, beta, state, scale=_scale(scale, q))

    def short_conv(x, weight, initial_state, backend: str = "auto"):
        channels = _static_last(x)
        if initial_state is None:
            tail = op.Constant(value_ints=[channels, int(weight.shape[-1]) - 1])
            initial_state = op.CastLike(_zeros(op.Concat(op.Shape(x, end=1), tail, axis=0)), x)
        return f["short_conv"](x, weight, initial_state, channels=channels)

    def mla_attention(q, k_nope, k_pe, v, scale: float, backend: str = "auto"):
        return f["mla_attention"](q, k_nope, k_pe, v, scale=scale)

    def mla_decode_absorbed(q, latent, w_kvb, scale: float, lengths=None, backend: str = "auto"):
        if lengths is None:
            return f["mla_decode_absorbed"](q, latent, w_kvb, scale=scale)
        return f["mla_decode_absorbed_lengths"](q, latent, w_kvb, lengths, scale=scale)

    def _route(name, x_or_logits, *weight, bias, top_k, scoring, renormalize, routed_scale):
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"k3::{name}: no ONNX translation for scoring {scoring!r}")
        if bias is None:
            experts = weight[0] if weight else x_or_logits
            bias = _zeros(op.Shape(experts, start=0, end=1) if weight else op.Shape(experts, start=-1))
        return f[f"{name}_{scoring}"](x_or_logits, *weight, bias, top_k=top_k, renormalize=int(renormalize),
                                      routed_scale=routed_scale)

    def moe_route(logits, bias, top_k: int, scoring: str, renormalize: bool, routed_scale: float,
                  backend: str = "auto"):
        return _route("moe_route", logits, bias=bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                      routed_scale=routed_scale)

    def linear_route(x, weight, bias, top_k: int, scoring: str, renormalize: bool, routed_scale: float,
                     backend: str = "auto"):
        return _route("linear_route", x, weight, bias=bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                      routed_scale=routed_scale)

    def moe_dispatch(x, indices, num_experts: int, capacity_factor: float, backend: str = "auto"):
        return f["moe_dispatch"](x, indices, num_experts=num_experts, capacity_factor=capacity_factor)

    def moe_combine(expert_out, weights, slots, backend: str = "auto"):
        if slots is None:
            return f["moe_combine_ordered"](expert_out, weights)
        return f["moe_combine"](expert_out, weights, slots)

    def to_dtype(x, dtype: int, non_blocking: bool = False, copy: bool = False, memory_format=None):
        return op.Cast(x, to=dtype)

    translations = {
        "rms_norm": rms_norm, "l2_norm": l2_norm, "rms_norm_gate": rms_norm_gate, "add_rms_norm": add_rms_norm,
        "attn_res": attn_res, "situ_glu": situ_glu, "swiglu": swiglu, "gelu": gelu, "linear_glu": linear_glu,
        "expert_glu": expert_glu, "expert_matmul": expert_matmul, "mx_expert_glu": mx_expert_glu,
        "mx_expert_matmul": mx_expert_matmul, "mx_dequantize": mx_dequantize, "mx_fake_quantize": mx_fake_quantize,
        "mx_linear": mx_linear, "kda_gate": kda_gate, "kda_chunk": kda_chunk, "kda_decode_step": kda_decode_step,
        "short_conv": short_conv, "mla_attention": mla_attention, "mla_decode_absorbed": mla_decode_absorbed,
        "moe_route": moe_route, "linear_route": linear_route, "moe_dispatch": moe_dispatch,
        "moe_combine": moe_combine, "rms_inv": rms_inv, "attn_res_normed": attn_res_normed,
    }
    table = {getattr(K3, name).default: fn for name, fn in translations.items()}
    # aten.to.dtype (`.float()` in emitted code) reaches the exporter untranslated when export skips the
    # decomposition retrace (k3compile.emit.onnx.export.trace): torchlib only translates what it decomposes to.
    table[torch.ops.aten.to.dtype] = to_dtype
    return table
