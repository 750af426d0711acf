"""PerHeadMuon against torch.optim.Muon / AdamW run on the same blocks, QK-clip against hand-computed factors."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from k3compile.runtime.muon import (
    NS_COEFFICIENTS,
    PerHeadMuon,
    default_use_muon,
    muon_precision,
    native_bf16_matmul,
    newton_schulz,
    qk_clip_,
)

STEPS = 4


def _params(*shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(shapes, steps=STEPS, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


def _run(opt, params, grads, **step_kw):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step(**step_kw)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_one_block_matches_torch_muon(nesterov, adjust_lr_fn):
    shapes = [(12, 20), (24, 8)]  # wide and tall (NS runs on the transpose)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref_p, our_p = _params(*shapes), _params(*shapes)
    grads = _grads(shapes)
    _run(torch.optim.Muon(ref_p, **kw), ref_p, grads)
    _run(PerHeadMuon(our_p, **kw), our_p, grads)
    for r, o in zip(ref_p, our_p):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-6)


def test_newton_schulz_matches_torch_and_is_near_orthogonal():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(16, 40, generator=torch.Generator().manual_seed(3))
    ours = newton_schulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(ours, _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7))
    sv = torch.linalg.svdvals(ours.float())
    assert sv.min() > 0.5 and sv.max() < 1.5  # the quintic's band, not exactly 1


def test_batched_newton_schulz_is_matrix_by_matrix():
    g = torch.randn(5, 24, 10, generator=torch.Generator().manual_seed(4))  # tall: each runs on its transpose
    batched = newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
    assert batched.shape == g.shape and batched.dtype == torch.float32
    for m, o in zip(g, batched):
        torch.testing.assert_close(o, newton_schulz(m, NS_COEFFICIENTS, 5, 1e-7, torch.float32), rtol=1e-5, atol=1e-6)


def test_fp32_blocks_of_one_shape_are_batched_across_parameters(monkeypatch):
    import k3compile.runtime.muon as muon

    calls = []
    real = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda g, *a, **kw: calls.append(tuple(g.shape)) or real(g, *a, **kw))
    ps = _params((8, 12), (2, 8, 12), (16, 12))  # 1 + 2 + 2 blocks of 8 x 12 (the last cut in two heads)
    opt = PerHeadMuon([{"params": ps[:2]}, {"params": ps[2:], "head_split": 2}], ns_dtype=torch.float32)
    _run(opt, ps, _grads([p.shape for p in ps], steps=1))
    assert calls == [(5, 8, 12)]


@pytest.mark.parametrize("shape", [(6, 16, 40), (3, 48, 20)])
def test_fp32_and_bf16_newton_schulz_agree_to_bf16_tolerance(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    o32 = newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
    o16 = newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, torch.bfloat16)
    assert o32.dtype == torch.float32
    # bf16 carries 8 bits; five iterations of rounding leave the two within a few of its ulps (2^-8 = 0.4%)
    rel = torch.linalg.matrix_norm(o16.float() - o32) / torch.linalg.matrix_norm(o32)
    assert rel.max() < 3e-2
    assert not torch.equal(o16.float(), o32)  # really two precisions
    sv = torch.linalg.svdvals(o32)
    assert sv.min() > 0.5 and sv.max() < 1.5


def test_fp32_and_bf16_steps_agree_to_bf16_tolerance():
    shapes = [(24, 16), (3, 8, 12), (16, 16)]
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    p16, p32 = _params(*shapes), _params(*shapes)
    start = [p.detach().clone() for p in p16]
    grads = _grads(shapes)
    groups = lambda ps: [{"params": ps[:1], "head_split": 4}, {"params": ps[1:2], "head_split": 2}, {"params": ps[2:]}]
    _run(PerHeadMuon(groups(p16), **kw), p16, grads)
    _run(PerHeadMuon(groups(p32), ns_dtype=torch.float32, **kw), p32, grads)
    for a, b, p0 in zip(p16, p32, start):
        moved = torch.linalg.vector_norm(b.detach() - p0)
        assert torch.linalg.vector_norm(a.detach() - b.detach()) < 3e-2 * moved


def test_muon_precision_choice(monkeypatch):
    assert muon_precision("bf16") == (torch.bfloat16, "Muon's Newton-Schulz in bf16 (training.muon_precision)")
    assert muon_precision("fp32")[0] == torch.float32
    native, why = native_bf16_matmul("cpu")
    dtype, line = muon_precision("auto")
    assert dtype == (torch.bfloat16 if native else torch.float32) and why in line
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # what a CPU without AVX512_BF16 or AMX gets anyway
    assert muon_precision("auto")[0] == torch.float32
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert native_bf16_matmul("cpu") == (False, f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
                                                "no AVX512_BF16 or AMX")
    with pytest.raises(ValueError):
        muon_precision("fp16")


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_head_split_equals_muon_per_head(adjust_lr_fn):
    H, dh, D = 4, 6, 16
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn=adjust_lr_fn)
    (w,) = _params((H * dh, D))
    heads = [nn.Parameter(w.detach()[h * dh : (h + 1) * dh].clone()) for h in range(H)]
    grads = _grads([(H * dh, D)])
    _run(PerHeadMuon([{"params": [w], "head_split": H}], **kw), [w], grads)
    head_grads = [[g[h * dh : (h + 1) * dh] for h in range(H)] for (g,) in grads]
    _run(torch.optim.Muon(heads, **kw), heads, head_grads)
    torch.testing.assert_close(w.detach(), torch.cat([h.detach() for h in heads]), rtol=0, atol=1e-6)
    # and it is not the whole-matrix update
    (whole,) = _params((H * dh, D))
    _run(PerHeadMuon([whole], **kw), [whole], grads)
    assert (whole - w).abs().max() > 1e-3


def test_uneven_split_and_stacked_experts_equal_muon_per_block():
    sizes, D, E = (4, 8, 12), 10, 3
    kw = dict(lr=0.01, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    w, x = _params((sum(sizes), D), (E, 6, D))
    grads = _grads([w.shape, x.shape])
    opt = PerHeadMuon([{"params": [w], "head_split": sizes}, {"params": [x], "head_split": 2}], **kw)
    refs = [nn.Parameter(b.detach().clone()) for b in torch.split(w.detach(), sizes)]
    refs += [nn.Parameter(b.detach().clone()) for e in x.detach() for b in torch.split(e, 3)]
    ref_grads = [[*torch.split(gw, sizes), *[b for e in gx for b in torch.split(e, 3)]] for gw, gx in grads]
    _run(opt, [w, x], grads)
    _run(torch.optim.Muon(refs, **kw), refs, ref_grads)
    torch.testing.assert_close(w.detach(), torch.cat([r.detach() for r in refs[:3]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(x.detach(), torch.stack(refs[3:]).detach().view(E, 6, D), rtol=0, atol=1e-6)


@pytest.mark.parametrize("betas,wd", [((0.9, 0.999), 0.01), ((0.9, 0.95), 0.1)])
def test_vectors_follow_torch_adamw(betas, wd):
    shapes = [(7,), (5, 3), ()]  # a vector, an embedding-like matrix routed to AdamW explicitly, a scalar
    ref_p, our_p = _params(*shapes), _params(*shapes)
    grads = _grads(shapes)
    _run(torch.optim.AdamW(ref_p, lr=3e-3, betas=betas, eps=1e-8, weight_decay=wd), ref_p, grads)
    opt = PerHeadMuon([{"params": our_p, "use_muon": False}], lr=0.02, adamw_lr=3e-3, betas=betas,
                      adamw_weight_decay=wd)
    _run(opt, our_p, grads)
    for r, o in zip(ref_p, our_p):
        assert torch.equal(o, r)


class _Tiny(nn.Module):
    def __init__(self, d=16, H=4, dh=4, V=11):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.q_proj = nn.Linear(d, H * dh, bias=False)
        self.k_proj = nn.Linear(d, H * dh, bias=False)
        self.v_proj = nn.Linear(d, H * dh, bias=True)
        self.o_proj = nn.Linear(H * dh, d, bias=False)
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)


def test_from_named_parameters_routing():
    m = _Tiny()
    opt = PerHeadMuon.from_named_parameters(m.named_parameters(), head_splits={"[qkv]_proj.weight": 4}, lr=0.01)
    kind = {id(p): (g["use_muon"], g.get("head_split")) for g in opt.param_groups for p in g["params"]}
    assert kind[id(m.q_proj.weight)] == kind[id(m.v_proj.weight)] == (True, 4)
    assert kind[id(m.o_proj.weight)] == (True, 1)
    for p in (m.embed.weight, m.lm_head.weight, m.norm.weight, m.v_proj.bias):
        assert kind[id(p)] == (False, None)
    assert not default_use_muon("layers.0.attn.q_conv.weight", torch.empty(8, 4))
    assert default_use_muon("layers.0.moe.experts.up_proj.weight", torch.empty(2, 8, 4))
    names = PerHeadMuon.from_named_parameters(m.named_parameters(), use_muon={"o_proj.weight"})
    assert [len(g["params"]) for g in names.param_groups] == [1, 7]
    with pytest.raises(ValueError):
        PerHeadMuon.from_named_parameters(m.named_parameters(), head_splits={"norm.weight": 2})


def test_mixed_model_matches_muon_plus_adamw():
    m, ref = _Tiny(), _Tiny()
    ref.load_state_dict(m.state_dict())
    opt = PerHeadMuon.from_named_parameters(m.named_parameters(), lr=0.02, adamw_lr=1e-3, betas=(0.9, 0.95))
    mats = [p for n, p in ref.named_parameters() if default_use_muon(n, p)]
    rest = [p for n, p in ref.named_parameters() if not default_use_muon(n, p)]
    r_muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    r_adam = torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        tok = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(step))
        for model, opts in ((m, [opt]), (ref, [r_muon, r_adam])):
            h = model.embed(tok)
            a = model.o_proj(model.q_proj(h) * model.k_proj(h) + model.v_proj(h))
            model.lm_head(model.norm(h + a)).logsumexp(-1).sum().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)


def test_bf16_momentum_buffer_is_not_normalised_in_place():
    # torch.optim.Muon divides a bf16 buffer by its norm in place when nesterov=False; we must not.
    (p,) = _params((8, 16), dtype=torch.bfloat16)
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(5)).bfloat16()
    opt = PerHeadMuon([p], lr=0.01, momentum=0.9, nesterov=False)
    p.grad = g
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(g).lerp_(g, 0.1))


def _naive_head_factors(max_logits, tau):
    return [math.sqrt(tau / m) if m > tau else 1.0 for m in max_logits]


def test_qk_clip_scales_only_offending_heads():
    H, dq, dk, D, tau = 4, 3, 2, 5, 100.0
    w_q, w_k = _params((H * dq, D), (H * dk, D))
    q0, k0 = w_q.detach().clone(), w_k.detach().clone()
    max_logits = torch.tensor([50.0, 150.0, 100.0, 400.0])  # head 2 equals tau: not clipped
    f = qk_clip_(w_q, w_k, max_logits, tau, dq, dk)
    want = _naive_head_factors(max_logits.tolist(), tau)
    assert f.tolist() == pytest.approx(want, rel=1e-7) and want[3] == 0.5
    for h in range(H):
        rq, rk = slice(h * dq, (h + 1) * dq), slice(h * dk, (h + 1) * dk)
        if want[h] == 1.0:
            assert torch.equal(w_q[rq], q0[rq]) and torch.equal(w_k[rk], k0[rk])
        else:
            torch.testing.assert_close(w_q[rq], q0[rq] * want[h], rtol=1e-6, atol=0)
            torch.testing.assert_close(w_k[rk], k0[rk] * want[h], rtol=1e-6, atol=0)


def test_qk_clip_brings_max_logit_to_tau():
    H, d, D, T, tau = 3, 4, 8, 6, 30.0
    w_q, w_k = (torch.randn(H * d, D, generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    w_q *= torch.tensor([0.05, 3.0, 3.0]).repeat_interleave(d)[:, None]  # head 0 stays under tau
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(9))

    def head_max(wq, wk):
        rows = [slice(h * d, (h + 1) * d) for h in range(H)]
        return torch.stack([((x @ wq[r].T) @ (x @ wk[r].T).T).max() for r in rows])

    before = head_max(w_q, w_k)
    assert before[0] < tau < before[1:].min()
    qk_clip_(w_q, w_k, before, tau, d, d)
    after = head_max(w_q, w_k)
    torch.testing.assert_close(after, torch.tensor([before[0].item(), tau, tau]), rtol=1e-5, atol=0)


def test_qk_clip_on_fused_view_and_bf16():
    H, dn, dv, r = 2, 3, 2, 4
    w = torch.randn(H * (dn + dv), r).bfloat16()
    w0 = w.clone()
    k_view = w.view(H, dn + dv, r)[:, :dn]
    q = torch.ones(H * 2, r, dtype=torch.bfloat16)
    qk_clip_(q, k_view, torch.tensor([400.0, 1.0]), 100.0, 2, dn)
    blocks, blocks0 = w.view(H, dn + dv, r), w0.view(H, dn + dv, r)
    assert torch.equal(blocks[0, :dn], (blocks0[0, :dn].float() * 0.5).bfloat16())
    assert torch.equal(blocks[0, dn:], blocks0[0, dn:]) and torch.equal(blocks[1], blocks0[1])  # v rows untouched
    assert q[:2].eq(0.5).all() and q[2:].eq(1.0).all()
    with pytest.raises(ValueError):
        qk_clip_(torch.ones(8, r), torch.ones(8, r), torch.ones(3), 1.0, 2, 2)


def test_optimizer_qk_clip_integration():
    m = _Tiny()
    kw = dict(head_splits={"[qkv]_proj.weight": 4}, lr=0.01, qk_clip_tau=10.0,
              qk_clip_pairs={"attn": ("q_proj.weight", "k_proj.weight")})
    ref = copy.deepcopy(m)
    opt = PerHeadMuon.from_named_parameters(m.named_parameters(), **kw)
    ref_opt = PerHeadMuon.from_named_parameters(ref.named_parameters(), **kw)
    for model in (m, ref):
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 0.1
    logits = torch.tensor([5.0, 40.0, 10.0, 12.5])
    opt.step(max_logits={"attn": logits})
    ref_opt.step()
    qk_clip_(ref.q_proj.weight, ref.k_proj.weight, logits, 10.0, 4, 4)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt.qk_clip_({"attn": torch.tensor([1.0, 1.0, 1.0, 1.0])})["attn"].tolist() == [1.0] * 4


def test_state_dict_round_trip_continues_identically():
    m = _Tiny()
    kw = dict(head_splits={"[qkv]_proj.weight": 4, "o_proj.weight": (4, 4, 8)}, lr=0.02, adamw_lr=2e-3)
    opt = PerHeadMuon.from_named_parameters(m.named_parameters(), **kw)
    shapes = [p.shape for p in m.parameters()]
    grads = _grads(shapes, steps=4, seed=11)
    _run(opt, list(m.parameters()), grads[:2])
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    m2 = _Tiny()
    m2.load_state_dict(saved["model"])
    opt2 = PerHeadMuon.from_named_parameters(m2.named_parameters(), **kw)
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[1]["head_split"] == (4, 4, 8)
    _run(opt, list(m.parameters()), grads[2:])
    _run(opt2, list(m2.parameters()), grads[2:])
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    for k in sd["state"]:
        for name, v in sd["state"][k].items():
            assert torch.equal(v, sd2["state"][k][name]), (k, name)


def test_validation_errors():
    with pytest.raises(ValueError):
        PerHeadMuon([{"params": _params((10, 4)), "head_split": 3}])
    with pytest.raises(ValueError):
        PerHeadMuon([{"params": _params((10, 4)), "head_split": (4, 4)}])
    with pytest.raises(ValueError):
        PerHeadMuon([{"params": _params((4,)), "use_muon": True}])
    with pytest.raises(ValueError):
        PerHeadMuon(_params((4, 4)), adjust_lr_fn="bogus")
    with pytest.raises(ValueError):
        PerHeadMuon(_params((4, 4)), ns_dtype=torch.float16)
    with pytest.raises(ValueError):
        PerHeadMuon([{"params": _params((4, 4), (4,))}])
    with pytest.raises(ValueError):
        PerHeadMuon(_params((4, 4))).qk_clip_({})
