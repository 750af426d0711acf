"""C kernels of moe_combine for the CPU target (kernels/moe/moe.c): the weighted sum of each token's expert rows
read in place through its slots (no gathered copy), and a hand-written backward (the reference recomputes the
forward under torch.func.vjp). fp32 with int64 slots; other dtypes, tensors the C kernels cannot read
(`native.takes`) and the slot-free decode form keep the reference."""

from __future__ import annotations

from ctypes import c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.moe.reference import combine_ref
from k3compile.kernels._common.native import F32, I64

_FWD = (F32, F32, I64, F32) + (c_int64,) * 4 + (c_int,)
_BWD = (F32, F32, F32, I64, F32, F32) + (c_int64,) * 4 + (c_int,)


def _uses_reference(out_ECD: Tensor, weights_TK: Tensor, slots_TK: Tensor | None, *grads: Tensor) -> bool:
    return (slots_TK is None or out_ECD.dtype != torch.float32 or weights_TK.dtype != torch.float32
            or slots_TK.dtype != torch.int64 or not native.takes(out_ECD, weights_TK, slots_TK, *grads))


def _check(kernel: str, w: Tensor, slots: Tensor) -> None:
    native.expect_numel(kernel, "weights", w, slots.numel())


def moe_combine(out_ECD: Tensor, weights_TK: Tensor, slots_TK: Tensor | None) -> Tensor:
    """y_t = sum_k w_tk * out[slot_tk] [T, D], a dropped choice contributing zero, as `combine_ref`."""
    if _uses_reference(out_ECD, weights_TK, slots_TK):
        return combine_ref(out_ECD, weights_TK, slots_TK)
    rows, w, slots = out_ECD.contiguous(), weights_TK.contiguous(), slots_TK.contiguous()
    _check("k3_moe_combine", w, slots)
    (t, k), d = slots.shape, rows.shape[-1]
    y = rows.new_empty(t, d)
    native.function("k3_moe_combine", _FWD)(rows, w, slots, y, t, k, d, rows.numel() // d, native.threads())
    return y


def moe_combine_bwd(grads: list[Tensor], out_ECD: Tensor, weights_TK: Tensor, slots_TK: Tensor | None) -> list[Tensor]:
    """[d expert_out, d weights] for grads = [dy]."""
    if _uses_reference(out_ECD, weights_TK, slots_TK, grads[0]):
        leaves = [out_ECD.detach().requires_grad_(), weights_TK.detach().requires_grad_()]
        with torch.enable_grad():
            return list(torch.autograd.grad(combine_ref(*leaves, slots_TK), leaves, grads[0]))
    rows, w, slots = out_ECD.contiguous(), weights_TK.contiguous(), slots_TK.contiguous()
    _check("k3_moe_combine_bwd", w, slots)
    dy = native.f32(grads[0])
    (t, k), d = slots.shape, rows.shape[-1]
    native.expect_numel("k3_moe_combine_bwd", "dy", dy, t * d)
    drows, dw = torch.empty_like(rows), torch.empty_like(w)
    native.function("k3_moe_combine_bwd", _BWD)(dy, rows, w, slots, drows, dw, t, k, d, rows.numel() // d,
                                                native.threads())
    return [drows, dw]
