"""Lowering: Spec -> torch.fx.GraphModule over k3 ops, with readable parameter names.

Lowering emits the skeleton every K3-class model shares: embedding, per layer a
generic token mixer and an FFN (dense MLP or LatentMoE) each behind a pre-norm,
generic depth mixes in front of every sublayer, the final norm and head. The
passes then decide what is generic (interleave: KDA or MLA; attn_res: how depth
is mixed). Full-size specs lower on the meta device with no weight memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from k3compile.ir.generic_ops import DEPTH_MIX, TOKEN_MIXER
from k3compile.ir.init import init_parameters
from k3compile.ir.verify import eliminate_dead_code
from k3compile.modules.mlp import MLP
from k3compile.modules.moe import LatentMoE
from k3compile.modules.norms import RMSNorm
from k3compile.spec.schema import Spec

EXAMPLE_BATCH, EXAMPLE_TOKENS = 2, 8  # shapes used to verify graphs with fake tensors


class FlatTracer(fx.Tracer):
    """Traces through every module (nn.Linear included) so the graph holds ops, not modules."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


class TokenMixerSlot(nn.Module):
    """Placeholder for a layer's attention until the interleave pass resolves it."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return TOKEN_MIXER(x, self.layer)


def make_ffn(spec: Spec, layer: int) -> nn.Module:
    """The FFN of one layer: LatentMoE on MoE layers, a dense MLP elsewhere."""
    a = spec.activation
    if not spec.is_moe_layer(layer):
        return MLP(spec.hidden_size, spec.dense_ffn.intermediate_size, a.kind, a.beta1, a.beta2)
    m = spec.moe
    r = m.router
    return LatentMoE(
        hidden_size=spec.hidden_size,
        num_experts=m.num_experts,
        top_k=m.top_k,
        expert_intermediate_size=m.expert_intermediate_size,
        num_shared_experts=m.num_shared_experts,
        shared_intermediate_size=m.shared_intermediate_size,
        latent_size=m.latent_size,
        latent_norm=m.latent_norm,
        activation=a.kind,
        beta1=a.beta1,
        beta2=a.beta2,
        scoring=r.scoring,
        routed_scaling=r.routed_scaling,
        renormalize=r.renormalize,
        balancing=r.balancing,
        histogram_bins=r.histogram_bins,
        capacity_factor=m.capacity_factor,
        norm_eps=spec.norm_eps,
        bias_update_rate=r.bias_update_rate,
        aux_loss_coef=r.aux_loss_coef,
    )


class Layer(nn.Module):
    def __init__(self, spec: Spec, i: int):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = TokenMixerSlot(i)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        ffn = make_ffn(spec, i)
        if spec.is_moe_layer(i):
            self.moe = ffn
        else:
            self.ffn = ffn

    @property
    def mlp(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.ffn


class Skeleton(nn.Module):
    """The generic model: what lowering traces."""

    def __init__(self, spec: Spec):
        super().__init__()
        d = spec.hidden_size
        self.embed = nn.Embedding(spec.vocab_size, d)
        self.layers = nn.ModuleList(Layer(spec, i) for i in range(spec.num_layers))
        self.final_norm = RMSNorm(d, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(d, spec.vocab_size, bias=False)
        self.tied = spec.tie_embeddings

    def forward(self, tokens):  # unannotated: the emitted code needs no typing imports
        outputs = [F.embedding(tokens, self.embed.weight)]
        for i, layer in enumerate(self.layers):
            h = DEPTH_MIX(list(outputs), 2 * i)
            outputs.append(layer.attn(layer.attn_norm(h)))
            h = DEPTH_MIX(list(outputs), 2 * i + 1)
            outputs.append(layer.mlp(layer.ffn_norm(h)))
        h = self.final_norm(DEPTH_MIX(list(outputs), 2 * len(self.layers)))
        return F.linear(h, self.embed.weight if self.tied else self.lm_head.weight)


@dataclass
class Lowered:
    gm: fx.GraphModule
    example_inputs: tuple  # token ids on the graph's device, for verification and numerics


def example_tokens(spec: Spec, device: torch.device | str, batch: int = EXAMPLE_BATCH, tokens: int = EXAMPLE_TOKENS):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    return ids.to(device)


def lower(spec: Spec, device: torch.device | str = "meta") -> Lowered:
    """Trace the skeleton of `spec`; real devices get initialised weights (see k3compile.ir.init)."""
    with torch.device(device):
        root = Skeleton(spec)
    init_parameters(root, spec)
    graph = FlatTracer().trace(root)
    gm = fx.GraphModule(root, graph, class_name=_class_name(spec))
    eliminate_dead_code(gm)  # tuple outputs a configuration leaves unread (router scores without QB)
    gm.recompile()
    _keep_buffer_persistence(root, gm)
    return Lowered(gm, (example_tokens(spec, device),))


def _keep_buffer_persistence(root: nn.Module, gm: fx.GraphModule) -> None:
    """fx copies buffers as persistent; mark the ones the modules keep out of state_dict again."""
    for path, module in root.named_modules():
        for leaf in module._non_persistent_buffers_set:
            try:
                owner = gm.get_submodule(path)
            except AttributeError:  # fx copied nothing of this module: the graph never reads it
                continue
            if hasattr(owner, leaf):
                owner._non_persistent_buffers_set.add(leaf)


def _class_name(spec: Spec) -> str:
    return "K3_" + "".join(c if c.isalnum() else "_" for c in spec.name)
