"""GPU bench cases: AttnRes depth softmax and the MoE router (Triton kernels vs the PyTorch references).

K3 shapes: AttnRes over 9 sources (embedding, 7 block summaries, the partial block) of [B*T = 16384, 7168]
bf16; router with T = 16384 tokens, 896 experts, top-16, hidden 7168 (sigmoid scores, selection bias,
renormalised, routed_scale 2.827).
"""

from __future__ import annotations

import torch
from gpu_case import GpuCase

from k3compile.kernels.attn_res import triton as attn_res_triton
from k3compile.kernels.moe import triton as route_triton
from k3compile.kernels.attn_res.reference import attn_res_ref
from k3compile.kernels.fused.reference import linear_route_ref
from k3compile.kernels.moe.reference import route_ref

BF16 = 2  # bytes per element
FP32 = 4
INT64 = 8
# Triton's and torch's sigmoid differ by an ulp or so, and among 16384 random tokens x 17 leading choices
# (scores + bias) some 15-20 pairs lie within two ulps (a few tie exactly): those may come out in either
# order, so the router cases compare (weights, scores) only (tests/kernels/test_route_triton.py checks the
# indices exactly on tie-free inputs), and the swapped pairs move the weights by ~1e-4 in relative RMS at most.
ROUTE_RTOL = 1e-3


def _floats(routed: tuple) -> tuple:
    """(weights, scores) of a router's (weights, indices, scores)."""
    return routed[0], routed[2]


def _attn_res_cases(device: str, S: int, N: int, D: int) -> list[GpuCase]:
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(S, 1, N, D, device=device, generator=g).to(torch.bfloat16)
    query = (torch.randn(D, device=device, generator=g) * 0.02).to(torch.bfloat16)
    norm_weight = torch.ones(D, device=device, dtype=torch.bfloat16)
    g_h = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    eps = 1e-6
    leaves = [t.clone().requires_grad_() for t in (src, query, norm_weight)]

    def reference_bwd():
        return torch.autograd.grad(attn_res_ref(*leaves, eps), leaves, g_h)

    params = 2 * D * BF16
    return [
        GpuCase(
            name=f"attn_res S={S} N={N} D={D} bf16",
            triton=lambda: attn_res_triton.attn_res(src, query, norm_weight, eps),
            reference=lambda: attn_res_ref(src, query, norm_weight, eps),
            flops=6.0 * S * N * D,  # per source element: square, dot, softmax-weighted accumulate
            bytes=float((S + 1) * N * D * BF16 + params),  # read the sources once, write h
            rtol=1e-2,
        ),
        GpuCase(
            name=f"attn_res_bwd S={S} N={N} D={D} bf16",
            triton=lambda: attn_res_triton.attn_res_bwd([g_h], src, query, norm_weight, eps),
            reference=reference_bwd,
            flops=12.0 * S * N * D,
            bytes=float((2 * S + 1) * N * D * BF16 + 2 * params),  # read sources and dh, write dsources
            rtol=1e-2,
        ),
    ]


def _route_cases(device: str, T: int, E: int, K: int, H: int) -> list[GpuCase]:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
    weight = (torch.randn(E, H, device=device, generator=g) * H**-0.5).to(torch.bfloat16)
    bias = torch.randn(E, device=device, generator=g) * 0.01  # fp32: splits the many ties of bf16 logits
    args = (bias, K, "sigmoid", True, 2.827)
    logits = torch.nn.functional.linear(x, weight)
    grads = [torch.randn(T, K, device=device, generator=g), torch.randn(T, E, device=device, generator=g)]
    leaf_logits = logits.clone().requires_grad_()
    leaf_x, leaf_w = x.clone().requires_grad_(), weight.clone().requires_grad_()

    def _vjp(outputs, inputs):
        weights, _, scores = outputs
        return torch.autograd.grad((weights, scores), inputs, grads)

    route_bytes = T * E * BF16 + E * FP32 + T * E * FP32 + T * K * (FP32 + INT64)  # logits in; scores, top-k out
    route_bwd_bytes = T * E * (BF16 + FP32 + BF16) + E * FP32 + T * K * FP32  # logits, g_scores in; dlogits out
    matmul = 2.0 * T * E * H
    return [
        GpuCase(
            name=f"linear_route T={T} H={H} E={E} K={K} bf16",
            triton=lambda: _floats(route_triton.linear_route(x, weight, *args)),
            reference=lambda: _floats(linear_route_ref(x, weight, *args)),
            flops=matmul,
            bytes=float((T * H + E * H) * BF16 + route_bytes),
            rtol=ROUTE_RTOL,
        ),
        GpuCase(
            name=f"route T={T} E={E} K={K} (logits bf16)",
            triton=lambda: _floats(route_triton.route(logits, *args)),
            reference=lambda: _floats(route_ref(logits, *args)),
            flops=float(T * E * (4 + 3 * K)),  # sigmoid, bias add, K rounds of argmax + gather over the row
            bytes=float(route_bytes),
            rtol=ROUTE_RTOL,
        ),
        GpuCase(
            name=f"route_bwd T={T} E={E} K={K} (logits bf16)",
            triton=lambda: route_triton.route_bwd(grads, logits, *args),
            reference=lambda: _vjp(route_ref(leaf_logits, *args), [leaf_logits]),
            flops=float(T * E * (4 + 3 * K + 3)),
            bytes=float(route_bwd_bytes),
            rtol=1e-2,
        ),
        GpuCase(
            name=f"linear_route_bwd T={T} H={H} E={E} K={K} bf16",
            triton=lambda: route_triton.linear_route_bwd(grads, x, weight, *args),
            reference=lambda: _vjp(linear_route_ref(leaf_x, leaf_w, *args), [leaf_x, leaf_w]),
            flops=2 * matmul,  # dx and dW (the recomputed logits are not counted)
            bytes=float((2 * T * H + 2 * E * H) * BF16 + route_bwd_bytes),
            rtol=1e-2,
        ),
    ]


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    """AttnRes forward/backward and router forward/backward; tiny shapes when `dry_run`."""
    if dry_run:
        return _attn_res_cases(device, S=3, N=10, D=64) + _route_cases(device, T=8, E=40, K=4, H=32)
    return _attn_res_cases(device, S=9, N=16384, D=7168) + _route_cases(device, T=16384, E=896, K=16, H=7168)
