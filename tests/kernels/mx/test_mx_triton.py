"""Triton MX kernels (interpreter on CPU) against the PyTorch references in kernels/mx/reference.py.

Quantisers and dequantiser: bit equality (NaN positions equal) on random data with ragged block counts and
on special values (signed zeros, NaN/Inf blocks, fp32 subnormals, exact ties, extreme exponents). Linear:
relative RMS error against `mx_linear_ref` on both launch paths; backward against torch autograd.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from k3compile.kernels.mx import reference as mx
from k3compile.kernels.mx import triton as mx_triton
from k3compile.kernels.mx.tile_triton import dequant_e2m1_tile, e8m0_to_fp32
from k3compile.kernels._common.compare import rel_rms

FORMATS = ("e2m1", "e4m3", "e5m2")
# Scales up to 2^128 overflow fp32 on purpose (the reference gives Inf too); numpy warns under the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run through the Triton interpreter


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    return obj


class _OnDevice:
    """mx_triton's wrappers with tensor arguments moved to DEVICE and results back to the CPU."""

    def __getattr__(self, name):
        fn = getattr(mx_triton, name)
        return lambda *args: _to(fn(*_to(args, DEVICE)), "cpu")


tri = _OnDevice()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits (fp8 / uint8 -> uint8, 16-bit -> int16, 32-bit -> int32)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype and shape, NaN in the same places, identical bits everywhere else."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point() and a.element_size() > 1:
        nan = b.isnan()
        assert torch.equal(a.isnan(), nan)
        a, b = a[~nan], b[~nan]
    assert torch.equal(_bits(a), _bits(b))


