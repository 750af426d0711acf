"""PyTorch references for the OCP Microscaling (MX v1.0) formats MXFP4 (e2m1) and MXFP8 (e4m3, e5m2).

A block of `block` consecutive values along the last dim shares one E8M0 scale byte
(X = 2^(byte - 127), 0xFF = NaN). Quantisation follows the OCP rule:
X = 2^(floor(log2(amax)) - emax_elem), then each element x / X is rounded to nearest,
ties to even, in the element format (subnormals included) and saturated to +-max.

Decisions where OCP leaves a choice (all tested in tests/kernels/test_mx.py):
- All-zero block: amax = 0 gives log2 = -inf, which the E8M0 clamp turns into 0x00 (2^-127);
  the payload keeps each zero's sign.
- A block with a NaN or an Inf gets scale 0xFF (NaN) and an all-zero payload, so the whole
  block decodes to NaN. E8M0 has no Inf and the floor rule is undefined at Inf; OCP lets
  implementations treat Inf like NaN for the scale.
- The shared exponent is clamped to E8M0's range [-127, 127] (tiny blocks flush towards zero,
  huge float64 blocks saturate).
- e2m1 payload: uint8 [..., n/2], element 2i in the low nibble, 2i+1 in the high nibble, sign in bit 3.
  e4m3 / e5m2 payload: torch.float8_e4m3fn / torch.float8_e5m2 tensors [..., n]; dequantisation also
  accepts their uint8 bit patterns.
- The rounding is done here in float64, exact for every fp64/fp32/bf16/fp16 input (one rounding,
  never double rounding); the fp8 casts below only ever see values that are already representable.

The `_ref` functions are the oracle. The `_fast` functions give the same bits for fp32/bf16/fp16
(NaN payloads aside) with exact fp32 bit and power-of-two arithmetic, see `_fast_elements`, and call
the reference for float64. They round themselves rather than through torch's fp32 -> fp8 casts, whose
out-of-range handling differs between their scalar and AVX-512 paths. They assume IEEE subnormals
(torch's default; not under `torch.set_flush_denormal(True)`).

Storage sizes for static analysis live in k3compile.analysis.formats (no torch import there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from k3compile.kernels._common.consts import cached, const


class MXFormat(NamedTuple):
    """Element format parameters: width in bits, mantissa bits, min normal exponent, max exponent, max value."""

    bits: int
    mbits: int
    emin: int
    emax: int
    max: float


MX_FORMATS: dict[str, MXFormat] = {
    "e2m1": MXFormat(bits=4, mbits=1, emin=0, emax=2, max=6.0),
    "e4m3": MXFormat(bits=8, mbits=3, emin=-6, emax=8, max=448.0),
    "e5m2": MXFormat(bits=8, mbits=2, emin=-14, emax=15, max=57344.0),
}

E8M0_BIAS = 127
E8M0_NAN = 0xFF
# The 8 e2m1 magnitudes, indexed by the 3-bit code (exponent bits, mantissa bit).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def mx_format(fmt: str) -> MXFormat:
    """The element format's parameters; ValueError for an unknown name."""
    if fmt not in MX_FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[fmt]


def check_mx_shape(n, fmt: str, block: int) -> MXFormat:
    """Validate a last dim of n elements for MX blocking; returns the format."""
    f = mx_format(fmt)
    if block <= 0:
        raise ValueError(f"MX block size must be positive, got {block}")
    if n % block != 0:
        raise ValueError(f"MX quantisation needs the last dim ({n}) to be a multiple of the block size ({block})")
    if f.bits == 4 and n % 2 != 0:
        raise ValueError(f"e2m1 packs two elements per byte; the last dim ({n}) must be even")
    return f


