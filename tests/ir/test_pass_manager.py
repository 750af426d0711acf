"""The pass manager: records, disabling, dumps, failures with reproducers, numerics checks, fork; and via build."""

from __future__ import annotations

import dataclasses

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from k3compile.build import BuildOptions, compile_graphs
from k3compile.ir.lower import EXAMPLE_BATCH, EXAMPLE_TOKENS, lower
from k3compile.ir.verify import GraphVerificationError
from k3compile.ir.pass_manager import GraphPass, NumericsMismatch, PassContext, PassFailure, PassManager
from k3compile.passes import attn_res, interleave
from k3compile.spec.load import load_spec
from k3compile.spec.schema import Spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
INPUTS = (torch.randn(2, 4, generator=torch.Generator().manual_seed(0)),)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        return F.relu(F.linear(x, self.w))


def small_gm() -> fx.GraphModule:
    return fx.symbolic_trace(Small())


def find(gm: fx.GraphModule, target) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is target)


# ---- test-only passes


def _relu_to_clamp(gm, ctx):
    """Numerics-preserving: relu(x) -> clamp_min(x, 0)."""
    relu = find(gm, F.relu)
    with gm.graph.inserting_before(relu):
        new = gm.graph.call_function(torch.clamp_min, (relu.args[0], 0.0))
    relu.replace_all_uses_with(new)
    gm.graph.erase_node(relu)
    return {"rewritten": 1}


def _double_output(gm, ctx):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        doubled = gm.graph.call_function(torch.mul, (out.args[0], 2.0))
    out.args = (doubled,)
    return {"rewritten": 1}


def _perturb_weight(gm, ctx):
    """Claims to preserve numerics, but nudges a weight."""
    with torch.no_grad():
        for p in gm.parameters():
            p.add_(0.01)
            break
    return {}


def _raise(gm, ctx):
    raise ValueError("boom: something went wrong\nsecond line")


def _add_dangling(gm, ctx):
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        gm.graph.call_function(torch.sigmoid, (x,))
    return {}


def _bad_shape(gm, ctx):
    lin = find(gm, torch._C._nn.linear)
    with gm.graph.inserting_after(lin):
        bad = gm.graph.call_function(torch.matmul, (lin, lin))  # [2, 3] @ [2, 3]
    lin.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)
    return {}


def gp(name, run, preserves=True):
    return GraphPass(name, f"test pass {name}", preserves, ("rewritten",), run)


CLAMP = gp("clamp", _relu_to_clamp)
DOUBLE = gp("double", _double_output, preserves=False)
PERTURB = gp("perturb", _perturb_weight)


@pytest.fixture(scope="module")
def spec() -> Spec:
    return load_spec(SPECS / "k3-tiny.yaml")


@pytest.fixture
def ctx(spec):
    return PassContext(spec, "train", "cpu")


# ---------------------------------------------------------------- records, disabling, unknown names


def test_runs_in_order_and_records(ctx):
    seen = []
    gm = small_gm()
    pm = PassManager([CLAMP, DOUBLE], on_pass=seen.append)
    pm.run(gm, ctx, INPUTS)
    assert seen == ["clamp", "double"]
    assert [(r.name, r.status, r.statistics, r.preserves_numerics) for r in pm.records] == [
        ("clamp", "ran", {"rewritten": 1}, True),
        ("double", "ran", {"rewritten": 1}, False),
    ]
    assert pm.records[0].as_dict() == {
        "name": "clamp", "summary": "test pass clamp", "preserves_numerics": True, "status": "ran",
        "statistics": {"rewritten": 1},
    }  # fmt: skip
    torch.testing.assert_close(gm(*INPUTS), 2 * Small()(*INPUTS), rtol=0, atol=0)


def test_disabled_pass_is_skipped_and_recorded(ctx):
    gm = small_gm()
    pm = PassManager([gp("boom", _raise), DOUBLE], disabled=frozenset({"boom"}))
    pm.run(gm, ctx, INPUTS)  # boom never runs
    assert [(r.name, r.status, r.statistics) for r in pm.records] == [("boom", "disabled", {}), ("double", "ran", {"rewritten": 1})]


