"""Forward FLOPs per token: each term by hand for the small spec (tests/conftest.py HAND_SPEC), and how terms scale."""

from __future__ import annotations

import pytest

from k3compile.analysis.flops import KDA_CHUNK, forward_flops_per_token
from k3compile.analysis.params import param_counts
from k3compile.analysis.sources import attn_res_source_counts
from k3compile.spec.load import load_spec_text

N = 100  # context

# Active matmul weights of the hand spec (counted in tests/analysis/test_params.py, repeated here by shape).
KDA_MATMULS = 3 * 32 * 64 + 8 * 64 + 32 * 8 + 2 * 64 + 4 * 64 + 32 * 4 + 64 * 32  # q/k/v, f_down/up, b, g_down/up, o
MLA_MATMULS = 16 * 64 + 24 * 16 + 36 * 64 + 48 * 32 + 32 * 64 + 64 * 32  # q_a, q_b, kv_a, kv_b, g, o
DENSE = 3 * 96 * 64
MOE_ACTIVE = 8 * 64 + 2 * 32 * 64 + 2 * 3 * 32 * 32 + 3 * 32 * 64  # router, latent down/up, 2 of 8 experts, shared
HEAD = 32 * 64
MATMUL_PARAMS = 2 * KDA_MATMULS + 2 * MLA_MATMULS + DENSE + 3 * MOE_ACTIVE + HEAD

HAND = {
    "matmul": 2 * MATMUL_PARAMS,
    "attention": 2 * 2 * 2 * (8 + 4 + 16) * N,  # 2 MLA layers x 2 x H x (nope + rope + v) x N
    "kda": 2 * 2 * (6 * 16 * 16 + 3 * 64 * 16 + 64 * 64),  # 2 KDA layers x H x (6 dk^2 + 3 C dk + C^2), C = 64
    "short_conv": 2 * 2 * 3 * 3 * 32,  # 2 KDA layers x 2 x W x (q, k, v) x P
    "attn_res": 4 * 64 * 21,  # 4 d x sources summed over the 9 applications (see test_attn_res_sources)
}


def test_matmul_params_match_active_count(hand_spec):
    """The hand list of matmul weights is the active count minus the non-matmul tensors."""
    non_matmul = 2 * (3 * 32 * 3 + 2 + 32 + 16) + 2 * (16 + 32) + 3 * 32 + (4 * 2 * 64 + 64) + (4 * 256 + 128)
    assert MATMUL_PARAMS == param_counts(hand_spec)["active"] - non_matmul == 108_800


def test_attn_res_sources(hand_spec):
    """Block 2 layers = 4 sublayers: embedding + finished blocks + the partial sum once a block has started."""
    #   sublayers done:   0  1  2  3  4  5  6  7  8 (final)
    assert attn_res_source_counts(hand_spec) == [1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_attn_res_sources_full_and_plain(hand_text):
    full = load_spec_text(hand_text.replace("mode: block, block_size: 2", "mode: full"))
    assert attn_res_source_counts(full) == list(range(1, 10))  # embedding + every earlier sublayer
    plain = load_spec_text(hand_text.replace("{kind: attn_res, mode: block, block_size: 2}", "{kind: plain}"))
    assert attn_res_source_counts(plain) == []
    assert forward_flops_per_token(plain, N)["attn_res"] == 0


def test_terms_by_hand(hand_spec):
    f = forward_flops_per_token(hand_spec, N)
    assert KDA_CHUNK == 64
    assert {k: f[k] for k in HAND} == HAND
    assert f["forward"] == sum(HAND.values()) == 281_344
    assert f["context"] == N


def test_context_scaling(hand_spec):
    """Only full attention grows with context; KDA's chunked cost per token does not."""
    f1, f2 = forward_flops_per_token(hand_spec, N), forward_flops_per_token(hand_spec, 3 * N)
    assert f2["attention"] == 3 * f1["attention"]
    for k in ("matmul", "kda", "short_conv", "attn_res"):
        assert f2[k] == f1[k]


def test_k3_is_about_two_flops_per_active_parameter(k3_spec):
    f = forward_flops_per_token(k3_spec, 1)
    p = param_counts(k3_spec)
    assert f["forward"] == pytest.approx(2 * p["active"], rel=0.02)
    # Gated MLA at 1M context: 24 layers x 2 x 96 heads x (128 + 64 + 128) x N
    n = 1 << 20
    assert forward_flops_per_token(k3_spec, n)["attention"] == 24 * 2 * 96 * 320 * n


def test_gated_linear_attention_term(hand_text):
    """Without the delta rule: H (4 dk^2 + 4 C dk) per KDA layer and token, chunk C = 16."""
    spec = load_spec_text(hand_text.replace("output_gate_rank: 4", "output_gate_rank: 4\n  delta_rule: false"))
    assert forward_flops_per_token(spec, 128)["kda"] == 2 * 2 * (4 * 16 * 16 + 4 * 16 * 16)
