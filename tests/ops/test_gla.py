"""k3::gla_chunk and k3::gla_decode_step: registered ops, gradients against autograd of the recurrence, fakes."""

import torch

from k3compile.kernels.gla import reference as ref
from k3compile.kernels.binding import choose
from k3compile.kernels.gla.op import gla, gla_decode_step


def _inputs(T=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, T, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, T, 2, 3, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, T, 2, 4, generator=gen, dtype=torch.float64)
    S0 = torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, S0)]


def test_chunk_op_gradients_equal_those_of_the_recurrence():
    inputs = _inputs()
    o, S = gla(*inputs[:4], initial_state=inputs[4], chunk_size=4)
    o_ref, S_ref = ref.gla_naive(*inputs[:4], None, inputs[4])
    torch.testing.assert_close(o, o_ref)
    w_o, w_S = torch.randn_like(o), torch.randn_like(S)
    got = torch.autograd.grad((o * w_o).sum() + (S * w_S).sum(), inputs)
    want = torch.autograd.grad((o_ref * w_o).sum() + (S_ref * w_S).sum(), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_decode_op_gradients_and_meta():
    q, k, v, g, S = (t[:, 0] if t.dim() == 4 and t.shape[1] == 9 else t for t in _inputs())
    o, S1 = gla_decode_step(q, k, v, g, S)
    o_ref, S_ref = ref.gla_naive(q[:, None], k[:, None], v[:, None], g[:, None], None, S)
    torch.testing.assert_close(o, o_ref[:, 0])
    assert torch.autograd.gradcheck(lambda *a: gla_decode_step(*a), (q, k, v, g, S))
    meta = [t.detach().to("meta") for t in (q, k, v, g, S)]
    o_m, S_m = gla_decode_step(*meta)
    assert o_m.shape == o.shape and S_m.dtype == S1.dtype


def test_bound_to_the_reference_on_every_target():
    assert choose("gla_chunk", "h100") == {"impl": "torch", "reason": "no Triton kernel for k3::gla_chunk"}
    assert choose("gla_decode_step", "cpu")["impl"] == "torch"
