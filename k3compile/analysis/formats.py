"""Storage cost of the number formats a quantisation policy can choose.

MX formats store `block` elements with one shared E8M0 scale byte (OCP MX v1.0):
MXFP4 costs 4 + 8/32 = 4.25 bits per value at block 32.
"""

from __future__ import annotations

ELEMENT_BITS = {"fp32": 32, "bf16": 16, "mxfp8": 8, "mxfp4": 4}
SCALE_BITS = 8  # one E8M0 byte per MX block
ELEMENT_OF_POLICY = {"mxfp4": "e2m1", "mxfp8": "e4m3"}  # policy format -> MX element format


def is_mx(fmt: str) -> bool:
    return fmt.startswith("mx")


def storage_bytes(numel: int, fmt: str, block: int = 32) -> int:
    """Exact bytes to store `numel` values in `fmt`; MX blocks run along a dim divisible by `block`."""
    payload_bits = numel * ELEMENT_BITS[fmt]
    if payload_bits % 8:
        raise ValueError(f"{numel} values of {fmt} do not fill whole bytes")
    scales = 0
    if is_mx(fmt):
        if numel % block:
            raise ValueError(f"{numel} values do not split into MX blocks of {block}")
        scales = numel // block * SCALE_BITS // 8
    return payload_bits // 8 + scales
