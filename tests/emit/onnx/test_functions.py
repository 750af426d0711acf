"""Every k3 ONNX function against its op's PyTorch reference: one call node in a model of its own, run by
onnxruntime (CPU) and, for the bodies with Loop, Scan or FP4, by onnx.reference too.

Errors are max|onnx - torch| / max|torch|; fp32 reformulations of the same math stay near 1e-6, and the MX
codecs are bit-exact.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import k3compile.ops  # noqa: F401
from k3compile.emit.onnx import functions as F
from k3compile.emit.onnx import translate
from k3compile.kernels.activations import reference as activations
from k3compile.kernels.attn_res import reference as attn_res
from k3compile.kernels.attn_res_normed import reference as attn_res_normed
from k3compile.kernels.experts import reference as experts
from k3compile.kernels.fused import reference as fused
from k3compile.kernels.kda import reference as kda
from k3compile.kernels.mla import reference as mla
from k3compile.kernels.moe import reference as moe
from k3compile.kernels.norms import reference as norms
from k3compile.kernels.mx import reference as kmx
from k3compile.kernels.short_conv import reference as sc

TOL = 5e-6


@pytest.fixture(scope="module")
def lib():
    return F.define(24, "uint8")


@pytest.fixture(scope="module")
def lib_fp4():
    return F.define(24, "fp4")


def call(lib, name, inputs, attrs=None, n_out=1, engine="onnxruntime"):
    """Outputs of one k3.<name> call on numpy `inputs` (a model holding just it and the functions it calls)."""
    names = [f"in{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(name, names, [f"out{i}" for i in range(n_out)], domain=F.DOMAIN, **(attrs or {}))],
        name,
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, inputs)],
        [onnx.ValueInfoProto(name=f"out{i}") for i in range(n_out)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", lib.opset), helper.make_opsetid(F.DOMAIN, 1)],
                              functions=lib.protos([name]))
    feeds = dict(zip(names, inputs))
    if engine == "onnxruntime":
        import onnxruntime as ort

        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def rel(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want.detach().numpy() if isinstance(want, torch.Tensor) else want, np.float64)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_every_k3_op_is_translated_or_listed():

    ops = {n for n in dir(torch.ops.k3) if isinstance(getattr(torch.ops.k3, n), torch._ops.OpOverloadPacket)}
    # the project's ops; tests/ops/test_registry.py registers toy "test_*" ops in whichever worker runs it
    forward = {n for n in ops if not n.endswith("_bwd") and not n.startswith("test_")}
    translated = {target.name().split("::")[1] for target in translate.table(F.define(24, "uint8")) if target.namespace == "k3"}
    assert forward == translated | set(translate.UNTRANSLATED)
    assert not translated & set(translate.UNTRANSLATED)


def test_every_function_declares_its_op(lib):
    assert set(lib.ops.values()) <= {target.name().split("::")[1] for target in translate.table(lib) if target.namespace == "k3"}
    for name, fn in lib.functions.items():
        assert fn.name == name


def test_opset_too_low_for_fp4():
    with pytest.raises(ValueError, match="opset 23 is too low"):
        F.define(23, "fp4")
    assert F.define(18, "uint8").opset == 18


def test_norms(lib):
    x, w, gate, res = randn(2, 5, 16), randn(16, seed=1), randn(2, 5, 16, seed=2), randn(2, 5, 16, seed=3)
    assert rel(call(lib, "rms_norm", [x.numpy(), w.numpy()], {"eps": 1e-5})[0], norms.rms_norm_ref(x, w, 1e-5)) < TOL
    assert rel(call(lib, "l2_norm", [x.numpy()], {"eps": 1e-6})[0], norms.l2_norm_ref(x, 1e-6)) < TOL
    got = call(lib, "rms_norm_gate", [x.numpy(), w.numpy(), gate.numpy()], {"eps": 1e-5})[0]
    assert rel(got, norms.rms_norm_gate_ref(x, w, gate, 1e-5)) < TOL
    normed, total = call(lib, "add_rms_norm", [x.numpy(), res.numpy(), w.numpy()], {"eps": 1e-5}, n_out=2)
    want = norms.add_rms_norm_ref(x, res, w, 1e-5)
    assert rel(normed, want[0]) < TOL and rel(total, want[1]) == 0
    sources = randn(3, 2, 5, 16, seed=4)
    got = call(lib, "attn_res", [sources.numpy(), w.numpy(), gate[0, 0].numpy()], {"eps": 1e-5})[0]
    assert rel(got, attn_res.attn_res_ref(sources, w, gate[0, 0], 1e-5)) < TOL
    rinv = call(lib, "rms_inv", [sources[0].numpy()], {"eps": 1e-5})[0]
    assert rel(rinv, attn_res_normed.rms_inv_ref(sources[0], 1e-5)) < TOL
    rinvs = attn_res_normed.rms_inv_ref(sources, 1e-5)
    got = call(lib, "attn_res_normed", [sources.numpy(), rinvs.numpy(), w.numpy(), gate[0, 0].numpy()], {})[0]
    assert rel(got, attn_res.attn_res_ref(sources, w, gate[0, 0], 1e-5)) < TOL


def test_activations_and_projections(lib):
    g, u = randn(2, 5, 24) * 5, randn(2, 5, 24, seed=1) * 30
    assert rel(call(lib, "situ_glu", [g.numpy(), u.numpy()], {"beta1": 4.0, "beta2": 25.0})[0],
               activations.situ_glu_ref(g, u, 4.0, 25.0)) < TOL
    assert rel(call(lib, "swiglu", [g.numpy(), u.numpy()])[0], activations.swiglu_ref(g, u)) < TOL
    for approximate in ("none", "tanh"):
        assert rel(call(lib, f"gelu_{approximate}", [g.numpy()])[0], activations.gelu_ref(g, approximate)) < TOL
    x, wg, wu = randn(2, 5, 16), randn(24, 16, seed=2), randn(24, 16, seed=3)
    betas = {"beta1": 4.0, "beta2": 25.0}
    assert rel(call(lib, "linear_glu_situ_glu", [x.numpy(), wg.numpy(), wu.numpy()], betas)[0],
               fused.linear_glu_ref(x, wg, wu, "situ_glu", 4.0, 25.0)) < TOL
    assert rel(call(lib, "linear_glu_swiglu", [x.numpy(), wg.numpy(), wu.numpy()])[0],
               fused.linear_glu_ref(x, wg, wu, "swiglu", 0.0, 0.0)) < TOL
    xe, eg, eu, ed = randn(2, 4, 6, 16), randn(2, 4, 24, 16, seed=1), randn(2, 4, 24, 16, seed=2), randn(2, 4, 16, 24, seed=3)
    assert rel(call(lib, "expert_glu_situ_glu", [xe.numpy(), eg.numpy(), eu.numpy()], betas)[0],
               experts.expert_glu_ref(xe, eg, eu, "situ_glu", 4.0, 25.0)) < TOL
    hidden = experts.expert_glu_ref(xe, eg, eu, "swiglu", 0.0, 0.0)
    assert rel(call(lib, "expert_glu_swiglu", [xe.numpy(), eg.numpy(), eu.numpy()])[0], hidden) < TOL
    assert rel(call(lib, "expert_matmul", [hidden.numpy(), ed.numpy()])[0], experts.expert_matmul_ref(hidden, ed)) < TOL


def _fp4_elements(packed: torch.Tensor) -> np.ndarray:
    """Packed e2m1 bytes [..., n/2] as the FLOAT4E2M1 values [..., n] onnx.reference reads."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).numpy()
    return codes.view(ml_dtypes.float4_e2m1fn)


