"""Triton expert grouped GEMMs against kernels/experts/reference.py: GLU and plain forward, MXFP4 weights, backward, bf16.

Shapes are ragged against every block: C = 13 capacity rows (the last 3 of each expert zero, as unused
capacity), w = 48 / I = 40 against 32-wide blocks (and 64-wide defaults), MXFP4 K = 96 against BLOCK_K 64.
"""

import pytest
import torch

from k3compile.kernels.experts import reference as ref
from k3compile.kernels.experts import triton as mt
from k3compile.kernels._common.launch import launch_config
from k3compile.kernels.mx.reference import mx_quantize_fast
from k3compile.kernels._common.compare import rel_rms as _rel_rms

KINDS = ("situ_glu", "swiglu")
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
BETAS = (4.0, 25.0)


@pytest.fixture(params=["default", "small"])
def blocks(request, monkeypatch):
    """Run once with the kernels' default blocks and once with 16 x 32 x 32 blocks (several tiles per dim)."""
    if request.param == "small":
        monkeypatch.setattr(
            mt, "launch_config", lambda name, dev, defaults, **s: {**launch_config(name, dev, defaults, **s), **SMALL}
        )
    return request.param


def _buffer(E, C, d, dtype=torch.float32, seed=0):
    """Expert buffer [E, C, d] whose last 3 rows are zero (unused capacity)."""
    x = torch.randn(E, C, d, generator=torch.Generator().manual_seed(seed))
    x[:, -3:] = 0
    return x.to(dtype)


def _weight(E, n, k, seed, dtype=torch.float32):
    return (torch.randn(E, n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5 * 2).to(dtype)


def _grads(fn, inputs, cotangent):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, cotangent)


@pytest.mark.parametrize("kind", KINDS)
def test_expert_glu_forward_and_backward(blocks, kind):
    E, C, w, I = 3, 13, 48, 40
    x, wg, wu = _buffer(E, C, w), _weight(E, I, w, 1), _weight(E, I, w, 2)
    y = mt.expert_glu(x, wg, wu, kind, *BETAS)
    want = ref.expert_glu_ref(x, wg, wu, kind, *BETAS)
    assert y.shape == (E, C, I) and y.dtype == torch.float32 and y.is_contiguous()
    assert _rel_rms(y, want) <= 1e-5
    assert (y[:, -3:] == 0).all()  # act(0, 0) = 0 on unused capacity rows

    dy = torch.randn(E, C, I, generator=torch.Generator().manual_seed(3))
    got = mt.expert_glu_bwd([dy], x, wg, wu, kind, *BETAS)
    want = _grads(lambda *t: ref.expert_glu_ref(*t, kind, *BETAS), (x, wg, wu), dy)
    for g, r, arg in zip(got, want, (x, wg, wu)):
        assert g.shape == arg.shape and g.dtype == arg.dtype and g.is_contiguous()
        assert _rel_rms(g, r) <= 1e-5


def test_expert_matmul_forward_and_backward(blocks):
    E, C, I, w = 3, 13, 40, 48
    x, wd = _buffer(E, C, I), _weight(E, w, I, 4)
    y = mt.expert_matmul(x, wd)
    assert y.shape == (E, C, w) and y.dtype == torch.float32
    assert _rel_rms(y, ref.expert_matmul_ref(x, wd)) <= 1e-5

    dy = torch.randn(E, C, w, generator=torch.Generator().manual_seed(5))
    got = mt.expert_matmul_bwd([dy], x, wd)
    want = _grads(ref.expert_matmul_ref, (x, wd), dy)
    for g, r, arg in zip(got, want, (x, wd)):
        assert g.shape == arg.shape and g.dtype == arg.dtype
        assert _rel_rms(g, r) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_backwards_match_the_hand_written_reference_backwards(kind):
    E, C, w, I = 3, 13, 48, 40
    x, wg, wu, wd = _buffer(E, C, w), _weight(E, I, w, 6), _weight(E, I, w, 7), _weight(E, w, I, 8)
    g = torch.Generator().manual_seed(9)
    dy_glu, dy_mm = torch.randn(E, C, I, generator=g), torch.randn(E, C, w, generator=g)
    h = _buffer(E, C, I, seed=10)
    pairs = [(mt.expert_glu_bwd([dy_glu], x, wg, wu, kind, *BETAS), ref.expert_glu_bwd_ref([dy_glu], x, wg, wu, kind, *BETAS)),
             (mt.expert_matmul_bwd([dy_mm], h, wd), ref.expert_matmul_bwd_ref([dy_mm], h, wd))]
    for got, want in pairs:
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert _rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_mx_expert_glu(blocks, kind):
    E, C, w, I = 2, 13, 96, 40  # w: 3 scale blocks of 32, ragged against BLOCK_K 64
    x = _buffer(E, C, w)
    gq = mx_quantize_fast(_weight(E, I, w, 6), "e2m1", 32)
    uq = mx_quantize_fast(_weight(E, I, w, 7), "e2m1", 32)
    y = mt.mx_expert_glu(x, *gq, *uq, 32, kind, *BETAS)
    assert y.shape == (E, C, I) and y.dtype == torch.float32
    assert _rel_rms(y, ref.mx_expert_glu_ref(x, *gq, *uq, 32, kind, *BETAS)) <= 1e-5


def test_mx_expert_matmul(blocks):
    E, C, I, w = 2, 13, 96, 48
    x = _buffer(E, C, I)
    data, scale = mx_quantize_fast(_weight(E, w, I, 8), "e2m1", 32)
    y = mt.mx_expert_matmul(x, data, scale, 32)
    assert y.shape == (E, C, w) and y.dtype == torch.float32
    assert _rel_rms(y, ref.mx_expert_matmul_ref(x, data, scale, 32)) <= 1e-5


