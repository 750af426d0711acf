"""KDA and short-conv ops: chunked == recurrent in fp32 (outputs, states, gradients), gradchecks of the
chunked op's hand-written backward, the decode step, meta / fx / compile, and a smoke run of the CPU
benchmark."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3compile.kernels.kda import reference as kda_kernels
from k3compile.kernels.kda.reference import kda_naive
from k3compile.kernels.short_conv.reference import short_conv_naive
from k3compile.kernels.kda.op import kda, kda_decode_step, kda_gate
from k3compile.kernels.short_conv.op import short_conv
from k3compile.kernels._common.compare import rel_rms as _rel_rms

F64 = torch.float64
BENCH = Path(__file__).resolve().parents[2] / "bench" / "ops_cpu.py"


def _inputs(B=2, T=9, H=2, K=16, V=16, dtype=torch.float32, seed=0, requires_grad=False):
    """Realistic gates: g = -5 * sigmoid(.), beta = sigmoid(.), q and k L2-normalised."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=dtype))
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta, S0)]


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent_fp32_values_and_grads(T, with_state):
    *xs, S0 = _inputs(T=T, requires_grad=True)
    init = S0 if with_state else None
    leaves = xs + ([S0] if with_state else [])
    results = []
    for mode in ("chunk", "recurrent"):
        o, S = kda(*xs, initial_state=init, output_final_state=True, mode=mode)
        # A loss that weights every output and state entry differently, so every gradient path is exercised.
        loss = (o * torch.cos(o.detach() * 3)).sum() + (S * torch.sin(S.detach())).sum()
        results.append([o, S, *torch.autograd.grad(loss, leaves)])
    for got, want in zip(*results):
        assert _rel_rms(got, want) < 1e-5


def test_chunk_matches_recurrent_fp32_head_dim_64():
    # The benchmark's head size (K = V = 64, chunk 64) over two and a bit chunks, state in and out.
    *xs, S0 = _inputs(B=1, T=130, H=2, K=64, V=64, seed=2, requires_grad=True)
    results = []
    for mode in ("chunk", "recurrent"):
        o, S = kda(*xs, initial_state=S0, output_final_state=True, mode=mode)
        loss = (o * torch.cos(o.detach() * 3)).sum() + (S * torch.sin(S.detach())).sum()
        results.append([o, S, *torch.autograd.grad(loss, [*xs, S0])])
    for got, want in zip(*results):
        assert _rel_rms(got, want) < 1e-5


def test_chunk_backward_reuses_the_forward(monkeypatch):
    # The registered backward reads what the forward saved: one forward per training step, not two.
    calls = []
    forward = kda_kernels.kda_chunk_fwd
    monkeypatch.setattr(kda_kernels, "kda_chunk_fwd", lambda *a: calls.append(1) or forward(*a))
    *xs, S0 = _inputs(T=20, requires_grad=True)
    o, S = kda(*xs, initial_state=S0, output_final_state=True, chunk_size=8)
    (o.sum() + S.sum()).backward()
    assert len(calls) == 1
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in [*xs, S0])


def test_long_sequence_path_through_the_op(monkeypatch):
    # Blocks of one chunk: the op's fake declares ChunkStates, and values and gradients still equal the
    # recurrence (the backward recomputes what the forward did not keep).
    monkeypatch.setattr(kda_kernels, "_BLOCK_CHUNK_HEADS", 1)
    *xs, S0 = _inputs(T=70, requires_grad=True)
    out = torch.ops.k3.kda_chunk.default(*xs, None, S0, 16)
    fake = torch.ops.k3.kda_chunk.default(*(x.to("meta") for x in xs), None, S0.to("meta"), 16)
    assert len(out) == len(fake) == 4 and [t.shape for t in out] == [t.shape for t in fake]
    results = []
    for mode in ("chunk", "recurrent"):
        o, S = kda(*xs, initial_state=S0, output_final_state=True, mode=mode, chunk_size=16)
        loss = (o * torch.cos(o.detach() * 3)).sum() + (S * torch.sin(S.detach())).sum()
        results.append([o, S, *torch.autograd.grad(loss, [*xs, S0])])
    for got, want in zip(*results):
        assert _rel_rms(got, want) < 1e-5


