"""The C kernels of glu_train (kernels/glu_train/glu.c) against kernels/glu_train/reference.py and autograd of the plain GLUs."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels.glu_train import c as glu_c
from k3compile.kernels.activations.reference import glu_ref
from k3compile.kernels._common.compare import rel_rms
from k3compile.kernels.glu_train.reference import glu_train_bwd_ref, glu_train_ref
from k3compile.kernels.mx.reference import mx_fake_quantize_ref

KINDS = [("situ_glu", 4.0, 25.0), ("swiglu", 0.0, 0.0)]


def _inputs(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 4).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(("kind", "b1", "b2"), KINDS)
@pytest.mark.parametrize("shape", [(7, 129), (2, 3, 4096 + 5)])  # ragged against the kernel's 4096-value spans
def test_values_and_derivatives_match_the_reference(kind, b1, b2, shape):
    gate, up, _ = _inputs(shape)
    got, want = glu_c.glu_train(gate, up, kind, b1, b2), glu_train_ref(gate, up, kind, b1, b2)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
        assert rel_rms(a, b) <= 1e-6


@pytest.mark.parametrize(("kind", "b1", "b2"), KINDS)
def test_backward_is_the_gradient_of_the_activation(kind, b1, b2):
    gate, up, dy = _inputs((33, 40), seed=1)
    outs = glu_c.glu_train(gate, up, kind, b1, b2)
    got = glu_c.glu_train_bwd([dy], list(outs), gate, up, kind, b1, b2)
    leaves = [gate.double().requires_grad_(), up.double().requires_grad_()]
    want = torch.autograd.grad(glu_ref(*leaves, kind, b1, b2), leaves, dy.double())
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and rel_rms(a, b) <= 1e-6
    # the two multiplies are the reference backward's, bit for bit, on the same derivatives
    for a, b in zip(got, glu_train_bwd_ref([dy], list(outs), gate, up, kind, b1, b2)):
        assert torch.equal(a, b)


def test_bf16_round_trips_through_fp32_and_float64_keeps_the_reference():
    gate, up, _ = _inputs((5, 64), dtype=torch.bfloat16)
    y, jg, ju = glu_c.glu_train(gate, up, "situ_glu", 4.0, 25.0)
    want = glu_train_ref(gate, up, "situ_glu", 4.0, 25.0)
    assert y.dtype == torch.bfloat16 and jg.dtype == ju.dtype == torch.float32
    assert rel_rms(y, want[0]) <= 1e-2 and rel_rms(jg, want[1]) <= 1e-6
    g64, u64, _ = _inputs((5, 64), dtype=torch.float64)
    for a, b in zip(glu_c.glu_train(g64, u64, "swiglu", 0, 0), glu_train_ref(g64, u64, "swiglu", 0, 0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_quantised_fill_is_the_activation_fake_quantised(fmt):
    gate, up, _ = _inputs((64, 96), seed=2)
    y, jg, ju = (torch.empty(64, 96) for _ in range(3))
    glu_c.glu_fill(gate, up, y, jg, ju, "situ_glu", 4.0, 25.0, fmt, 32)
    plain, _, _ = glu_c.glu_train(gate, up, "situ_glu", 4.0, 25.0)
    assert torch.equal(y, mx_fake_quantize_ref(plain, fmt, 32))  # the same activation, quantised in cache


def test_unknown_kind_is_refused():
    gate, up, _ = _inputs((2, 4))
    with pytest.raises(ValueError, match="glu_train kind"):
        glu_c.glu_train(gate, up, "gelu", 1.0, 1.0)
