"""Triton MoE router (route, linear_route; forward and backward) against `route_ref`, `linear_route_ref`, autograd."""

import pytest
import torch

from k3compile.kernels.moe import triton as rt
from k3compile.kernels.fused.reference import linear_route_ref
from k3compile.kernels.moe.reference import route_ref
from k3compile.kernels._common.compare import rel_rms as _rel_rms


def _small_blocks(monkeypatch):
    """Two tokens per program, so T = 13 spans several programs and a ragged last one."""
    monkeypatch.setattr(rt, "launch_config", lambda name, device, defaults, **sizes: {**defaults, "BLOCK_T": 2})


def _check_forward(got, want, fwd_tol):
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
    assert torch.equal(got[1], want[1])
    assert _rel_rms(got[0], want[0]) <= fwd_tol
    assert _rel_rms(got[2], want[2]) <= fwd_tol


def _cotangents(weights, scores, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(weights.shape, generator=g), torch.randn(scores.shape, generator=g)]


def _check_route(logits, bias, top_k, scoring, renormalize, scale, fwd_tol=1e-6, bwd_tol=1e-5):
    got = rt.route(logits, bias, top_k, scoring, renormalize, scale)
    leaf = logits.clone().requires_grad_()
    want = route_ref(leaf, bias, top_k, scoring, renormalize, scale)
    _check_forward(got, want, fwd_tol)
    grads = _cotangents(want[0], want[2])
    (ref,) = torch.autograd.grad((want[0] * grads[0]).sum() + (want[2] * grads[1]).sum(), leaf)
    (dlogits,) = rt.route_bwd(grads, logits, bias, top_k, scoring, renormalize, scale)
    assert dlogits.shape == logits.shape and dlogits.dtype == logits.dtype
    assert _rel_rms(dlogits, ref) <= bwd_tol


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("top_k", [3, 4])
def test_route_matches_reference_and_autograd(scoring, renormalize, with_bias, top_k, monkeypatch):
    # E = 40 is not a power of two (padded to 64); T = 13 with two tokens per program leaves a ragged block.
    _small_blocks(monkeypatch)
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(13, 40, generator=g) * 2
    bias = torch.randn(40, generator=g) * 0.1 if with_bias else None
    _check_route(logits, bias, top_k, scoring, renormalize, 2.5)


def test_route_wide_row_top16_and_leading_dims():
    # E = 1000 (a 1024 row in registers), K = 16, logits [B, T, E].
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 1000, generator=g)
    _check_route(logits, torch.randn(1000, generator=g) * 0.05, 16, "sigmoid", True, 2.827)
    _check_route(logits, None, 16, "softmax", False, 1.0)


def test_route_ties_pick_the_lowest_index_first():
    # All-equal scores (logit 0 -> 0.5), then a row where experts 1 and 5 tie for second place behind 3.
    logits = torch.zeros(2, 8)
    logits[1, 3], logits[1, 1], logits[1, 5] = 2.0, 1.0, 1.0
    weights, indices, _ = rt.route(logits, None, 3, "sigmoid", False, 1.0)
    assert indices.tolist() == [[0, 1, 2], [3, 1, 5]]
    assert weights[0].tolist() == [0.5, 0.5, 0.5]


def test_route_no_tokens():
    weights, indices, scores = rt.route(torch.zeros(0, 40), None, 4, "sigmoid", True, 1.0)
    assert weights.shape == (0, 4) and indices.shape == (0, 4) and scores.shape == (0, 40)
    (dlogits,) = rt.route_bwd([weights, scores], torch.zeros(0, 40), None, 4, "sigmoid", True, 1.0)
    assert dlogits.shape == (0, 40)


def test_route_bf16_logits(monkeypatch):
    # Distinct logits exactly representable in bf16 (multiples of 1/16), so no ties in the choice.
    _small_blocks(monkeypatch)
    g = torch.Generator().manual_seed(4)
    logits = ((torch.stack([torch.randperm(40, generator=g) for _ in range(13)]) - 20) / 16).to(torch.bfloat16)
    _check_route(logits, None, 4, "sigmoid", True, 2.5, 1e-6, 1e-2)
    _check_route(logits, torch.randn(40, generator=g).to(torch.bfloat16) * 0.1, 3, "softmax", False, 1.0, 1e-6, 1e-2)


def _check_linear_route(x, weight, bias, top_k, scoring, renormalize, scale, fwd_tol, bwd_tol):
    got = rt.linear_route(x, weight, bias, top_k, scoring, renormalize, scale)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    want = linear_route_ref(*leaves, bias, top_k, scoring, renormalize, scale)
    _check_forward(got, want, fwd_tol)
    grads = _cotangents(want[0], want[2])
    ref = torch.autograd.grad((want[0] * grads[0]).sum() + (want[2] * grads[1]).sum(), leaves)
    got_grads = rt.linear_route_bwd(grads, x, weight, bias, top_k, scoring, renormalize, scale)
    assert len(got_grads) == 2
    for grad, r, arg in zip(got_grads, ref, (x, weight)):
        assert grad.shape == arg.shape and grad.dtype == arg.dtype
        assert _rel_rms(grad, r) <= bwd_tol


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_linear_route_matches_reference_and_autograd(scoring, monkeypatch):
    _small_blocks(monkeypatch)
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(2, 7, 100, generator=g), torch.randn(40, 100, generator=g) * 0.1
    _check_linear_route(x, weight, torch.randn(40, generator=g) * 0.1, 4, scoring, True, 2.5, 1e-6, 1e-5)


def test_linear_route_bf16():
    # bf16 x and W give bf16 logits in both (same matmul); a fp32 bias keeps the choice free of ties.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(13, 64, generator=g).to(torch.bfloat16)
    weight = (torch.randn(40, 64, generator=g) * 0.1).to(torch.bfloat16)
    _check_linear_route(x, weight, torch.randn(40, generator=g) * 0.1, 3, "sigmoid", True, 1.0, 1e-6, 1e-2)
