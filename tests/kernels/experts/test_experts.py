"""Expert GEMM references against naive per-expert loops in float64, with an independent MXFP4 decoder."""

import pytest
import torch

from k3compile.kernels.experts import reference as ref
from k3compile.kernels.mx.reference import mx_quantize_fast
from k3compile.kernels._common.compare import autograd_grads
from k3compile.kernels._common.compare import rel_rms as _rel
from k3compile.kernels.experts.op import expert_glu, expert_matmul, expert_rows_matmul

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7, sign in bit 3


def _act(g, u, kind, b1, b2):
    """The gated activation written out on float64 tensors."""
    s = 1.0 / (1.0 + torch.exp(-g))
    if kind == "situ_glu":
        return b1 * torch.tanh(g / b1) * s * b2 * torch.tanh(u / b2)
    return g * s * u


def _loop_glu(x, wg, wu, kind, b1=4.0, b2=25.0):
    out = []
    for e in range(x.shape[0]):
        xe = x[e].double()
        out.append(_act(xe @ wg[e].double().T, xe @ wu[e].double().T, kind, b1, b2))
    return torch.stack(out)


def _loop_matmul(x, w):
    return torch.stack([x[e].double() @ w[e].double().T for e in range(x.shape[0])])


def _decode(data, scale, block):
    """Packed e2m1 [E, n, k/2] + E8M0 [E, n, k/block] -> float64 [E, n, k], element by element."""
    E, n, half = data.shape
    out = torch.empty(E, n, 2 * half, dtype=torch.float64)
    for e in range(E):
        for r in range(n):
            for j in range(2 * half):
                code = (int(data[e, r, j // 2]) >> (4 * (j % 2))) & 0xF
                value = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
                out[e, r, j] = value * 2.0 ** (int(scale[e, r, j // block]) - 127)
    return out


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_expert_glu_ref_matches_loop(kind):
    torch.manual_seed(0)
    x, wg, wu = torch.randn(3, 5, 12) * 2, torch.randn(3, 7, 12), torch.randn(3, 7, 12)
    got = ref.expert_glu_ref(x, wg, wu, kind, 4.0, 25.0)
    assert got.shape == (3, 5, 7) and got.dtype == torch.float32
    assert _rel(got, _loop_glu(x, wg, wu, kind)) < 1e-6


def test_situ_glu_beta_and_bound():
    """beta1/beta2 reach the activation: with tiny betas every output is bounded by b1 * b2."""
    torch.manual_seed(1)
    x, wg, wu = torch.randn(2, 4, 8) * 3, torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    got = ref.expert_glu_ref(x, wg, wu, "situ_glu", 0.5, 0.25)
    assert _rel(got, _loop_glu(x, wg, wu, "situ_glu", 0.5, 0.25)) < 1e-6
    assert got.abs().max() <= 0.5 * 0.25


def test_expert_matmul_ref_matches_loop_and_keeps_dtype():
    torch.manual_seed(2)
    x, w = torch.randn(4, 3, 10), torch.randn(4, 6, 10)
    assert _rel(ref.expert_matmul_ref(x, w), _loop_matmul(x, w)) < 1e-6
    y = ref.expert_matmul_ref(x.bfloat16(), w.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (4, 3, 6)
    assert _rel(y.float(), _loop_matmul(x.bfloat16(), w.bfloat16())) < 1e-2


@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
@pytest.mark.parametrize("C", [3, 32])  # a few rows per expert (gate and up as one stack), and many
def test_mx_refs_match_hand_decoded_weights(C, kind):
    torch.manual_seed(3)
    E, w, I = 2, 64, 4
    x, h = torch.randn(E, C, w), torch.randn(E, C, I * 8)
    gate = mx_quantize_fast(torch.randn(E, I, w), "e2m1", 32)
    up = mx_quantize_fast(torch.randn(E, I, w), "e2m1", 32)
    down = mx_quantize_fast(torch.randn(E, w // 8, I * 8), "e2m1", 32)
    wg, wu, wd = (_decode(*q, 32) for q in (gate, up, down))
    got = ref.mx_expert_glu_ref(x, *gate, *up, 32, kind, 4.0, 25.0)
    assert _rel(got, _loop_glu(x, wg, wu, kind)) < 1e-6
    assert _rel(ref.mx_expert_matmul_ref(h, *down, 32), _loop_matmul(h, wd)) < 1e-6


def test_glu_ref_gradcheck_and_kind_check():
    torch.manual_seed(4)
    args = [torch.randn(2, n, 4, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5)]  # x, gate, up
    for kind in ("situ_glu", "swiglu"):
        assert torch.autograd.gradcheck(lambda *t: ref.expert_glu_ref(*t, kind, 4.0, 25.0), args)
    with pytest.raises(ValueError, match="kind"):
        ref.expert_glu_ref(*args, "gelu", 4.0, 25.0)
    assert ref.expert_glu_ref(*args, "swiglu", 4.0, 25.0).dtype == torch.float64


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("kind", ["situ_glu", "swiglu"])
def test_hand_written_backwards_equal_autograd_of_the_reference(kind, dtype, tol):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 9, 16, generator=g).to(dtype)  # ranks x experts leading dims
    wg, wu = (torch.randn(2, 3, 12, 16, generator=g).div_(2).to(dtype) for _ in range(2))
    wd = torch.randn(2, 3, 16, 12, generator=g).div_(2).to(dtype)
    dy, dh = torch.randn(2, 3, 9, 12, generator=g).to(dtype), torch.randn(2, 3, 9, 16, generator=g).to(dtype)
    h = torch.randn(2, 3, 9, 12, generator=g).to(dtype)
    pairs = [
        (ref.expert_glu_bwd_ref([dy], x, wg, wu, kind, 4.0, 25.0),
         autograd_grads(lambda *t: ref.expert_glu_ref(*t, kind, 4.0, 25.0), (x, wg, wu), [dy]), (x, wg, wu)),
        (ref.expert_matmul_bwd_ref([dh], h, wd), autograd_grads(ref.expert_matmul_ref, (h, wd), [dh]), (h, wd)),
    ]
    for got, want, args in pairs:
        for a, b, arg in zip(got, want, args, strict=True):
            assert a.shape == arg.shape and a.dtype == arg.dtype
            assert _rel(a, b) <= tol


def test_gradchecks_through_the_ops_do_not_recompute(monkeypatch):
    def no_recompute(*args, **kwargs):
        raise AssertionError("an expert op's backward recomputed its forward under torch.func.vjp")

    monkeypatch.setattr(torch.func, "vjp", no_recompute)
    kw = dict(dtype=torch.float64, requires_grad=True)
    x, wg, wu = torch.randn(2, 3, 4, **kw), torch.randn(2, 5, 4, **kw), torch.randn(2, 5, 4, **kw)
    for kind in ("situ_glu", "swiglu"):
        assert torch.autograd.gradcheck(lambda *t: expert_glu(*t, kind), (x, wg, wu))
    assert torch.autograd.gradcheck(expert_matmul, (torch.randn(2, 3, 5, **kw), torch.randn(2, 4, 5, **kw)))


@pytest.mark.parametrize("counts", [[5, 0, 3, 7], [0, 0, 0, 0], [4, 4, 4, 4]])
def test_rows_matmul_is_each_experts_matmul_on_its_rows(counts):
    """expert_rows_matmul: rows sorted by expert (counts each, then zero rows), per-expert x w_e^T, a per-expert
    loop in float64; the rows past the experts' are zero, and its hand-written backward passes gradcheck."""
    torch.manual_seed(0)
    E, I, W, N = 4, 6, 5, 20
    x = torch.randn(N, I, dtype=torch.float64)
    w = torch.randn(E, W, I, dtype=torch.float64, requires_grad=True)
    c = torch.tensor(counts)
    used = sum(counts)
    x[used:] = 0
    x.requires_grad_()
    y = ref.expert_rows_matmul_ref(x.detach(), w.detach(), c)
    start = 0
    for e, n in enumerate(counts):
        assert torch.allclose(y[start : start + n], (x[start : start + n] @ w[e].T).detach(), rtol=1e-12, atol=1e-12)
        start += n
    assert torch.equal(y[used:], torch.zeros(N - used, W, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda x, w: expert_rows_matmul(x, w, c), (x, w))
    dy = torch.randn(N, W, dtype=torch.float64)
    dx, dw = ref.expert_rows_matmul_bwd_ref([dy], x.detach(), w.detach(), c)
    assert torch.equal(dx[used:], torch.zeros_like(dx[used:]))
    for e, n in enumerate(counts):
        assert (dw[e].abs().sum() == 0) == (n == 0)


def test_rows_matmul_equals_the_capacity_buffers_on_their_rows():
    """The rows an expert holds in its capacity buffer give the same outputs in the rows layout (fp32)."""
    torch.manual_seed(1)
    E, C, I, W = 3, 8, 16, 12
    counts = torch.tensor([8, 2, 5])
    buffer = torch.randn(E, C, I)
    for e, n in enumerate(counts.tolist()):
        buffer[e, n:] = 0
    w = torch.randn(E, W, I)
    rows = torch.cat([buffer[e, :n] for e, n in enumerate(counts.tolist())] + [torch.zeros(4, I)])
    got = expert_rows_matmul(rows, w, counts)
    want = expert_matmul(buffer, w)
    assert _rel(got[: int(counts.sum())], torch.cat([want[e, :n] for e, n in enumerate(counts.tolist())])) <= 1e-6
