"""fuse: each pattern fires exactly where its unfused form occurs, and the outputs do not change."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from k3compile.build import pipeline
from k3compile.ir.lower import FlatTracer, lower
from k3compile.ir.pass_manager import PassContext, PassManager
from k3compile.modules.norms import RMSNorm
from k3compile.passes import fuse

K3 = torch.ops.k3
PASSES = pipeline()
FUSE = [p.name for p in PASSES].index("fuse")
GRAPHS = ("train", "prefill", "decode")
INFER_GRAPHS = ("prefill", "decode")


def count(gm, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def around_fuse(spec, device="cpu", graph="train"):
    """(graph before fuse, its outputs, graph after fuse, its outputs, fuse record); outputs None on meta."""
    lowered = lower(spec, device, graph=graph)
    gm, inputs = lowered.gm, lowered.example_inputs
    pm = PassManager(PASSES[: FUSE + 1])
    ctx = PassContext(spec, "train" if graph == "train" else "infer", spec.target, graph)
    pm.run(gm, ctx, inputs, stop=FUSE)
    norm_inputs = [n.args[0].target for n in gm.graph.nodes if n.target is K3.rms_norm.default]
    glus = count(gm, K3.situ_glu.default) + count(gm, K3.swiglu.default)
    with torch.no_grad():
        before = gm(*inputs) if device != "meta" else None
        pm.run(gm, ctx, inputs, start=FUSE)
        after = gm(*inputs) if device != "meta" else None
    return {"norm_inputs": norm_inputs, "glus": glus, "gm": gm, "before": before, "after": after, "record": pm.records[-1]}


@pytest.fixture(scope="module")
def plain(load):
    """The plain-residual ablation: every pre-norm but the first reads a residual add."""
    return load("ablations/no-attn-res.yaml"), around_fuse(load("ablations/no-attn-res.yaml"))


def test_add_rms_norm_fires_on_every_residual_add(plain):
    spec, r = plain
    L = spec.num_layers
    adds_into_norms = sum(t is operator.add for t in r["norm_inputs"])
    assert adds_into_norms == 2 * L  # sites 1 .. 2L: attention and FFN pre-norms after the first, and the final norm
    gm = r["gm"]
    assert r["record"].statistics["add_rms_norm"] == count(gm, K3.add_rms_norm.default) == 2 * L
    assert not any(n.target is K3.rms_norm.default and n.args[0].target is operator.add for n in gm.graph.nodes)
    # Each fused op feeds its sublayer (output 0) and the next residual add (output 1); the final norm's sum
    # has no later reader.
    used = [sorted(u.args[1] for u in n.users) for n in gm.graph.nodes if n.target is K3.add_rms_norm.default]
    assert used == [[0, 1]] * (2 * L - 1) + [[0]]


def test_plain_outputs_unchanged_bit_for_bit(plain):
    _, r = plain
    assert torch.equal(r["after"], r["before"])


def test_linear_glu_fires_on_dense_and_shared_experts(tiny_spec, tiny_build, record):
    n_moe = sum(tiny_spec.is_moe_layer(i) for i in range(tiny_spec.num_layers))
    expected = len(tiny_spec.dense_layers) + n_moe  # one dense FFN + one shared-expert MLP per MoE layer
    for graph in INFER_GRAPHS:  # the CPU train graph takes glu_train instead (next test)
        gm = tiny_build[graph].gm
        # At decode, merge_projections stacks every gate/up pair (the shared experts' with the latent down
        # projection, the dense FFN's alone) into one matmul, so their activation is a situ_glu of its split
        # outputs (tests/passes/test_merge_projections.py).
        merged = expected if graph == "decode" else 0
        fused = [n for n in gm.graph.nodes if n.target is K3.linear_glu.default]
        assert len(fused) + merged == expected == record(graph, "fuse").statistics["linear_glu"]
        owners = sorted(n.args[1].target.rsplit(".", 2)[0] for n in fused)
        shared = [f"layers.{i}.moe.shared_experts" for i in range(1, 8)]
        assert owners == ([] if merged else sorted(["layers.0.ffn"] + shared))
        for n in fused:
            assert n.args[2].target == n.args[1].target.replace("gate_proj", "up_proj")
            assert n.args[3:] == ("situ_glu", 4.0, 25.0)
        # The routed experts' activation goes into their grouped GEMM instead (test_routed_experts_...).
        assert count(gm, K3.situ_glu.default) == merged


def test_cpu_train_graph_applies_every_glu_with_glu_train(tiny_spec, tiny_build, record):
    """The CPU train graph keeps the GLU projections' matmuls (linears; expert_matmul for the stacked experts,
    which group_experts then runs on the experts' rows) and applies each activation with glu_train, whose
    backward reads the derivatives it saved."""
    n_moe = sum(tiny_spec.is_moe_layer(i) for i in range(tiny_spec.num_layers))
    gm = tiny_build["train"].gm
    glus = [n for n in gm.graph.nodes if n.target is K3.glu_train.default]
    stats = record("train", "fuse").statistics
    assert stats["glu_train"] == len(tiny_spec.dense_layers) + 2 * n_moe
    # the routed experts' glu_train then goes into expert_rows_ffn (group_experts), which runs it on each group
    assert len(glus) == len(tiny_spec.dense_layers) + n_moe == stats["glu_train"] - count(gm, K3.expert_rows_ffn.default)
    assert stats["linear_glu"] == stats["expert_glu"] == 0
    assert count(gm, K3.linear_glu.default) == count(gm, K3.expert_glu.default) == count(gm, K3.situ_glu.default) == 0
    projections = {K3.expert_matmul.default, K3.expert_rows_matmul.default, torch._C._nn.linear}
    for n in glus:
        assert n.args[2:] == ("situ_glu", 4.0, 25.0) and {a.target for a in n.args[:2]} <= projections
        assert [u.args[1] for u in n.users] == [0]  # only the activation is read; the derivatives go to backward
    assert record("prefill", "fuse").statistics["glu_train"] == record("decode", "fuse").statistics["glu_train"] == 0


def test_gpu_train_graph_keeps_the_fused_glu_projections(load):
    spec = load("k3-tiny.yaml", "target=h100")
    r = around_fuse(spec, device="meta")
    stats = r["record"].statistics
    assert stats["glu_train"] == 0 and stats["linear_glu"] == 8 and stats["expert_glu"] == 7


def test_attn_res_leaves_no_residual_add_to_fuse(record):
    for graph in GRAPHS:
        stats = record(graph, "fuse").statistics
        kinds = ("glu_train", "add_rms_norm", "rms_norm_gate", "linear_glu", "router", "expert_glu", "expert_matmul",
                 "mx_experts")
        assert stats["add_rms_norm"] == 0 and stats["nodes_rewritten"] == sum(stats[k] for k in kinds)


def test_router_logits_scoring_bias_and_top_k_become_one_op(tiny_spec, tiny_build, record):
    n_moe = sum(tiny_spec.is_moe_layer(i) for i in range(tiny_spec.num_layers))
    for graph in GRAPHS:
        gm = tiny_build[graph].gm
        fused = [n for n in gm.graph.nodes if n.target is K3.linear_route.default]
        assert len(fused) == n_moe == record(graph, "fuse").statistics["router"]
        assert count(gm, K3.moe_route.default) == 0
        for n in fused:  # reads the router weight and its selection bias, with the spec's top-k and scoring
            assert n.args[1].args[0].target.endswith(".moe.router.weight")
            assert n.args[2].target.endswith(".moe.router.bias")
            assert n.args[3:5] == (tiny_spec.moe.top_k, tiny_spec.moe.router.scoring)


def test_routed_experts_become_grouped_gemms(tiny_spec, tiny_build, record):
    """Training (CPU): expert_matmul for gate, up and down on the fake-quantised stacked weights, glu_train
    between (then one expert_rows_ffn on the experts' rows by group_experts, whose dispatch reads the
    fake-quantised tokens); inference: expert_glu + expert_matmul in their MXFP4 forms reading the packed
    buffers (the dequantisation moves into the kernel). In the decode graph the packed data and scales are
    first gathered by the routing indices, so only the picked experts are read."""
    n_moe = sum(tiny_spec.is_moe_layer(i) for i in range(tiny_spec.num_layers))
    train = tiny_build["train"].gm
    ffns = [n for n in train.graph.nodes if n.target is K3.expert_rows_ffn.default]
    assert len(ffns) == n_moe and count(train, K3.expert_rows_matmul.default) == 0
    for f in ffns:
        x, *ws = f.args[:4]
        assert x.target is operator.getitem  # the dispatched rows of the fake-quantised tokens
        assert x.args[0].args[0].target is K3.mx_fake_quantize.default
        assert all(w.target is K3.mx_fake_quantize.default for w in ws)
        assert [w.args[0].target.rsplit(".", 2)[-2] for w in ws] == ["gate_proj", "up_proj", "down_proj"]
        assert f.args[5:] == ("situ_glu", 4.0, 25.0, "e4m3", 32)
    assert not any(n.target is torch.matmul for n in train.graph.nodes)
    stats = record("train", "fuse").statistics
    assert stats["expert_glu"] == 0 and stats["expert_matmul"] == 3 * n_moe and stats["mx_experts"] == 0
    for graph in INFER_GRAPHS:
        infer = tiny_build[graph].gm
        mx_glu = [n for n in infer.graph.nodes if n.target is K3.mx_expert_glu.default]
        mx_down = [n for n in infer.graph.nodes if n.target is K3.mx_expert_matmul.default]
        assert len(mx_glu) == len(mx_down) == n_moe and record(graph, "fuse").statistics["mx_experts"] == 2 * n_moe
        for g in mx_glu:
            weights = [_packed_source(a, graph) for a in g.args[1:5]]
            assert [a.target.rsplit(".", 1)[-1] for a in weights] == ["weight_mx", "weight_scale"] * 2
            assert g.args[5:] == (32, "situ_glu", 4.0, 25.0)
        for d in mx_down:
            weights = [_packed_source(a, graph) for a in d.args[1:3]]
            assert [a.target.rsplit(".", 1)[-1] for a in weights] == ["weight_mx", "weight_scale"]
        assert count(infer, K3.mx_dequantize.default) == count(infer, K3.expert_glu.default) == 0


def _packed_source(arg, graph: str):
    """The packed buffer an MX expert GEMM reads: directly (prefill) or through the decode graph's expert gather."""
    if graph == "decode":
        assert arg.target is operator.getitem and arg.args[1].op != "get_attr", arg.name  # w[routing indices]
        arg = arg.args[0]
    assert arg.op == "get_attr", arg.name
    return arg


