"""The dense MLP: gated (SiTU-GLU, SwiGLU) or ungated GELU."""

from __future__ import annotations

from torch import Tensor, nn

from k3compile.kernels.activations.op import gelu, situ_glu, swiglu

ACTIVATIONS = ("situ_glu", "swiglu", "gelu")


def check_activation(activation: str, beta1: float | None, beta2: float | None) -> None:
    """The activation is known and has its betas exactly when it is SiTU-GLU."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "situ_glu" and (beta1 is None or beta2 is None):
        raise ValueError("situ_glu needs beta1 and beta2 (K3: 4 and 25)")
    if activation != "situ_glu" and (beta1 is not None or beta2 is not None):
        raise ValueError(f"beta1/beta2 only apply to situ_glu, not {activation}")


class MLP(nn.Module):
    """y = down(act(gate x, up x)) for situ_glu / swiglu; y = down(gelu(up x)) for gelu (exact erf form).

    Parameters: gate_proj.weight [I, D] (gated kinds only), up_proj.weight [I, D], down_proj.weight [D, I].
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        beta1: float | None = None,
        beta2: float | None = None,
    ):
        super().__init__()
        check_activation(activation, beta1, beta2)
        self.activation, self.beta1, self.beta2 = activation, beta1, beta2
        if activation != "gelu":
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "gelu":
            return self.down_proj(gelu(self.up_proj(x)))
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "situ_glu":
            return self.down_proj(situ_glu(gate, up, self.beta1, self.beta2))
        return self.down_proj(swiglu(gate, up))

    def extra_repr(self) -> str:
        betas = f", beta1={self.beta1}, beta2={self.beta2}" if self.activation == "situ_glu" else ""
        return f"activation={self.activation}{betas}"
