"""The C kernels of kda_gate (kernels/kda/kda_gate.c) against kernels/kda/reference.py and autograd through it."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels._common.compare import rel_rms
from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.kernels.kda.c import kda_gate, kda_gate_bwd


@pytest.mark.parametrize("form", ["lower_bounded_sigmoid", "softplus"])
@pytest.mark.parametrize(("shape", "threads"), [((2, 5, 3, 16), 1), ((3, 40, 4, 64), 2)])
def test_forward_and_backward_match_the_reference(form, shape, threads):
    g = torch.Generator().manual_seed(0)
    H, K = shape[-2:]
    f, dg = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    A_log, dt_bias = torch.randn(H, generator=g) * 0.5, torch.randn(H * K, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kda_gate(f, A_log, dt_bias, form, -5.0)
        assert got.dtype == torch.float32 and rel_rms(got, kda_gate_ref(f, A_log, dt_bias, form, -5.0)) <= 1e-6
        leaves = [t.double().requires_grad_() for t in (f, A_log, dt_bias)]
        want = torch.autograd.grad(kda_gate_ref(*leaves, form, -5.0), leaves, dg.double())
        for a, b in zip(kda_gate_bwd([dg], f, A_log, dt_bias, form, -5.0), want):
            assert a.dtype == torch.float32 and a.shape == b.shape and rel_rms(a, b) <= 1e-5
    finally:
        torch.set_num_threads(before)


def test_bf16_is_read_through_fp32_and_float64_keeps_the_reference():
    f = torch.randn(2, 3, 2, 8)
    A_log, dt_bias = torch.zeros(2), torch.zeros(16)
    got = kda_gate(f.bfloat16(), A_log, dt_bias, "softplus", 0.0)
    want = kda_gate(f.bfloat16().float(), A_log, dt_bias, "softplus", 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    f64 = f.double()
    assert torch.equal(kda_gate(f64, A_log.double(), dt_bias.double(), "softplus", 0.0),
                       kda_gate_ref(f64, A_log.double(), dt_bias.double(), "softplus", 0.0))
    with pytest.raises(ValueError, match="unknown KDA decay form"):
        kda_gate(f, A_log, dt_bias, "exp", 0.0)
