"""Parameter initialisation: seeded per parameter name, so a weight's value never depends on build order.

Rules, first match wins (d = hidden size, L = layers, std = spec.init_std):

| parameter | init |
|---|---|
| `*norm.weight` | ones |
| `*attn_res.query`, `*ffn_res.query`, `final_res.query` | zeros (AttnRes starts as a plain average) |
| `*.A_log` | log(U(1, 16)) per head |
| `*.dt_bias` | the published decay convention, below |
| `*_conv.weight` (depthwise short conv, W taps) | U(-1/sqrt(W), 1/sqrt(W)) |
| `*.o_proj.weight`, `*.down_proj.weight`, `*.latent_up.weight` | N(0, std / sqrt(2 L)) (residual-branch outputs) |
| every other parameter | N(0, std) |

Buffers keep the values their module gave them (the router's selection bias starts at zero).

Values are drawn on the device the parameter lives on, from a generator of that device seeded by the name:
on the CPU the numbers above, bit for bit, on every machine; on a GPU its own (Philox) stream, drawn there,
so a large model is initialised where it lives without a pass through host memory. Each parameter's whole
value is one call per rule, whatever its number of experts.

KDA decay (the convention of fla's KimiDeltaAttention and transformers' Kimi Linear): per channel
dt = exp(U(log 1e-3, log 1e-1)). The softplus form takes dt_bias = softplus^-1(dt), so at f = 0 a
channel keeps exp(-exp(A_log) * dt) of its state per step: a median of about 0.94 with A_log =
log U(1, 16). The lower-bounded sigmoid form (K3) takes the dt_bias that gives the same decay at
f = 0: lower_bound * sigmoid(exp(A_log) * dt_bias) = -exp(A_log) * dt, i.e. dt_bias =
logit(exp(A_log) * dt / -lower_bound) / exp(A_log); where a bound above -1.6 cannot decay that fast,
the ratio is capped just below 1 (the strongest decay the bound allows). With K3's bound of -5 the
median kept is the same 0.94; a dt_bias of zero would keep only about 0.08 per step.
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
from torch import nn

from k3compile.spec.schema import Spec


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def initial_value(
    name: str, shape: tuple[int, ...], spec: Spec, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The fp32 initial value of parameter `name`, by the rules above, drawn on `device`."""
    device = torch.device(device)
    return _init_value(name, torch.Size(shape), spec, _generator(spec.training.seed, name, device), device)


def _init_value(name: str, shape: torch.Size, spec: Spec, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    std = spec.init_std
    if fnmatch.fnmatchcase(name, "*norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".query"):
        return torch.zeros(shape, device=device)
    if name.endswith(".A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith(".dt_bias"):
        return _dt_bias(name, shape, spec, gen, device)
    if fnmatch.fnmatchcase(name, "*_conv.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=gen)
    if any(name.endswith(s) for s in (".o_proj.weight", ".down_proj.weight", ".latent_up.weight")):
        std = std / math.sqrt(2 * spec.num_layers)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


DT_MIN, DT_MAX = 1e-3, 1e-1  # the published range of the per-channel step size dt
RATIO_CAP = 1 - 1e-6  # sigmoid's reach: g can come as close to lower_bound as this


def _dt_bias(name: str, shape: torch.Size, spec: Spec, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """dt_bias [H*K] by the decay convention above; reads its layer's A_log (seeded by its own name)."""
    dt = torch.empty(shape, device=device).uniform_(math.log(DT_MIN), math.log(DT_MAX), generator=gen).exp()
    decay = spec.kda.decay
    if decay.form == "softplus":
        return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    a_log_name = name.removesuffix("dt_bias") + "A_log"
    heads = spec.kda.num_heads
    a = initial_value(a_log_name, (heads,), spec, device).exp().repeat_interleave(shape[0] // heads)
    return torch.logit((a * dt / -decay.lower_bound).clamp(max=RATIO_CAP)) / a


@torch.no_grad()
def init_parameters(module: nn.Module, spec: Spec, prefix: str = "") -> None:
    """Initialise every parameter of `module` by the rules above; `prefix` is its path in the model."""
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        full = f"{prefix}.{name}" if prefix else name
        p.copy_(initial_value(full, p.shape, spec, p.device))
