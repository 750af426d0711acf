"""MX reference kernels against hand-checked bytes and an independent bit-level Python encoder.

Bit layouts used in the hand tables:
  e2m1 code = s e e m: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, +8 for negative.
  e4m3 byte = s eeee mmm (bias 7, 0x7F/0xFF NaN): 1.0 = 0x38, 256 = 0x78, 448 = 0x7E.
  e5m2 byte = s eeeee mm (bias 15, exp 31 Inf/NaN): 1.0 = 0x3C, 2^15 = 0x78, 57344 = 0x7B.
  E8M0 scale byte = shared exponent + 127; 0x7F is 2^0.
Scale 2^0 needs the block amax in [2^emax, 2^(emax+1)): [4, 8) for e2m1, [256, 512) for e4m3,
[32768, 65536) for e5m2, which is why those anchors appear in the rows below.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from k3compile.analysis.formats import ELEMENT_OF_POLICY, storage_bytes
from k3compile.kernels.mx import reference as mx

NAN, INF = float("nan"), float("inf")

# (case, fmt, block, input values, expected payload bytes, expected scale bytes)
HAND_CASES = [
    # all-zero block: log2(0) = -inf clamps to the smallest E8M0 exponent -> 0x00.
    ("zeros", "e2m1", 4, [0.0, 0.0, 0.0, 0.0], [0x00, 0x00], [0x00]),
    # -0 keeps its sign: code 0x8 in the nibble of elements 0 and 3 -> bytes 0x08 (low), 0x80 (high).
    ("neg_zero", "e2m1", 4, [-0.0, 0.0, 0.0, -0.0], [0x08, 0x80], [0x00]),
    # layout: amax 4 -> X = 1. 1.0 -> 0x2 (low nibble), -0.5 -> 0x9 (high) -> 0x92; 4 -> 0x6, 0 -> 0x0 -> 0x06.
    ("layout", "e2m1", 4, [1.0, -0.5, 4.0, 0.0], [0x92, 0x06], [0x7F]),
    # amax 1 -> shared exp 0 - 2 = -2 (byte 125 = 0x7D): 1/X = 4 -> 0x6, -0.5/X = -2 -> 0xC -> 0xC6.
    ("layout_scaled", "e2m1", 4, [1.0, -0.5, 0.0, 0.0], [0xC6, 0x00], [0x7D]),
    # ties at X = 1: 2.5 -> 2 (0x4), 5 -> 4 (0x6), 0.25 -> 0 (0x0): the even codes win.
    ("ties", "e2m1", 4, [4.0, 2.5, 5.0, 0.25], [0x46, 0x06], [0x7F]),
    # 0.75 -> 1 (code 2), 1.25 -> 1 (2), 1.75 -> 2 (4), 4 -> 6.
    ("ties_2", "e2m1", 4, [0.75, 1.25, 1.75, 4.0], [0x22, 0x64], [0x7F]),
    # 3.5 -> 4 (0x6), -5 -> -4 (0xE), -2.5 -> -2 (0xC), 4 (0x6).
    ("ties_neg", "e2m1", 4, [3.5, -5.0, -2.5, 4.0], [0xE6, 0x6C], [0x7F]),
    # floor rule: amax 7.5 -> X = 1, so 7 and 6.5 clip to 6 (0x7) and -7.5 to -6 (0xF); 1 -> 0x2.
    ("saturate", "e2m1", 4, [7.0, -7.5, 6.5, 1.0], [0xF7, 0x27], [0x7F]),
    # subnormal 0.5 (code 1): 0.3 > 0.25 rounds up to it, -0.2 rounds to -0 (0x8).
    ("subnormal", "e2m1", 4, [0.5, 0.3, -0.2, 4.0], [0x11, 0x68], [0x7F]),
    # mixed signs: -6 -> 0xF, 3 -> 0x5, -1.5 -> 0xB, 0.5 -> 0x1.
    ("mixed", "e2m1", 4, [-6.0, 3.0, -1.5, 0.5], [0x5F, 0x1B], [0x7F]),
    # a NaN or an Inf anywhere: NaN scale, zero payload.
    ("nan", "e2m1", 4, [1.0, NAN, 2.0, 3.0], [0x00, 0x00], [0xFF]),
    ("inf", "e2m1", 4, [1.0, -INF, 2.0, 3.0], [0x00, 0x00], [0xFF]),
    # fp32 subnormal amax 2^-140: shared exp -142 clamps to -127 (0x00); 2^-140 / 2^-127 = 2^-13 -> 0.
    ("tiny", "e2m1", 4, [2.0**-140, 0.0, 0.0, 0.0], [0x00, 0x00], [0x00]),
    # amax 2^-126: shared exp -128 clamps to -127, so the element is 2 (0x4) instead of 4.
    ("tiny_clamped", "e2m1", 4, [2.0**-126, 0.0, 0.0, 0.0], [0x04, 0x00], [0x00]),
    # amax 2^127: shared exp 125 (0xFC); 2^127 -> 4 (0x6), -2^126 -> -2 (0xC).
    ("huge", "e2m1", 4, [2.0**127, -(2.0**126), 0.0, 0.0], [0xC6, 0x00], [0xFC]),
    # e4m3 ties at X = 1: 1.0625 -> 1.0 (0x38, mantissa 000), 1.1875 -> 1.25 (0x3A), -1.0625 -> 0xB8.
    ("ties", "e4m3", 4, [256.0, 1.0625, 1.1875, -1.0625], [0x78, 0x38, 0x3A, 0xB8], [0x7F]),
    # e4m3 subnormals (step 2^-9): 2^-9 -> 0x01, 2^-10 tie -> 0, 3*2^-10 tie -> 2*2^-9 (0x02).
    ("subnormal", "e4m3", 4, [256.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10], [0x78, 0x01, 0x00, 0x02], [0x7F]),
    # min normal 2^-6 = 0x08; 5*2^-10 = 2.5 steps -> 2 steps (0x02); -0 -> 0x80.
    ("subnormal_2", "e4m3", 4, [256.0, 2.0**-6, 5 * 2.0**-10, -0.0], [0x78, 0x08, 0x02, 0x80], [0x7F]),
    # X = 1, step 32 near the top: 470 and the tie 464 go to 448 (0x7E, no 480 in e4m3fn); 300 -> 288 (0x79).
    ("saturate", "e4m3", 4, [470.0, 464.0, 300.0, -470.0], [0x7E, 0x7E, 0x79, 0xFE], [0x7F]),
    # floor-rule clip: amax 1.875 -> shared exp -8 (0x77); 1.875 * 2^8 = 480 -> 448; 1 * 2^8 = 256 (0x78).
    ("saturate_floor", "e4m3", 4, [1.875, 1.0, 0.0, 0.0], [0x7E, 0x78, 0x00, 0x00], [0x77]),
    ("nan", "e4m3", 4, [NAN, 1.0, 2.0, 3.0], [0x00, 0x00, 0x00, 0x00], [0xFF]),
    ("inf", "e4m3", 4, [INF, 1.0, 2.0, 3.0], [0x00, 0x00, 0x00, 0x00], [0xFF]),
    # shared exp -148 clamps to -127; 2^-13 is below half of e4m3's smallest step 2^-9 -> 0.
    ("tiny", "e4m3", 4, [2.0**-140, 0.0, 0.0, 0.0], [0x00, 0x00, 0x00, 0x00], [0x00]),
    # e5m2 ties at X = 1 (step 0.25 at 1): 1.125 -> 1.0 (0x3C), 1.375 -> 1.5 (0x3E), -1.625 -> -1.5 (0xBE).
    ("ties", "e5m2", 4, [32768.0, 1.125, 1.375, -1.625], [0x78, 0x3C, 0x3E, 0xBE], [0x7F]),
    # e5m2 subnormals (step 2^-16): 2^-16 -> 0x01, 3*2^-17 tie -> 0x02, 2^-17 tie -> 0.
    ("subnormal", "e5m2", 4, [32768.0, 2.0**-16, 3 * 2.0**-17, 2.0**-17], [0x78, 0x01, 0x02, 0x00], [0x7F]),
    # amax 1.875 -> shared exp -15 (0x70); 1.875 * 2^15 = 61440 clips to 57344 (0x7B); -1 -> -2^15 (0xF8).
    ("saturate_floor", "e5m2", 4, [1.875, -1.0, 0.0, 0.0], [0x7B, 0xF8, 0x00, 0x00], [0x70]),
    ("inf", "e5m2", 4, [1.0, 2.0, 3.0, -INF], [0x00, 0x00, 0x00, 0x00], [0xFF]),
    # clamped to 2^-127 (0x00): 2^-140 / 2^-127 = 2^-13 is an e5m2 normal, exponent field 2 -> 0x08.
    ("tiny", "e5m2", 4, [2.0**-140, 0.0, 0.0, 0.0], [0x08, 0x00, 0x00, 0x00], [0x00]),
    # two blocks of 2: block 0 amax 6 -> X = 1; block 1 amax 0.75 -> shared exp -1 - 2 = -3 (0x7C), 0.75*8 = 6.
    ("two_blocks", "e2m1", 2, [6.0, -1.0, 0.75, 0.5], [0xA7, 0x67], [0x7F, 0x7C]),
]


def _bytes(data: torch.Tensor) -> list[int]:
    return data.view(torch.uint8).flatten().tolist()


@pytest.mark.parametrize(
    "case,fmt,block,values,want_data,want_scale", HAND_CASES, ids=[f"{c[1]}-{c[0]}" for c in HAND_CASES]
)
def test_hand_table(case, fmt, block, values, want_data, want_scale):
    x = torch.tensor(values, dtype=torch.float32)
    data, scale = mx.mx_quantize_ref(x, fmt, block)
    assert _bytes(data) == want_data
    assert scale.dtype == torch.uint8 and scale.tolist() == want_scale


@pytest.mark.parametrize("fmt,top", [("e2m1", 6.0), ("e4m3", 448.0), ("e5m2", 57344.0)])
def test_huge_float64_amax_clamps_scale_and_saturates(fmt, top):
    # amax 2^200: shared exp clamps to 127 (0xFE); 2^200 / 2^127 = 2^73 saturates; 2^126 / 2^127 = 0.5.
    x = torch.tensor([2.0**200, 2.0**126], dtype=torch.float64)
    data, scale = mx.mx_quantize_ref(x, fmt, 2)
    assert scale.tolist() == [0xFE]
    back = mx.mx_dequantize_ref(data, scale, fmt, 2, torch.float64)
    assert back.tolist() == [top * 2.0**127, 2.0**126]


def test_dequant_hand_values():
    back = mx.mx_dequantize_ref(torch.tensor([0x92, 0x06], dtype=torch.uint8), torch.tensor([0x7D]), "e2m1", 4)
    assert back.tolist() == [0.25, -0.125, 1.0, 0.0]
    nan_block = mx.mx_dequantize_ref(torch.zeros(4, dtype=torch.uint8), torch.tensor([0xFF, 0x7F]), "e4m3", 2)
    assert nan_block[:2].isnan().all() and nan_block[2:].tolist() == [0.0, 0.0]
    neg_zero = mx.mx_dequantize_ref(torch.tensor([0x08, 0x80], dtype=torch.uint8), torch.tensor([0]), "e2m1", 4)
    assert torch.signbit(neg_zero).tolist() == [True, False, False, True]
    assert (neg_zero == 0).all()


def test_fp8_payload_dtypes_and_uint8_bits_accepted():
    x = torch.tensor([256.0, 1.0, -0.5, 3.0])
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        data, scale = mx.mx_quantize_ref(x, fmt, 4)
        assert data.dtype == dt
        a = mx.mx_dequantize_ref(data, scale, fmt, 4)
        b = mx.mx_dequantize_ref(data.view(torch.uint8), scale, fmt, 4)
        assert torch.equal(a, b) and torch.equal(a, x)


def test_fp4_packing_byte_by_byte_block32():
    # Elements 0..7 are 0, .5, 1, ..., 3.5; 8..15 the same negated (element 8 is -0.0); then repeated.
    # amax 3.5: shared exp floor(log2 3.5) - 2 = -1, so X = 0.5 and the scaled values are 0..7, whose
    # codes are 0, 2 (1), 4 (2), 5 (3), 6 (4), 6 (5: tie to the even code of 4), 7 (6), 7 (7 saturates).
    # Byte i = code[2i] | code[2i+1] << 4: 0x20, 0x54, 0x66, 0x77, then 0xA8, 0xDC, 0xEE, 0xFF for the negatives.
    vals = [(k % 8) * 0.5 * (-1) ** (k // 8) for k in range(32)]
    data, scale = mx.mx_quantize_ref(torch.tensor(vals), "e2m1", 32)
    assert scale.tolist() == [126]  # amax 3.5: floor(log2 3.5) = 1, 1 - 2 = -1, +127
    pos = [0x0, 0x2, 0x4, 0x5, 0x6, 0x6, 0x7, 0x7]
    codes = pos + [c | 0x8 for c in pos] + pos + [c | 0x8 for c in pos]
    assert _bytes(data) == [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)]
    assert _bytes(data)[:8] == [0x20, 0x54, 0x66, 0x77, 0xA8, 0xDC, 0xEE, 0xFF]


def test_pack_unpack_inverse():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3).reshape(2, 24)
    assert torch.equal(mx.unpack_e2m1(mx.pack_e2m1(codes)), codes)


@pytest.mark.parametrize(
    "shape,fmt,block,match",
    [((2, 33), "e2m1", 32, "multiple of the block"), ((4,), "e3m2", 2, "unknown MX"), ((3,), "e2m1", 1, "even")],
)
def test_bad_shapes_raise(shape, fmt, block, match):
    with pytest.raises(ValueError, match=match):
        mx.mx_quantize_ref(torch.zeros(shape), fmt, block)


def test_dequant_scale_shape_checked():
    with pytest.raises(ValueError, match="scale shape"):
        mx.mx_dequantize_ref(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "e2m1")


def test_storage_bytes_match_quantized_tensors():
    """The static analysis's byte rule equals what mx_quantize really stores (payload + E8M0 scales)."""
    x = torch.randn(3, 64)
    for policy_fmt, element_fmt in ELEMENT_OF_POLICY.items():
        data, scale = mx.mx_quantize_ref(x, element_fmt, 16)
        assert storage_bytes(x.numel(), policy_fmt, 16) == data.numel() * data.element_size() + scale.numel()


