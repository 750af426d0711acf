"""GPU bench cases for the norm and GLU Triton kernels (kernels/norms/triton.py, kernels/activations/triton.py).

All memory-bound: GB/s counts each tensor read or written once (bf16, 2 bytes an element); the weight
gradient's fp32 partial rows are scratch, not counted. FLOPs are rough per-element counts, for the record.
K3 shapes: 16384 tokens; hidden 7168 for the block norms, 32 KDA heads x 128 for the per-head norms,
SiTU-GLU / SwiGLU on a 16384 x 18432 gate and up (a 2 x 18432 gate_up projection's two halves).
Backward references are torch.autograd.grad through the PyTorch reference with the same cotangents.
"""

from __future__ import annotations

import torch
from gpu_case import GpuCase

from k3compile.kernels.activations import reference as act_ref
from k3compile.kernels.activations import triton as act_tri
from k3compile.kernels.norms import reference as norm_ref
from k3compile.kernels.norms import triton as norm_tri

EPS = 1e-5
BETA1, BETA2 = 4.0, 25.0
RTOL = 1e-2  # bf16 outputs: a last-bit rounding difference is ~4e-3 relative


def _grad_ref(fn, args: list[torch.Tensor], cotangents: list[torch.Tensor]):
    """A closure: torch.autograd.grad of fn(*args) (args re-leafed once, up front) with these cotangents."""
    leaves = [a.detach().requires_grad_() for a in args]

    def run():
        out = fn(*leaves)
        outs = list(out) if isinstance(out, tuple) else [out]
        return torch.autograd.grad(outs, leaves, cotangents[: len(outs)])

    return run


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    """Forward and backward of every norm and GLU kernel at K3 shapes (tiny ones with dry_run)."""
    T, D, H, K, F = (8, 100, 3, 37, 100) if dry_run else (16384, 7168, 32, 128, 18432)
    dt, e = torch.bfloat16, 2
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    x, res, dy, ds, w = randn(T, D), randn(T, D), randn(T, D), randn(T, D), randn(D)
    xh, gh, dyh, wh = randn(T, H, K), randn(T, H, K), randn(T, H, K), randn(K)
    g, u, dyg = randn(T, F), randn(T, F), randn(T, F)
    nd, nh, nf = T * D, T * H * K, T * F
    name = f"{T}x{D} bf16"
    head = f"{T}x{H}x{K} bf16"
    glu = f"{T}x{F} bf16"

    return [
        GpuCase(f"rms_norm {name}", lambda: norm_tri.rms_norm(x, w, EPS), lambda: norm_ref.rms_norm_ref(x, w, EPS),
                flops=4.0 * nd, bytes=float(e * (2 * nd + D)), rtol=RTOL),
        GpuCase(f"add_rms_norm {name}", lambda: norm_tri.add_rms_norm(x, res, w, EPS),
                lambda: norm_ref.add_rms_norm_ref(x, res, w, EPS), flops=5.0 * nd, bytes=float(e * (4 * nd + D)),
                rtol=RTOL),
        GpuCase(f"l2_norm {head}", lambda: norm_tri.l2_norm(xh, EPS), lambda: norm_ref.l2_norm_ref(xh, EPS),
                flops=3.0 * nh, bytes=float(e * 2 * nh), rtol=RTOL),
        GpuCase(f"rms_norm_gate {head}", lambda: norm_tri.rms_norm_gate(xh, wh, gh, EPS),
                lambda: norm_ref.rms_norm_gate_ref(xh, wh, gh, EPS), flops=9.0 * nh, bytes=float(e * (3 * nh + K)),
                rtol=RTOL),
        GpuCase(f"rms_norm_bwd {name}", lambda: norm_tri.rms_norm_bwd([dy], x, w, EPS),
                _grad_ref(lambda *a: norm_ref.rms_norm_ref(*a, EPS), [x, w], [dy]),
                flops=10.0 * nd, bytes=float(e * (3 * nd + 2 * D)), rtol=RTOL),
        GpuCase(f"add_rms_norm_bwd {name}", lambda: norm_tri.add_rms_norm_bwd([dy, ds], x, res, w, EPS),
                _grad_ref(lambda *a: norm_ref.add_rms_norm_ref(*a, EPS), [x, res, w], [dy, ds]),
                flops=12.0 * nd, bytes=float(e * (6 * nd + 2 * D)), rtol=RTOL),
        GpuCase(f"l2_norm_bwd {head}", lambda: norm_tri.l2_norm_bwd([dyh], xh, EPS),
                _grad_ref(lambda *a: norm_ref.l2_norm_ref(*a, EPS), [xh], [dyh]),
                flops=8.0 * nh, bytes=float(e * 3 * nh), rtol=RTOL),
        GpuCase(f"rms_norm_gate_bwd {head}", lambda: norm_tri.rms_norm_gate_bwd([dyh], xh, wh, gh, EPS),
                _grad_ref(lambda *a: norm_ref.rms_norm_gate_ref(*a, EPS), [xh, wh, gh], [dyh]),
                flops=20.0 * nh, bytes=float(e * (5 * nh + 2 * K)), rtol=RTOL),
        GpuCase(f"situ_glu {glu}", lambda: act_tri.situ_glu(g, u, BETA1, BETA2),
                lambda: act_ref.situ_glu_ref(g, u, BETA1, BETA2), flops=30.0 * nf, bytes=float(e * 3 * nf),
                rtol=RTOL),
        GpuCase(f"swiglu {glu}", lambda: act_tri.swiglu(g, u), lambda: act_ref.swiglu_ref(g, u),
                flops=8.0 * nf, bytes=float(e * 3 * nf), rtol=RTOL),
        GpuCase(f"situ_glu_bwd {glu}", lambda: act_tri.situ_glu_bwd([dyg], g, u, BETA1, BETA2),
                _grad_ref(lambda *a: act_ref.situ_glu_ref(*a, BETA1, BETA2), [g, u], [dyg]),
                flops=45.0 * nf, bytes=float(e * 5 * nf), rtol=RTOL),
        GpuCase(f"swiglu_bwd {glu}", lambda: act_tri.swiglu_bwd([dyg], g, u),
                _grad_ref(act_ref.swiglu_ref, [g, u], [dyg]), flops=14.0 * nf, bytes=float(e * 5 * nf), rtol=RTOL),
    ]
