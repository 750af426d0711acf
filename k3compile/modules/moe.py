"""Stable LatentMoE: a biased top-k router with load balancing, fixed-capacity routed experts, shared experts.

    y = shared(x) + W_up RMSNorm( sum_{i in top-k} p_i E_i(W_down x) )

Without a latent size the routed experts run at full width and there is no W_down, norm or W_up.

Routing statistics are non-persistent buffers of `router`, updated in place by forward in training
mode only (plain tensor ops, so fx tracing, torch.compile(fullgraph=True) and meta all see ordinary
buffer mutations; an eval forward, for validation or decoding, mutates nothing):
`router.load` (assignments per expert before dropping, int64) and `router.dropped` (choices over
capacity, int64), accumulated until `update_balance()`; `router.qb_bias` (exact QB: the bias derived
from the last batch) or `router.qb_counts` (histogram QB: margin counts, accumulated); `router.aux_loss`
(the last auxiliary loss, detached) when balancing is "aux_loss", whose gradient reaches training
through `attach_aux_loss` on the routing weights, so forward returns only y.
The trainer calls `update_balance()` once per optimizer step (after all-reducing `router.load` or
`router.qb_counts` across data-parallel ranks if it wants global statistics): the new selection bias
then applies from the next step, never to the batch it was measured on, and is frozen at inference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.modules.mlp import MLP, check_activation
from k3compile.modules.norms import RMSNorm
from k3compile.kernels.balancing.op import (
    attach_aux_loss,
    aux_balance_loss,
    qb_histogram,
    qb_update_from_histogram,
    quantile_balance_update,
    sign_balance_update,
)
from k3compile.kernels.moe.op import expert_mlp, moe_combine, moe_dispatch, route

BALANCING = ("quantile", "bias_sign", "aux_loss", "none")


def _uniform_fan_in(weight: Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)


class Router(nn.Module):
    """Router weight [E, D], fp32 selection bias [E] (a persistent buffer, not a parameter) and balancing state.

    Logits are computed in fp32. The bias and the fp32 statistics stay fp32 under `module.to(dtype)`.
    """

    FP32_BUFFERS = ("bias", "qb_bias", "aux_loss")

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        scoring: str = "sigmoid",
        routed_scaling: float = 1.0,
        renormalize: bool = True,
        balancing: str = "quantile",
        histogram_bins: int | None = None,
        bias_update_rate: float = 1e-3,
        aux_loss_coef: float = 1e-3,
    ):
        super().__init__()
        if balancing not in BALANCING:
            raise ValueError(f"balancing must be one of {BALANCING}, got {balancing!r}")
        if histogram_bins is not None and balancing != "quantile":
            raise ValueError("histogram_bins only applies to quantile balancing")
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.routed_scaling, self.renormalize = scoring, routed_scaling, renormalize
        self.balancing, self.histogram_bins = balancing, histogram_bins
        self.bias_update_rate, self.aux_loss_coef = bias_update_rate, aux_loss_coef
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        if balancing == "quantile" and histogram_bins is None:
            self.register_buffer("qb_bias", torch.zeros(num_experts), persistent=False)
        if balancing == "quantile" and histogram_bins is not None:
            counts = torch.zeros(num_experts, histogram_bins, dtype=torch.int64)
            self.register_buffer("qb_counts", counts, persistent=False)
        if balancing == "aux_loss":
            self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _uniform_fan_in(self.weight, self.weight.shape[1])
        self.bias.zero_()

    def _apply(self, fn, recurse=True):
        kept = {n: b for n, b in self._buffers.items() if n in self.FP32_BUFFERS}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():  # follow the device move, keep the fp32 values
            new = self._buffers[name]
            self._buffers[name] = new.float() if old.is_meta or new.is_meta else old.to(new.device)
        return out

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights [T, K] (fp32) and expert indices [T, K]; in training, records balancing statistics."""
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 router (float64 stays float64)
        logits = F.linear(x_TD.to(acc), self.weight.to(acc))
        weights, indices, scores = route(
            logits, self.bias, self.top_k, self.scoring, self.renormalize, self.routed_scaling
        )
        if self.training:
            weights = self._record_balancing(weights, indices, scores)
        return weights, indices

    def _record_balancing(self, weights: Tensor, indices: Tensor, scores: Tensor) -> Tensor:
        if self.balancing == "quantile" and self.histogram_bins is None:
            self.qb_bias.copy_(quantile_balance_update(scores.detach(), self.bias, self.top_k))
        elif self.balancing == "quantile":
            self.qb_counts.add_(qb_histogram(scores.detach(), self.bias, self.top_k, self.histogram_bins))
        elif self.balancing == "aux_loss":
            aux = aux_balance_loss(scores, indices)
            self.aux_loss.copy_(aux.detach())
            weights = attach_aux_loss(weights, aux, self.aux_loss_coef)
        return weights

    @torch.no_grad()
    def update_balance(self) -> dict[str, Tensor]:
        """Apply the balancing rule to the selection bias, reset the statistics, return them as they were.

        quantile: bias from the last training batch (exact) or from the accumulated histogram;
        bias_sign: one sign step on the accumulated load; aux_loss, none: the bias is untouched.
        Without a training forward since the last call the bias is left as it is.
        """
        stats = {"load": self.load.clone(), "dropped": self.dropped.clone()}
        seen = self.load.sum() > 0
        if self.balancing == "quantile" and self.histogram_bins is None:
            new = self.qb_bias
        elif self.balancing == "quantile":
            new = qb_update_from_histogram(self.qb_counts, self.bias, self.top_k)
            self.qb_counts.zero_()
        elif self.balancing == "bias_sign":
            new = sign_balance_update(self.load, self.bias, self.bias_update_rate)
        else:
            new = self.bias
        self.bias.copy_(torch.where(seen, new, self.bias))
        self.load.zero_()
        self.dropped.zero_()
        return stats


