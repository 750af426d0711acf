"""AttnRes module and the block/full source bookkeeping on a toy 5-layer stack."""

import pytest
import torch

from k3compile.modules.attn_res import AttnRes, AttnResSources, Source, source_plan


def test_params_and_init_average():
    m = AttnRes(8, norm_eps=1e-5)
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == {"query": (8,), "norm.weight": (8,)}
    assert torch.equal(m.query, torch.zeros(8)) and torch.equal(m.norm.weight, torch.ones(8))
    srcs = [torch.randn(2, 3, 8) for _ in range(3)]
    torch.testing.assert_close(m(srcs), sum(srcs) / 3)
    torch.testing.assert_close(m(torch.stack(srcs)), sum(srcs) / 3)


def _emb():
    return Source("embedding")


def _blk(*k):
    return Source("block", k)


def _part(*k):
    return Source("partial", k)


# Toy stack: 5 layers, block size 2 -> sublayers 0..9 (layer l: attention 2l, FFN 2l+1), blocks of
# 4 sublayers {0-3}, {4-7}, {8-9}; sublayer 10 is the AttnRes before the final norm. Written by hand.
BLOCK_TABLE = {
    0: [_emb()],
    1: [_emb(), _part(0)],
    2: [_emb(), _part(0, 1)],
    3: [_emb(), _part(0, 1, 2)],
    4: [_emb(), _blk(0, 1, 2, 3)],
    5: [_emb(), _blk(0, 1, 2, 3), _part(4)],
    6: [_emb(), _blk(0, 1, 2, 3), _part(4, 5)],
    7: [_emb(), _blk(0, 1, 2, 3), _part(4, 5, 6)],
    8: [_emb(), _blk(0, 1, 2, 3), _blk(4, 5, 6, 7)],
    9: [_emb(), _blk(0, 1, 2, 3), _blk(4, 5, 6, 7), _part(8)],
    10: [_emb(), _blk(0, 1, 2, 3), _blk(4, 5, 6, 7), _part(8, 9)],
}


def test_block_plan_toy_five_layers():
    for k, want in BLOCK_TABLE.items():
        assert source_plan(k, "block", 2) == want, k


def test_full_plan():
    assert source_plan(0, "full") == [_emb()]
    assert source_plan(3, "full") == [_emb(), Source("sublayer", (0,)), Source("sublayer", (1,)),
                                      Source("sublayer", (2,))]
    assert len(source_plan(10, "full")) == 11


def test_k3_final_source_count():
    # 93 layers, block size 12: 7 full blocks (168 sublayers) + a partial of 18 -> embedding + 8 sources.
    plan = source_plan(2 * 93, "block", 12)
    assert len(plan) == 9 and plan[-1].kind == "partial" and len(plan[-1].sublayers) == 18


@pytest.mark.parametrize("mode,block_size", [("block", 2), ("full", None)])
def test_runtime_sources_follow_the_plan(mode, block_size):
    # Sublayer k outputs the constant 2^k (embedding 0.5): every source sum is identifiable.
    emb = torch.full((1, 1, 1), 0.5, dtype=torch.float64)
    state = AttnResSources(emb, mode, block_size)
    for k in range(11):
        want = [0.5 if s.kind == "embedding" else float(sum(2**j for j in s.sublayers))
                for s in source_plan(k, mode, block_size)]
        assert state.sources().flatten().tolist() == want, k
        state.add(torch.full((1, 1, 1), float(2**k), dtype=torch.float64))


def test_bad_modes_raise():
    with pytest.raises(ValueError):
        source_plan(1, "block")
    with pytest.raises(ValueError):
        source_plan(1, "full", 2)
    with pytest.raises(ValueError):
        AttnResSources(torch.zeros(1), "dense")


def test_module_meta_trace_compile():
    with torch.device("meta"):
        m = AttnRes(16).bfloat16()
    assert m(torch.empty(3, 2, 4, 16, device="meta", dtype=torch.bfloat16)).shape == (2, 4, 16)
    m = AttnRes(8)
    gm = torch.fx.symbolic_trace(m)
    assert torch.ops.k3.attn_res.default in {n.target for n in gm.graph.nodes}

    def stack_of_three(x):
        state = AttnResSources(x, "block", 1)
        for _ in range(3):
            state.add(torch.tanh(m(state.sources())))
        return m(state.sources())

    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(torch.compile(stack_of_three, fullgraph=True, backend="aot_eager")(x),
                               stack_of_three(x))
