"""The C kernel of mx_fake_quantize (kernels/mx/mx.c) gives the bits of the reference: the same exact fp32
arithmetic, so every bf16/fp16 value, their fp32 neighbours and the hand-checked specials must match bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.kernels.mx import reference as mx
from k3compile.kernels.mx.c import mx_fake_quantize

FORMATS = ["e2m1", "e4m3", "e5m2"]
NAN, INF = float("nan"), float("inf")


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype and shape, NaN in the same places, every other element bit for bit (-0 apart from +0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.masked_fill(nan, 0).view(ints), want.masked_fill(nan, 0).view(ints))


def _every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_value_in_blocks_of_32(fmt, dtype):
    v = _every_16bit_value(dtype)[torch.randperm(2**16, generator=torch.Generator().manual_seed(0))]
    x = v.reshape(-1, 128)
    _same_bits(mx_fake_quantize(x, fmt, 32), mx.mx_fake_quantize_ref(x, fmt, 32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp32_neighbours_of_every_bf16_value(fmt):
    # ties of the element grids have few significant bits: bf16 values and their fp32 neighbours probe
    # round-half-to-even from both sides; each sits in a block of 2 with an anchor that sets its scale
    base = _every_16bit_value(torch.bfloat16).float().view(torch.int32)
    v = torch.cat([(base + d).view(torch.float32) for d in (-1, 0, 1)])
    gen = torch.Generator().manual_seed(1)
    j = torch.randint(-3, 13, v.shape, generator=gen).to(torch.float64)
    anchor = v.double().abs() * torch.exp2(j) * (1 + torch.rand(v.shape, generator=gen, dtype=torch.float64))
    anchor = torch.where(torch.isfinite(anchor), anchor, 1.0).float()
    x = torch.stack((v, anchor), dim=-1).reshape(-1, 64)
    _same_bits(mx_fake_quantize(x, fmt, 2), mx.mx_fake_quantize_ref(x, fmt, 2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_specials(fmt):
    rows = [
        [0.0, -0.0, 0.0, 0.0],  # an all-zero block keeps each sign
        [1.0, NAN, 2.0, 3.0],  # a NaN or an Inf anywhere: the whole block NaN
        [INF, 1.0, 2.0, 3.0],
        [2.0**-140, 0.0, -(2.0**-149), 0.0],  # fp32 subnormal amax: the smallest scale
        [2.0**127, -(2.0**126), 3.0e38, 0.0],  # the largest fp32 exponents
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    _same_bits(mx_fake_quantize(x, fmt, 4), mx.mx_fake_quantize_ref(x, fmt, 4))


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    block=st.sampled_from([2, 4, 8, 32]),
    values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=32, max_size=32),
    shift=st.integers(-150, 120),
)
def test_property_equals_reference(fmt, block, values, shift):
    x = (torch.tensor(values, dtype=torch.float32) * 2.0**shift).reshape(-1, 32)
    _same_bits(mx_fake_quantize(x, fmt, block), mx.mx_fake_quantize_ref(x, fmt, block))


def test_float64_keeps_the_reference_and_shapes_are_checked():
    x = torch.randn(3, 64, dtype=torch.float64)
    assert torch.equal(mx_fake_quantize(x, "e4m3", 32), mx.mx_fake_quantize_ref(x, "e4m3", 32))
    with pytest.raises(ValueError, match="multiple of the block size"):
        mx_fake_quantize(torch.randn(3, 30), "e4m3", 32)