def test_mx_dequantize_both_representations_are_exact(lib, lib_fp4):
    data, scale = kmx.mx_quantize_fast(randn(3, 8, 64) * torch.logspace(-4, 4, 64), "e2m1", 32)
    scale[0, 0, 0] = kmx.E8M0_NAN
    want = kmx.mx_dequantize_ref(data, scale, "e2m1", 32).numpy()
    got = call(lib, "mx_dequantize_e2m1", [data.numpy(), scale.numpy()], {"block": 32})[0]
    np.testing.assert_array_equal(got, want)
    fp4 = [_fp4_elements(data), scale.numpy().view(ml_dtypes.float8_e8m0fnu)]
    np.testing.assert_array_equal(call(lib_fp4, "mx_dequantize_e2m1", fp4, {"block": 32}, engine="reference")[0], want)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_mx_fake_quantize_is_bit_exact(lib, fmt):
    x = randn(4, 6, 64) * torch.logspace(-30, 30, 64)
    x[0, 0, :32] = 0.0
    x[0, 1, 3], x[0, 2, 40] = float("nan"), float("-inf")
    f = kmx.MX_FORMATS[fmt]
    x[1, 0, :32] = torch.arange(32) * 2.0 ** -(f.mbits + 1)  # exact ties of the element grid
    x[1, 0, 0] = 2.0 ** f.emax
    want = kmx.mx_fake_quantize_ref(x, fmt, 32).numpy()
    for engine in ("onnxruntime", "reference"):
        got = call(lib, "mx_fake_quantize", [x.numpy()], {"block": 32, **F.mx_format_attributes(fmt)}, engine=engine)[0]
        np.testing.assert_array_equal(got, want)


