"""Eager K3-class model for serving: chunked prefill, then decoding with constant-size KDA state.

Built from the same modules the compiler inlines, with the same parameter names,
so a compiled model's state_dict loads into it. Caches per layer: KDA keeps its
fp32 recurrent state and the short-conv tails (constant in context length); MLA
keeps the normed KV latent and the shared rope key (growing by one row a token).
MoE runs drop-free at inference (dense dispatch, capacity = tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.analysis.formats import ELEMENT_OF_POLICY
from k3compile.ir.lower import Layer
from k3compile.modules.attn_res import AttnRes, AttnResSources
from k3compile.modules.kda import KDAMixer, KDAState
from k3compile.modules.moe import RoutedExperts
from k3compile.modules.norms import RMSNorm
from k3compile.ops.mx import mx_fake_quantize
from k3compile.passes.interleave import make_mixer
from k3compile.spec.schema import Spec
from k3compile.spec.weights import activation_format


@dataclass
class DecodeCache:
    """Per-layer decoding state and the number of tokens seen."""

    layers: list = field(default_factory=list)
    position: int = 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split into KDA state (recurrent + conv) and MLA latent cache."""
        kda = mla = 0
        for state in self.layers:
            if isinstance(state, KDAState):
                kda += sum(t.numel() * t.element_size() for t in state)
            elif isinstance(state, Tensor):
                mla += state.numel() * state.element_size()
        return {"kda_state": kda, "mla_latent": mla, "total": kda + mla}


class DecoderLayer(Layer):
    """The lowered layer with its token mixer resolved and, for attention residuals, its AttnRes modules."""

    def __init__(self, spec: Spec, i: int):
        super().__init__(spec, i)
        self.attn = make_mixer(spec, i)
        if spec.residual.kind == "attn_res":
            self.attn_res = AttnRes(spec.hidden_size, spec.norm_eps)
            self.ffn_res = AttnRes(spec.hidden_size, spec.norm_eps)
        if spec.is_moe_layer(i):
            self.moe.capacity_factor = None  # inference never drops tokens

    def mix(self, x: Tensor, state, position: int) -> tuple[Tensor, object]:
        if isinstance(self.attn, KDAMixer):
            return self.attn(x, state, mode="chunk" if x.shape[1] > 1 else "decode")
        return self.attn(x, state, position)


class Decoder(nn.Module):
    """forward(tokens, cache=None) -> (logits [B, T, V], cache): prefill when cache is None, else continue."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        self.embed = nn.Embedding(spec.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        if spec.residual.kind == "attn_res":
            self.final_res = AttnRes(d, spec.norm_eps)
        self.final_norm = RMSNorm(d, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(d, spec.vocab_size, bias=False)
        self._apply_activation_policy()

    def _apply_activation_policy(self) -> None:
        """Fake-quantise the inputs of matmuls whose policy activation format is MX, as the compiled graph does.

        Weights come in already quantised (an inference build's packed weights, dequantised).
        """
        block = self.spec.quantization.block_size
        for name, module in self.named_modules():
            if isinstance(module, RoutedExperts):
                fmt = activation_format(self.spec, f"{name}.up_proj")
                if fmt in ELEMENT_OF_POLICY:
                    module.act_quant = (ELEMENT_OF_POLICY[fmt], block)
            elif isinstance(module, nn.Linear):
                fmt = activation_format(self.spec, name)
                if fmt in ELEMENT_OF_POLICY:
                    element = ELEMENT_OF_POLICY[fmt]
                    module.register_forward_pre_hook(lambda m, args, e=element: (mx_fake_quantize(args[0], e, block),))

    def forward(self, tokens: Tensor, cache: DecodeCache | None = None) -> tuple[Tensor, DecodeCache]:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tuple(tokens.shape)}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.spec.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        cache = cache or DecodeCache(layers=[None] * len(self.layers))
        end = cache.position + tokens.shape[1]
        if end > self.spec.context_length:
            raise ValueError(f"context of {end} tokens exceeds the spec's context_length {self.spec.context_length}")
        x0 = self.embed(tokens)
        r = self.spec.residual
        sources = AttnResSources(x0, r.mode, r.block_size) if r.kind == "attn_res" else None
        h = x0
        states = []
        for i, layer in enumerate(self.layers):
            inp = layer.attn_res(sources.sources()) if sources else h
            out, state = layer.mix(layer.attn_norm(inp), cache.layers[i], cache.position)
            states.append(state)
            h = _advance(sources, h, out)
            inp = layer.ffn_res(sources.sources()) if sources else h
            out = layer.mlp(layer.ffn_norm(inp))
            h = _advance(sources, h, out)
        final = self.final_res(sources.sources()) if sources else h
        head = self.embed.weight if self.spec.tie_embeddings else self.lm_head.weight
        logits = F.linear(self.final_norm(final), head)
        return logits, DecodeCache(layers=states, position=end)


def _advance(sources: AttnResSources | None, h: Tensor, out: Tensor) -> Tensor:
    if sources is not None:
        sources.add(out)
        return h
    return h + out