def test_numerics_checked_in_the_build(record):
    for graph in GRAPHS:
        r = record(graph, "fuse")
        assert r.preserves_numerics and r.max_rel_diff is not None and r.max_rel_diff <= 1e-5


def test_kda_gate_is_fused_at_the_source(tiny_spec, tiny_build, record):
    """KDA emits k3::rms_norm_gate itself, so the shipped specs leave the rms_norm_gate pattern nothing to do."""
    for graph in GRAPHS:
        gm = tiny_build[graph].gm
        assert count(gm, K3.rms_norm_gate.default) == tiny_spec.mixers.count("K")
        assert record(graph, "fuse").statistics["rms_norm_gate"] == 0


def test_swiglu_kind(load):
    spec = load("ablations/swiglu.yaml")
    r = around_fuse(spec, graph="prefill")
    fused = [n for n in r["gm"].graph.nodes if n.target is K3.linear_glu.default]
    assert len(fused) == 8 and all(n.args[3] == "swiglu" for n in fused)
    assert r["glus"] == 8 + 7  # before: 8 fusable + 7 routed-expert activations
    assert r["record"].statistics["expert_glu"] == 7 and count(r["gm"], K3.swiglu.default) == 0
    torch.testing.assert_close(r["after"], r["before"], rtol=1e-5, atol=1e-6)
    train = around_fuse(spec)  # the CPU train graph: every activation through glu_train
    glus = [n for n in train["gm"].graph.nodes if n.target is K3.glu_train.default]
    assert len(glus) == 15 and all(n.args[2] == "swiglu" for n in glus)
    torch.testing.assert_close(train["after"], train["before"], rtol=1e-5, atol=1e-6)