# An independent bit-level reference: decode every code from its fields, encode by exhaustive search.
FIELDS = {"e2m1": (2, 1, 1), "e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias


def bit_decode(code: int, fmt: str) -> float:
    """Value of a code from its sign, exponent and mantissa fields (e4m3fn S.1111.111 is NaN; e5m2 exp 31 Inf/NaN)."""
    ebits, mbits, bias = FIELDS[fmt]
    sign = -1.0 if code >> (ebits + mbits) else 1.0
    e, m = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    if (fmt == "e4m3" and e == 15 and m == 7) or (fmt == "e5m2" and e == 31 and m):
        return math.nan
    if fmt == "e5m2" and e == 31:
        return sign * math.inf
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - mbits)
    return sign * math.ldexp((1 << mbits) + m, e - bias - mbits)


def _positive_codes(fmt: str) -> list[tuple[int, Fraction]]:
    ebits, mbits, _ = FIELDS[fmt]
    out = [(c, bit_decode(c, fmt)) for c in range(1 << (ebits + mbits))]
    return [(c, Fraction(v)) for c, v in out if math.isfinite(v)]


POSITIVE = {fmt: _positive_codes(fmt) for fmt in FIELDS}


def bit_encode(v: float, fmt: str) -> int:
    """Nearest code to v, ties to the even code, saturating at the largest finite code."""
    ebits, mbits, _ = FIELDS[fmt]
    target = abs(Fraction(v))
    best = min(POSITIVE[fmt], key=lambda cv: (abs(cv[1] - target), cv[0] & 1))[0]
    return best | ((1 << (ebits + mbits)) if math.copysign(1.0, v) < 0 else 0)


