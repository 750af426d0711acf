"""KDA token mixer: Kimi Delta Attention with short convs, per-channel decay gate and gated output norm."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from k3compile.modules.norms import RMSNorm
from k3compile.kernels.gla.op import gla, gla_decode_step
from k3compile.kernels.kda.op import kda, kda_decode_step, kda_gate
from k3compile.kernels.norms.op import l2_norm, rms_norm_gate
from k3compile.kernels.short_conv.op import short_conv

MIXER_MODES = ("chunk", "recurrent", "decode")


class KDAState(NamedTuple):
    """Decoding state of one KDA layer: the fp32 recurrent state and the last W-1 inputs of each conv."""

    recurrent: Tensor  # [B, H, K, V] fp32
    q_conv: Tensor  # [B, P, W-1]
    k_conv: Tensor
    v_conv: Tensor


class ShortConv(nn.Module):
    """Causal depthwise conv over time followed by SiLU; `weight` is [channels, kernel size]."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))

    def forward(self, x_BTC: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        y, new_state = short_conv(x_BTC, self.weight, state, output_final_state=True)
        return y, new_state


class KDAMixer(nn.Module):
    """Kimi Delta Attention layer (reference section 2).

    q, k, v = SiLU(ShortConv(W_{q,k,v} x)), q and k L2-normalised per head; g from the low-rank
    f = f_up(f_down x) in the K3 ("lower_bounded_sigmoid") or Kimi Linear ("softplus") form;
    beta = sigmoid(b_proj x); y = o_proj(RMSNorm_head(o) * sigmoid(gate x)), gate full rank (g_proj)
    when gate_rank is None, else g_up(g_down x). Ablations: delta_rule=False is plain gated linear attention
    (no b_proj, k3::gla_*); decay_granularity="head" gives one decay per head (f_up: r -> H, dt_bias [H]),
    broadcast over the key channels.

    forward(x, state, mode): mode None picks "chunk" for T > 1 and "decode" (the fused one-token step)
    for T == 1; "recurrent" steps token by token. Pass mode explicitly under torch.fx.symbolic_trace.

    Init: projection matrices normal(0, init_std); conv taps normal(0, 1/sqrt(conv_size)); A_log =
    log(uniform(1, 16)); dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (small, as in
    Mamba); o_norm weight ones.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_size: int = 4,
        decay_form: str = "lower_bounded_sigmoid",
        lower_bound: float | None = -5.0,
        decay_rank: int | None = None,
        gate_rank: int | None = None,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        chunk_size: int = 64,
        delta_rule: bool = True,
        decay_granularity: str = "channel",
    ):
        super().__init__()
        if decay_form == "lower_bounded_sigmoid" and lower_bound is None:
            raise ValueError("decay_form lower_bounded_sigmoid needs a lower_bound (K3 uses -5.0)")
        D, H, K = hidden_size, num_heads, head_dim
        P = H * K
        r = head_dim if decay_rank is None else decay_rank
        if decay_granularity not in ("channel", "head"):
            raise ValueError(f"decay_granularity must be channel or head, got {decay_granularity!r}")
        decays = H if decay_granularity == "head" else P
        self.delta_rule, self.decay_granularity = delta_rule, decay_granularity
        self.num_heads, self.head_dim, self.conv_size = H, K, conv_size
        self.decay_form, self.lower_bound = decay_form, -5.0 if lower_bound is None else lower_bound
        self.gate_rank, self.norm_eps, self.init_std, self.chunk_size = gate_rank, norm_eps, init_std, chunk_size

        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv = ShortConv(P, conv_size)
        self.k_conv = ShortConv(P, conv_size)
        self.v_conv = ShortConv(P, conv_size)
        self.f_down = nn.Linear(D, r, bias=False)
        self.f_up = nn.Linear(r, decays, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(decays))
        if delta_rule:
            self.b_proj = nn.Linear(D, H, bias=False)
        if gate_rank is None:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_down = nn.Linear(D, gate_rank, bias=False)
            self.g_up = nn.Linear(gate_rank, P, bias=False)
        self.o_norm = RMSNorm(K, norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.A_log.is_meta:  # shapes only (and meta normal_ runs a slow Python reference)
            return
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.init_std)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.normal_(conv.weight, std=self.conv_size**-0.5)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
        nn.init.ones_(self.o_norm.weight)

    def _gate(self, x_BTD: Tensor) -> Tensor:
        if self.gate_rank is None:
            return self.g_proj(x_BTD)
        return self.g_up(self.g_down(x_BTD))

    def forward(
        self, x_BTD: Tensor, state: KDAState | None = None, mode: str | None = None
    ) -> tuple[Tensor, KDAState]:
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        if mode is None:
            mode = "decode" if T == 1 else "chunk"
        if mode not in MIXER_MODES:
            raise ValueError(f"unknown KDA mixer mode {mode!r}; expected one of {MIXER_MODES}")
        q, q_state = self.q_conv(self.q_proj(x_BTD), None if state is None else state.q_conv)
        k, k_state = self.k_conv(self.k_proj(x_BTD), None if state is None else state.k_conv)
        v, v_state = self.v_conv(self.v_proj(x_BTD), None if state is None else state.v_conv)
        if mode == "decode" and isinstance(T, int) and T != 1:  # (under fx tracing T is symbolic)
            raise ValueError(f"mode 'decode' takes one token at a time, got T={T}")
        tokens = (B,) if mode == "decode" else (B, T)  # the one-token step ops take [B, H, K]: no token axis
        q, k = l2_norm(q.view(*tokens, H, K)), l2_norm(k.view(*tokens, H, K))
        v = v.view(*tokens, H, K)
        per_head = self.decay_granularity == "head"
        g = kda_gate(self.f_up(self.f_down(x_BTD)).view(*tokens, H, 1 if per_head else K), self.A_log,
                     self.dt_bias, self.decay_form, self.lower_bound)
        if per_head:
            g = g.expand(*tokens, H, K).contiguous()
        recurrent = None if state is None else state.recurrent
        if mode == "decode":
            if recurrent is None:
                recurrent = x_BTD.new_zeros(B, H, K, K, dtype=torch.float32)
            if self.delta_rule:
                beta = torch.sigmoid(self.b_proj(x_BTD).float().view(B, H))
                o, S = kda_decode_step(q, k, v, g, beta, recurrent)
            else:
                o, S = gla_decode_step(q, k, v, g, recurrent)
        elif not self.delta_rule:
            o, S = gla(q, k, v, g, initial_state=recurrent)
        else:
            beta = torch.sigmoid(self.b_proj(x_BTD).float())
            o, S = kda(q, k, v, g, beta, initial_state=recurrent, output_final_state=True, mode=mode,
                       chunk_size=self.chunk_size)
        gate = self._gate(x_BTD).view(*tokens, H, K)
        o = rms_norm_gate(o, self.o_norm.weight, gate, self.norm_eps).reshape(B, T, H * K)
        return self.o_proj(o), KDAState(S, q_state, k_state, v_state)
