"""Triton absorbed MLA decoding against the PyTorch references: ragged caches, split and unsplit, bf16."""

import pytest
import torch

from k3compile.kernels.mla import triton as mdt
from k3compile.kernels._common.launch import launch_config
from k3compile.kernels.mla.reference import mla_attention_ref, mla_decode_absorbed_ref
from k3compile.kernels._common.compare import rel_rms as _rel_rms


@pytest.fixture
def config(monkeypatch):
    """force(**cfg): launch the decode kernel with these config entries over its defaults."""

    def force(**over):
        def patched(name, dev, defaults, **sizes):
            cfg = launch_config(name, dev, defaults, **sizes)
            return {**cfg, **over} if name == "mla_decode_absorbed" else cfg

        monkeypatch.setattr(mdt, "launch_config", patched)

    return force


def _inputs(B, T, S, H, L, R, N, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, N + R, generator=g)
    latent = torch.randn(B, S, L + R, generator=g)
    w_kvb = torch.randn(H * (N + V), L, generator=g) * L**-0.5
    return q.to(dtype), latent.to(dtype), w_kvb.to(dtype)


# S ragged in BLOCK_S = 16; with S = 33, T = 3 and 3 splits, the first queries see no key of the last split.
@pytest.mark.parametrize("S", [37, 33])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference_ragged_cache(config, S, T, splits):
    config(BLOCK_S=16, SPLITS=splits)
    q, latent, w = _inputs(2, T, S, 3, 32, 16, 16, 24)
    o = mdt.mla_decode_absorbed(q, latent, w, 0.2)
    ref = mla_decode_absorbed_ref(q, latent, w, 0.2)
    assert o.shape == (2, T, 3, 24) and o.dtype == torch.float32 and o.is_contiguous()
    assert _rel_rms(o, ref) < 1e-5


def test_two_head_blocks_and_unpadded_dims(config):
    # H = 20 over BLOCK_H = 16 (a ragged second block), L = 24 and R = 8 padded to the dot minimum of 16.
    config(BLOCK_S=16, BLOCK_H=16, SPLITS=2)
    q, latent, w = _inputs(1, 2, 40, 20, 24, 8, 8, 16, seed=1)
    o = mdt.mla_decode_absorbed(q, latent, w, 0.25)
    assert _rel_rms(o, mla_decode_absorbed_ref(q, latent, w, 0.25)) < 1e-5


def test_matches_expanded_attention_with_non_contiguous_query(config):
    # Independent of the absorbed reference: expand per-head keys and values from the latent and attend.
    config(BLOCK_S=16, SPLITS=2)
    B, T, S, H, L, R, N, V = 1, 2, 21, 2, 16, 16, 16, 16
    q, latent, w = _inputs(B, T, S, H, L, R, N, V, seed=2)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided [B, T, H, K]
    w_h = w.view(H, N + V, L)
    c_kv, k_pe = latent[..., :L], latent[..., L:]
    k_nope = torch.einsum("bsl,hnl->bshn", c_kv, w_h[:, :N])
    v = torch.einsum("bsl,hvl->bshv", c_kv, w_h[:, N:])
    ref = mla_attention_ref(q, k_nope, k_pe, v, 0.3)
    assert _rel_rms(mdt.mla_decode_absorbed(q, latent, w, 0.3), ref) < 1e-5


@pytest.mark.parametrize("sms", [1, 64])
def test_default_config_auto_splits(monkeypatch, sms):
    # Default fp32 BLOCK_S = 16: S = 300 is 19 blocks, at most 3 splits of 8 blocks. One SM (two program slots)
    # -> one split fills it; 64 SMs -> 3 splits of 7 blocks (the last ragged), merged by the reduce kernel.
    monkeypatch.setattr(mdt, "sm_count", lambda device: sms)
    q, latent, w = _inputs(1, 2, 300, 3, 32, 16, 16, 24, seed=3)
    o = mdt.mla_decode_absorbed(q, latent, w, 0.2)
    assert _rel_rms(o, mla_decode_absorbed_ref(q, latent, w, 0.2)) < 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_bf16(config, splits):
    config(BLOCK_S=16, SPLITS=splits)
    q, latent, w = _inputs(2, 1, 37, 3, 32, 16, 16, 24, dtype=torch.bfloat16, seed=4)
    o = mdt.mla_decode_absorbed(q, latent, w, 0.2)
    ref = mla_decode_absorbed_ref(q, latent, w, 0.2)
    assert o.dtype == torch.bfloat16 and _rel_rms(o, ref) < 2e-2


def test_split_count_fills_whole_waves():
    assert mdt.split_count(32, 132, 64) == 4  # 128 programs: one wave on 132 SMs
    assert mdt.split_count(200, 132, 64) == 3  # 600 programs in 660 slots; 1 or 2 splits fill only 76%
    assert mdt.split_count(132, 132, 8) == 1
    assert mdt.split_count(7, 132, 3) == 3  # capped by the cache's length: the fullest allowed
    assert mdt.split_count(1, 1, 0) == 1


def test_64_head_blocks_with_ragged_heads_and_splits(config):
    # K3's decode block: 64 heads a program; H = 70 leaves a ragged second head block, 3 splits are merged.
    config(BLOCK_H=64, BLOCK_S=16, SPLITS=3)
    q, latent, w = _inputs(1, 2, 45, 70, 16, 16, 16, 16, seed=5)
    o = mdt.mla_decode_absorbed(q, latent, w, 0.25)
    assert _rel_rms(o, mla_decode_absorbed_ref(q, latent, w, 0.25)) < 1e-5
