"""Triton device helpers for OCP MX tiles: decode E8M0 scales and e2m1 payloads, quantise blocks in registers.

Shared by the MX kernels (kernels/mx/triton.py) and the grouped MoE GEMM. Everything is exact integer / bit
arithmetic on fp32 bits (no fp8 casts, no table gathers), so the results are the bits of kernels/mx/reference.py's
references (see `mx_quantize_ref`): blocks run along a tile's last dim, BLOCK (a power of two) values per
scale. Format constants come from kernels/mx/reference.py's MX_FORMATS: `mx_format_constexprs(fmt)` gives them as
keyword arguments (MBITS, EMIN, EMAX, MAXV) for a kernel launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3compile.kernels.mx.reference import mx_format

_E8M0_NAN = tl.constexpr(255)
_TWO_POW_M127 = tl.constexpr(0x00400000)  # fp32 bits of 2^-127 (E8M0 byte 0), the one scale below fp32's normals
_HALF_BITS = tl.constexpr(0x3F000000)  # fp32 bits of 0.5; also 126 << 23, e2m1's exponent bias moved onto fp32's
_NAN_BITS = tl.constexpr(0x7FC00000)
_TWO_POW_126 = tl.constexpr(2.0**126)


def mx_format_constexprs(fmt: str) -> dict:
    """The element format's constants as the constexpr keyword arguments the helpers below take."""
    f = mx_format(fmt)
    return {"MBITS": f.mbits, "EMIN": f.emin, "EMAX": f.emax, "MAXV": f.max}


