"""nn.Module building blocks over k3 ops; parameter names match the spec weight inventory."""

from k3compile.modules.attn_res import AttnRes, AttnResSources, source_plan
from k3compile.modules.kda import KDAMixer, KDAState, ShortConv
from k3compile.modules.mla import MLAMixer
from k3compile.modules.mlp import MLP
from k3compile.modules.moe import LatentMoE, Router, RoutedExperts
from k3compile.modules.norms import RMSNorm

__all__ = [
    "MLP",
    "AttnRes",
    "AttnResSources",
    "KDAMixer",
    "KDAState",
    "LatentMoE",
    "MLAMixer",
    "RMSNorm",
    "Router",
    "RoutedExperts",
    "ShortConv",
    "source_plan",
]
