"""PyTorch references for the MLP nonlinearities: SiTU-GLU (K3), SwiGLU and GELU.

Computed in at least fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3compile.kernels._common.consts import const
from k3compile.kernels.norms.reference import as_dtype, upcast

GLU_KINDS = ("situ_glu", "swiglu")


def check_glu_kind(kind: str, op: str) -> None:
    """ValueError (naming `op`) unless `kind` names a gated activation the GLU ops support."""
    if kind not in GLU_KINDS:
        raise ValueError(f"{op} kind must be one of {GLU_KINDS}, got {kind!r}")


def situ_glu_ref(gate: Tensor, up: Tensor, beta1: float, beta2: float) -> Tensor:
    """SiTU-GLU: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)].

    Equals SwiGLU silu(g) * u to first order near zero (tanh(z) = z - z^3/3 + ...),
    and every output is bounded by b1 * b2 in magnitude.
    """
    g, u = upcast(gate), upcast(up)
    b1, b2 = const(beta1, g), const(beta2, u)  # the bits of the Python scalars, without a cast per call
    y = b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))
    return as_dtype(y, gate.dtype)


def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU: silu(g) * u."""
    return as_dtype(F.silu(upcast(gate)) * upcast(up), gate.dtype)


def glu_ref(gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float) -> Tensor:
    """act(gate, up) for a GLU kind (check_glu_kind first): situ_glu with its betas, or swiglu (betas unused)."""
    return situ_glu_ref(gate, up, beta1, beta2) if kind == "situ_glu" else swiglu_ref(gate, up)


def gelu_ref(x: Tensor, approximate: str) -> Tensor:
    """GELU; approximate="none" is the exact erf form, "tanh" the tanh approximation (as torch.nn.GELU)."""
    return as_dtype(F.gelu(upcast(x), approximate=approximate), x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Hand-written backwards (registered with the ops, and used by the fused GLU projections' backwards).


def glu_grads(gy: Tensor, gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """(dgate, dup) of act(gate, up) for the cotangent gy, in the compute dtype (fp32 at least), from the
    pre-activations alone.

    situ_glu, with A(g) = b1 tanh(g/b1) sigmoid(g) and B(u) = b2 tanh(u/b2):
      dgate = gy B(u) A'(g),  A'(g) = sigmoid(g) (1 - tanh(g/b1)^2) + A(g) (1 - sigmoid(g));
      dup = gy A(g) (1 - tanh(u/b2)^2).
    swiglu: dgate = gy u silu'(g), dup = gy silu(g).
    """
    gy, g, u = upcast(gy), upcast(gate), upcast(up)
    if kind == "swiglu":
        return torch.ops.aten.silu_backward(gy * u, g), gy * F.silu(g)
    tanh_g = torch.tanh(g / beta1)
    sig = torch.sigmoid(g)
    tanh_u = torch.tanh(u / beta2)
    act_g = torch.mul(tanh_g, sig).mul_(beta1)
    d_act_g = torch.addcmul(sig, sig, tanh_g.square_(), value=-1).add_(act_g).addcmul_(act_g, sig, value=-1)
    dgate = torch.mul(gy, tanh_u).mul_(d_act_g).mul_(beta2)
    dup = torch.mul(gy, act_g).mul_(tanh_u.square_().neg_().add_(1))
    return dgate, dup


def situ_glu_bwd_ref(grads: list[Tensor], gate: Tensor, up: Tensor, beta1: float, beta2: float) -> list[Tensor]:
    """[dgate, dup] of `situ_glu_ref` for grads = [dy]."""
    dgate, dup = glu_grads(grads[0], gate, up, "situ_glu", beta1, beta2)
    return [dgate.to(gate.dtype), dup.to(up.dtype)]


def swiglu_bwd_ref(grads: list[Tensor], gate: Tensor, up: Tensor) -> list[Tensor]:
    """[dgate, dup] of `swiglu_ref` for grads = [dy]."""
    dgate, dup = glu_grads(grads[0], gate, up, "swiglu", 0.0, 0.0)
    return [dgate.to(gate.dtype), dup.to(up.dtype)]
