"""Parameter counts: every weight of a small spec counted by hand, the active-parameter rules, layer layouts,
and the published totals of Kimi K3 and Kimi Linear (computed from their specs, checked against the papers)."""

from __future__ import annotations

import pytest

from k3compile.analysis.params import param_counts
from k3compile.spec.load import load_spec, load_spec_text
from k3compile.spec.weights import COMPONENTS

D, V = 64, 32  # hand spec (tests/conftest.py HAND_SPEC): hidden size, vocab

# One KDA layer: H 2, dk 16, P 32, conv 3, decay rank 8, output-gate rank 4.
KDA_LAYER = {
    "q_proj, k_proj, v_proj": 3 * 32 * 64,
    "q/k/v short conv": 3 * 32 * 3,
    "f_down": 8 * 64,
    "f_up": 32 * 8,
    "A_log": 2,
    "dt_bias": 32,
    "b_proj": 2 * 64,
    "g_down": 4 * 64,
    "g_up": 32 * 4,
    "o_norm": 16,
    "o_proj": 64 * 32,
}
# One MLA layer: H 2, q_lora 16, kv_lora 32, nope 8, rope 4, v 16, output gate.
MLA_LAYER = {
    "q_a_proj": 16 * 64,
    "q_a_norm": 16,
    "q_b_proj": 2 * (8 + 4) * 16,
    "kv_a_proj": (32 + 4) * 64,
    "kv_a_norm": 32,
    "kv_b_proj": 2 * (8 + 16) * 32,
    "g_proj": 2 * 16 * 64,
    "o_proj": 64 * 2 * 16,
}
DENSE_LAYER = 3 * 96 * 64  # gate, up, down of a gated MLP, intermediate 96
ROUTER = 8 * 64
LATENT = 32 * 64 + 32 + 64 * 32  # latent_down, latent_norm, latent_up
ROUTED = 8 * 3 * 32 * 32  # 8 experts x (gate, up, down) at latent width 32, intermediate 32
SHARED = 2 * 3 * 16 * 64  # 2 shared experts x (gate, up, down) at width 64, intermediate 16
NORMS = 4 * 2 * 64 + 64  # attn_norm + ffn_norm per layer, final norm
ATTN_RES = 4 * 2 * (64 + 64) + (64 + 64)  # query + norm, before attention and FFN of each layer, and before the final norm

HAND_TOTALS = {
    "embedding": V * D,
    "output_head": V * D,
    "kda": 2 * sum(KDA_LAYER.values()),  # layers 0, 1
    "mla": 2 * sum(MLA_LAYER.values()),  # layers 2, 3
    "dense_ffn": DENSE_LAYER,  # layer 0
    "router": 3 * ROUTER,  # layers 1..3
    "latent_proj": 3 * LATENT,
    "shared_experts": 3 * SHARED,
    "routed_experts": 3 * ROUTED,
    "norms": NORMS,
    "attn_res": ATTN_RES,
}


def test_hand_counts_per_component(hand_spec):
    by = param_counts(hand_spec)["by_component"]
    assert {c: v["total"] for c, v in by.items()} == HAND_TOTALS


def test_hand_totals(hand_spec):
    p = param_counts(hand_spec)
    assert sum(KDA_LAYER.values()) == 9810 and sum(MLA_LAYER.values()) == 9392
    assert p["total"] == 168_740
    # active: no input embedding, routed experts 2 of 8
    assert p["active"] == 168_740 - V * D - 3 * ROUTED * 6 // 8 == 111_396


def test_active_rules(hand_spec):
    by = param_counts(hand_spec)["by_component"]
    assert by["embedding"]["active"] == 0  # a lookup, not a matmul
    assert by["output_head"]["active"] == V * D
    assert by["routed_experts"]["active"] == 3 * ROUTED * 2 // 8
    for c in COMPONENTS:
        if c not in ("embedding", "routed_experts"):
            assert by[c]["active"] == by[c]["total"], c


def test_tied_embedding_is_counted_once_and_active(hand_text):
    tied = param_counts(load_spec_text(hand_text.replace("name: hand", "name: hand\ntie_embeddings: true")))
    assert tied["by_component"]["embedding"] == {"total": V * D, "active": V * D}
    assert tied["by_component"]["output_head"] == {"total": 0, "active": 0}
    assert tied["total"] == 168_740 - V * D
    assert tied["active"] == 111_396