def mx_quant_meta(shape: torch.Size | tuple, fmt: str, block: int) -> tuple[tuple, torch.dtype, tuple]:
    """(payload shape, payload dtype, scale shape) for an input of `shape` (used by the fake impls)."""
    *lead, n = shape
    f = check_mx_shape(n, fmt, block)
    if f.bits == 4:
        return (*lead, n // 2), torch.uint8, (*lead, n // block)
    return (*lead, n), _FP8_DTYPES[fmt], (*lead, n // block)


def mx_dequant_meta(data_shape: torch.Size | tuple, scale_shape: torch.Size | tuple, fmt: str, block: int) -> tuple:
    """Shape of the decoded values [..., n], after checking the payload and scale shapes agree."""
    *lead, m = data_shape
    n = m * 2 if mx_format(fmt).bits == 4 else m
    check_mx_shape(n, fmt, block)
    if len(scale_shape) != len(data_shape) or scale_shape[-1] * block != n:
        raise ValueError(f"MX scale shape {tuple(scale_shape)} does not match {n} elements in blocks of {block}")
    return (*lead, n)


def _pow2(e: Tensor) -> Tensor:
    """Exact 2^e in float64 for integer e in [-1022, 1023], built from the exponent bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _floor_log2(a: Tensor) -> Tensor:
    """floor(log2(a)) exactly for positive finite float64 a (frexp: a = m * 2^k, m in [0.5, 1))."""
    return torch.frexp(a).exponent.to(torch.int64) - 1


def round_to_element(v: Tensor, fmt: str) -> Tensor:
    """Round float64 values to the element format: nearest, ties to even, subnormals kept, saturated to +-max.

    Exact in float64: the step at |v| is ulp = 2^(max(floor(log2|v|), emin) - mbits), a power of two,
    so v / ulp is exact and torch.round (half to even) picks the even neighbour on ties.
    """
    f = mx_format(fmt)
    mag = v.abs()
    exp = torch.clamp(_floor_log2(torch.where(mag > 0, mag, 1.0)), min=f.emin)
    ulp = _pow2(exp - f.mbits)
    q = torch.clamp(torch.round(mag / ulp) * ulp, max=f.max)
    return torch.copysign(q, v)


def _e2m1_codes(q: Tensor) -> Tensor:
    """4-bit codes (sign in bit 3) of float64 values already on the e2m1 grid."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=q.device)
    code = torch.searchsorted(table, q.abs())
    return (code + torch.signbit(q).to(code.dtype) * 8).to(torch.uint8)


def pack_e2m1(codes: Tensor) -> Tensor:
    """Pack 4-bit codes [..., n] into bytes [..., n/2]: element 2i low nibble, 2i+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(data: Tensor) -> Tensor:
    """Inverse of `pack_e2m1`: bytes [..., n/2] to 4-bit codes [..., n]."""
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)


def decode_e2m1(codes: Tensor) -> Tensor:
    """Values (float64) of 4-bit e2m1 codes."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=codes.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


def mx_quantize_ref(x: Tensor, fmt: str, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantise x [..., n] to MX: (payload, E8M0 scales [..., n/block] uint8).

    The payload is uint8 [..., n/2] for e2m1 (packed), float8_e4m3fn / float8_e5m2 [..., n] for fp8.
    """
    f = check_mx_shape(x.shape[-1], fmt, block)
    xb = x.to(torch.float64).unflatten(-1, (-1, block))  # [..., nb, block]
    special = (~torch.isfinite(xb)).any(dim=-1, keepdim=True)  # NaN or Inf: NaN scale
    xb = torch.where(special, 0.0, xb)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    shared = torch.where(amax > 0, _floor_log2(torch.where(amax > 0, amax, 1.0)) - f.emax, -E8M0_BIAS)
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    q = round_to_element(xb * _pow2(-shared), fmt).flatten(-2)
    scale = torch.where(special, E8M0_NAN, shared + E8M0_BIAS).squeeze(-1).to(torch.uint8)
    if f.bits == 4:
        return pack_e2m1(_e2m1_codes(q)), scale
    return q.to(_FP8_DTYPES[fmt]), scale


def mx_dequantize_ref(
    data: Tensor, scale: Tensor, fmt: str, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Decode MX payload + E8M0 scales to values [..., n] in `dtype`; a 0xFF scale gives a NaN block."""
    mx_dequant_meta(data.shape, scale.shape, fmt, block)
    if mx_format(fmt).bits == 4:
        elems = decode_e2m1(unpack_e2m1(data))
    else:
        raw = data.view(_FP8_DTYPES[fmt]) if data.dtype == torch.uint8 else data
        elems = raw.to(torch.float64)
    s = scale.to(torch.int64).unsqueeze(-1)
    factor = torch.where(s == E8M0_NAN, torch.nan, _pow2(s - E8M0_BIAS))
    return (elems.unflatten(-1, (-1, block)) * factor).flatten(-2).to(dtype)


def mx_fake_quantize_ref(x: Tensor, fmt: str, block: int = 32) -> Tensor:
    """dequant(quant(x)) in x's dtype: the values an MX round trip leaves."""
    data, scale = mx_quantize_ref(x, fmt, block)
    return mx_dequantize_ref(data, scale, fmt, block, x.dtype)


def mx_linear_ref(
    x: Tensor, data: Tensor, scale: Tensor, fmt: str = "e2m1", block: int = 32, act_fmt: str | None = None
) -> Tensor:
    """y = x @ dequant(W)^T for MX weights W [out, in] blocked along `in`; optional MX fake-quant of x.

    Computes in fp32 (fp64 for fp64 x) and returns x's dtype.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = mx_dequantize_ref(data, scale, fmt, block, acc)
    xa = x.to(acc)
    if act_fmt is not None:
        xa = mx_fake_quantize_ref(xa, act_fmt, block)
    return (xa @ w.T).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Fast path: the same bits as the reference for fp32 / bf16 / fp16, in fp32 without float64.
# Every Python number below enters the arithmetic as a cached 0-dim tensor (`const`): the same bits as a
# wrapped scalar, without an allocation and a cast per operand, which dominate the small tensors of decoding.

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXP_MASK = 0x7F800000  # fp32 exponent field
_TWO_POW_M127 = 0x00400000  # bits of 2^-127, the one E8M0 scale below fp32's normals
_CHUNK = 1 << 18  # elements per rounding pass: a bounded int32 scratch (fresh pages cost), few passes
_SMALL = 1 << 10  # up to this many elements (a decoding step's activations) take the fewest-calls forms
# Decoding tables, payload byte -> fp32 values: the e2m1 pair (low nibble, high nibble), or the fp8 value.
_BYTES = torch.arange(256, dtype=torch.uint8)
_DECODE = {"e2m1": decode_e2m1(unpack_e2m1(_BYTES)).view(256, 2).float()}
_DECODE.update({fmt: _BYTES.view(dt).float() for fmt, dt in _FP8_DTYPES.items()})


def _f32(bits: Tensor) -> Tensor:
    """Reinterpret int32 bits as fp32."""
    return bits.view(torch.float32)


def _i32(value: int, like: Tensor):
    return const(value, like, torch.int32)


def _e8m0_factor(b: Tensor) -> Tensor:
    """fp32 2^(b - 127) for E8M0 bytes b (int32), NaN for 0xFF; exact, 2^-127 included."""
    bits = torch.where(b == 0, _TWO_POW_M127, b << 23)
    return torch.where(b == E8M0_NAN, torch.nan, _f32(bits))


def _scaled_table(fmt: str, like: Tensor) -> Tensor:
    """Decoded payload byte times its block's scale, for every (scale byte, payload byte): [65536] values.

    Row s * 256 + d holds decode(d) * 2^(s - 127) in fp32 (NaN for s = 0xFF): exact, see
    `mx_dequantize_fast`. e2m1 rows hold both nibbles' values, an fp32 pair viewed as one int64, so one
    gather decodes a byte. Built once per format and like's device (512 KiB for e2m1, 256 KiB for fp8).
    """
    def make() -> Tensor:
        factor = _e8m0_factor(torch.arange(256, dtype=torch.int32))  # [256] by scale byte
        elems = _DECODE[fmt]  # [256, 2] or [256]
        scaled = factor.view(256, 1, *([1] * (elems.dim() - 1))) * elems  # [256 scale, 256 payload(, 2)]
        scaled = scaled.reshape(65536, -1).contiguous()
        table = scaled.view(torch.int64).view(65536) if fmt == "e2m1" else scaled.view(65536)
        return table.to(like.device)

    return cached(("mx_scaled", fmt), like, make)


def _fast_scales(xb: Tensor, f: MXFormat) -> tuple[Tensor, Tensor, Tensor]:
    """Block amax (fp32, NaN/Inf for NaN/Inf blocks), the E8M0 byte << 23 (int32) and 2^-shared (fp32) of
    fp32 blocks xb [..., nb, block], all [..., nb, 1].

    With E the exponent field of amax, floor(log2 amax) = E - 127 for a normal amax, so the byte
    shared + 127 = max(E - emax, 0): a subnormal or zero amax clamps to 0, and E <= 254 keeps the byte
    <= 252 (the upper clamp never fires for fp32). 2^-shared = 2^(127 - byte) is a normal fp32. NaN/Inf
    blocks (E = 255) get finite junk in both; the callers discard or NaN those blocks by their amax.
    """
    if xb.numel() <= _SMALL:  # max |x|, exact, NaN propagating: one call, but slow beyond a few blocks
        amax = torch.linalg.vector_norm(xb, float("inf"), dim=-1, keepdim=True)
    else:
        amax = xb.abs().amax(dim=-1, keepdim=True)
    e = torch.bitwise_and(amax.view(torch.int32), _i32(_EXP_MASK, amax))  # E << 23
    byte_bits = e.sub_(_i32(f.emax << 23, e)).clamp_min_(_i32(0, e))
    inv_scale = _f32(torch.sub(_i32(254 << 23, e), byte_bits))
    return amax, byte_bits, inv_scale


def _round_to_grid_(m: Tensor, f: MXFormat) -> Tensor:
    """Round contiguous fp32 m (|m| <= max) in place to the element grid, ties to even, subnormals kept.

    ulp = 2^(max(floor(log2|m|), emin) - mbits) is m's exponent field (as a float, 2^floor(log2|m|)) raised
    to 2^emin and scaled: a normal power of two. So m / ulp is exact (bar fp32 underflow of values that
    round to a signed 0 either way), torch.round is half-to-even, and times ulp is exact: one rounding.
    """
    mask, lowest, step = _i32(_EXP_MASK, m), 2.0**f.emin, const(2.0**-f.mbits, m)  # clamp_min_ takes a float as is
    if m.numel() <= _CHUNK:  # one pass, no scratch (decoding's small tensors)
        ulp = _f32(torch.bitwise_and(m.view(torch.int32), mask)).clamp_min_(lowest).mul_(step)
        return m.div_(ulp).round_().mul_(ulp)
    flat = m.view(-1)
    scratch = torch.empty(_CHUNK, dtype=torch.int32, device=m.device)
    for start in range(0, flat.numel(), _CHUNK):
        v = flat[start : start + _CHUNK]
        ulp = _f32(torch.bitwise_and(v.view(torch.int32), mask, out=scratch[: v.numel()]))
        ulp.clamp_min_(lowest).mul_(step)
        v.div_(ulp).round_().mul_(ulp)
    return m


def _fast_elements(x: Tensor, f: MXFormat, block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(element values [..., nb, block] fp32 on the grid, signed; block amax, E8M0 byte << 23 and 2^-shared,
    [..., nb, 1]).

    Exact in fp32 because x is fp32-representable: m = x * 2^-shared with -shared in [-125, 127] is exact
    unless |m| < 2^-126, far below half the smallest element step, where both round to the same signed 0;
    |m| < 2^(emax+1), and saturating to +-max before rounding gives what saturating after it does.
    amax * 0 (0, or NaN for a NaN/Inf block) added to 2^-shared makes those blocks' elements NaN: the
    callers zero them (payload) or keep them (fake-quant).
    """
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    *lead, n = xf.shape
    xb = xf.view(*lead, n // block, block)
    amax, byte_bits, inv_scale = _fast_scales(xb, f)
    inv_scale.addcmul_(amax, const(0.0, amax))
    m = torch.mul(xb, inv_scale) if xf is x else xb.mul_(inv_scale)  # xf is a fresh copy unless x was contiguous fp32
    return _round_to_grid_(m.clamp_(-f.max, f.max), f), amax, byte_bits, inv_scale  # scalar clamp: no cast


def _e2m1_codes_fast(q: Tensor) -> Tensor:
    """4-bit codes (int32) of fp32 values on the e2m1 grid, from their bits (q is overwritten).

    q * 2^-126 puts e2m1's exponent field (bias 1) exactly on fp32's (subnormal 0.5 -> 2^-127, a
    subnormal too), so bits 22..24 are the code's exponent and mantissa, and bit 31 its sign.
    """
    s = q.mul_(2.0**-126).view(torch.int32)
    codes = (s >> 22).bitwise_and_(0x7)
    return codes.bitwise_or_(s.bitwise_right_shift_(28).bitwise_and_(0x8))


def mx_quantize_fast(x: Tensor, fmt: str, block: int = 32) -> tuple[Tensor, Tensor]:
    """`mx_quantize_ref` with the same bits, fast for fp32/bf16/fp16 (other dtypes use the reference)."""
    f = check_mx_shape(x.shape[-1], fmt, block)
    if x.dtype not in FAST_DTYPES:
        return mx_quantize_ref(x, fmt, block)
    q, amax, byte_bits, _ = _fast_elements(x, f, block)
    b = byte_bits.bitwise_right_shift_(23).masked_fill_(~torch.isfinite(amax), E8M0_NAN)
    finite = b != E8M0_NAN  # NaN/Inf blocks get an all-zero payload
    scale = b.squeeze(-1).to(torch.uint8)
    if f.bits == 4:
        return pack_e2m1(_e2m1_codes_fast(q).mul_(finite).flatten(-2).to(torch.uint8)), scale
    data = q.to(_FP8_DTYPES[fmt])
    data.view(torch.uint8).mul_(finite)
    return data.flatten(-2), scale


def mx_dequantize_fast(
    data: Tensor, scale: Tensor, fmt: str, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """`mx_dequantize_ref` with the same bits, fast for fp32/bf16/fp16 outputs (float64 uses the reference).

    Element times 2^(scale - 127) is exact in fp32 (at least 2^-143, at most 6 or 57344 * 2^127, where an
    overflow rounds to Inf as the float64 route's cast does), so the one rounding to `dtype` is the same.
    The products come from one table gathered at scale byte * 256 + payload byte (`_scaled_table`).
    """
    if dtype not in FAST_DTYPES:
        return mx_dequantize_ref(data, scale, fmt, block, dtype)
    out_shape = mx_dequant_meta(data.shape, scale.shape, fmt, block)
    per_byte = 2 if mx_format(fmt).bits == 4 else 1
    if block % per_byte:  # an e2m1 byte straddling two blocks: decode and scale apart
        byte = data.view(torch.uint8).reshape(-1).to(torch.int32)
        elems = _DECODE[fmt].to(data.device).index_select(0, byte).view(*data.shape[:-1], -1)
        factor = _e8m0_factor(scale.to(torch.int32).unsqueeze(-1))
        return (elems.unflatten(-1, (-1, block)) * factor).flatten(-2).to(dtype)
    lead, nb = data.shape[:-1], scale.shape[-1]
    # index = scale byte * 256 + payload byte, in int32: the payload copied in (one cast), the scale added in
    # (copy_ casts as it copies: one call fewer than .to, and two fewer than an add_ of a uint8 operand)
    index = torch.empty(data.shape, dtype=torch.int32, device=data.device)
    index.copy_(data if data.dtype == torch.uint8 else data.view(torch.uint8))
    row = torch.empty((*scale.shape, 1), dtype=torch.int32, device=scale.device).copy_(scale.view(*scale.shape, 1))
    index = index.view(*lead, nb, block // per_byte).add_(row, alpha=256)
    values = _scaled_table(fmt, data).index_select(0, index.view(-1))
    values = (values.view(torch.float32) if per_byte == 2 else values).view(out_shape)
    return values if dtype == torch.float32 else values.to(dtype)


def mx_fake_quantize_fast(x: Tensor, fmt: str, block: int = 32) -> Tensor:
    """`mx_fake_quantize_ref` with the same bits in one fp32 pass (no packed payload), for QAT.

    Element value over 2^-shared is exact in fp32: it is the element times 2^shared (2^-127 for byte 0; see
    `mx_dequantize_fast`), and 2^-shared a normal power of two. NaN/Inf blocks come out NaN whole
    (`_fast_elements`).
    """
    f = check_mx_shape(x.shape[-1], fmt, block)
    if x.dtype not in FAST_DTYPES:
        return mx_fake_quantize_ref(x, fmt, block)
    q, _, _, inv_scale = _fast_elements(x, f, block)
    y = q.div_(inv_scale).view(x.shape)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def mx_linear_fast(
    x: Tensor, data: Tensor, scale: Tensor, fmt: str = "e2m1", block: int = 32, act_fmt: str | None = None
) -> Tensor:
    """`mx_linear_ref` on the fast dequantise / fake-quantise (identical operands, so identical result)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = mx_dequantize_fast(data, scale, fmt, block, acc)
    xa = x if x.dtype == acc else x.to(acc)
    if act_fmt is not None:
        xa = mx_fake_quantize_fast(xa, act_fmt, block)
    y = xa @ w.T
    return y if y.dtype == x.dtype else y.to(x.dtype)