def reference_quantize(values: list[float], fmt: str, block: int) -> tuple[list[int], list[int]]:
    """(element codes, scale bytes) of the OCP rule by the slow route, before any packing."""
    emax = mx.MX_FORMATS[fmt].emax
    codes, scales = [], []
    for i in range(0, len(values), block):
        blk = values[i : i + block]
        if any(math.isnan(v) or math.isinf(v) for v in blk):
            codes += [0] * block
            scales.append(0xFF)
            continue
        amax = max(abs(v) for v in blk)
        shared = math.frexp(amax)[1] - 1 - emax if amax > 0 else -127
        shared = max(-127, min(127, shared))
        codes += [bit_encode(math.ldexp(v, -shared), fmt) for v in blk]
        scales.append(shared + 127)
    return codes, scales


def test_bit_decoder_matches_torch_fp8_both_ways():
    # torch's float8 casts (used only on exactly representable values) agree with the bit fields.
    for fmt, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        codes = torch.arange(256, dtype=torch.uint8)
        got = codes.view(dt).to(torch.float64).tolist()
        want = [bit_decode(c, fmt) for c in range(256)]
        assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want)), fmt
        finite = [c for c in range(256) if math.isfinite(want[c])]
        back = torch.tensor([want[c] for c in finite], dtype=torch.float64).to(dt).view(torch.uint8)
        assert back.tolist() == finite


