"""Trainer-side load balancing: same bias as Router.update_balance for every rule, routers found by buffer names."""

import copy

import pytest
import torch
from torch import nn

from k3compile.modules.moe import LatentMoE
from k3compile.runtime.balance import find_routers, restore_stats, snapshot_stats, update_balance
from k3compile.spec.schema import Router as RouterConfig

RULES = [
    ("quantile", None),
    ("quantile", 50),
    ("bias_sign", None),
    ("aux_loss", None),
    ("none", None),
]


def _moe(balancing: str, bins: int | None) -> LatentMoE:
    torch.manual_seed(0)
    return LatentMoE(
        hidden_size=16, num_experts=8, top_k=2, expert_intermediate_size=8, latent_size=8, activation="swiglu",
        balancing=balancing, histogram_bins=bins, capacity_factor=1.0, bias_update_rate=0.01,
    )  # fmt: skip


@pytest.mark.parametrize("balancing,bins", RULES)
def test_update_matches_router_update_balance(balancing, bins):
    moe = _moe(balancing, bins)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two steps: the second one routes with the first one's bias
        moe(x).sum().backward()
        ours = copy.deepcopy(moe)
        moe.update_balance()
        config = RouterConfig(balancing=balancing, histogram_bins=bins, bias_update_rate=0.01)
        stats = update_balance(find_routers(ours), config, top_k=2).summary()
        assert torch.equal(ours.router.bias, moe.router.bias)
        assert int(ours.router.load.sum()) == 0 and int(ours.router.dropped) == 0
        assert stats.imbalance is not None and stats.imbalance >= 1.0
    if balancing in ("quantile", "bias_sign"):
        assert moe.router.bias.abs().sum() > 0
    if balancing == "aux_loss":
        assert stats.aux_loss is not None


def test_find_routers_on_a_plain_container_by_buffer_names():
    root = nn.Module()
    for i in (1, 3):
        r = nn.Module()
        r.register_buffer("bias", torch.zeros(4))
        r.register_buffer("qb_bias", torch.zeros(4), persistent=False)
        r.register_buffer("load", torch.zeros(4, dtype=torch.int64), persistent=False)
        r.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        root.add_module(f"r{i}", r)
    other = nn.Module()
    other.register_buffer("bias", torch.zeros(4))  # a bias with no routing statistics is not a router
    root.add_module("norm", other)
    routers = find_routers(root)
    assert [r.name for r in routers] == ["r1", "r3"]
    assert routers[0].qb_counts is None and routers[0].qb_bias is root.r1.qb_bias


def test_summary_numbers_by_hand():
    root = nn.Module()
    for name, load, dropped in (("a", [4, 0, 2, 2], 1), ("b", [1, 1, 1, 1], 0)):
        r = nn.Module()
        r.register_buffer("bias", torch.zeros(4))
        r.register_buffer("load", torch.tensor(load), persistent=False)
        r.register_buffer("dropped", torch.tensor(dropped), persistent=False)
        root.add_module(name, r)
    config = RouterConfig(balancing="bias_sign", bias_update_rate=0.5)
    stats = update_balance(find_routers(root), config, top_k=1).summary()
    assert stats.imbalance == pytest.approx((4 / 2 + 1) / 2)  # max/mean per layer, averaged
    assert stats.dropped == pytest.approx(1 / 12)
    # sign rule: b_j + rate * sign(mean - load_j), mean 2: [-0.5, +0.5, 0, 0]; the even layer stays 0
    assert root.a.bias.tolist() == [-0.5, 0.5, 0.0, 0.0] and root.b.bias.tolist() == [0.0] * 4


def test_a_router_without_tokens_keeps_its_bias():
    moe = _moe("quantile", None)
    moe.router.bias.fill_(0.25)
    moe.router.qb_bias.fill_(9.0)  # stale: no forward since
    stats = update_balance(find_routers(moe), RouterConfig(), top_k=2).summary()
    assert torch.equal(moe.router.bias, torch.full((8,), 0.25))
    assert stats.imbalance is None and stats.dropped is None


def test_snapshot_and_restore_undo_an_evaluation_forward():
    moe = _moe("quantile", 50)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    moe(x)
    routers = find_routers(moe)
    saved = snapshot_stats(routers)
    before = {k: v.clone() for k, v in moe.router.named_buffers()}
    moe(x * 2)  # the emitted training graph records statistics on every forward
    assert not torch.equal(moe.router.load, before["load"])
    restore_stats(routers, saved)
    assert all(torch.equal(v, before[k]) for k, v in moe.router.named_buffers())