@pytest.mark.parametrize("field", ["disabled", "dump_after"])
def test_unknown_pass_names_are_rejected(field):
    with pytest.raises(ValueError, match="unknown pass 'nope'; passes are: clamp, double"):
        PassManager([CLAMP, DOUBLE], **{field: frozenset({"nope"})})


def test_dump_after_all_is_a_known_name():
    PassManager([CLAMP], dump_after=frozenset({"all"}))
    with pytest.raises(ValueError, match="unknown pass 'all'"):
        PassManager([CLAMP], disabled=frozenset({"all"}))


# ---------------------------------------------------------------- dumps


def _dumps(ctx, dump_after, disabled=frozenset()):
    dumps = {}
    pm = PassManager([CLAMP, DOUBLE], disabled=disabled, dump_after=frozenset(dump_after), on_dump=dumps.__setitem__)
    pm.run(small_gm(), ctx, INPUTS)
    return dumps


def test_dump_after_named_pass(ctx):
    dumps = _dumps(ctx, {"double"})
    assert list(dumps) == ["00-lowered", "02-double"]
    assert "%relu: float32[2, 3] = call_function[relu](%linear)" in dumps["00-lowered"]
    assert "%mul: float32[2, 3] = call_function[mul](%clamp_min, 2.0)" in dumps["02-double"]


def test_dump_after_all_skips_disabled_passes(ctx):
    assert list(_dumps(ctx, {"all"})) == ["00-lowered", "01-clamp", "02-double"]
    assert list(_dumps(ctx, {"all"}, disabled={"clamp"})) == ["00-lowered", "02-double"]
    assert _dumps(ctx, set()) == {}


# ---------------------------------------------------------------- failures and reproducers


def test_raising_pass_names_itself_and_leaves_a_reproducer(ctx, spec, tmp_path):
    pm = PassManager([CLAMP, gp("skipped", _raise), gp("boom", _raise), DOUBLE], disabled=frozenset({"skipped"}),
                     reproducer_root=tmp_path)  # fmt: skip
    with pytest.raises(PassFailure) as info:
        pm.run(small_gm(), ctx, INPUTS)
    e = info.value
    assert e.pass_name == "boom"
    assert str(e).startswith("pass 'boom' failed: ValueError: boom: something went wrong (reproducer: ")
    assert isinstance(e.__cause__, ValueError)
    where = e.reproducer
    assert where is not None and where.parent == tmp_path and where.name.startswith("k3compile-repro-k3-tiny-")
    assert Spec.model_validate_json((where / "spec.json").read_text()) == spec
    assert (where / "passes.txt").read_text().split() == ["clamp", "boom"]  # up to the failure, disabled left out
    assert "Pass 'boom' failed in mode train, target cpu." in (where / "README.txt").read_text()
    assert [r.name for r in pm.records] == ["clamp", "skipped"]


def test_reproducer_spec_rebuilds(ctx, tmp_path):
    """The reproducer's spec.json is a spec the loader accepts as it is."""
    with pytest.raises(PassFailure) as info:
        PassManager([gp("boom", _raise)], reproducer_root=tmp_path).run(small_gm(), ctx, INPUTS)
    text = (info.value.reproducer / "spec.json").read_text()
    assert load_spec(info.value.reproducer / "spec.json") == ctx.spec
    assert json.loads(text)["name"] == "k3-tiny"


def test_pass_leaving_a_shape_error_fails(ctx, tmp_path):
    with pytest.raises(PassFailure, match="pass 'bad' failed: shape propagation failed") as info:
        PassManager([CLAMP, gp("bad", _bad_shape)], reproducer_root=tmp_path).run(small_gm(), ctx, INPUTS)
    assert info.value.pass_name == "bad"
    assert (info.value.reproducer / "passes.txt").read_text().split() == ["clamp", "bad"]


def test_dangling_input_graph_is_rejected(ctx):
    gm = small_gm()
    _add_dangling(gm, ctx)
    with pytest.raises(GraphVerificationError, match=r"dangling nodes \(computed, never used\): sigmoid$"):
        PassManager([CLAMP]).run(gm, ctx, INPUTS)