def test_recurrent_matches_naive_fp32():
    *xs, S0 = _inputs(T=40)
    o, S = kda(*xs, initial_state=S0, output_final_state=True, mode="recurrent")
    o_n, S_n = kda_naive(*(t.double() for t in xs), None, S0.double())
    assert _rel_rms(o, o_n) < 1e-6 and _rel_rms(S, S_n) < 1e-6


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradcheck_float64(mode):
    inputs = _inputs(B=1, T=5, H=1, K=4, V=3, dtype=F64, requires_grad=True)

    def f(q, k, v, g, beta, S0):
        return kda(q, k, v, g, beta, scale=0.7, initial_state=S0, output_final_state=True, mode=mode, chunk_size=4)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("T,chunk_size", [(10, 16), (40, 32)])
def test_gradcheck_float64_chunk_levels(T, chunk_size):
    # chunk 16 exercises the 8x8 base blocks and one halving level, chunk 32 two levels, two chunks and padding.
    inputs = _inputs(B=1, T=T, H=1, K=2, V=2, dtype=F64, seed=5, requires_grad=True)
    f = lambda *a: kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=chunk_size)  # noqa: E731
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def test_gradcheck_float64_decode_gate_conv():
    q, k, v, g, beta, S0 = _inputs(B=1, T=1, H=2, K=3, V=2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: kda_decode_step(*a, scale=0.5), (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    )
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(1, 2, 2, 3, generator=gen, dtype=F64, requires_grad=True)
    A = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)
    dt = torch.randn(6, generator=gen, dtype=F64, requires_grad=True)
    for form in ("lower_bounded_sigmoid", "softplus"):
        assert torch.autograd.gradcheck(lambda f, A, dt: kda_gate(f, A, dt, form, -5.0), (f, A, dt))
    x = torch.randn(1, 3, 2, generator=gen, dtype=F64, requires_grad=True)
    w = torch.randn(2, 3, generator=gen, dtype=F64, requires_grad=True)
    s = torch.randn(1, 2, 2, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, s: short_conv(x, w, s, True), (x, w, s))


def test_decode_steps_equal_recurrent_and_chunk():
    *xs, S0 = _inputs(T=6)
    o_seq, S_seq = kda(*xs, initial_state=S0, output_final_state=True, chunk_size=4)
    S, outs = S0, []
    for t in range(6):
        o, S = kda_decode_step(*(x[:, t] for x in xs), S)
        outs.append(o)
    assert _rel_rms(torch.stack(outs, 1), o_seq) < 1e-5 and _rel_rms(S, S_seq) < 1e-5
    assert S.dtype == torch.float32


def test_wrapper_contract():
    *xs, _ = _inputs(T=3)
    o, S = kda(*xs)
    assert S is None and o.shape == (2, 3, 2, 16) and o.is_contiguous()
    torch.testing.assert_close(kda(*xs, scale=16**-0.5)[0], o)
    with pytest.raises(ValueError, match="mode"):
        kda(*xs, mode="parallel")
    with pytest.raises(ValueError, match="decay form"):
        kda_gate(xs[3], torch.zeros(2), torch.zeros(32), "relu")


def test_bf16_inputs():
    *xs, S0 = _inputs(T=33, dtype=torch.bfloat16, requires_grad=True)
    o, S = kda(*xs, initial_state=S0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    grads = torch.autograd.grad(o.float().sum() + S.sum(), [*xs, S0])
    assert all(gr.dtype == torch.bfloat16 for gr in grads)
    leaves32 = [x.detach().float().requires_grad_() for x in [*xs, S0]]
    o32, S32 = kda(*leaves32[:5], initial_state=leaves32[5], output_final_state=True)
    grads32 = torch.autograd.grad(o32.sum() + S32.sum(), leaves32)
    assert _rel_rms(o, o32) < 1e-2 and _rel_rms(S, S32) < 1e-5
    for gr, gr32 in zip(grads, grads32):
        assert _rel_rms(gr, gr32) < 1e-2


def test_short_conv_op_matches_loop_and_state():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 6, generator=gen), torch.randn(6, 4, generator=gen)
    s0 = torch.randn(2, 6, 3, generator=gen)
    y, s = short_conv(x, w, s0, output_final_state=True)
    y_n, s_n = short_conv_naive(x, w, s0)
    torch.testing.assert_close(y, y_n)
    torch.testing.assert_close(s, s_n)
    assert short_conv(x, w)[1] is None
    assert short_conv(x.bfloat16(), w.bfloat16())[0].dtype == torch.bfloat16