class StackedWeight(nn.Module):
    """One weight [E, out, in] for all experts (holder, so the parameter is named `<proj>.weight`)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _uniform_fan_in(self.weight, self.weight.shape[-1])


class RoutedExperts(nn.Module):
    """E experts as stacked weights gate/up [E, I, w] and down [E, w, I], run as batched matmuls on [E, C, w]."""

    def __init__(
        self,
        num_experts: int,
        width: int,
        intermediate_size: int,
        activation: str,
        beta1: float | None = None,
        beta2: float | None = None,
    ):
        super().__init__()
        check_activation(activation, beta1, beta2)
        self.activation, self.beta1, self.beta2 = activation, beta1, beta2
        self.act_quant: tuple[str, int] | None = None  # (MX element format, block) for the matmul inputs
        self.weight_quant: tuple[str, int] | None = None  # (MX element format, block): QAT of the weights
        if activation != "gelu":
            self.gate_proj = StackedWeight(num_experts, intermediate_size, width)
        self.up_proj = StackedWeight(num_experts, intermediate_size, width)
        self.down_proj = StackedWeight(num_experts, width, intermediate_size)

    def forward(self, buffer_ECW: Tensor) -> Tensor:
        gate = self.gate_proj.weight if self.activation != "gelu" else None
        b1, b2 = (self.beta1, self.beta2) if self.activation == "situ_glu" else (0.0, 0.0)
        return expert_mlp(
            buffer_ECW, gate, self.up_proj.weight, self.down_proj.weight, self.activation, b1, b2, self.act_quant,
            self.weight_quant,
        )


class LatentMoE(nn.Module):
    """Stable LatentMoE layer on [..., D] inputs (see the module docstring for the statistics it records).

    capacity_factor: per-expert buffer C = ceil(capacity_factor * T * k / n); None is the dense mode
    (C = T, nothing dropped; for decoding and tests). It is a plain attribute and may be changed.
    beta1/beta2 are used by situ_glu only. The S shared experts of width Is are one MLP of width S*Is.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        num_shared_experts: int = 0,
        shared_intermediate_size: int | None = None,
        latent_size: int | None = None,
        latent_norm: bool = True,
        activation: str = "situ_glu",
        beta1: float | None = 4.0,
        beta2: float | None = 25.0,
        scoring: str = "sigmoid",
        routed_scaling: float = 1.0,
        renormalize: bool = True,
        balancing: str = "quantile",
        histogram_bins: int | None = None,
        capacity_factor: float | None = 1.25,
        norm_eps: float = 1e-5,
        bias_update_rate: float = 1e-3,
        aux_loss_coef: float = 1e-3,
    ):
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) exceeds num_experts ({num_experts})")
        if num_shared_experts > 0 and shared_intermediate_size is None:
            raise ValueError("num_shared_experts > 0 needs shared_intermediate_size")
        betas = (beta1, beta2) if activation == "situ_glu" else ()
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.router = Router(
            hidden_size, num_experts, top_k, scoring, routed_scaling, renormalize, balancing, histogram_bins,
            bias_update_rate, aux_loss_coef,
        )  # fmt: skip
        latent = latent_size is not None
        width = latent_size if latent else hidden_size
        self.latent_down = nn.Linear(hidden_size, width, bias=False) if latent else None
        self.latent_norm = RMSNorm(width, norm_eps) if latent and latent_norm else None
        self.latent_up = nn.Linear(width, hidden_size, bias=False) if latent else None
        self.experts = RoutedExperts(num_experts, width, expert_intermediate_size, activation, *betas)
        self.shared_experts = None
        if num_shared_experts > 0:
            self.shared_experts = MLP(hidden_size, num_shared_experts * shared_intermediate_size, activation, *betas)

    def forward(self, x: Tensor) -> Tensor:
        x_TD = x.reshape(-1, self.hidden_size)
        weights, indices = self.router(x_TD)
        h = self.latent_down(x_TD) if self.latent_down is not None else x_TD
        buffer, slots, load, dropped = moe_dispatch(h, indices, self.num_experts, self.capacity_factor)
        if self.training:
            self.router.load.add_(load)
            self.router.dropped.add_(dropped)
        u = moe_combine(self.experts(buffer), weights, slots)
        if self.latent_norm is not None:
            u = self.latent_norm(u)
        y = self.latent_up(u) if self.latent_up is not None else u
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_TD)
        return y.view(x.shape)  # (view_as is two aten calls)

    def update_balance(self) -> dict[str, Tensor]:
        """Apply load balancing to the router bias (once per optimizer step); returns the statistics."""
        return self.router.update_balance()
