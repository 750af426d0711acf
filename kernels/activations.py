"""PyTorch references for the MLP nonlinearities: SiTU-GLU (K3), SwiGLU and GELU.

Computed in at least fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3compile.kernels.consts import const
from k3compile.kernels.norms import as_dtype, upcast


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


def gelu_ref(x: Tensor, approximate: str) -> Tensor:
    """GELU; approximate="none" is the exact erf form, "tanh" the tanh approximation (as torch.nn.GELU)."""
    return as_dtype(F.gelu(upcast(x), approximate=approximate), x.dtype)
