"""bind_kernels: every op node records its implementation; cpu binds the C kernels where they exist (the
references with cpu_kernels="torch"), GPU targets the Triton kernels, and every fallback says why."""

from __future__ import annotations

import copy

import pytest
import torch

from k3compile.ir.pass_manager import PassContext
from k3compile.kernels import binding
from k3compile.passes import bind_kernels
from k3compile.passes.bind_kernels import op_name

OP_KINDS = ("call_function", "call_method")


def op_nodes(gm):
    return [n for n in gm.graph.nodes if n.op in OP_KINDS]


def is_k3(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.name.startswith("k3::")


GRAPHS = ("train", "prefill", "decode")
# Ops each inference graph of k3-tiny must bind to Triton on h200 (the decode graph: the decode kernels).
H200_OPS = {  # the CPU-built graphs rebound: a CPU prefill mixes depth with attn_res_normed (no Triton kernel)
    "prefill": {"mx_expert_glu", "attn_res_normed", "kda_chunk", "moe_dispatch"},
    "decode": {"mx_expert_glu", "attn_res", "kda_decode_step", "mla_decode_absorbed"},
}


@pytest.fixture(scope="module", params=list(H200_OPS))
def rebound(request, tiny_spec, tiny_build):
    """A k3-tiny inference graph (prefill or decode) bound again for h200 (bind_kernels reads only the target)."""
    graph = request.param
    gm = copy.deepcopy(tiny_build[graph].gm)
    stats = bind_kernels.run(gm, PassContext(tiny_spec, "infer", "h200", graph))
    return graph, gm, stats


@pytest.mark.parametrize("graph", GRAPHS)
def test_every_op_node_is_bound_on_cpu(tiny_spec, tiny_build, graph):
    gm = copy.deepcopy(tiny_build[graph].gm)  # built over the references; bound again as a default build binds
    stats = bind_kernels.run(gm, PassContext(tiny_spec, "infer", "cpu", graph))
    ops = op_nodes(gm)
    k3 = [n for n in ops if is_k3(n)]
    assert k3 and len(k3) < len(ops)
    for n in gm.graph.nodes:
        kernel = n.meta.get("kernel")
        if n.op not in OP_KINDS:
            assert kernel is None, n.name
        elif is_k3(n):
            op = n.target._schema.name.removeprefix("k3::")
            if op in binding.C_KERNELS:
                want = {"impl": f"c:{binding.C_KERNELS[op]}", "reason": "C kernel built for this CPU"}
            else:
                want = {"impl": "torch", "reason": "PyTorch reference on CPU"}
            assert kernel == {"op": f"k3::{op}", **want}
            assert n.kwargs["backend"] == want["impl"].partition(":")[0]
        else:
            assert kernel["impl"] == "native" and kernel["op"].startswith("torch.") and kernel["reason"], n.name
    c = sum(n.kwargs["backend"] == "c" for n in k3)
    assert c > 0 and stats == {"k3_ops": len(k3), "triton": 0, "c": c, "reference": len(k3) - c,
                               "native": len(ops) - len(k3)}


@pytest.mark.parametrize("graph", GRAPHS)
def test_cpu_kernels_torch_keeps_every_reference(record, tiny_build, graph):
    stats = record(graph, "bind_kernels").statistics
    assert stats["c"] == 0 and stats["reference"] == stats["k3_ops"] > 0
    for n in tiny_build[graph].gm.graph.nodes:
        if is_k3(n):
            op = n.target._schema.name.removeprefix("k3::")
            reason = "C kernels off (cpu_kernels='torch')" if op in binding.C_KERNELS else "PyTorch reference on CPU"
            assert n.meta["kernel"]["reason"] == reason and n.kwargs["backend"] == "torch"


def test_an_unknown_cpu_kernels_choice_is_refused(tiny_spec, tiny_build):
    gm = copy.deepcopy(tiny_build["decode"].gm)
    with pytest.raises(ValueError, match="cpu_kernels must be one of"):
        bind_kernels.run(gm, PassContext(tiny_spec, "infer", "cpu", "decode", cpu_kernels="fast"))


def test_h200_records_the_reason_for_each_fallback(rebound):
    graph, gm, stats = rebound
    k3 = [n for n in op_nodes(gm) if is_k3(n)]
    seen = set()
    for n in k3:
        kernel = n.meta["kernel"]
        op = n.target._schema.name.removeprefix("k3::")
        seen.add(op)
        if op in binding.TRITON_KERNELS:
            assert kernel["impl"] == f"triton:{binding.TRITON_KERNELS[op]}" and isinstance(kernel["config"], dict)
            assert kernel["reason"] and n.kwargs["backend"] == "triton"
        else:
            assert kernel == {"op": f"k3::{op}", "impl": "torch", "reason": f"no Triton kernel for k3::{op}"}
            assert n.kwargs["backend"] == "torch"
    assert H200_OPS[graph] <= seen
    assert stats["k3_ops"] == len(k3) == stats["triton"] + stats["reference"]
    assert stats["triton"] > stats["reference"]


def test_h200_binding_records_the_tuned_configs(tiny_spec, tiny_build, monkeypatch):
    tuned = {"norms.triton": {"rms_norm": [{"max": {"N": 256}, "config": {"BLOCK_M": 2, "num_warps": 8}}]}}
    monkeypatch.setattr(binding, "module_configs", lambda target: tuned if target == "h200" else {})
    gm = copy.deepcopy(tiny_build["train"].gm)
    stats = bind_kernels.run(gm, PassContext(tiny_spec, "train", "h200"))
    norms = [n for n in gm.graph.nodes if n.target is torch.ops.k3.rms_norm.default]
    assert norms and stats["triton"] >= len(norms)
    for n in norms:
        kernel = n.meta["kernel"]
        assert kernel["impl"] == "triton:norms.triton.rms_norm" and kernel["reason"] == "tuned for h200"
        assert kernel["config"] == tuned["norms.triton"] and n.kwargs["backend"] == "triton"
    cpu = bind_kernels.run(gm, PassContext(tiny_spec, "train", "cpu"))  # cpu: the C kernels, never Triton
    assert cpu["triton"] == 0 and norms[0].meta["kernel"]["impl"] == "c:norms.c.rms_norm"
    assert norms[0].kwargs["backend"] == "c"


def test_unknown_target_is_rejected(tiny_spec, tiny_build):
    gm = copy.deepcopy(tiny_build["train"].gm)
    with pytest.raises(ValueError, match="unknown target 'tpu'"):
        bind_kernels.run(gm, PassContext(tiny_spec, "train", "tpu"))


def test_op_names():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    k3 = g.call_function(torch.ops.k3.rms_norm.default, (x, x, 1e-5))
    fn = g.call_function(torch.sigmoid, (k3,))
    method = g.call_method("transpose", (fn, 0, 1))
    g.output(method)
    assert op_name(k3) == ("k3", "rms_norm")
    assert op_name(fn) == ("torch", "sigmoid")
    assert op_name(method) == ("torch", "Tensor.transpose")
    assert op_name(x) is None


def test_numerics_checked_in_the_build(record):
    for graph in GRAPHS:
        r = record(graph, "bind_kernels")
        assert r.preserves_numerics and r.max_rel_diff == 0.0  # bound to the references: it only annotates nodes
    # bound to the C kernels it may move the outputs by fp32 rounding, and MX roundings behind it by a step
    assert bind_kernels.PASS.rtol == 1e-3


def test_every_numerics_preserving_pass_was_checked(tiny_build):
    """The --verify-numerics build compared every numerics-preserving pass that ran, on every graph of both modes."""
    assert set(tiny_build) == set(GRAPHS)
    for compiled in tiny_build.values():
        checked = [r for r in compiled.records if r.preserves_numerics]
        assert {r.name for r in checked} >= {"interleave", "attn_res", "shard_experts", "fuse", "bind_kernels"}
        for r in compiled.records:
            assert (r.max_rel_diff is not None) == r.preserves_numerics, r.name
            if r.preserves_numerics:
                assert r.status == "ran" and r.max_rel_diff <= 1e-5, r.name
