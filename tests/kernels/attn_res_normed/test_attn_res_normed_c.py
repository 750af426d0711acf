"""The C kernels of rms_inv and attn_res_normed (kernels/attn_res_normed/attn_res.c) against kernels/attn_res_normed/reference.py, and
the mix against AttnRes itself (kernels/attn_res/reference.py), forward and backward."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels.attn_res_normed import reference as ref
from k3compile.kernels.attn_res_normed import c
from k3compile.kernels.attn_res.reference import attn_res_ref
from k3compile.kernels._common.compare import rel_rms


def _inputs(S, B, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(S, B, T, D, generator=g) * 2
    q, w = torch.randn(D, generator=g), torch.randn(D, generator=g)
    return v, q, w, torch.randn(B, T, D, generator=g)


@pytest.mark.parametrize(("S", "B", "T", "D"), [(1, 1, 3, 16), (3, 2, 5, 100), (9, 2, 64, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_attn_res_forward_and_backward(S, B, T, D, threads):
    v, q, w, dh = _inputs(S, B, T, D)
    eps = 1e-5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        r = torch.stack([c.rms_inv(s, eps) for s in v])
        assert rel_rms(r, torch.stack([ref.rms_inv_ref(s, eps) for s in v])) <= 1e-6
        h = c.attn_res_normed(v, r, q, w)
        assert h.shape == (B, T, D) and rel_rms(h, attn_res_ref(v, q, w, eps)) <= 1e-6
        # the two ops chained, backward through their C backwards, against autograd of AttnRes in float64
        dv, dr, dq, dw = c.attn_res_normed_bwd([dh], v, r, q, w)
        dv = dv + torch.stack([c.rms_inv_bwd([dr[i]], v[i], eps)[0] for i in range(S)])
        leaves = [t.double().requires_grad_() for t in (v, q, w)]
        want = torch.autograd.grad(attn_res_ref(*leaves, eps), leaves, dh.double())
        for got, expect in zip((dv, dq, dw), want):
            assert got.dtype == torch.float32 and rel_rms(got, expect) <= 1e-5
    finally:
        torch.set_num_threads(before)


def test_float64_and_too_many_sources_keep_the_reference():
    v, q, w, dh = _inputs(3, 1, 4, 8)
    v64, q64, w64 = v.double(), q.double(), w.double()
    r64 = torch.stack([ref.rms_inv_ref(s, 1e-5) for s in v64])
    assert torch.equal(c.attn_res_normed(v64, r64, q64, w64), ref.attn_res_normed_ref(v64, r64, q64, w64))
    many = torch.randn(c.MAX_SOURCES + 1, 1, 2, 8)
    r = torch.ones(c.MAX_SOURCES + 1, 1, 2)
    assert torch.equal(c.attn_res_normed(many, r, q, w), ref.attn_res_normed_ref(many, r, q, w))
