"""C kernels of glu_train for the CPU target (kernels/glu_train/glu.c): the activation and its derivatives in one pass.

`glu_fill` is also the middle of expert_rows_ffn's C form, where the activation is MX fake-quantised in the same
pass. libmvec's expf/tanhf (or libm's) stand in for torch's, so values agree with the reference to fp32 rounding,
not bit for bit; the backward's two multiplies are the reference's exactly.
"""

from __future__ import annotations

from ctypes import c_float, c_int, c_int64

import torch
from torch import Tensor

from k3compile.kernels._common import native
from k3compile.kernels.activations.reference import GLU_KINDS, check_glu_kind
from k3compile.kernels.glu_train.reference import glu_train_bwd_ref, glu_train_ref
from k3compile.kernels.mx.c import format_args
from k3compile.kernels._common.native import F32

_FILL = (F32,) * 5 + (c_int64, c_int, c_float, c_float, c_int, c_int, c_int, c_int, c_float, c_int)
_GRADS = (F32,) * 5 + (c_int64, c_int)
_NO_FORMAT = (0, -1, 0, 0.0)  # emax < 0: no quantisation


def glu_fill(g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, kind: str, beta1: float, beta2: float,
             act_fmt: str | None = None, block: int = 32) -> None:
    """y = act(g, u) (MX fake-quantised to act_fmt in blocks of `block` along the last dim, when given), dy/dg and
    dy/du, into contiguous fp32 tensors of one shape."""
    fmt = format_args(act_fmt) if act_fmt is not None else _NO_FORMAT
    for what, t in (("up", u), ("y", y), ("dy/dgate", jg), ("dy/dup", ju)):
        native.expect_numel("k3_glu_fill", what, t, g.numel())
    if act_fmt is not None and g.numel() % block:
        raise native.KernelInputError(f"k3_glu_fill: {g.numel()} elements are not whole blocks of {block}")
    native.function("k3_glu_fill", _FILL)(g, u, y, jg, ju, g.numel(), GLU_KINDS.index(kind), beta1, beta2, block, *fmt,
                                         native.threads())


def glu_train(gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float) -> tuple[Tensor, Tensor, Tensor]:
    """(act(gate, up) in gate's dtype, dy/dgate, dy/dup in fp32), as `glu_train_ref`."""
    check_glu_kind(kind, "glu_train")
    if not native.takes(gate, up):
        return glu_train_ref(gate, up, kind, beta1, beta2)
    g = native.f32(gate)
    u = native.f32(up)
    y, jg, ju = (torch.empty(gate.shape, dtype=torch.float32) for _ in range(3))
    glu_fill(g, u, y, jg, ju, kind, beta1, beta2)
    return y.to(gate.dtype), jg, ju


def glu_train_bwd(grads: list[Tensor], outputs: list[Tensor], gate: Tensor, up: Tensor, kind: str, beta1: float,
                  beta2: float) -> list[Tensor]:
    """[dgate, dup] = dy * (dy/dgate, dy/dup), one pass."""
    _, jg, ju = outputs
    if jg.dtype != torch.float32 or not native.takes(grads[0], jg, ju):
        return glu_train_bwd_ref(grads, outputs, gate, up, kind, beta1, beta2)
    native.expect_numel("k3_glu_grads", "dy", grads[0], jg.numel())
    gy = native.f32(grads[0])
    dg, du = torch.empty_like(jg), torch.empty_like(ju)
    native.function("k3_glu_grads", _GRADS)(gy, jg, ju, dg, du, gy.numel(), native.threads())
    return [dg.to(gate.dtype), du.to(up.dtype)]