def test_ungated_mlp_has_nothing_to_fuse(load):
    spec = load("k3-tiny.yaml", "activation.kind=gelu", "activation.beta1=null", "activation.beta2=null")
    r = around_fuse(spec, device="meta")
    assert r["record"].statistics["linear_glu"] == 0 and count(r["gm"], K3.linear_glu.default) == 0


# ---------------------------------------------------------------- rms_norm_gate on hand-made graphs


class Gated(nn.Module):
    def __init__(self, gate_first: bool = False, reuse_norm: bool = False):
        super().__init__()
        self.norm = RMSNorm(16)
        self.gate = nn.Linear(16, 16, bias=False)
        self.gate_first, self.reuse_norm = gate_first, reuse_norm
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        n, s = self.norm(x), torch.sigmoid(self.gate(x))
        y = s * n if self.gate_first else n * s
        return y + n if self.reuse_norm else y


@pytest.mark.parametrize("gate_first", [False, True])
def test_rms_norm_gate_fires_and_keeps_outputs(tiny_spec, gate_first):
    module = Gated(gate_first)
    gm = torch.fx.GraphModule(module, FlatTracer().trace(module))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    want = gm(x)
    stats = fuse.run(gm, PassContext(tiny_spec))
    gm.recompile()
    assert stats["rms_norm_gate"] == 1
    assert count(gm, K3.rms_norm_gate.default) == 1 and count(gm, K3.rms_norm.default) == 0
    assert not any(n.target in (torch.sigmoid, operator.mul) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), want, rtol=1e-6, atol=1e-6)


def test_rms_norm_gate_skips_a_norm_used_elsewhere(tiny_spec):
    module = Gated(reuse_norm=True)
    gm = torch.fx.GraphModule(module, FlatTracer().trace(module))
    code = gm.code
    assert fuse.run(gm, PassContext(tiny_spec))["rms_norm_gate"] == 0
    gm.recompile()
    assert gm.code == code


def test_cpu_train_without_qat_fuses_the_down_matmul_after_glu_train(load, run_passes):
    """Without QAT the down projection reads glu_train's output directly; it still becomes expert_matmul."""
    spec = load("k3-tiny.yaml", "quantization.qat=false")
    names = [p.name for p in PASSES[: FUSE + 1]]
    gm, _, records = run_passes(spec, names, device="meta")
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    assert records[-1].statistics["expert_matmul"] == count(gm, K3.expert_matmul.default) == 3 * n_moe
    assert not any(n.target is torch.matmul for n in gm.graph.nodes)