@triton.jit
def to_fp32(x):
    """x as fp32, exactly; bf16 by moving its bits up (the interpreter's bf16 cast drops subnormals)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def e8m0_to_fp32(scale):
    """fp32 2^(s - 127) of a uint8 E8M0 tile (exact, 2^-127 included); NaN for 0xFF."""
    s = scale.to(tl.int32)
    bits = tl.where(s == 0, _TWO_POW_M127, s << 23)
    return tl.where(s == _E8M0_NAN, _NAN_BITS, bits).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_bits(codes, SHIFT: tl.constexpr):
    """fp32 bit patterns of the e2m1 codes held in bits SHIFT..SHIFT+3 of an int32 tile, each worth its value
    times 2^-126: the 3 magnitude bits land on fp32's bits 24..22 (exponent field e, top mantissa bit m, so
    2^(e-127)(1 + m/2) for e >= 1 and the subnormal m 2^-127 for e = 0) and the sign bit on bit 31."""
    return ((codes << (22 - SHIFT)) & 0x01C00000) | ((codes << (28 - SHIFT)) & -0x80000000)


@triton.jit
def e2m1_values(codes):
    """fp32 values of 4-bit e2m1 codes (int32 tile; sign bit 3, exponent bits 2..1, mantissa bit 0).

    One exact multiply by 2^126 turns `e2m1_bits` into 2^(e-1)(1 + m/2) and m/2: no selects or compares, the
    subnormal code (0.5) included (fp32 multiplies keep subnormals on GPUs and in the interpreter).
    """
    return e2m1_bits(codes, 0).to(tl.float32, bitcast=True) * _TWO_POW_126


@triton.jit
def scale_blocks(values, factor, BLOCK: tl.constexpr):
    """values [R, C] times the per-block factor [R, C // BLOCK] broadcast over each block of BLOCK."""
    R: tl.constexpr = values.shape[0]
    C: tl.constexpr = values.shape[1]
    v = tl.reshape(values, (R, C // BLOCK, BLOCK))
    return tl.reshape(v * factor[:, :, None], (R, C))


@triton.jit
def dequant_e2m1_tile(packed, scale, BLOCK: tl.constexpr):
    """fp32 tile [R, C] of packed e2m1 bytes [R, C // 2] (element 2i low nibble, 2i+1 high) times the
    E8M0 scales [R, C // BLOCK]; a 0xFF scale gives a NaN block. Each product is exact in fp32."""
    R: tl.constexpr = packed.shape[0]
    H: tl.constexpr = packed.shape[1]
    p = packed.to(tl.int32)
    bits = tl.reshape(tl.join(e2m1_bits(p, 0), e2m1_bits(p, 4)), (R, 2 * H))
    return scale_blocks(bits.to(tl.float32, bitcast=True) * _TWO_POW_126, e8m0_to_fp32(scale), BLOCK)


@triton.jit
def fp8_values(data):
    """fp32 values of an fp8 tile (tl.float8e4nv or tl.float8e5), decoded from its bits.

    A normal code is its 7 magnitude bits moved to fp32's mantissa top plus the exponent-bias difference;
    exponent field 0 is m * 2^(emin - mbits). e4m3fn: 0x7F is NaN; e5m2: exponent 31 is Inf / NaN.
    """
    c = data.to(tl.uint8, bitcast=True).to(tl.int32)
    if data.dtype == tl.float8e5:
        special = tl.where((c & 3) == 0, 0x7F800000, _NAN_BITS)
        bits = tl.where((c & 0x7C) == 0x7C, special, ((c & 0x7F) << 21) + (112 << 23))
        mag = tl.where((c & 0x7C) == 0, (c & 3).to(tl.float32) * 2.0**-16, bits.to(tl.float32, bitcast=True))
    else:
        bits = tl.where((c & 0x7F) == 0x7F, _NAN_BITS, ((c & 0x7F) << 20) + (120 << 23))
        mag = tl.where((c & 0x78) == 0, (c & 7).to(tl.float32) * 2.0**-9, bits.to(tl.float32, bitcast=True))
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def dequant_fp8_tile(data, scale, BLOCK: tl.constexpr):
    """fp32 tile [R, C] of an fp8 tile (tl.float8e4nv / tl.float8e5) times E8M0 scales [R, C // BLOCK]."""
    return scale_blocks(fp8_values(data), e8m0_to_fp32(scale), BLOCK)


@triton.jit
def mx_scale_tile(x, EMAX: tl.constexpr, BLOCK: tl.constexpr):
    """E8M0 bytes (int32 [R, C // BLOCK]) of the fp32 tile x [R, C]: 255 for a block holding a NaN or an Inf.

    Non-negative floats order like their bits, so the block's amax is an integer max of |x|'s bits (NaN and
    Inf are the bits >= 0x7F800000). floor(log2 amax) is its exponent field E - 127 for a normal amax, so
    the byte is max(E - EMAX, 0): subnormal and zero blocks clamp to 0, and E <= 254 keeps it <= 252.
    Padding lanes must hold 0.
    """
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    mag = tl.reshape(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, (R, C // BLOCK, BLOCK))
    amax = tl.max(mag, axis=2)
    byte = tl.maximum((amax >> 23) - EMAX, 0)
    return tl.where(amax >= 0x7F800000, _E8M0_NAN, byte)


@triton.jit
def mx_round_tile(x, byte, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr, BLOCK: tl.constexpr):
    """Round the fp32 tile x [R, C] divided by its blocks' scales 2^(byte - 127) to the element grid.

    Returns (magnitude codes int32 [R, C], element values fp32 [R, C] signed, zeros keep their sign).
    m = x * 2^(127 - byte) is exact (a normal power of two; results below 2^-126 round to 0 either way);
    saturating to +-MAXV first equals saturating after. With m's significand sig (24 bits) and exponent
    e = E - 127, the grid step is 2^(max(e, EMIN) - MBITS), so q = sig >> d rounded half to even on the
    dropped bits is the element in steps, and the code is q + (max(e - EMIN, 0) << MBITS) (a carry to
    q = 2^(MBITS+1) lands on the next binade's code). Blocks with byte 255 give junk the callers replace.
    """
    inv = ((254 - tl.minimum(byte, 252)) << 23).to(tl.float32, bitcast=True)
    m = scale_blocks(x, inv, BLOCK)
    m = tl.minimum(tl.maximum(m, -MAXV), MAXV)
    bits = m.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    sig = (bits & 0x7FFFFF) | 0x800000
    d = tl.minimum(23 - MBITS + tl.maximum(EMIN - e, 0), 25)
    q = sig >> d
    rem = sig - (q << d)
    half = 1 << (d - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = q + (tl.maximum(e - EMIN, 0) << MBITS)
    step = ((tl.maximum(e, EMIN) - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    val = q.to(tl.float32) * step
    return code, tl.where(bits < 0, -val, val)


@triton.jit
def mx_encode_tile(x, byte, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Element codes (int32 [R, C], sign in bit BITS - 1: 4 for e2m1, 8 for fp8) of the fp32 tile x [R, C] under
    the E8M0 bytes `byte` [R, C // BLOCK] from `mx_scale_tile`; NaN/Inf blocks get all-zero codes."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    mag, _ = mx_round_tile(x, byte, MBITS, EMIN, MAXV, BLOCK)
    code = mag | ((x.to(tl.int32, bitcast=True) < 0).to(tl.int32) << (BITS - 1))
    code = tl.where(byte[:, :, None] == _E8M0_NAN, 0, tl.reshape(code, (R, C // BLOCK, BLOCK)))
    return tl.reshape(code, (R, C))


@triton.jit
def pack_e2m1_tile(codes):
    """uint8 [R, C // 2] of 4-bit codes [R, C]: element 2i in the low nibble, 2i + 1 in the high one."""
    R: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def fake_quantize_tile(x, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, MAXV: tl.constexpr,
                       BLOCK: tl.constexpr):
    """dequant(quant(x)) of the fp32 tile x [R, C] (blocks along C), fp32; NaN blocks for NaN/Inf inputs.

    The element value times its scale is exact in fp32 (one rounding at the caller's cast, as the reference).
    """
    byte = mx_scale_tile(x, EMAX, BLOCK)
    _, val = mx_round_tile(x, byte, MBITS, EMIN, MAXV, BLOCK)
    return scale_blocks(val, e8m0_to_fp32(byte), BLOCK)