def test_full_rank_kda_gate_and_plain_q(hand_text):
    text = hand_text.replace("output_gate_rank: 4", "output_gate_rank: null").replace("q_lora_rank: 16", "q_lora_rank: null")
    by = param_counts(load_spec_text(text))["by_component"]
    kda_layer = sum(KDA_LAYER.values()) - KDA_LAYER["g_down"] - KDA_LAYER["g_up"] + 32 * 64
    mla_layer = sum(MLA_LAYER.values()) - MLA_LAYER["q_a_proj"] - MLA_LAYER["q_a_norm"] - MLA_LAYER["q_b_proj"] + 2 * 12 * 64
    assert by["kda"]["total"] == 2 * kda_layer
    assert by["mla"]["total"] == 2 * mla_layer


def test_ungated_mlp_and_plain_residual(hand_text):
    text = (hand_text.replace("activation: {kind: situ_glu, beta1: 4, beta2: 25}", "activation: {kind: gelu}")
            .replace("residual: {kind: attn_res, mode: block, block_size: 2}", "residual: {kind: plain}"))
    by = param_counts(load_spec_text(text))["by_component"]
    assert by["dense_ffn"]["total"] == 2 * 96 * 64
    assert by["routed_experts"]["total"] == 3 * 8 * 2 * 32 * 32
    assert by["shared_experts"]["total"] == 3 * 2 * 2 * 16 * 64
    assert by["attn_res"]["total"] == 0


def test_components_sum_to_totals(shipped_spec):
    p = param_counts(load_spec(shipped_spec))
    assert set(p["by_component"]) == set(COMPONENTS)
    assert sum(c["total"] for c in p["by_component"].values()) == p["total"]
    assert sum(c["active"] for c in p["by_component"].values()) == p["active"]
    assert 0 < p["active"] <= p["total"]


def test_routed_active_is_exactly_k_of_n(shipped_spec):
    spec = load_spec(shipped_spec)
    r = param_counts(spec)["by_component"]["routed_experts"]
    assert r["active"] * spec.moe.num_experts == r["total"] * spec.moe.top_k


# ------------------------------------------------------------------ the published models


def test_k3_layers(k3_spec):
    mla = [i + 1 for i, m in enumerate(k3_spec.mixers) if m == "M"]  # 1-based
    assert mla == list(range(4, 93, 4)) + [93]
    assert (k3_spec.mixers.count("K"), k3_spec.mixers.count("M")) == (69, 24)
    assert sorted(k3_spec.dense_layers) == [0]
    assert sum(k3_spec.is_moe_layer(i) for i in range(93)) == 92


def test_kimi_linear_layers(kimi_linear_spec):
    mla = [i + 1 for i, m in enumerate(kimi_linear_spec.mixers) if m == "M"]
    assert mla == [4, 8, 12, 16, 20, 24, 27]
    assert kimi_linear_spec.mixers.count("K") == 20


def test_k3_total_is_2_8_trillion(k3_spec):
    p = param_counts(k3_spec)
    assert p["total"] == pytest.approx(2.8e12, rel=0.01)
    # the routed experts are nearly all of it: 92 layers x 896 x 3 x 3072 x 3584
    assert p["by_component"]["routed_experts"]["total"] == 92 * 896 * 3 * 3072 * 3584
    assert p["by_component"]["embedding"]["total"] == p["by_component"]["output_head"]["total"] == 163840 * 7168


def test_kimi_linear_48b_a3b(kimi_linear_spec):
    p = param_counts(kimi_linear_spec)
    assert p["total"] == pytest.approx(48e9, rel=0.03)
    # The spec counts 3.107e9 active (output head included, input embedding not): "A3B" is a rounded label,
    # 3.6% above 3e9, so the check allows 4%. Dropping the head would give 2.73e9 (9% under).
    assert p["active"] == pytest.approx(3e9, rel=0.04)
    assert p["by_component"]["routed_experts"]["total"] == 26 * 256 * 3 * 1024 * 2304


def test_kda_ablations_without_delta_rule_and_per_head_decay(hand_text):
    """delta_rule false has no b_proj; per-head decay projects to H decays (f_up r -> H, dt_bias [H])."""
    text = hand_text.replace("rank: 8}", "rank: 8, granularity: head}").replace(
        "output_gate_rank: 4", "output_gate_rank: 4\n  delta_rule: false")
    by = param_counts(load_spec_text(text))["by_component"]
    kda_layer = sum(KDA_LAYER.values()) - KDA_LAYER["b_proj"] - KDA_LAYER["f_up"] - KDA_LAYER["dt_bias"] + 2 * 8 + 2
    assert by["kda"]["total"] == 2 * kda_layer