def test_meta_shapes():
    m = dict(device="meta")
    q, k, g = (torch.empty(2, 70, 4, 8, **m, dtype=torch.bfloat16) for _ in range(3))
    v, beta = torch.empty(2, 70, 4, 6, **m, dtype=torch.bfloat16), torch.empty(2, 70, 4, **m)
    for mode in ("chunk", "recurrent"):
        o, S = kda(q, k, v, g, beta, output_final_state=True, mode=mode)
        assert o.shape == (2, 70, 4, 6) and o.dtype == torch.bfloat16
        assert S.shape == (2, 4, 8, 6) and S.dtype == torch.float32 and S.device.type == "meta"
    o, S = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], torch.empty(2, 4, 8, 6, **m))
    assert o.shape == (2, 4, 6) and S.shape == (2, 4, 8, 6)
    gate = kda_gate(g, torch.empty(4, **m), torch.empty(32, **m), "softplus")
    assert gate.shape == g.shape and gate.dtype == torch.float32
    y, s = short_conv(torch.empty(2, 70, 32, **m), torch.empty(32, 4, **m), output_final_state=True)
    assert y.shape == (2, 70, 32) and s.shape == (2, 32, 3)


def _all_ops(q, k, v, f, beta, x, w):
    g = kda_gate(f, torch.zeros(2), torch.zeros(32), "lower_bounded_sigmoid", -5.0)
    o1, S = kda(q, k, v, g, beta, output_final_state=True, chunk_size=8)
    o2, _ = kda(q, k, v, g, beta, mode="recurrent")
    o3, _ = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)
    y, _ = short_conv(x, w)
    return o1.sum() + o2.sum() + o3.sum() + y.sum()


def _traced_inputs():
    q, k, v, g, beta, _ = _inputs(B=1, T=5, H=2, K=16, V=4)
    gen = torch.Generator().manual_seed(1)
    return q, k, v, g, beta, torch.randn(1, 5, 6, generator=gen), torch.randn(6, 3, generator=gen)


def test_symbolic_trace_and_compile():
    args = _traced_inputs()
    gm = torch.fx.symbolic_trace(_all_ops)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("kda_chunk", "kda_recurrent", "kda_decode_step", "kda_gate", "short_conv"):
        assert getattr(torch.ops.k3, name).default in targets
    torch.testing.assert_close(gm(*args), _all_ops(*args))
    q = args[0].clone().requires_grad_()
    out = torch.compile(_all_ops, fullgraph=True, backend="aot_eager")(q, *args[1:])
    torch.testing.assert_close(out, _all_ops(*args))
    out.backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("ops_cpu_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.kda_flops(1, 4096, 8, 64, 64) == 8 * (6 * 4096 * 64**2 + 3 * 4096 * 64 * 64 + 4096 * 64**2)
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "kda chunk fwd" in out and "kda recurrent fwd" in out and "matmul" in out


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("with_state", [False, True])
def test_zero_tokens_give_no_output_and_the_state_unchanged(mode, with_state):
    """As the recurrence over no step: an empty output and the initial state (a copy, never the input itself)."""
    *xs, S0 = _inputs(T=0, requires_grad=True)
    o, S = kda(*xs, initial_state=S0 if with_state else None, output_final_state=True, mode=mode)
    assert o.shape == (2, 0, 2, 16) and o.dtype == xs[2].dtype
    assert torch.equal(S, S0 if with_state else torch.zeros_like(S0)) and S.data_ptr() != S0.data_ptr()
    if with_state:
        (S * 2).sum().backward()
        assert torch.equal(S0.grad, torch.full_like(S0, 2.0))  # the state passes straight through
        assert all(x.grad is None or x.grad.shape == x.shape for x in xs)
    o_naive, S_naive = kda_naive(*xs, None, S0 if with_state else None)
    assert o_naive.shape == o.shape and torch.equal(S_naive, S.detach())


def test_short_conv_over_zero_tokens_keeps_its_state():
    x = torch.randn(2, 0, 6)
    weight, state = torch.randn(6, 4), torch.randn(2, 6, 3)
    y, new = short_conv(x, weight, state, output_final_state=True)
    assert y.shape == (2, 0, 6) and torch.equal(new, state) and new.data_ptr() != state.data_ptr()
