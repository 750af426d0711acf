"""Parameter initialisation: seeded per parameter name, so a weight's value never depends on build order.

Rules, first match wins (d = hidden size, L = layers, std = spec.init_std):

| parameter | init |
|---|---|
| `*norm.weight` | ones |
| `*attn_res.query`, `*ffn_res.query`, `final_res.query` | zeros (AttnRes starts as a plain average) |
| `*.A_log` | log(U(1, 16)) per head |
| `*.dt_bias` | zeros |
| `*_conv.weight` (depthwise short conv, W taps) | U(-1/sqrt(W), 1/sqrt(W)) |
| `*.o_proj.weight`, `*.down_proj.weight`, `*.latent_up.weight` | N(0, std / sqrt(2 L)) (residual-branch outputs) |
| every other parameter | N(0, std) |

Buffers keep the values their module gave them (the router's selection bias starts at zero).
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
from torch import nn

from k3compile.spec.schema import Spec


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def initial_value(name: str, shape: tuple[int, ...], spec: Spec) -> torch.Tensor:
    """The fp32 initial value of parameter `name` (on the CPU), by the rules above."""
    return _init_value(name, torch.Size(shape), spec, _generator(spec.training.seed, name))


def _init_value(name: str, shape: torch.Size, spec: Spec, gen: torch.Generator) -> torch.Tensor:
    std = spec.init_std
    if fnmatch.fnmatchcase(name, "*norm.weight"):
        return torch.ones(shape)
    if name.endswith(".query"):
        return torch.zeros(shape)
    if name.endswith(".A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if name.endswith(".dt_bias"):
        return torch.zeros(shape)
    if fnmatch.fnmatchcase(name, "*_conv.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if any(name.endswith(s) for s in (".o_proj.weight", ".down_proj.weight", ".latent_up.weight")):
        std = std / math.sqrt(2 * spec.num_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(module: nn.Module, spec: Spec, prefix: str = "") -> None:
    """Initialise every parameter of `module` by the rules above; `prefix` is its path in the model."""
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            continue
        full = f"{prefix}.{name}" if prefix else name
        p.copy_(initial_value(full, p.shape, spec).to(p.dtype))