def test_mx_expert_gemms_and_linear(lib):
    x = randn(4, 6, 64)
    gate = kmx.mx_quantize_fast(randn(4, 32, 64, seed=1), "e2m1", 32)
    up = kmx.mx_quantize_fast(randn(4, 32, 64, seed=2), "e2m1", 32)
    down = kmx.mx_quantize_fast(randn(4, 64, 32, seed=3), "e2m1", 32)
    args = [x.numpy(), *(t.numpy() for t in gate + up)]
    got = call(lib, "mx_expert_glu_situ_glu", args, {"block": 32, "beta1": 4.0, "beta2": 25.0})[0]
    assert rel(got, experts.mx_expert_glu_ref(x, *gate, *up, 32, "situ_glu", 4.0, 25.0)) < TOL
    got = call(lib, "mx_expert_glu_swiglu", args, {"block": 32})[0]
    assert rel(got, experts.mx_expert_glu_ref(x, *gate, *up, 32, "swiglu", 0.0, 0.0)) < TOL
    hidden = randn(4, 6, 32, seed=4)
    got = call(lib, "mx_expert_matmul", [hidden.numpy(), *(t.numpy() for t in down)], {"block": 32})[0]
    assert rel(got, experts.mx_expert_matmul_ref(hidden, *down, 32)) < TOL
    x2, weight = randn(5, 64), kmx.mx_quantize_fast(randn(16, 64, seed=5), "e2m1", 32)
    wargs = [x2.numpy(), *(t.numpy() for t in weight)]
    assert rel(call(lib, "mx_linear", wargs, {"block": 32})[0], kmx.mx_linear_ref(x2, *weight, "e2m1", 32)) < TOL
    got = call(lib, "mx_linear_act", wargs, {"block": 32, **F.mx_format_attributes("e4m3")})[0]
    assert rel(got, kmx.mx_linear_ref(x2, *weight, "e2m1", 32, "e4m3")) < TOL


def _kda_inputs(B=2, T=77, H=3, K=16, form="lower_bounded_sigmoid"):
    q = torch.nn.functional.normalize(randn(B, T, H, K, seed=1), dim=-1)
    k = torch.nn.functional.normalize(randn(B, T, H, K, seed=2), dim=-1)
    v = randn(B, T, H, K, seed=3)
    g = kda.kda_gate_ref(randn(B, T, H, K, seed=4), randn(H, seed=5), randn(H * K, seed=6), form, -5.0)
    beta = torch.sigmoid(randn(B, T, H, seed=7))
    return q, k, v, g, beta, randn(B, H, K, K, seed=8)


@pytest.mark.parametrize("form", ["lower_bounded_sigmoid", "softplus"])
def test_kda_gate(lib, form):
    f, A_log, dt_bias = randn(2, 7, 3, 16), randn(3, seed=1), randn(48, seed=2)
    attrs = {"lower_bound": -5.0} if form == "lower_bounded_sigmoid" else {}
    got = call(lib, f"kda_gate_{form}", [f.numpy(), A_log.numpy(), dt_bias.numpy()], attrs)[0]
    assert rel(got, kda.kda_gate_ref(f, A_log, dt_bias, form, -5.0)) < TOL


@pytest.mark.parametrize("chunk,engine", [(16, "onnxruntime"), (64, "onnxruntime"), (16, "reference")])
def test_kda_chunk(lib, chunk, engine):
    """77 tokens: chunks of 16 or 64 with a padded last chunk, from a nonzero initial state, against the
    literal recurrence in float64."""
    q, k, v, g, beta, S0 = _kda_inputs()
    o, S = call(lib, "kda_chunk", [t.numpy() for t in (q, k, v, g, beta, S0)],
                {"scale": 0.25, "chunk_size": chunk}, n_out=2, engine=engine)
    want_o, want_S = kda.kda_naive(*(t.double() for t in (q, k, v, g, beta)), 0.25, S0.double())
    assert rel(o, want_o) < 1e-5 and rel(S, want_S) < 1e-5