def random_input(rows: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with per-row magnitudes from 1e-30 to 1e30 (scale bytes over most of E8M0's range)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g) * torch.logspace(-30, 30, rows)[:, None]).to(dtype)


def grid_ties(fmt: str) -> list[float]:
    """Midpoints between neighbouring positive grid values at scale 1 (the tie cases), from the decoder."""
    f = mx.mx_format(fmt)
    if f.bits == 4:
        grid = torch.tensor(mx.E2M1_MAGNITUDES, dtype=torch.float64)
    else:
        grid = torch.arange(128, dtype=torch.uint8).view(mx._FP8_DTYPES[fmt]).double()
        grid = grid[grid.isfinite() & (grid <= f.max)]
    return ((grid[1:] + grid[:-1]) / 2).tolist()


def special_input(fmt: str, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """Blocks of edge cases, one block per row; element 0 of a tie row pins the scale to 2^0."""
    f = mx.mx_format(fmt)
    nan, inf = float("nan"), float("inf")
    tiny = torch.finfo(dtype).tiny
    rows = [
        [0.0] * block,
        [-0.0, 0.0] * (block // 2),
        [1.0, nan] + [2.0] * (block - 2),
        [1.0, -inf] + [-0.0] * (block - 2),
        [tiny / 4, -tiny / 8, tiny * 3, 0.0] * (block // 4),  # subnormal and near-min inputs
        [2.0**127, -(2.0**126), 1e30, -3.0] * (block // 4),
        [f.max * 1.9, -f.max * 1.3, 1.0, 0.5] * (block // 4),  # saturation after the floor rule
    ]
    ties = grid_ties(fmt)
    for i in range(0, len(ties), block - 1):
        chunk = [t * s for t, s in zip(ties[i : i + block - 1], [1, -1] * block)]
        rows.append([2.0**f.emax] + chunk + [0.0] * (block - 1 - len(chunk)))
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------------------------
# Device helpers of mx_tile_triton through a tiny kernel.


@triton.jit
def _tile_probe(p_ptr, s_ptr, out_ptr, fac_ptr, R: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    packed = tl.load(p_ptr + r * (C // 2) + tl.arange(0, C // 2)[None, :])
    scale = tl.load(s_ptr + r * (C // BLOCK) + tl.arange(0, C // BLOCK)[None, :])
    tl.store(out_ptr + r * C + tl.arange(0, C)[None, :], dequant_e2m1_tile(packed, scale, BLOCK))
    tl.store(fac_ptr + r * (C // BLOCK) + tl.arange(0, C // BLOCK)[None, :], e8m0_to_fp32(scale))


@pytest.mark.parametrize("block", [32, 8])
def test_tile_helpers_decode_every_code_and_scale(block):
    """Every payload byte under every scale byte (0 = 2^-127, 255 = NaN): the reference's bits."""
    rows, n = 128, 512  # 256 payload bytes per row, every row a pair of scale bytes
    packed = torch.arange(256, dtype=torch.uint8).repeat(rows, 1)
    scale = torch.arange(256, dtype=torch.uint8).repeat_interleave(rows * (n // block) // 256).view(rows, n // block)
    out = torch.empty(rows, n, device=DEVICE)
    factor = torch.empty(rows, n // block, device=DEVICE)
    _tile_probe[(1,)](packed.to(DEVICE), scale.to(DEVICE), out, factor, rows, n, block)
    out, factor = out.cpu(), factor.cpu()
    assert_same_bits(out, mx.mx_dequantize_ref(packed, scale, "e2m1", block))
    expected = torch.where(scale == 255, float("nan"), torch.exp2(scale.double() - 127)).float()
    assert_same_bits(factor, expected)


# ---------------------------------------------------------------------------------------------
# Quantise / fake-quantise / dequantise: bit equality.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_bits_random_and_special(fmt, dtype):
    for x in (random_input(37, 96, dtype), special_input(fmt, dtype)):  # 111 blocks: a ragged last program
        data, scale = tri.mx_quantize(x, fmt, 32)
        data_ref, scale_ref = mx.mx_quantize_ref(x, fmt, 32)
        assert_same_bits(data, data_ref)
        assert_same_bits(scale, scale_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_quantize_bits_random_and_special(fmt, dtype):
    for x in (random_input(37, 96, dtype, seed=1), special_input(fmt, dtype)):
        assert_same_bits(tri.mx_fake_quantize(x, fmt, 32), mx.mx_fake_quantize_ref(x, fmt, 32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_blocks_and_fp16(fmt):
    """Blocks that are not powers of two (padded tiles) or smaller than a tile, fp16 input, 3-d input."""
    for block, shape in ((24, (3, 5, 48)), (4, (2, 3, 8))):
        x = random_input(shape[0] * shape[1], shape[2], torch.float16, seed=2).view(shape) * 1e-20
        data, scale = tri.mx_quantize(x, fmt, block)
        data_ref, scale_ref = mx.mx_quantize_ref(x, fmt, block)
        assert_same_bits(data, data_ref)
        assert_same_bits(scale, scale_ref)
        assert_same_bits(tri.mx_fake_quantize(x, fmt, block), mx.mx_fake_quantize_ref(x, fmt, block))
        assert_same_bits(
            tri.mx_dequantize(data_ref, scale_ref, fmt, block, torch.float16),
            mx.mx_dequantize_ref(data_ref, scale_ref, fmt, block, torch.float16),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_bits_every_payload_byte(fmt, dtype):
    """Random payload bytes (every e2m1 pair, fp8 NaN codes included) under random scales, 0 and 255."""
    g = torch.Generator().manual_seed(3)
    n = 96
    width = n // 2 if fmt == "e2m1" else n
    data = torch.randint(0, 256, (37, width), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (37, n // 32), dtype=torch.uint8, generator=g)
    scale[0] = torch.tensor([0, 255, 127], dtype=torch.uint8)
    if fmt != "e2m1":
        data = data.view(mx._FP8_DTYPES[fmt])
    out = tri.mx_dequantize(data, scale, fmt, 32, dtype)
    assert_same_bits(out, mx.mx_dequantize_ref(data, scale, fmt, 32, dtype))
    if fmt != "e2m1":  # uint8 bit patterns are accepted too
        assert_same_bits(tri.mx_dequantize(data.view(torch.uint8), scale, fmt, 32, dtype), out)


def test_non_contiguous_empty_and_unsupported_inputs():
    x = random_input(64, 40, torch.float32, seed=9).t()  # [40, 64], strided
    assert_same_bits(tri.mx_fake_quantize(x, "e4m3", 32), mx.mx_fake_quantize_ref(x, "e4m3", 32))
    data, scale = mx.mx_quantize_ref(torch.randn(24, 64, generator=torch.Generator().manual_seed(9)), "e2m1", 32)
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(10)).t()
    y = tri.mx_linear(x, data, scale, "e2m1", 32, None)
    assert rel_rms(y, mx.mx_linear_ref(x, data, scale, "e2m1", 32, None)) <= 1e-5
    data, scale = tri.mx_quantize(torch.empty(0, 64), "e4m3", 32)
    assert data.shape == (0, 64) and scale.shape == (0, 2)
    assert tri.mx_fake_quantize(torch.empty(0, 64), "e2m1", 32).shape == (0, 64)
    with pytest.raises(TypeError):
        tri.mx_fake_quantize(torch.zeros(2, 32, dtype=torch.float64), "e4m3", 32)
    with pytest.raises(ValueError):
        tri.mx_quantize(torch.zeros(2, 48), "e4m3", 32)


# ---------------------------------------------------------------------------------------------
# Linear and its backward.


@pytest.fixture(params=[0, 1], ids=["dequant_dot", "dot_scaled"])
def dot_scaled(request, monkeypatch):
    """Force the mx_linear path: the DOT_SCALED launch-config key laid over the tuned/default config."""
    real = mx_triton.launch_config

    def config(kernel, device, defaults, **sizes):
        return {**real(kernel, device, defaults, **sizes), "DOT_SCALED": request.param}

    monkeypatch.setattr(mx_triton, "launch_config", config)
    return request.param


def _weights(fmt: str, block: int, n_out: int = 37, n_in: int = 96, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * torch.logspace(-2, 2, n_out)[:, None]
    return mx.mx_quantize_ref(w, fmt, block)


@pytest.mark.parametrize("act_fmt", [None, "e4m3", "e2m1"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_fp32(dot_scaled, fmt, act_fmt):
    """out 37 and in 96 are not multiples of the tiles; M = 21 rows from a 3-d x."""
    data, scale = _weights(fmt, 32)
    x = torch.randn(3, 7, 96, generator=torch.Generator().manual_seed(5))
    y = tri.mx_linear(x, data, scale, fmt, 32, act_fmt)
    ref = mx.mx_linear_ref(x, data, scale, fmt, 32, act_fmt)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert rel_rms(y, ref) <= 1e-5


@pytest.mark.parametrize("act_fmt", [None, "e4m3"])
def test_linear_bf16_fp16_and_block16(dot_scaled, act_fmt):
    """bf16 / fp16 x (one output rounding apart from the reference), and block 16 (dot_scaled falls back)."""
    data, scale = _weights("e2m1", 32)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(21, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
        y = tri.mx_linear(x, data, scale, "e2m1", 32, act_fmt)
        assert y.dtype == dtype
        assert rel_rms(y, mx.mx_linear_ref(x, data, scale, "e2m1", 32, act_fmt)) <= 5e-3
    data, scale = _weights("e4m3", 16)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(7))
    ref = mx.mx_linear_ref(x, data, scale, "e4m3", 16, act_fmt)
    assert rel_rms(tri.mx_linear(x, data, scale, "e4m3", 16, act_fmt), ref) <= 1e-5


@pytest.mark.parametrize(
    "fmt,act_fmt,dtype,n_out,tol",
    [
        ("e2m1", None, torch.float32, 37, 1e-5),
        ("e4m3", "e4m3", torch.float32, 64, 1e-5),  # out a multiple of the N tile: the unmasked loop
        ("e2m1", "e4m3", torch.bfloat16, 37, 5e-3),
    ],
)
def test_linear_bwd_matches_autograd(fmt, act_fmt, dtype, n_out, tol):
    """dx = grad_y @ dequant(W): autograd of the reference formula with the activation quant as identity."""
    data, scale = _weights(fmt, 32, n_out)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, 96, generator=g).to(dtype).requires_grad_()
    grad_y = torch.randn(3, 7, n_out, generator=g).to(dtype)
    w = mx.mx_dequantize_ref(data, scale, fmt, 32, torch.float32)
    (expected,) = torch.autograd.grad((x.float() @ w.T).to(dtype), x, grad_y)
    (dx,) = tri.mx_linear_bwd([grad_y], x.detach(), data, scale, fmt, 32, act_fmt)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert rel_rms(dx, expected) <= tol


@pytest.mark.parametrize("act_fmt", [None, "e4m3"])
def test_linear_bf16_weight_buffer_for_many_rows(monkeypatch, act_fmt):
    """BUFFER_M = 1 sends every call through the bf16 weight buffer and the dense GEMM (large-M training and
    prefill), forward and backward; K = 128 against the default 32- and 64-wide K tiles."""
    real = mx_triton.launch_config

    def config(kernel, device, defaults, **sizes):
        return {**real(kernel, device, defaults, **sizes), "BUFFER_M": 1, "DOT_SCALED": 0}

    monkeypatch.setattr(mx_triton, "launch_config", config)
    data, scale = _weights("e2m1", 32, n_out=40, n_in=128)
    g = torch.Generator().manual_seed(9)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-3)):
        x = torch.randn(3, 7, 128, generator=g).to(dtype)
        if dtype == torch.float32 and act_fmt is None:
            continue  # fp32 x: IEEE products in registers, no buffer
        y = tri.mx_linear(x, data, scale, "e2m1", 32, act_fmt)
        assert y.dtype == dtype and rel_rms(y, mx.mx_linear_ref(x, data, scale, "e2m1", 32, act_fmt)) <= tol
    grad_y = torch.randn(3, 7, 40, generator=g).to(torch.bfloat16)
    w = mx.mx_dequantize_ref(data, scale, "e2m1", 32, torch.float32)
    (dx,) = tri.mx_linear_bwd([grad_y], x, data, scale, "e2m1", 32, act_fmt)
    assert dx.dtype == torch.bfloat16 and rel_rms(dx, (grad_y.float() @ w).to(torch.bfloat16)) <= 5e-3
