"""pack_mxfp4: packed MX weights for inference, fake quantisation for QAT training, and equal logits."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

from k3compile.analysis.formats import ELEMENT_OF_POLICY, storage_bytes
from k3compile.analysis.memory import weight_bytes
from k3compile.build import pipeline
from k3compile.ir.lower import example_tokens
from k3compile.modules.model import empty_caches
from k3compile.ir.pass_manager import PassContext
from k3compile.spec.schema import MX_FORMATS
from k3compile.spec.weights import weight_inventory

K3 = torch.ops.k3
MX_OPS = (K3.mx_fake_quantize.default, K3.mx_dequantize.default, K3.mx_linear.default, K3.mx_quantize.default)
NAMES = [p.name for p in pipeline()]
UP_TO_PACK = NAMES[: NAMES.index("pack_mxfp4") + 1]
GRAPHS = ("train", "prefill", "decode")
INFER_GRAPHS = ("prefill", "decode")  # the graphs of an infer build


def mode_of(graph: str) -> str:
    return "train" if graph == "train" else "infer"


def mx_weights(spec) -> dict:
    return {w.name: w for w in weight_inventory(spec) if w.format in MX_FORMATS}


def mx_bytes_saved(wb: dict) -> int:
    """bf16 bytes minus policy bytes, the fp32 tensors (quantization.keep_fp32) counted at bf16: what packing saves."""
    return wb["bf16"] - wb["policy"] + wb["by_format"].get("fp32", 0) // 2


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fq_input(node) -> bool:
    """The matmul-like `node` reads an activation fake-quantised to e4m3 (the policy's mxfp8): directly, as the
    decode graph's rows repeated per choice from one (quantised before the repeat: the same values), or as the
    rows group_experts dispatches from the fake-quantised tokens."""
    x = node.args[0]
    while x.op == "call_method" and x.target in ("view", "expand", "reshape"):
        x = x.args[0]
    if x.target is operator.getitem and x.args[0].target is K3.moe_dispatch_rows.default:
        x = x.args[0].args[0]
    return x.target is K3.mx_fake_quantize.default and x.args[1:] == ("e4m3", 32)


# ---------------------------------------------------------------- inference build (k3-tiny)


@pytest.mark.parametrize("graph", INFER_GRAPHS)
def test_infer_replaces_mx_weights_by_packed_buffers(tiny_spec, tiny_build, graph):
    gm = tiny_build[graph].gm
    mx = mx_weights(tiny_spec)
    assert len(mx) == 3 * 7  # gate/up/down of the routed experts of the 7 MoE layers
    params = {n: tuple(p.shape) for n, p in gm.named_parameters()}
    assert params == {w.name: w.shape for w in weight_inventory(tiny_spec) if w.name not in mx}
    buffers = dict(gm.named_buffers())
    packed = gm.meta["packed"]
    assert set(packed) == set(mx)
    block = tiny_spec.quantization.block_size
    for name, w in mx.items():
        data, scale = buffers[f"{name}_mx"], buffers[f"{name}_scale"]
        *lead, n = w.shape
        assert data.dtype == scale.dtype == torch.uint8
        assert tuple(data.shape) == (*lead, n // 2)  # two e2m1 codes per byte
        assert tuple(scale.shape) == (*lead, n // block)  # one E8M0 byte per block
        assert data.numel() + scale.numel() == storage_bytes(w.numel, w.format, block)
        assert packed[name] == {"data": f"{name}_mx", "scale": f"{name}_scale", "fmt": "e2m1", "block": block, "shape": list(w.shape)}


@pytest.mark.parametrize("graph", INFER_GRAPHS)
def test_infer_statistics_equal_the_analysis(tiny_spec, record, graph):
    stats = record(graph, "pack_mxfp4").statistics
    wb = weight_bytes(tiny_spec)
    assert stats["weights_packed"] == len(mx_weights(tiny_spec))
    assert stats["weights_fake_quantized"] == 0
    assert stats["bytes_saved"] == mx_bytes_saved(wb) == 16_171_008
    assert stats["activations_quantized"] > 0


@pytest.mark.parametrize("graph", INFER_GRAPHS)
def test_packed_data_decodes_to_the_fake_quantised_weights(tiny_spec, tiny_build, graph):
    train = dict(tiny_build["train"].gm.named_parameters())
    buffers = dict(tiny_build[graph].gm.named_buffers())
    for name in list(mx_weights(tiny_spec))[:3]:
        w = train[name].detach()
        decoded = K3.mx_dequantize.default(buffers[f"{name}_mx"], buffers[f"{name}_scale"], "e2m1", 32, torch.float32)
        assert torch.equal(decoded, K3.mx_fake_quantize.default(w, "e2m1", 32)), name


@pytest.mark.parametrize("graph", INFER_GRAPHS)
def test_infer_matmuls_read_dequantised_weights_and_quantised_inputs(tiny_spec, load, run_passes, graph):
    # before fuse moves the dequantisation into GEMMs
    gm, _, _ = run_passes(tiny_spec, UP_TO_PACK, mode="infer", graph=graph)
    deq = [n for n in gm.graph.nodes if n.target is K3.mx_dequantize.default]
    assert len(deq) == len(mx_weights(tiny_spec))
    for d in deq:
        data, scale = d.args[:2]
        if graph == "decode":  # the decode graph dequantises only the experts the tokens picked
            assert data.target is scale.target is operator.getitem and data.args[1:] == scale.args[1:]
            data, scale = data.args[0], scale.args[0]
        assert data.op == "get_attr" and data.target.endswith("_mx") and d.args[2:4] == ("e2m1", 32)
        assert scale.op == "get_attr" and scale.target == data.target.removesuffix("_mx") + "_scale"
        mms = [m for u in d.users for m in u.users]  # through the transpose
        assert mms and all(fq_input(m) for m in mms)


# ---------------------------------------------------------------- QAT training build (k3-tiny)


def test_qat_train_fake_quantises_the_weights(tiny_spec, tiny_build, record):
    gm = tiny_build["train"].gm
    mx = mx_weights(tiny_spec)
    assert {n: tuple(p.shape) for n, p in gm.named_parameters()} == {w.name: w.shape for w in weight_inventory(tiny_spec)}
    reads = {n.target: n for n in gm.graph.nodes if n.op == "get_attr" and n.target in mx}
    assert set(reads) == set(mx)
    for name, node in reads.items():
        (user,) = node.users
        assert user.target is K3.mx_fake_quantize.default and user.args[1:] == ("e2m1", 32), name
        # fuse made the matmuls grouped GEMMs, group_experts runs them on the experts' rows as one FFN op,
        # which fake-quantises the down projection's input itself
        experts = (K3.expert_glu.default, K3.expert_matmul.default, K3.expert_rows_ffn.default)
        assert all(t.target in experts and fq_input(t) for t in user.users), name
        assert all(t.args[8:] == ("e4m3", 32) for t in user.users if t.target is K3.expert_rows_ffn.default), name
    nodes = list(gm.graph.nodes)
    assert not any(n.target in (K3.mx_dequantize.default, K3.mx_linear.default) for n in nodes)
    assert gm.meta.get("packed", {}) == {}
    stats = record("train", "pack_mxfp4").statistics
    assert stats["weights_fake_quantized"] == len(mx) and stats["weights_packed"] == stats["bytes_saved"] == 0
    for graph in INFER_GRAPHS:
        assert stats["activations_quantized"] == record(graph, "pack_mxfp4").statistics["activations_quantized"]


def test_packed_inference_logits_equal_qat_training_logits(tiny_spec, tiny_build):
    """Same seeded weights; the train graph is routed as at inference (drop-free) so only packing differs.

    Prefill over all tokens gives the train graph's logits; prefill over all but the last token, then one
    decode step, gives its logits at the last position.
    """
    from k3compile.passes import routing

    train = copy.deepcopy(tiny_build["train"].gm)
    routing.PASS.run(train, PassContext(tiny_spec, "infer"))
    for n in train.graph.nodes:  # group_experts' dispatch too: drop-free (its rows are then every choice)
        if n.target is K3.moe_dispatch_rows.default:
            n.update_arg(3, routing.DENSE)
    train.recompile()
    x = example_tokens(tiny_spec, "cpu")
    B, T = x.shape
    with torch.no_grad():
        want = train(x)
        logits, _ = tiny_build["prefill"].gm(x, empty_caches(tiny_spec, B, T))
        assert rel(logits, want) <= 1e-4
        _, caches = tiny_build["prefill"].gm(x[:, :-1], empty_caches(tiny_spec, B, T))
        positions = torch.full((B,), T - 1, dtype=torch.int64)
        step, _ = tiny_build["decode"].gm(x[:, -1:], positions, caches)
        assert rel(step[:, 0], want[:, -1]) <= 1e-4


# ---------------------------------------------------------------- policy variants


@pytest.mark.parametrize("graph", GRAPHS)
def test_qat_off_and_bf16(load, run_passes, graph):
    """qat: false trains on plain weights (inference still packs); the bf16 ablation touches nothing."""
    mode = mode_of(graph)
    spec = load("k3-tiny.yaml", "quantization.qat=false")
    gm, _, records = run_passes(spec, UP_TO_PACK, device="meta", mode=mode, graph=graph)
    has_mx = any(n.target in MX_OPS for n in gm.graph.nodes)
    assert has_mx == (mode == "infer")
    assert records[-1].statistics["weights_packed"] == (len(mx_weights(spec)) if mode == "infer" else 0)
    spec = load("ablations/bf16.yaml")
    gm, _, records = run_passes(spec, UP_TO_PACK, device="meta", mode=mode, graph=graph)
    assert not any(n.target in MX_OPS for n in gm.graph.nodes)
    assert set(records[-1].statistics.values()) == {0}
    assert {n for n, _ in gm.named_parameters()} == {w.name for w in weight_inventory(spec)}


MIXED = (
    "moe.capacity_factor=8",  # capacity = tokens: nothing dropped in training either, so train and infer compare
    'quantization.rules=[{match: "layers.*.shared_experts.*", weight: mxfp8, activation: mxfp8},'
    ' {match: "layers.*.moe.router", weight: mxfp8}, {match: "layers.*.moe.experts.*", weight: mxfp4, activation: mxfp8}]',
)


@pytest.fixture(scope="module")
def mixed(load, run_passes):
    """k3-tiny with MXFP8 shared experts (plain linears: the mx_linear path), MXFP8 routers (read through an
    fp32 cast) and MXFP4 routed experts."""
    spec = load("k3-tiny.yaml", *MIXED)
    built = {g: run_passes(spec, UP_TO_PACK, device="cpu", mode=mode_of(g), graph=g) for g in GRAPHS}
    return spec, built


@pytest.mark.parametrize("graph", INFER_GRAPHS)
def test_mxfp8_linears_become_mx_linear(mixed, graph):
    spec, built = mixed
    gm, _, records = built[graph]
    fp8 = {n for n, w in mx_weights(spec).items() if w.format == "mxfp8"}
    shared = {n for n in fp8 if ".shared_experts." in n}
    assert len(shared) == 3 * 7 and len(fp8) == len(shared) + 7
    lin = [n for n in gm.graph.nodes if n.target is K3.mx_linear.default]
    assert len(lin) == len(shared)
    for n in lin:
        assert n.args[1].target.removesuffix("_mx") in shared and n.args[3:5] == ("e4m3", 32) and fq_input(n)
    buffers = dict(gm.named_buffers())
    for name in fp8:
        assert buffers[f"{name}_mx"].dtype == torch.uint8 and name not in dict(gm.named_parameters())
    assert set(gm.meta["packed"]) == set(mx_weights(spec))
    wb = weight_bytes(spec)
    assert records[-1].statistics["bytes_saved"] == mx_bytes_saved(wb)
    assert records[-1].statistics["weights_packed"] == len(mx_weights(spec))
    assert gm.meta["packed"][next(iter(fp8))]["fmt"] == ELEMENT_OF_POLICY["mxfp8"]


@pytest.mark.parametrize("graph", INFER_GRAPHS)
@pytest.mark.parametrize(
    "overrides",
    [("quantization.default_weight=mxfp4",), ("quantization.default_weight=mxfp8", "tie_embeddings=true")],
    ids=["default-mxfp4", "tied-mxfp8"],
)
def test_packed_weights_are_the_inventorys_mx_weights(load, run_passes, overrides, graph):
    """Whatever the policy, inference packs exactly the weights the analysis counts as MX (routers included,
    a tied embedding not: the inventory keeps the lookup table in bf16)."""
    spec = load("k3-tiny.yaml", *overrides)
    gm, _, records = run_passes(spec, UP_TO_PACK, device="meta", mode="infer", graph=graph)
    assert set(gm.meta["packed"]) == set(mx_weights(spec))
    assert not set(mx_weights(spec)) & {n for n, _ in gm.named_parameters()}
    wb = weight_bytes(spec)
    assert records[-1].statistics["bytes_saved"] == mx_bytes_saved(wb)


def test_mixed_policy_logits_agree(mixed):
    spec, built = mixed
    (train, inputs, _), (infer, _, _) = built["train"], built["prefill"]
    (x,) = inputs
    with torch.no_grad():
        logits, _ = infer(x, empty_caches(spec, *x.shape))
        assert rel(logits, train(x)) <= 1e-4


@pytest.mark.parametrize("graph", GRAPHS)
def test_expert_parallel_weights_are_quantised_too(load, run_passes, graph):
    """shard_experts' expert-parallel form reads the stacked expert weights; the policy still applies."""
    mode = mode_of(graph)
    spec = load("k3-tiny.yaml", "parallel.ep=4")
    gm, _, records = run_passes(spec, UP_TO_PACK, device="meta", mode=mode, graph=graph)
    stats = records[-1].statistics
    n = len(mx_weights(spec))
    assert (stats["weights_packed"], stats["weights_fake_quantized"]) == ((n, 0) if mode == "infer" else (0, n))
    # Every graph reads the rank's own (packed or fake-quantised) experts as they are, between the all-to-all
    # exchanges: no rank-major view.
    assert not [v for v in gm.graph.nodes if v.target is torch.unflatten]


def test_expert_parallel_inference_logits_equal_ep_1(load, run_passes):
    spec = load("k3-tiny.yaml", "parallel.ep=4")
    gm, inputs, _ = run_passes(spec, UP_TO_PACK, device="cpu", mode="infer")  # the prefill graph
    gm1, _, _ = run_passes(load("k3-tiny.yaml"), UP_TO_PACK, device="cpu", mode="infer")
    with torch.no_grad():
        logits, caches = gm(*inputs)
        logits1, caches1 = gm1(*inputs)
        assert rel(logits, logits1) <= 1e-6
        assert caches.keys() == caches1.keys()
        for name in caches:
            assert rel(caches[name], caches1[name]) <= 1e-6, name


# ---------------------------------------------------------------- the decode graph's absorbed MLA

KV_B_MX = ('quantization.rules=[{match: "layers.*.attn.kv_b_proj", weight: mxfp4, activation: mxfp8}]',)


def test_absorbed_decode_reads_kv_b_proj_as_the_expanded_form_does(load, run_passes):
    """The decode graph's absorbed MLA reads kv_b_proj whole (not through a linear), yet the policy applies as in
    prefill: the weight is packed (dequantised in the graph) and its input, the latent's c_kv part, fake-quantised;
    so prefill then one decode step equals a longer prefill."""
    spec = load("k3-tiny.yaml", *KV_B_MX)
    names = {f"layers.{i}.attn.kv_b_proj.weight" for i, kind in enumerate(spec.mixers) if kind == "M"}
    assert set(mx_weights(spec)) == names
    built = {g: run_passes(spec, UP_TO_PACK, mode="infer", graph=g) for g in INFER_GRAPHS}
    for graph, (gm, _, records) in built.items():
        assert set(gm.meta["packed"]) == names and not names & {n for n, _ in gm.named_parameters()}, graph
        assert records[-1].statistics["activations_quantized"] == len(names), graph
    decode = built["decode"][0]
    absorbed = [n for n in decode.graph.nodes if n.target is K3.mla_decode_absorbed.default]
    assert len(absorbed) == len(names)
    for n in absorbed:
        latent, w = n.args[1:3]
        assert w.target is K3.mx_dequantize.default and w.args[0].target.endswith("kv_b_proj.weight_mx")
        assert latent.target is torch.cat and latent.args[0][0].target is K3.mx_fake_quantize.default
    prefill = built["prefill"][0]
    x = example_tokens(spec, "cpu")
    B, T = x.shape
    with torch.no_grad():
        want, _ = prefill(x, empty_caches(spec, B, T))
        _, caches = prefill(x[:, :-1], empty_caches(spec, B, T))
        step, _ = decode(x[:, -1:], torch.full((B,), T - 1, dtype=torch.int64), caches)
    assert rel(step[:, 0], want[:, -1]) <= 1e-4  # (reading kv_b_proj and c_kv unquantised: about 1e-2)