def test_bf16():
    """bf16 in and out (fp32 accumulation); the interpreter's casts to bf16 truncate, hence the tolerance."""
    E, C, w, I = 2, 16, 64, 32
    bf = torch.bfloat16
    x, wg, wu, wd = _buffer(E, C, w, bf), _weight(E, I, w, 1, bf), _weight(E, I, w, 2, bf), _weight(E, w, I, 3, bf)
    y = mt.expert_glu(x, wg, wu, "situ_glu", *BETAS)
    assert y.dtype == bf and _rel_rms(y, ref.expert_glu_ref(x, wg, wu, "situ_glu", *BETAS)) <= 1e-2
    h = _buffer(E, C, I, bf)
    assert _rel_rms(mt.expert_matmul(h, wd), ref.expert_matmul_ref(h, wd)) <= 1e-2
    gq = mx_quantize_fast(wg, "e2m1", 32)
    uq = mx_quantize_fast(wu, "e2m1", 32)
    y = mt.mx_expert_glu(x, *gq, *uq, 32, "swiglu", *BETAS)
    assert y.dtype == bf and _rel_rms(y, ref.mx_expert_glu_ref(x, *gq, *uq, 32, "swiglu", *BETAS)) <= 1e-2

    dy = torch.randn(E, C, I, generator=torch.Generator().manual_seed(9)).to(bf)
    got = mt.expert_glu_bwd([dy], x, wg, wu, "situ_glu", *BETAS)
    want = _grads(lambda *t: ref.expert_glu_ref(*t, "situ_glu", *BETAS), (x, wg, wu), dy)
    for g, r in zip(got, want):
        assert g.dtype == bf and _rel_rms(g, r) <= 2e-2


def test_non_contiguous_inputs_and_empty_capacity():
    E, C, w, I = 2, 5, 32, 24
    x = _buffer(E, C, w)
    wg_t = _weight(E, w, I, 1).transpose(1, 2)  # [E, I, w] view, not contiguous
    wu = _weight(E, I, w, 2)
    want = ref.expert_glu_ref(x, wg_t, wu, "swiglu", *BETAS)
    assert _rel_rms(mt.expert_glu(x, wg_t, wu, "swiglu", *BETAS), want) <= 1e-5

    empty = torch.zeros(E, 0, w)
    assert mt.expert_glu(empty, wu, wu, "situ_glu", *BETAS).shape == (E, 0, I)
    dx, dwg, dwu = mt.expert_glu_bwd([torch.zeros(E, 0, I)], empty, wu, wu, "situ_glu", *BETAS)
    assert dx.shape == (E, 0, w) and (dwg == 0).all() and (dwu == 0).all() and dwg.shape == (E, I, w)


def test_rejects_bad_kind_and_mx_shapes():
    x = torch.zeros(1, 4, 32)
    w = torch.zeros(1, 16, 32)
    with pytest.raises(ValueError, match="kind"):
        mt.expert_glu(x, w, w, "gelu", *BETAS)
    data, scale = mx_quantize_fast(torch.zeros(1, 16, 64), "e2m1", 32)  # K = 64, x has 32
    with pytest.raises(ValueError, match="does not match"):
        mt.mx_expert_glu(x, data, scale, data, scale, 32, "swiglu", *BETAS)


@pytest.fixture(params=["tma", "pointers"])
def loads(request, monkeypatch):
    """Run once with TMA descriptors (the interpreter has them) and once with masked pointer loads (A100)."""
    from k3compile.kernels._common import gemm_triton

    if request.param == "pointers":
        monkeypatch.setattr(gemm_triton, "use_tma", lambda device, *tensors: False)
    return request.param


def test_both_operand_paths_forward_and_backward(loads):
    """Dense GLU and GEMM forward and backward, the dual-product dx and the weight gradients, on each load path."""
    E, C, w, I = 2, 13, 48, 40
    x, wg, wu = _buffer(E, C, w), _weight(E, I, w, 11), _weight(E, I, w, 12)
    dy = torch.randn(E, C, I, generator=torch.Generator().manual_seed(13))
    want = ref.expert_glu_ref(x, wg, wu, "situ_glu", *BETAS)
    assert _rel_rms(mt.expert_glu(x, wg, wu, "situ_glu", *BETAS), want) <= 1e-5
    got = mt.expert_glu_bwd([dy], x, wg, wu, "situ_glu", *BETAS)
    for g, r in zip(got, ref.expert_glu_bwd_ref([dy], x, wg, wu, "situ_glu", *BETAS), strict=True):
        assert _rel_rms(g, r) <= 1e-5


@pytest.mark.parametrize("C", [3, 37])
def test_mx_scale_words_and_few_tokens(loads, C):
    """K = 128 (four E8M0 scales a row: the one-word scale loads) with 3 tokens (a decode step's narrow tile)
    and 37 (a ragged 64-token tile)."""
    E, I, w = 2, 128, 40
    x = _buffer(E, C, I, seed=14)
    data, scale = mx_quantize_fast(_weight(E, w, I, 15), "e2m1", 32)
    y = mt.mx_expert_matmul(x, data, scale, 32)
    assert _rel_rms(y, ref.mx_expert_matmul_ref(x, data, scale, 32)) <= 1e-5
    gq = mx_quantize_fast(_weight(E, w, I, 16), "e2m1", 32)
    got = mt.mx_expert_glu(x, data, scale, *gq, 32, "swiglu", *BETAS)
    assert _rel_rms(got, ref.mx_expert_glu_ref(x, data, scale, *gq, 32, "swiglu", *BETAS)) <= 1e-5