def test_dead_code_a_pass_leaves_is_removed_before_verification(ctx):
    """After a pass, nodes computed for nothing are eliminated (side effects kept), then the graph is verified."""

    def orphan(gm, c):
        relu = find(gm, F.relu)
        relu.replace_all_uses_with(relu.args[0])  # relu becomes dead
        _add_dangling(gm, c)  # and a fresh dead sigmoid
        return {}

    gm = small_gm()
    PassManager([gp("orphan", orphan, preserves=False)]).run(gm, ctx, INPUTS)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "get_attr", "call_function", "output"]


# ---------------------------------------------------------------- numerics


def test_numerics_preserving_pass_is_measured(ctx):
    small = small_gm()
    pm = PassManager([CLAMP, DOUBLE], numerics=(small, INPUTS))
    pm.run(small_gm(), ctx, INPUTS)
    assert pm.records[0].max_rel_diff == 0.0
    assert pm.records[1].max_rel_diff is None  # not numerics-preserving: applied, not compared
    assert "max_rel_diff" in pm.records[0].as_dict() and "max_rel_diff" not in pm.records[1].as_dict()
    torch.testing.assert_close(pm.numerics[0](*INPUTS), 2 * Small()(*INPUTS), rtol=0, atol=0)


def test_broken_numerics_preserving_pass_is_caught(ctx):
    small = small_gm()
    pm = PassManager([CLAMP, PERTURB], numerics=(small, INPUTS))
    with pytest.raises(NumericsMismatch, match="pass 'perturb' is declared numerics-preserving but changed the outputs"):
        pm.run(small_gm(), ctx, INPUTS)
    # The small instance is left as it was before the broken pass.
    assert torch.equal(pm.numerics[0].w, Small().w)


def test_tolerance_is_configurable(ctx):
    pm = PassManager([PERTURB], numerics=(small_gm(), INPUTS), rtol=1.0)
    pm.run(small_gm(), ctx, INPUTS)
    assert 0 < pm.records[0].max_rel_diff <= 1.0


def test_a_pass_may_declare_its_own_tolerance(ctx):
    """bind_kernels' way: a pass whose kernels round differently declares the tolerance it keeps."""
    loose = dataclasses.replace(PERTURB, rtol=1.0)
    pm = PassManager([loose], numerics=(small_gm(), INPUTS))
    pm.run(small_gm(), ctx, INPUTS)
    assert 0 < pm.records[0].max_rel_diff <= 1.0
    tight = dataclasses.replace(PERTURB, rtol=1e-9)
    with pytest.raises(NumericsMismatch, match=r"> 1e-09\)"):
        PassManager([tight], numerics=(small_gm(), INPUTS), rtol=1.0).run(small_gm(), ctx, INPUTS)


def test_broken_pass_is_caught_on_k3_tiny(spec, ctx):
    """The same check on the real model: a perturbed weight after the generic ops are resolved."""

    def perturb_final_norm(gm, c):
        with torch.no_grad():
            gm.final_norm.weight.mul_(1.01)
        return {}

    small = lower(spec, "cpu")
    main = lower(spec, "meta")
    passes = [interleave.PASS, attn_res.PASS, gp("perturb", perturb_final_norm)]
    pm = PassManager(passes, numerics=(small.gm, small.example_inputs))
    with pytest.raises(NumericsMismatch, match="'perturb'"):
        pm.run(main.gm, ctx, main.example_inputs)
    assert [r.name for r in pm.records] == ["interleave", "attn_res"]


def test_fork_continues_on_an_independent_copy(ctx):
    pm = PassManager([CLAMP, PERTURB], numerics=(small_gm(), INPUTS), rtol=1.0)
    gm = small_gm()
    pm.run(gm, ctx, INPUTS, stop=1)
    fork = pm.fork()
    assert [r.name for r in fork.records] == ["clamp"] and fork.records is not pm.records
    fork.run(copy.deepcopy(gm), ctx, INPUTS, start=1)
    assert [r.name for r in fork.records] == ["clamp", "perturb"] and len(pm.records) == 1
    assert torch.equal(pm.numerics[0].w, Small().w)  # the fork perturbed its own copy


# ---------------------------------------------------------------- through compile_graphs and the CLI


@pytest.fixture(scope="module")
def dumped(spec):
    """k3-tiny on meta, train and infer, every graph dumped, fuse disabled."""
    options = BuildOptions(device="meta", dump_after=frozenset({"all"}), disabled=frozenset({"fuse"}))
    return compile_graphs(spec, ("train", "infer"), options)