def test_decode_e2m1_matches_bit_fields():
    got = mx.decode_e2m1(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == [bit_decode(c, "e2m1") for c in range(16)]


def _check_against_reference(values: list[float], fmt: str, block: int, dtype=torch.float32):
    data, scale = mx.mx_quantize_ref(torch.tensor(values, dtype=dtype), fmt, block)
    want_codes, want_scale = reference_quantize(values, fmt, block)
    got_codes = mx.unpack_e2m1(data).tolist() if fmt == "e2m1" else _bytes(data)
    assert scale.tolist() == want_scale
    assert got_codes == want_codes


# Every float32 the element grids care about: ties, subnormals, signed zeros, huge and tiny magnitudes.
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
grid = st.sampled_from([0.0, -0.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 7.0, 1.0625, 1.1875, 464.0, 470.0, 61440.0])
special = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]),
    # ldexp exponents stay where the largest grid value times 2**e is still a finite float32
    values=st.lists(st.one_of(f32, grid, st.builds(math.ldexp, grid, st.integers(-140, 100))), min_size=8, max_size=8),
)
def test_random_float32_matches_bit_reference(fmt, values):
    _check_against_reference(values, fmt, 4)


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]), values=st.lists(st.one_of(f32, special), min_size=4, max_size=4))
def test_specials_match_bit_reference(fmt, values):
    _check_against_reference(values, fmt, 2)


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]),
    values=st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=4, max_size=4),
)
def test_random_float64_matches_bit_reference(fmt, values):
    # float64 inputs exercise E8M0 clamping at both ends and single (not double) rounding.
    _check_against_reference(values, fmt, 2, torch.float64)


