"""Triton AttnRes (forward and backward) against `attn_res_ref`, autograd of it and the plain average."""

import pytest
import torch

from k3compile.kernels.attn_res import triton as art
from k3compile.kernels.attn_res.reference import attn_res_bwd_ref, attn_res_ref
from k3compile.kernels._common.compare import rel_rms as _rel_rms

# Rows longer than a block (two-pass forward), several D blocks and several partial rows of du.
SMALL = {
    "attn_res": {"BLOCK_T": 4, "BLOCK_D": 32},
    "attn_res_bwd_coef": {"BLOCK_T": 4, "BLOCK_D": 32},
    "attn_res_bwd_dsrc": {"BLOCK_T": 2, "BLOCK_D": 32, "PROGRAMS": 12},
    "attn_res_bwd_reduce": {"BLOCK_D": 32},
}


@pytest.fixture(params=["default", "small"])
def blocks(request, monkeypatch):
    """Default configs (whole rows in registers: one-pass forward) or small blocks (chunked rows)."""
    if request.param == "small":
        monkeypatch.setattr(art, "launch_config", lambda name, device, defaults, **sizes: {**defaults, **SMALL[name]})
    return request.param


def _inputs(S, B, T, D, dtype=torch.float32, seed=0):
    """Sources of unequal scales (so the softmax is far from uniform), query and norm weight."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(S, 1, 1, 1, generator=g) * 3 + 0.1
    src = (torch.randn(S, B, T, D, generator=g) * scale).to(dtype)
    query = (torch.randn(D, generator=g) * 0.5).to(dtype)
    norm_weight = (torch.rand(D, generator=g) + 0.5).to(dtype)
    return src, query, norm_weight


def _check(src, query, norm_weight, eps, fwd_tol, bwd_tol, seed=1):
    h = art.attn_res(src, query, norm_weight, eps)
    leaves = [t.clone().requires_grad_() for t in (src, query, norm_weight)]
    h_ref = attn_res_ref(*leaves, eps)
    assert h.shape == h_ref.shape and h.dtype == h_ref.dtype and h.is_contiguous()
    assert _rel_rms(h, h_ref) <= fwd_tol

    g_h = torch.randn(h.shape, generator=torch.Generator().manual_seed(seed)).to(h.dtype)
    want = torch.autograd.grad(h_ref, leaves, g_h)
    got = art.attn_res_bwd([g_h], src, query, norm_weight, eps)
    assert len(got) == 3
    for grad, ref, arg in zip(got, want, (src, query, norm_weight)):
        assert grad.shape == arg.shape and grad.dtype == arg.dtype and grad.is_contiguous()
        assert _rel_rms(grad, ref) <= bwd_tol


@pytest.mark.parametrize(("S", "B", "T", "D"), [(3, 2, 13, 100), (9, 1, 5, 64), (2, 1, 1, 100), (20, 1, 3, 48)])
def test_matches_reference_and_autograd(S, B, T, D, blocks):
    # D = 100 and T = 13 are ragged for every block size; T = 1 is a single token; S = 20 is full AttnRes depth.
    _check(*_inputs(S, B, T, D), 1e-6, 1e-6, 1e-5)


@pytest.mark.parametrize(("S", "B", "T", "D"), [(3, 2, 13, 100), (20, 1, 3, 48)])
def test_backward_matches_the_hand_written_reference_backward(S, B, T, D):
    src, query, norm_weight = _inputs(S, B, T, D, seed=2)
    g_h = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3))
    got = art.attn_res_bwd([g_h], src, query, norm_weight, 1e-5)
    want = attn_res_bwd_ref([g_h], src, query, norm_weight, 1e-5)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _rel_rms(a, b) <= 1e-5


def test_non_contiguous_sources():
    src, query, norm_weight = _inputs(4, 2, 5, 40)
    src_view = src.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)  # same values, S not outermost in memory
    assert not src_view.is_contiguous()
    _check(src_view, query, norm_weight, 1e-6, 1e-6, 1e-5)


def test_zero_query_gives_the_plain_average(blocks):
    src, _, norm_weight = _inputs(5, 1, 7, 100)
    h = art.attn_res(src, torch.zeros(100), norm_weight, 1e-6)
    torch.testing.assert_close(h, src.double().mean(0).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, blocks):
    # Inputs and outputs in 16 bits, math in fp32 in both: the gap is the rounding of the outputs (the
    # interpreter rounds fp32 -> bf16 toward zero, a GPU to nearest even).
    _check(*_inputs(4, 2, 5, 100, dtype=dtype), 1e-6, 1e-2, 1e-2)


def test_no_tokens():
    src, query, norm_weight = _inputs(3, 2, 0, 16)
    assert art.attn_res(src, query, norm_weight, 1e-6).shape == (2, 0, 16)
    dsrc, dquery, dnorm_weight = art.attn_res_bwd([torch.zeros(2, 0, 16)], src, query, norm_weight, 1e-6)
    assert dsrc.shape == src.shape and not dquery.any() and not dnorm_weight.any()


def test_backward_is_deterministic(blocks):
    src, query, norm_weight = _inputs(3, 2, 13, 100)
    g_h = torch.randn(2, 13, 100)
    first = art.attn_res_bwd([g_h], src, query, norm_weight, 1e-6)
    second = art.attn_res_bwd([g_h], src, query, norm_weight, 1e-6)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
