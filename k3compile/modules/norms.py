"""Norm modules over k3 ops."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3compile.kernels.norms.op import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale `weight` (initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
