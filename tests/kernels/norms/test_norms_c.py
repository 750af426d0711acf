"""The C kernels of the row normalisations (kernels/norms/norms.c) against kernels/norms/reference.py and autograd through it."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels.norms import reference as ref
from k3compile.kernels.norms import c as norms_c
from k3compile.kernels._common.compare import rel_rms

SHAPES = [(3, 5, 100), (7, 256), (130, 37)]  # ragged last dims, more rows than threads


def _inputs(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x, gate, dy = (torch.randn(shape, generator=g) * 2 for _ in range(3))
    return [t.to(dtype) for t in (x, torch.randn(shape[-1], generator=g), gate, dy)]


def _cases(x, w, gate, eps):
    """(name, C forward, reference forward, args, C backward)."""
    return [
        ("rms_norm", norms_c.rms_norm, ref.rms_norm_ref, (x, w, eps), norms_c.rms_norm_bwd),
        ("rms_norm_gate", norms_c.rms_norm_gate, ref.rms_norm_gate_ref, (x, w, gate, eps), norms_c.rms_norm_gate_bwd),
        ("l2_norm", norms_c.l2_norm, ref.l2_norm_ref, (x, eps), norms_c.l2_norm_bwd),
    ]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_forward_and_backward_match_the_reference(shape, threads):
    x, w, gate, dy = _inputs(shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, fwd, fwd_ref, args, bwd in _cases(x, w, gate, 1e-5):
            got, want = fwd(*args), fwd_ref(*args)
            assert got.shape == want.shape and got.dtype == want.dtype and rel_rms(got, want) <= 1e-6, name
            leaves = [a.double().requires_grad_() if torch.is_tensor(a) else a for a in args]
            grads = torch.autograd.grad(fwd_ref(*leaves), [a for a in leaves if torch.is_tensor(a)], dy.double())
            for g, want_g in zip(bwd([dy], *args), grads):
                assert g.dtype == torch.float32 and rel_rms(g, want_g) <= 1e-5, name
    finally:
        torch.set_num_threads(before)


def test_bf16_round_trips_and_float64_keeps_the_reference():
    x, w, gate, dy = _inputs((4, 64), dtype=torch.bfloat16)
    for name, fwd, fwd_ref, args, bwd in _cases(x, w, gate, 1e-6):
        assert fwd(*args).dtype == torch.bfloat16 and rel_rms(fwd(*args), fwd_ref(*args)) <= 1e-2, name
        assert all(g.dtype == torch.bfloat16 for g in bwd([dy], *args)), name
    x, w, gate, dy = _inputs((4, 64), dtype=torch.float64)
    for name, fwd, fwd_ref, args, bwd in _cases(x, w, gate, 1e-6):
        assert torch.equal(fwd(*args), fwd_ref(*args)), name
