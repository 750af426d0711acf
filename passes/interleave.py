"""interleave: resolve each layer's generic token mixer into KDA or Gated MLA, per the spec's layout."""

from __future__ import annotations

import torch
from torch import fx, nn

from k3compile.ir.generic_ops import TOKEN_MIXER
from k3compile.ir.init import init_parameters
from k3compile.ir.inline import inline_module
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.modules.kda import KDAMixer
from k3compile.modules.mla import MLAMixer
from k3compile.spec.schema import MIXER_KDA, Spec


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


def _device(gm: fx.GraphModule) -> torch.device:
    return next(gm.parameters()).device


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    counts = {"kda_layers": 0, "mla_layers": 0, "nodes_added": 0}
    before = len(gm.graph.nodes)
    device = _device(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not TOKEN_MIXER:
            continue
        x, layer = node.args
        with torch.device(device):
            mixer = make_mixer(ctx.spec, layer)
        path = f"layers.{layer}.attn"
        init_parameters(mixer, ctx.spec, path)
        kwargs = {"mode": "chunk"} if ctx.spec.mixers[layer] == MIXER_KDA else {}
        inline_module(gm, node, mixer, path, x, **kwargs)
        counts["kda_layers" if ctx.spec.mixers[layer] == MIXER_KDA else "mla_layers"] += 1
    counts["nodes_added"] = len(gm.graph.nodes) - before
    return counts


PASS = GraphPass(
    name="interleave",
    summary="resolve each layer's generic token mixer into KDA or Gated MLA per the layout",
    preserves_numerics=False,
    statistics=("kda_layers", "mla_layers", "nodes_added"),
    run=run,
)
