"""The model definition: one nn.Module built from a Spec, the lowering input and the eager reference.

`K3Model(spec)` holds every parameter under the weight inventory's names (`layers.3.attn.q_proj.weight`)
and has three entry points, one per compiled graph:

- `forward(tokens)` -> logits [B, T, V]                                  (the train graph)
- `prefill(tokens, caches)` -> (logits, caches)                          (from empty caches)
- `decode(tokens, positions, caches)` -> (logits, caches)                (one token per sequence)

Caches are a flat dict of tensors with static shapes (see `cache_shapes`): per KDA layer its fp32
recurrent state `kda_state.<i>` [B, H, K, V] and the short-conv tails `kda_conv_{q,k,v}.<i>` [B, P, W-1];
per MLA layer its latent cache `mla_cache.<i>` [B, S, kv_lora + rope], preallocated to S = the
longest sequence served. `positions` [B] (int64) is, per sequence, the row the new token goes to,
so sequences of different lengths decode together and a decode step's shapes never change.

Two kinds of submodule are where lowering stops (see k3compile.ir.lower): each layer's token mixer
(`layers.<i>.attn`, KDA or MLA by the layout; the interleave pass inlines it in the graph's mode) and
each depth site (`layers.<i>.attn_res`, `layers.<i>.ffn_res`, `final_res`: a plain residual sum or
Attention Residuals; the attn_res pass wires it). Run eagerly, they compute the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.analysis.sources import source_plan
from k3compile.modules.attn_res import AttnRes
from k3compile.modules.init import init_parameters
from k3compile.modules.kda import KDAMixer, KDAState
from k3compile.modules.mla import MLAMixer
from k3compile.modules.mlp import MLP
from k3compile.modules.moe import LatentMoE, RoutedExperts
from k3compile.modules.norms import RMSNorm
from k3compile.spec.schema import MIXER_KDA, Spec

GRAPHS = ("train", "prefill", "decode")
KDA_CACHES = ("kda_state", "kda_conv_q", "kda_conv_k", "kda_conv_v")  # KDAState's fields, in order


def make_mixer(spec: Spec, layer: int) -> nn.Module:
    """The token mixer the layout assigns to `layer`, built from the spec's KDA or MLA section."""
    if spec.mixers[layer] == MIXER_KDA:
        k = spec.kda
        return KDAMixer(
            hidden_size=spec.hidden_size,
            num_heads=k.num_heads,
            head_dim=k.head_dim,
            conv_size=k.short_conv_size,
            decay_form=k.decay.form,
            lower_bound=k.decay.lower_bound,
            decay_rank=k.decay.rank or k.head_dim,
            gate_rank=k.output_gate_rank,
            norm_eps=spec.norm_eps,
            delta_rule=k.delta_rule,
            decay_granularity=k.decay.granularity,
        )
    m = spec.mla
    return MLAMixer(
        hidden_size=spec.hidden_size,
        num_heads=m.num_heads,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope=m.rope,
        rope_theta=m.rope_theta,
        output_gate=m.output_gate,
        norm_eps=spec.norm_eps,
        latent_norm_eps=m.latent_norm_eps,
    )


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


class PlainResidual(nn.Module):
    """A depth site of plain residuals: the sum of the embedding and every earlier sublayer output."""

    def __init__(self, site: int):
        super().__init__()
        self.site = site

    def forward(self, outputs: list[Tensor]) -> Tensor:
        if outputs[0].is_meta:  # only the shape matters there: skip the O(sites) sums
            return torch.empty_like(outputs[0])
        h = outputs[0]
        for out in outputs[1:]:
            h = h + out
        return h


class AttnResSite(AttnRes):
    """A depth site of Attention Residuals: the sources its plan names, mixed by AttnRes."""

    def __init__(self, site: int, mode: str, block_size: int | None, hidden_size: int, norm_eps: float):
        super().__init__(hidden_size, norm_eps)
        self.site, self.mode, self.block_size = site, mode, block_size

    def forward(self, outputs: list[Tensor]) -> Tensor:
        if outputs[0].is_meta:  # only the shape matters there: skip the O(sites) sums
            return torch.empty_like(outputs[0])
        sources = []
        for src in source_plan(self.site, self.mode, self.block_size):
            parts = [outputs[1 + k] for k in src.sublayers] if src.sublayers else [outputs[0]]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            sources.append(total)
        return self.mix(torch.stack(sources))

    def mix(self, sources_SBTD: Tensor) -> Tensor:
        """AttnRes over the stacked sources (what the attn_res pass inlines)."""
        return AttnRes.forward(self, sources_SBTD)


DEPTH_SITES = (PlainResidual, AttnResSite)


def make_site(spec: Spec, site: int) -> nn.Module:
    r = spec.residual
    if r.kind == "plain":
        return PlainResidual(site)
    return AttnResSite(site, r.mode, r.block_size, spec.hidden_size, spec.norm_eps)


