"""Bytes: number formats (MXFP4 = 4.25 bits), weights under a policy, decode caches, expert-parallel shards."""

from __future__ import annotations

import pytest

from k3compile.analysis.formats import storage_bytes
from k3compile.analysis.memory import cache_bytes, expert_parallel, weight_bytes
from k3compile.analysis.params import param_counts

HAND_TOTAL, HAND_ROUTED = 168_740, 3 * 8 * 3 * 32 * 32  # tests/analysis/test_params.py
HAND_FP32 = 3 * 8 * 64 + 2 * (2 + 32)  # quantization.keep_fp32: router weights (layers 1..3), A_log + dt_bias (KDA 0, 1)


@pytest.mark.parametrize(
    "fmt, block, bits",
    [("mxfp4", 32, 4.25), ("mxfp8", 32, 8.25), ("mxfp4", 16, 4.5), ("mxfp4", 64, 4.125), ("bf16", 32, 16), ("fp32", 32, 32)],
)
def test_bits_per_value(fmt, block, bits):
    n = 64 * 96
    assert storage_bytes(n, fmt, block) * 8 == n * bits


def test_storage_exact_small_cases():
    assert storage_bytes(32, "mxfp4") == 16 + 1  # 32 nibbles + one E8M0 scale byte
    assert storage_bytes(1, "bf16") == 2
    with pytest.raises(ValueError):
        storage_bytes(48, "mxfp4", 32)  # not whole blocks
    with pytest.raises(ValueError):
        storage_bytes(1, "mxfp4", 1)  # half a byte


def test_hand_weight_bytes(hand_spec):
    w = weight_bytes(hand_spec)
    routed = HAND_ROUTED * 17 // 32  # 4.25 bits = 17 bytes per block of 32
    rest = 2 * (HAND_TOTAL - HAND_ROUTED - HAND_FP32)
    assert w["by_format"] == {"bf16": rest, "fp32": 4 * HAND_FP32, "mxfp4": routed}
    assert w["policy"] == rest + 4 * HAND_FP32 + routed == 232_400
    assert w["bf16"] == 2 * HAND_TOTAL


def test_hand_cache_bytes(hand_spec):
    c = cache_bytes(hand_spec, context=100, batch=3)
    assert c["mla_latent"] == 2 * 3 * 100 * (32 + 4) * 2  # MLA layers x B x N x (kv_lora + rope) x bf16
    assert c["kda_state"] == 2 * 3 * 2 * 16 * 16 * 4  # KDA layers x B x H x dk x dv x fp32
    assert c["short_conv"] == 2 * 3 * 3 * 32 * (3 - 1) * 2  # KDA layers x B x (q, k, v) x P x (W - 1) x bf16
    assert c["total"] == c["mla_latent"] + c["kda_state"] + c["short_conv"] == 57_792
    assert c["all_full_attention"] == 4 * 3 * 100 * 36 * 2


def test_hand_expert_parallel(hand_spec):
    ep = expert_parallel(hand_spec)
    assert ep == {"ep": 4, "experts_per_rank": 2, "routed_expert_bytes_per_rank": HAND_ROUTED * 17 // 32 // 4}


def test_k3_weight_bytes(k3_spec):
    w = weight_bytes(k3_spec)
    p = param_counts(k3_spec)
    routed = p["by_component"]["routed_experts"]["total"]
    fp32 = p["by_component"]["router"]["total"] + 69 * (96 + 96 * 128)  # routers; A_log, dt_bias of 69 KDA layers
    assert w["by_format"]["mxfp4"] * 8 == routed * 4.25
    assert w["by_format"]["fp32"] == 4 * fp32  # quantization.keep_fp32
    assert w["by_format"]["bf16"] == 2 * (p["total"] - routed - fp32)
    assert w["bf16"] == 2 * p["total"]


def test_k3_mla_cache_is_576_values_per_token_per_layer(k3_spec):
    n = 12_345
    c = cache_bytes(k3_spec, n, 1)
    assert c["mla_latent"] == 24 * n * 576 * 2
    assert c["all_full_attention"] == 93 * n * 576 * 2
    assert c["mla_latent"] / c["all_full_attention"] == 24 / 93  # the 3:1 hybrid keeps about a quarter


def test_k3_cache_scaling(k3_spec):
    small, big = cache_bytes(k3_spec, 1000, 1), cache_bytes(k3_spec, 1_000_000, 1)
    assert small["kda_state"] == big["kda_state"] == 69 * 96 * 128 * 128 * 4  # constant in context
    assert small["short_conv"] == big["short_conv"]
    assert big["all_full_attention"] == 1000 * small["all_full_attention"]  # linear in context
    assert big["mla_latent"] == 1000 * small["mla_latent"]
    assert cache_bytes(k3_spec, 1000, 4)["total"] == 4 * small["total"]  # linear in batch


def test_k3_expert_parallel_bytes_are_total_over_ep(k3_spec):
    ep = expert_parallel(k3_spec)
    routed_bytes = weight_bytes(k3_spec)["by_format"]["mxfp4"]
    assert ep["ep"] == 64 and ep["experts_per_rank"] == 896 // 64 == 14
    assert ep["routed_expert_bytes_per_rank"] * 64 == routed_bytes


def test_all_kda_spec_has_no_full_attention_cache(specs_dir):
    from k3compile.spec.load import load_spec

    c = cache_bytes(load_spec(specs_dir / "ablations" / "all-kda.yaml"), 1 << 20, 1)
    assert c["mla_latent"] == 0 and c["total"] == c["kda_state"] + c["short_conv"]
    assert c["all_full_attention"] > 0  # the spec still has an mla section to compare with