def test_dump_after_all_through_build(dumped):
    assert list(dumped) == ["train", "prefill", "decode"]  # infer mode: the prefill and decode graphs
    for graph, compiled in dumped.items():
        ran = [r.name for r in compiled.records if r.status == "ran"]
        names = [f"{i:02d}-{r.name}" for i, r in enumerate(compiled.records, 1) if r.status == "ran"]
        assert list(compiled.dumps) == ["00-lowered"] + names
        assert "fuse" not in ran and "bind_kernels" in ran
        lowered = compiled.dumps["00-lowered"]  # the kept calls: a token mixer per layer, a depth site per site
        assert "call_module[layers.0.attn]" in lowered and "call_module[layers.0.attn_res]" in lowered
        assert "call_module[final_res]" in lowered
        after = compiled.dumps[names[0]]  # interleave
        kda = "kda_decode_step" if graph == "decode" else "kda_chunk"
        assert "call_module[layers.0.attn]" not in after and f"call_function[k3::{kda}]" in after
        T = 1 if graph == "decode" else EXAMPLE_TOKENS
        assert f"float32[{EXAMPLE_BATCH}, {T}, 256]" in after  # shapes of [B, T, D] activations
        assert ("call_function[k3::mx_dequantize]" in compiled.dumps[names[-1]]) == (graph != "train")


def test_disabled_pass_through_build(dumped):
    for compiled in dumped.values():
        (fuse,) = [r for r in compiled.records if r.name == "fuse"]
        assert fuse.status == "disabled" and fuse.statistics == {}
        assert not any(getattr(n.target, "__name__", "") == "linear_glu.default" for n in compiled.gm.graph.nodes)


def test_dump_after_one_pass_through_build(spec):
    compiled = compile_graphs(spec, ("train",), BuildOptions(device="meta", dump_after=frozenset({"attn_res"})))
    assert list(compiled["train"].dumps) == ["00-lowered", "02-attn_res"]
    assert "call_function[k3::attn_res_normed]" in compiled["train"].dumps["02-attn_res"]  # k3-tiny: cpu target


def test_unknown_pass_through_build(spec):
    with pytest.raises(ValueError, match="unknown pass 'fusion'"):
        compile_graphs(spec, ("train",), BuildOptions(device="meta", disabled=frozenset({"fusion"})))


def test_cli_rejects_unknown_pass(cli, tmp_path):
    rc, out, err = cli("build", SPECS / "k3-tiny.yaml", "-o", tmp_path, "--dump-after", "nope")
    assert rc != 0 and "unknown pass 'nope'" in err
    assert not any(tmp_path.iterdir())


def test_cli_dump_after_and_disable_pass(cli, tmp_path):
    rc, out, err = cli(
        "build", SPECS / "k3-tiny.yaml", "-o", tmp_path, "--mode", "train", "--dump-after", "interleave",
        "--disable-pass", "fuse",
    )  # fmt: skip
    assert rc == 0, err
    (pkg,) = tmp_path.iterdir()
    graphs = pkg / "graphs"
    assert sorted(p.name for p in (graphs / "train").iterdir()) == ["00-lowered.txt", "01-interleave.txt"]
    text = (graphs / "train" / "01-interleave.txt").read_text()
    assert "call_function[k3::kda_chunk]" in text and f"float32[{EXAMPLE_BATCH}, {EXAMPLE_TOKENS}, 256]" in text
    manifest = json.loads((pkg / "manifest.json").read_text())
    status = {r["name"]: r["status"] for r in manifest["passes"]["train"]}
    assert status["fuse"] == "disabled" and status["interleave"] == "ran"


def test_the_lazily_generated_code_runs_the_final_graph(spec):
    """Code is generated on first use: after every pass it must be the final graph's, as fx's interpreter runs it."""
    (compiled,) = compile_graphs(spec, ("train",), BuildOptions()).values()
    gm = compiled.gm
    assert gm.code == fx.GraphModule(gm, gm.graph).code
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gm(tokens), fx.Interpreter(gm).run(tokens), rtol=0, atol=0)
