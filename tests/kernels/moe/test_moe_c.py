"""The C kernels of moe_combine (kernels/moe/moe.c) against kernels/moe/reference.py's combine and autograd through it."""

from __future__ import annotations

import pytest
import torch

from k3compile.kernels._common.compare import rel_rms
from k3compile.kernels.moe.reference import combine_ref
from k3compile.kernels.moe.c import moe_combine, moe_combine_bwd


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_through_slots_forward_and_backward(threads):
    g = torch.Generator().manual_seed(0)
    T, K, D, n = 50, 3, 24, 160
    rows = torch.randn(1, n, D, generator=g)
    w = torch.rand(T, K, generator=g)
    slots = torch.randperm(n, generator=g)[: T * K].view(T, K)
    slots[::7, 1] = n  # dropped choices: the sentinel row past the end contributes zero
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert rel_rms(moe_combine(rows, w, slots), combine_ref(rows, w, slots)) <= 1e-7
        dy = torch.randn(T, D, generator=g)
        leaves = [rows.double().requires_grad_(), w.double().requires_grad_()]
        want = torch.autograd.grad(combine_ref(*leaves, slots), leaves, dy.double())
        got = moe_combine_bwd([dy], rows, w, slots)
        for a, b in zip(got, want):
            assert a.dtype == torch.float32 and a.shape == b.shape and rel_rms(a, b) <= 1e-6
        assert torch.equal(got[1][::7, 1], torch.zeros(len(range(0, T, 7))))
    finally:
        torch.set_num_threads(before)


def test_capacity_buffers_and_the_slot_free_form():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(4, 6, 8, generator=g)  # [E, C, D] buffers: slots index the flattened rows
    w = torch.rand(5, 2, generator=g)
    slots = torch.tensor([[0, 7], [24, 3], [13, 23], [5, 24], [11, 12]])
    assert rel_rms(moe_combine(out, w, slots), combine_ref(out, w, slots)) <= 1e-7
    gathered = torch.randn(10, 1, 8, generator=g)  # decode: one row per (token, choice), no slots
    assert torch.equal(moe_combine(gathered, w, None), combine_ref(gathered, w, None))
    dy = torch.randn(5, 8, generator=g)
    leaves = [gathered.clone().requires_grad_(), w.clone().requires_grad_()]
    want = torch.autograd.grad(combine_ref(*leaves, None), leaves, dy)
    for a, b in zip(moe_combine_bwd([dy], gathered, w, None), want):
        assert torch.equal(a, b)