class Block(nn.Module):
    """One layer: depth site, pre-norm token mixer; depth site, pre-norm FFN (MoE or dense)."""

    def __init__(self, spec: Spec, i: int):
        super().__init__()
        self.index = i
        self.attn_res = make_site(spec, 2 * i)
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = make_mixer(spec, i)
        self.ffn_res = make_site(spec, 2 * i + 1)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        ffn = make_ffn(spec, i)
        if spec.is_moe_layer(i):
            self.moe = ffn
        else:
            self.ffn = ffn

    @property
    def mlp(self) -> nn.Module:
        return self.moe if hasattr(self, "moe") else self.ffn

    def mix(self, x: Tensor, graph: str, caches: dict | None, positions: Tensor | None, new: dict) -> Tensor:
        """The token mixer in `graph`'s form, reading this layer's caches and writing the new ones to `new`."""
        i = self.index
        if isinstance(self.attn, KDAMixer):
            state = None if caches is None else KDAState(*(caches[f"{n}.{i}"] for n in KDA_CACHES))
            y, state = self.attn(x, state, mode="decode" if graph == "decode" else "chunk")
            if caches is not None:
                new.update({f"{n}.{i}": t for n, t in zip(KDA_CACHES, state)})
            return y
        cache = None if caches is None else caches[f"mla_cache.{i}"]
        y, cache = self.attn(x, cache, positions=positions) if graph == "decode" else self.attn(x, cache)
        if caches is not None:
            new[f"mla_cache.{i}"] = cache
        return y


class K3Model(nn.Module):
    """The whole model; see the module docstring for its three entry points and the cache layout."""

    def __init__(self, spec: Spec, init: bool = True):
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        # without init no default fill (on meta, normal_ runs a slow Python reference)
        self.embed = nn.Embedding(spec.vocab_size, d, _weight=None if init else torch.empty(spec.vocab_size, d))
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.num_layers))
        self.final_res = make_site(spec, 2 * spec.num_layers)
        self.final_norm = RMSNorm(d, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(d, spec.vocab_size, bias=False)
        self.tied = spec.tie_embeddings
        if init:
            init_parameters(self, spec)

    def forward(self, tokens):  # unannotated: the emitted code needs no typing imports
        return self._run(tokens, "train", None, None)[0]

    def quantize_as_trained(self) -> K3Model:
        """Fake-quantise, eagerly, what the training build does under the spec's policy with QAT: the routed
        experts' matmul inputs and weights (MX formats). A policy selecting other weights is refused (the
        eager definition has no hook there); the lowering input never calls this."""
        from k3compile.analysis.formats import ELEMENT_OF_POLICY
        from k3compile.spec.weights import activation_format, weight_inventory

        q = self.spec.quantization
        if not q.qat:
            return self
        experts = {name: m for name, m in self.named_modules() if isinstance(m, RoutedExperts)}
        for w in weight_inventory(self.spec):
            afmt = activation_format(self.spec, w.module)
            mx = w.matmul and (w.format in ELEMENT_OF_POLICY or afmt in ELEMENT_OF_POLICY)
            if mx and w.name.rpartition(".")[0].rpartition(".")[0] not in experts:
                raise ValueError(f"quantize_as_trained: the policy quantises {w.name}, outside the routed experts")
        formats = {w.name: w.format for w in weight_inventory(self.spec)}
        for name, m in experts.items():
            wfmt, afmt = formats[f"{name}.up_proj.weight"], activation_format(self.spec, f"{name}.up_proj")
            m.weight_quant = (ELEMENT_OF_POLICY[wfmt], q.block_size) if wfmt in ELEMENT_OF_POLICY else None
            m.act_quant = (ELEMENT_OF_POLICY[afmt], q.block_size) if afmt in ELEMENT_OF_POLICY else None
        return self

    def prefill(self, tokens, caches):
        return self._run(tokens, "prefill", caches, None)

    def decode(self, tokens, positions, caches):
        return self._run(tokens, "decode", caches, positions)

    def _run(self, tokens: Tensor, graph: str, caches: dict | None, positions: Tensor | None):
        outputs = [F.embedding(tokens, self.embed.weight)]
        new: dict = {}
        for layer in self.layers:
            h = layer.attn_res(list(outputs))
            outputs.append(layer.mix(layer.attn_norm(h), graph, caches, positions, new))
            h = layer.ffn_res(list(outputs))
            outputs.append(layer.mlp(layer.ffn_norm(h)))
        h = self.final_norm(self.final_res(list(outputs)))
        logits = F.linear(h, self.embed.weight if self.tied else self.lm_head.weight)
        return logits, new


def cache_shapes(spec: Spec, batch: int, max_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every serving cache, in layer order (the prefill/decode graphs' inputs)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i, kind in enumerate(spec.mixers):
        if kind == MIXER_KDA:
            k = spec.kda
            P = k.num_heads * k.head_dim
            out[f"kda_state.{i}"] = ((batch, k.num_heads, k.head_dim, k.head_dim), torch.float32)
            for n in KDA_CACHES[1:]:
                out[f"{n}.{i}"] = ((batch, P, k.short_conv_size - 1), torch.float32)
        else:
            m = spec.mla
            out[f"mla_cache.{i}"] = ((batch, max_len, m.kv_lora_rank + m.qk_rope_head_dim), torch.float32)
    return out


def empty_caches(spec: Spec, batch: int, max_len: int, device=None, dtype: torch.dtype | None = None) -> dict:
    """Zeroed caches for `batch` sequences of up to `max_len` tokens; `dtype` overrides the non-state ones."""
    return {
        name: torch.zeros(shape, dtype=dt if name.startswith("kda_state") or dtype is None else dtype, device=device)
        for name, (shape, dt) in cache_shapes(spec, batch, max_len).items()
    }
