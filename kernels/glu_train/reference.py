"""PyTorch reference of glu_train: a gated activation that also returns its elementwise derivatives.

y = act(gate, up) with dy/dgate and dy/dup, so the backward is two multiplies instead of the
transcendentals again (and the projections, which the fused GLU ops recompute). The values are
computed in cache-sized chunks of the flattened tensors, every intermediate in reused scratch:
on a CPU each full-size temporary would be another trip through memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.activations.reference import check_glu_kind
from k3compile.kernels.norms.reference import upcast_dtype

CHUNK = 1 << 16  # elements per chunk: the scratch and the chunk's slices stay in cache


def _situ(g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, s: list[Tensor], b1: float, b2: float) -> None:
    """SiTU-GLU y = A(g) B(u), A = b1 tanh(g/b1) sigmoid(g), B = b2 tanh(u/b2), with
    dy/dg = B A',  A' = sigmoid(g) (1 - tanh(g/b1)^2) + A (1 - sigmoid(g)),  dy/du = A (1 - tanh(u/b2)^2)."""
    tg, sg, tu = s
    torch.div(g, b1, out=tg).tanh_()
    torch.sigmoid(g, out=sg)
    torch.div(u, b2, out=tu).tanh_()
    a = torch.mul(tg, sg, out=y).mul_(b1)
    torch.mul(tg, tg, out=jg).neg_().add_(1).mul_(sg)  # sigmoid (1 - tanh^2)
    jg.add_(sg.neg_().add_(1).mul_(a))  # + A (1 - sigmoid)
    torch.mul(tu, tu, out=ju).neg_().add_(1).mul_(a)
    tu.mul_(b2)  # B
    jg.mul_(tu)
    y.mul_(tu)


def _swiglu(g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, s: list[Tensor]) -> None:
    """SwiGLU y = silu(g) u, dy/dg = u silu'(g) = u sigmoid(g) (1 + g (1 - sigmoid(g))), dy/du = silu(g)."""
    sg = s[0]
    torch.sigmoid(g, out=sg)
    torch.ops.aten.silu.out(g, out=ju)  # F.silu's own kernel: the bits of swiglu_ref (g * sigmoid(g) is not)
    torch.sub(g, ju, out=jg).add_(1).mul_(sg).mul_(u)  # sigmoid (1 + g - silu) u
    torch.mul(ju, u, out=y)


def glu_fill(g: Tensor, u: Tensor, y: Tensor, jg: Tensor, ju: Tensor, kind: str, beta1: float, beta2: float) -> None:
    """y, dy/dg, dy/du of act(g, u) into y, jg, ju: flat contiguous tensors of the compute dtype, in chunks of
    CHUNK elements through three scratch chunks (kind checked by the caller)."""
    n = g.numel()
    size = max(1, min(CHUNK, n))
    scratch = [g.new_empty(size) for _ in range(3)]
    for i in range(0, n, size):
        j = min(i + size, n)
        s = [t[: j - i] for t in scratch]
        parts = (g[i:j], u[i:j], y[i:j], jg[i:j], ju[i:j])
        if kind == "situ_glu":
            _situ(*parts, s, beta1, beta2)
        else:
            _swiglu(*parts, s)


def glu_train_ref(gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float) -> tuple[Tensor, Tensor, Tensor]:
    """(act(gate, up) in gate's dtype, dy/dgate, dy/dup in the compute dtype, fp32 at least).

    kind "situ_glu" uses beta1/beta2; "swiglu" ignores them.
    """
    check_glu_kind(kind, "glu_train")
    acc = upcast_dtype(gate.dtype)
    y, jg, ju = (torch.empty(gate.shape, dtype=acc, device=gate.device) for _ in range(3))
    g = gate.to(acc).contiguous().view(-1)
    u = up.to(acc).contiguous().view(-1)
    glu_fill(g, u, y.view(-1), jg.view(-1), ju.view(-1), kind, beta1, beta2)
    return y.to(gate.dtype), jg, ju


def glu_train_bwd_ref(
    grads: list[Tensor], outputs: list[Tensor], gate: Tensor, up: Tensor, kind: str, beta1: float, beta2: float
) -> list[Tensor]:
    """[dgate, dup] = dy * (dy/dgate, dy/dup) from the saved derivatives (outputs 1 and 2)."""
    _, jg, ju = outputs
    gy = grads[0].to(jg.dtype)
    return [torch.mul(gy, jg).to(gate.dtype), torch.mul(gy, ju).to(up.dtype)]
