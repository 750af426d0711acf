"""GPU bench cases for the MX Triton kernels (kernels/mx/triton.py) against kernels/mx/reference.py's `_fast` functions.

Quantisers are memory-bound: GB/s counts the input read once and the payload + scales (or the fake-quantised
values) written once; FLOPs are a rough 8 integer/float ops per element, for the record. They must match the
reference bit for bit (rtol 0). mx_linear / its backward are FLOP-bound: 2 M N K FLOPs; bytes are x, the MX
weight (4.25 bits a value for MXFP4) and y once each. K3 shapes: 16384 tokens x hidden 7168 activations
(MXFP8 QAT), a 2048 x 7168 MXFP4 weight (QAT fake-quant, and the linear with 4096 tokens).
"""

from __future__ import annotations

import torch
from gpu_case import GpuCase

from k3compile.kernels.mx import reference as mx
from k3compile.kernels.mx import triton as tri

BLOCK = 32
RTOL_BF16 = 1e-2  # bf16 outputs: a last-bit rounding difference is ~4e-3 relative


def _payload_bytes(n: int, fmt: str) -> float:
    """Bytes of an MX payload + E8M0 scales for n values."""
    return n * mx.mx_format(fmt).bits / 8 + n / BLOCK


def cases(device: str, dry_run: bool) -> list[GpuCase]:
    """Quantise / fake-quantise / dequantise and the MX linear forward + backward at K3 shapes."""
    T, D, O, M = (64, 96, 37, 21) if dry_run else (16384, 7168, 2048, 4096)
    dt, e = torch.bfloat16, 2
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    act, weight, x, grad_y = randn(T, D), randn(O, D) * 0.02, randn(M, D), randn(M, O)
    w4, s4 = mx.mx_quantize_fast(weight, "e2m1", BLOCK)
    a8, s8 = mx.mx_quantize_fast(act, "e4m3", BLOCK)
    n_act, n_w = T * D, O * D
    a_name, w_name = f"{T}x{D} bf16", f"{O}x{D} bf16"
    lin_name = f"{M}x{D} bf16 @ mxfp4 {O}x{D}"
    lin_bytes = float(e * M * D + _payload_bytes(n_w, "e2m1") + e * M * O)

    def linear_bwd_ref():
        w = mx.mx_dequantize_fast(w4, s4, "e2m1", BLOCK, torch.float32)
        return (grad_y.float() @ w).to(dt)

    return [
        GpuCase(f"mx_fake_quantize e4m3 {a_name}", lambda: tri.mx_fake_quantize(act, "e4m3", BLOCK),
                lambda: mx.mx_fake_quantize_fast(act, "e4m3", BLOCK), flops=8.0 * n_act,
                bytes=float(2 * e * n_act), rtol=0.0),
        GpuCase(f"mx_fake_quantize e2m1 {w_name}", lambda: tri.mx_fake_quantize(weight, "e2m1", BLOCK),
                lambda: mx.mx_fake_quantize_fast(weight, "e2m1", BLOCK), flops=8.0 * n_w,
                bytes=float(2 * e * n_w), rtol=0.0),
        GpuCase(f"mx_quantize e4m3 {a_name}", lambda: tri.mx_quantize(act, "e4m3", BLOCK),
                lambda: mx.mx_quantize_fast(act, "e4m3", BLOCK), flops=8.0 * n_act,
                bytes=e * n_act + _payload_bytes(n_act, "e4m3"), rtol=0.0),
        GpuCase(f"mx_quantize e2m1 {w_name}", lambda: tri.mx_quantize(weight, "e2m1", BLOCK),
                lambda: mx.mx_quantize_fast(weight, "e2m1", BLOCK), flops=8.0 * n_w,
                bytes=e * n_w + _payload_bytes(n_w, "e2m1"), rtol=0.0),
        GpuCase(f"mx_dequantize e4m3 -> {a_name}", lambda: tri.mx_dequantize(a8, s8, "e4m3", BLOCK, dt),
                lambda: mx.mx_dequantize_fast(a8, s8, "e4m3", BLOCK, dt), flops=2.0 * n_act,
                bytes=_payload_bytes(n_act, "e4m3") + e * n_act, rtol=0.0),
        GpuCase(f"mx_dequantize e2m1 -> {w_name}", lambda: tri.mx_dequantize(w4, s4, "e2m1", BLOCK, dt),
                lambda: mx.mx_dequantize_fast(w4, s4, "e2m1", BLOCK, dt), flops=2.0 * n_w,
                bytes=_payload_bytes(n_w, "e2m1") + e * n_w, rtol=0.0),
        GpuCase(f"mx_linear {lin_name}", lambda: tri.mx_linear(x, w4, s4, "e2m1", BLOCK, None),
                lambda: mx.mx_linear_fast(x, w4, s4, "e2m1", BLOCK, None), flops=2.0 * M * O * D,
                bytes=lin_bytes, rtol=RTOL_BF16),
        GpuCase(f"mx_linear act e4m3 {lin_name}", lambda: tri.mx_linear(x, w4, s4, "e2m1", BLOCK, "e4m3"),
                lambda: mx.mx_linear_fast(x, w4, s4, "e2m1", BLOCK, "e4m3"), flops=2.0 * M * O * D,
                bytes=lin_bytes, rtol=RTOL_BF16),
        GpuCase(f"mx_linear_bwd dx {lin_name}",
                lambda: tri.mx_linear_bwd([grad_y], x, w4, s4, "e2m1", BLOCK, "e4m3"), linear_bwd_ref,
                flops=2.0 * M * O * D, bytes=lin_bytes, rtol=RTOL_BF16),
    ]
