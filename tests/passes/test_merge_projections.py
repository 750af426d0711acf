"""merge_projections: the decode graph's projections of one input become one matmul; the weights stay one copy."""

from __future__ import annotations

import operator

import pytest
import torch

from k3compile.passes.merge_projections import LINEARS
from k3compile.spec.schema import MIXER_KDA

K3 = torch.ops.k3


def _projections_by_input(gm) -> dict:
    """input node -> the weight names of the bias-free linears and linear_glu's reading it (graph order)."""
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (*LINEARS, K3.linear_glu.default):
            continue
        if n.target in LINEARS and len(n.args) == 3 and n.args[2] is not None:
            continue  # a bias
        ws = n.args[1:3] if n.target is K3.linear_glu.default else n.args[1:2]
        if all(getattr(w, "op", None) == "get_attr" for w in ws):
            out.setdefault(n.args[0], []).extend(w.target for w in ws)
    return out


def test_each_group_is_the_projections_prefill_runs_on_one_input(tiny_spec, tiny_build, record):
    """Every stacked buffer holds exactly the weights the prefill graph projects one input through, in order
    (a projection alone is a group of one), the decode graph reads none of them apart from the stacked buffer,
    and reads each stacked buffer, its [in, out] transpose, with one torch.mm."""
    gm = tiny_build["decode"].gm
    merged = gm.meta["merged"]
    prefill = _projections_by_input(tiny_build["prefill"].gm).values()
    absorbed = [ws for ws in prefill if ws[0].endswith("kv_b_proj.weight")]  # decode's MLA reads it whole
    assert absorbed and sorted(merged.values()) == sorted(ws for ws in prefill if ws not in absorbed)
    stats = record("decode", "merge_projections").statistics
    assert stats == {"groups": len(merged), "weights_merged": sum(map(len, merged.values()))}
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(merged) <= read and not read & {w for ws in merged.values() for w in ws}
    assert not [n for n in gm.graph.nodes if n.target in (*LINEARS, K3.linear_glu.default)]
    for name, ws in merged.items():
        stacked = gm.get_buffer(name)
        assert torch.equal(stacked.t(), torch.cat([gm.get_parameter(w) for w in ws]))
        (mm,) = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name][0].users
        assert mm.target is torch.mm and mm.args[1].target == name


def test_kda_short_convs_are_one_over_the_stacked_channels(tiny_spec, tiny_build):
    """Per KDA layer the q, k and v short convolutions are one over their channels side by side (stacked taps
    and states), split back into the three outputs and the three new states the caches receive."""
    gm = tiny_build["decode"].gm
    convs = [n for n in gm.graph.nodes if n.target is K3.short_conv.default]
    kda = [i for i, kind in enumerate(tiny_spec.mixers) if kind == MIXER_KDA]
    assert len(convs) == len(kda)
    for i, conv in zip(kda, convs):
        taps, states = conv.args[1], conv.args[2]
        assert taps.target is torch.cat and states.target is torch.cat and states.kwargs == {"dim": 1}
        assert [w.target for w in taps.args[0]] == [f"layers.{i}.attn.{c}_conv.weight" for c in "qkv"]
        out = conv.meta["val"][0].shape[-1]
        assert out == 3 * tiny_spec.kda.num_heads * tiny_spec.kda.head_dim


def test_numerics_and_the_other_graphs(record, tiny_build):
    """Declared numerics-preserving, checked by --verify-numerics; prefill and train graphs are untouched."""
    assert record("decode", "merge_projections").max_rel_diff <= 1e-5
    for graph in ("train", "prefill"):
        assert record(graph, "merge_projections").statistics == {"groups": 0, "weights_merged": 0}
        assert not tiny_build[graph].gm.meta.get("merged")
    decode = tiny_build["decode"].gm
    glus = [n for n in decode.graph.nodes if n.target is K3.situ_glu.default]
    assert glus and all(a.target is operator.getitem for g in glus for a in g.args[:2])


@pytest.fixture(scope="module")
def inference_class(tmp_path_factory, tiny_spec):
    import k3compile
    from k3compile.build import BuildOptions, build

    package, _ = build(tiny_spec, tmp_path_factory.mktemp("merged"), BuildOptions(mode="infer"))
    return k3compile.load(package).InferenceModel


def _views_of_stacked(model) -> None:
    groups: dict[str, list[str]] = {}
    for stacked, member in model.MERGED:
        groups.setdefault(stacked, []).append(member)
    for stacked, members in groups.items():
        rows = model.get_buffer(stacked).t()  # the buffer is the [in, out] transpose of the stacked rows
        assert rows.is_contiguous()
        offset = 0
        for m in members:
            p = model.get_parameter(m)
            assert p.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
            assert p.data_ptr() == rows.data_ptr() + offset * rows.stride(0) * rows.element_size()
            offset += p.shape[0]
        assert offset == rows.shape[0]


def test_weights_are_views_of_the_stacked_buffer(inference_class):
    """No weight is held twice, the state dict keeps the weights' names, and loading one into the weights
    (in place) is what the stacked buffer holds; moves and casts keep the weights tied."""
    model = inference_class()
    stacked = {s for s, _ in model.MERGED}
    assert stacked and not stacked & set(model.state_dict())
    _views_of_stacked(model)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    fresh = inference_class(device="meta").to_empty(device="cpu")
    fresh.load_state_dict(state)
    _views_of_stacked(fresh)
    for s, member in fresh.MERGED:
        assert torch.equal(fresh.get_parameter(member), state[member])
    assigned = inference_class(device="meta")
    assigned.load_state_dict(state, assign=True)  # the loaded tensors become the weights: tied again after
    _views_of_stacked(assigned)
    for s, member in assigned.MERGED:
        assert torch.equal(assigned.get_parameter(member), state[member])
    doubled = fresh.to(torch.float64)
    _views_of_stacked(doubled)
    s, member = doubled.MERGED[0]
    assert doubled.get_buffer(s).dtype == torch.float64


def test_decode_matches_the_unmerged_weights(inference_class):
    """A decode step over the stacked buffer equals the prefill graph's per-weight matmuls (a full forward)."""
    torch.manual_seed(0)
    model = inference_class().eval()
    tokens = torch.randint(0, model.spec.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        _, cache = model.prefill(tokens[:, :8], max_len=16)
        step, _ = model.decode(tokens[:, 8], cache)
    torch.testing.assert_close(step[:, 0], full[:, 8], rtol=2e-3, atol=2e-3)