def test_kda_decode_step_and_short_conv(lib):
    q, k, v, g, beta, S0 = _kda_inputs(T=1)
    q, k, v, g, beta = (t[:, 0] for t in (q, k, v, g, beta))
    o, S = call(lib, "kda_decode_step", [t.numpy() for t in (q, k, v, g, beta, S0)], {"scale": 0.25}, n_out=2)
    want = kda.kda_decode_step_ref(q, k, v, g, beta, S0, 0.25)
    assert rel(o, want[0]) < TOL and rel(S, want[1]) < TOL
    x, weight, state = randn(2, 9, 24), randn(24, 4, seed=1), randn(2, 24, 3, seed=2)
    y, tail = call(lib, "short_conv", [x.numpy(), weight.numpy(), state.numpy()], {"channels": 24}, n_out=2)
    want = sc.short_conv_ref(x, weight, state)
    assert rel(y, want[0]) < TOL and rel(tail, want[1]) == 0


def test_mla(lib):
    B, S, T, H, N, R, V, L = 2, 11, 4, 3, 8, 4, 6, 10
    q, k_nope, k_pe, v = randn(B, T, H, N + R), randn(B, S, H, N, seed=1), randn(B, S, R, seed=2), randn(B, S, H, V, seed=3)
    got = call(lib, "mla_attention", [t.numpy() for t in (q, k_nope, k_pe, v)], {"scale": 0.3})[0]
    assert rel(got, mla.mla_attention_ref(q, k_nope, k_pe, v, 0.3)) < TOL
    latent, w_kvb = randn(B, S, L + R, seed=4), randn(H * (N + V), L, seed=5)
    got = call(lib, "mla_decode_absorbed", [q.numpy(), latent.numpy(), w_kvb.numpy()], {"scale": 0.3})[0]
    assert rel(got, mla.mla_decode_absorbed_ref(q, latent, w_kvb, 0.3)) < TOL
    lengths = torch.tensor([S, 6])  # a preallocated cache: the second sequence holds 6 of its S rows
    got = call(lib, "mla_decode_absorbed_lengths", [q.numpy(), latent.numpy(), w_kvb.numpy(), lengths.numpy()],
               {"scale": 0.3})[0]
    assert rel(got, mla.mla_decode_absorbed_ref(q, latent, w_kvb, 0.3, lengths)) < TOL


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routers(lib, scoring, renormalize):
    logits, bias, x, w = randn(13, 8), randn(8, seed=1) * 0.1, randn(13, 5, seed=2), randn(8, 5, seed=3)
    attrs = {"top_k": 3, "renormalize": int(renormalize), "routed_scale": 2.5}
    weights, indices, scores = call(lib, f"moe_route_{scoring}", [logits.numpy(), bias.numpy()], attrs, n_out=3)
    want = moe.route_ref(logits, bias, 3, scoring, renormalize, 2.5)
    assert rel(weights, want[0]) < TOL and rel(scores, want[2]) < TOL
    np.testing.assert_array_equal(indices, want[1].numpy())
    weights, indices, _ = call(lib, f"linear_route_{scoring}", [x.numpy(), w.numpy(), bias.numpy()], attrs, n_out=3)
    want = fused.linear_route_ref(x, w, bias, 3, scoring, renormalize, 2.5)
    assert rel(weights, want[0]) < TOL
    np.testing.assert_array_equal(indices, want[1].numpy())


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.25])
def test_dispatch_and_combine(lib, capacity_factor):
    """Drop-free (C = T) and with drops; the engine's stable sort must give the reference's slots exactly."""
    x = randn(13, 5)
    g = torch.Generator().manual_seed(1)
    indices = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(13)])
    got = call(lib, "moe_dispatch", [x.numpy(), indices.numpy()], {"num_experts": 8, "capacity_factor": capacity_factor},
               n_out=4)
    want = moe.dispatch_ref(x, indices, 8, capacity_factor)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b.numpy())
    out, weights = randn(*want[0].shape, seed=2), torch.rand(13, 3, generator=g)
    got = call(lib, "moe_combine", [out.numpy(), weights.numpy(), got[1]])[0]
    assert rel(got, moe.combine_ref(out, weights, want[1])) < TOL


def test_combine_in_token_choice_order(lib):
    """moe_combine without slots (decode's rows, one per (token, choice)) matches the reference."""
    out, weights = randn(13 * 3, 1, 5, seed=3), torch.rand(13, 3, generator=torch.Generator().manual_seed(4))
    got = call(lib, "moe_combine_ordered", [out.numpy(), weights.numpy()])[0]
    assert rel(got, moe.combine_ref(out, weights, None)) < TOL
