"""k3::rms_inv + k3::attn_res_normed: the same mix as k3::attn_res (values and gradients) with each source's
norm computed once; hand-written backwards against autograd of the references, gradcheck in float64."""

import pytest
import torch

from k3compile.kernels.attn_res.reference import attn_res_ref
from k3compile.kernels.attn_res_normed.reference import (
    attn_res_normed_bwd_ref,
    attn_res_normed_ref,
    rms_inv_bwd_ref,
    rms_inv_ref,
)
from k3compile.kernels._common.compare import autograd_grads, rel_rms
from k3compile.kernels.attn_res_normed.op import attn_res_normed, rms_inv


def _normed(v_SBTD, query, norm_weight, eps=1e-5):
    """attn_res the normalise-once way: one rms_inv per source, then the mix."""
    rinv = torch.stack([rms_inv(v, eps) for v in v_SBTD.unbind(0)])
    return attn_res_normed(v_SBTD, rinv, query, norm_weight)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_equals_attn_res(dtype, tol):
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(5, 2, 7, 48, generator=g) * torch.rand(5, 1, 1, 1, generator=g).mul(3)).to(dtype)
    query, norm_weight = torch.randn(48, generator=g).to(dtype), (torch.rand(48, generator=g) + 0.5).to(dtype)
    got, want = _normed(v, query, norm_weight), attn_res_ref(v, query, norm_weight, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_rms(got, want) <= tol


def test_gradients_equal_attn_res_float64():
    g = torch.Generator().manual_seed(1)
    kw = dict(dtype=torch.float64)
    v, query, w = torch.randn(4, 2, 3, 6, generator=g, **kw), torch.randn(6, generator=g, **kw), torch.rand(6, **kw)
    dh = torch.randn(2, 3, 6, generator=g, **kw)
    want = autograd_grads(lambda a, b, c: attn_res_ref(a, b, c, 1e-5), (v, query, w), [dh])
    got = autograd_grads(_normed, (v, query, w), [dh])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_gradcheck_float64_does_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("a backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    g = torch.Generator().manual_seed(2)
    kw = dict(dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 2, 5, generator=g, dtype=torch.float64).requires_grad_()
    query, w = torch.randn(5, **kw), torch.randn(5, **kw)
    rinv = (torch.rand(3, 2, 2, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(attn_res_normed, (v, rinv, query, w))
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rms_inv(t, 1e-5), (x,))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_hand_written_backwards_equal_autograd_of_the_references(dtype, tol):
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(5, 2, 7, 48, generator=g) * torch.rand(5, 1, 1, 1, generator=g).mul(3)).to(dtype)
    query, w = torch.randn(48, generator=g).to(dtype), (torch.rand(48, generator=g) + 0.5).to(dtype)
    rinv = rms_inv_ref(v, 1e-5)
    dh = torch.randn(2, 7, 48, generator=g).to(dtype)
    got = attn_res_normed_bwd_ref([dh], v, rinv, query, w)
    want = autograd_grads(attn_res_normed_ref, (v, rinv, query, w), [dh])
    for a, b, arg in zip(got, want, (v, rinv, query, w), strict=True):
        assert a.shape == arg.shape and a.dtype == arg.dtype
        assert rel_rms(a, b) <= tol
    dr = torch.randn(2, 7, generator=g)
    (dx,) = rms_inv_bwd_ref([dr], v[0], 1e-5)
    (want_dx,) = autograd_grads(lambda t: rms_inv_ref(t, 1e-5), (v[0],), [dr])
    assert dx.dtype == dtype and rel_rms(dx, want_dx) <= tol


def test_meta_shapes():
    v = torch.empty(4, 2, 3, 8, device="meta", dtype=torch.bfloat16)
    r = rms_inv(v[0])
    assert r.shape == (2, 3) and r.dtype == torch.float32 and r.device.type == "meta"
    h = attn_res_normed(v, torch.empty(4, 2, 3, device="meta"), torch.empty(8, device="meta"),
                        torch.empty(8, device="meta"))
    assert h.shape == (2, 3, 8) and h.dtype == torch.bfloat16