# ---------------------------------------------------------------------------------------------
# Round trips.


def _finite_codes(fmt: str) -> list[int]:
    n = 16 if fmt == "e2m1" else 256
    return [c for c in range(n) if math.isfinite(bit_decode(c, fmt))]


def _top_binade_codes(fmt: str) -> list[int]:
    emax = mx.MX_FORMATS[fmt].emax
    return [c for c in _finite_codes(fmt) if 2.0**emax <= abs(bit_decode(c, fmt))]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]), dtype=st.sampled_from(["f32", "f64"]))
def test_representable_values_round_trip_exactly(data, fmt, dtype):
    # A block whose largest element sits in the top binade keeps its scale, so every representable
    # value survives quantise -> dequantise -> quantise bit for bit (scale range kept inside fp32's).
    block, nblocks = 4, 3
    lo, hi = (0, 254) if dtype == "f64" else (20, 230)
    codes, scales = [], []
    for _ in range(nblocks):
        blk = data.draw(st.lists(st.sampled_from(_finite_codes(fmt)), min_size=block, max_size=block))
        blk[data.draw(st.integers(0, block - 1))] = data.draw(st.sampled_from(_top_binade_codes(fmt)))
        codes += blk
        scales.append(data.draw(st.integers(lo, hi)))
    values = [math.ldexp(bit_decode(c, fmt), scales[i // block] - 127) for i, c in enumerate(codes)]
    x = torch.tensor(values, dtype=torch.float64 if dtype == "f64" else torch.float32)
    d, s = mx.mx_quantize_ref(x, fmt, block)
    assert s.tolist() == scales
    got_codes = mx.unpack_e2m1(d).tolist() if fmt == "e2m1" else _bytes(d)
    assert got_codes == codes
    back = mx.mx_dequantize_ref(d, s, fmt, block, x.dtype)
    assert torch.equal(back, x) and torch.equal(torch.signbit(back), torch.signbit(x))


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]), values=st.lists(f32, min_size=8, max_size=8))
def test_round_trip_error_within_half_ulp_or_saturated(fmt, values):
    f = mx.MX_FORMATS[fmt]
    x = torch.tensor(values, dtype=torch.float32)
    data, scale = mx.mx_quantize_ref(x, fmt, 4)
    back = mx.mx_dequantize_ref(data, scale, fmt, 4, torch.float64).tolist()
    for i, v in enumerate(values):
        X = math.ldexp(1.0, scale[i // 4].item() - 127)
        scaled = abs(v) / X
        if scaled > f.max:
            assert back[i] == math.copysign(f.max * X, v)
        else:
            e = max(math.frexp(scaled)[1] - 1, f.emin) if scaled > 0 else f.emin
            assert abs(back[i] - v) <= 0.5 * math.ldexp(X, e - f.mbits)


def test_bf16_input_matches_float32_input():
    x = torch.randn(4, 64).to(torch.bfloat16)
    for fmt in mx.MX_FORMATS:
        a, b = mx.mx_quantize_ref(x, fmt), mx.mx_quantize_ref(x.float(), fmt)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        assert mx.mx_fake_quantize_ref(x, fmt).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Fast path (fp32 integer and power-of-two arithmetic) against the float64 reference, bit for bit.

FAST_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so that -0 != +0."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor):
    """Same dtype, NaN in the same places, every other element bit for bit. NaN payloads are left out:
    torch's own float -> bf16 cast gives 0x7FC0 or 0xFFFF for NaN depending on the tensor's size."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.is_floating_point():
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        got, want = got.masked_fill(nan, 0), want.masked_fill(nan, 0)
    assert torch.equal(_bits(got), _bits(want))


def _assert_fast_equals_reference(x: torch.Tensor, fmt: str, block: int):
    """Payload, scales, fake-quant output and decoded values of the fast path equal the reference's bits."""
    data, scale = mx.mx_quantize_ref(x, fmt, block)
    fast_data, fast_scale = mx.mx_quantize_fast(x, fmt, block)
    _assert_same_bits(fast_data.view(torch.uint8), data.view(torch.uint8))
    _assert_same_bits(fast_scale, scale)
    round_trip = mx.mx_dequantize_ref(data, scale, fmt, block, x.dtype)  # = mx_fake_quantize_ref(x, fmt, block)
    _assert_same_bits(mx.mx_fake_quantize_fast(x, fmt, block), round_trip)
    _assert_same_bits(mx.mx_dequantize_fast(data, scale, fmt, block, x.dtype), round_trip)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_fast_dequantize_every_code_and_scale_byte(fmt):
    # Every payload byte under every E8M0 byte (0x00 = 2^-127 subnormal, 0xFF = NaN), to every fast dtype.
    per_row = 2 if fmt == "e2m1" else 1  # elements per payload byte, one block each
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 256)
    for dtype in FAST_DTYPES:
        got = mx.mx_dequantize_fast(data, scale, fmt, per_row, dtype)
        _assert_same_bits(got, mx.mx_dequantize_ref(data, scale, fmt, per_row, dtype))


def _every_16bit_value(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _with_anchors(v: torch.Tensor, seed: int) -> torch.Tensor:
    """Blocks of 2: [v, anchor], anchor = |v| * 2^j * (1 + r), j in [-3, 12], so that v lands anywhere
    from the top binade to below the element format's smallest step (NaN/Inf v make NaN blocks)."""
    gen = torch.Generator().manual_seed(seed)
    v64 = v.to(torch.float64)
    j = torch.randint(-3, 13, v.shape, generator=gen).to(torch.float64)
    anchor = v64.abs() * torch.exp2(j) * (1 + torch.rand(v.shape, generator=gen, dtype=torch.float64))
    anchor = torch.where(torch.isfinite(anchor), anchor, 1.0).to(v.dtype)
    return torch.stack((v, anchor), dim=-1).reshape(-1, 64)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_quantize_every_16bit_value(fmt, dtype):
    # All 65536 bf16 / fp16 bit patterns (subnormals, -0, Inf, NaNs), each in a block of 2 with a random
    # anchor, then the same values in blocks of 32 in a shuffled order.
    v = _every_16bit_value(dtype)
    _assert_fast_equals_reference(_with_anchors(v, seed=1), fmt, 2)
    perm = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(2))
    _assert_fast_equals_reference(v[perm].reshape(-1, 128), fmt, 32)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_fast_quantize_fp32_next_to_every_bf16_value(fmt):
    # Element-grid ties have few significant bits, so they are bf16 values; their fp32 neighbours one
    # ulp either side (and the ties themselves) probe round-to-nearest-even from both sides.
    base = _every_16bit_value(torch.bfloat16).float().view(torch.int32)
    v = torch.cat([(base + d).view(torch.float32) for d in (-1, 0, 1)])
    _assert_fast_equals_reference(_with_anchors(v, seed=3), fmt, 2)


# Element-grid ties and the anchors that put them at scale 2^0, for all three formats.
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 464.0]
TIES += [1.125, 1.375, 2.0**-17, 3 * 2.0**-17, 61440.0, 4.0, 6.0, 256.0, 448.0, 32768.0, 57344.0]


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    fmt=st.sampled_from(["e2m1", "e4m3", "e5m2"]),
    dtype=st.sampled_from(FAST_DTYPES),
    block=st.sampled_from([2, 4, 8, 32]),
    nblocks=st.integers(1, 3),
)
def test_fast_path_equals_reference_property(data, fmt, dtype, block, nblocks):
    # Per test one binade shift k for the tie values (fp32 subnormal to huge), mixed with arbitrary
    # float32s (subnormals, +-0 included) and, sometimes, a NaN or an Inf.
    k = data.draw(st.integers(-160, 110), label="k")
    tied = st.sampled_from(TIES + [-t for t in TIES] + [-0.0]).map(lambda t: math.ldexp(t, k))
    n = block * nblocks
    values = data.draw(st.lists(st.one_of(tied, tied, f32), min_size=n, max_size=n), label="values")
    if data.draw(st.booleans(), label="special"):
        values[data.draw(st.integers(0, n - 1))] = data.draw(special)
    x = torch.tensor(values, dtype=torch.float32).to(dtype).reshape(nblocks, block)
    _assert_fast_equals_reference(x, fmt, block)


@pytest.mark.parametrize("dtype", FAST_DTYPES)
def test_fast_path_leaves_input_alone_and_takes_strided_input(dtype):
    # The fast path works in place on its own fp32 copy; an fp32 input must never be that copy.
    for x in (torch.randn(4, 64).to(dtype), torch.randn(64, 4).to(dtype).t()):
        before = x.clone()
        for fmt in mx.MX_FORMATS:
            _assert_fast_equals_reference(x, fmt, 32)
        assert torch.equal(_bits(x), _bits(before))


def test_fast_path_falls_back_to_reference_for_float64():
    x = torch.tensor([2.0**200, 2.0**126, -3.0, 0.1], dtype=torch.float64)  # byte 0xFE needs float64
    for fmt in mx.MX_FORMATS:
        _assert_fast_equals_reference(x, fmt, 2)
