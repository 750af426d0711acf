"""What each unit of a model (the embedding, every layer, the head) holds, saves and caches, from the spec alone.

`k3compile plan` places units on pipeline stages and divides each unit's numbers by the layout's degrees, so
everything here is split into three groups by how a layout shards it:

- `tp`: cut by tensor parallelism (attention heads of KDA and MLA, the FFN intermediate of the dense FFN and
  the shared experts, the vocabulary of the embedding and head); a TP rank holds 1/tp;
- `rep`: whole on every TP rank (norms, AttnRes, router, latent projections, the low-rank parts of MLA and
  KDA: q_a/kv_a, the decay's f_down, a low-rank output gate's g_down, the per-head-dim o_norm);
- `exp`: the routed experts, which expert parallelism splits (E / ep per rank) and tensor parallelism never cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3compile.analysis.formats import storage_bytes
from k3compile.analysis.memory import layer_cache_bytes
from k3compile.analysis.sources import SUBLAYERS_PER_LAYER, source_plan
from k3compile.runtime.muon import default_use_muon
from k3compile.spec.schema import MIXER_KDA, MIXER_MLA, Spec
from k3compile.spec.weights import Weight, weight_inventory

GROUPS = ("tp", "rep", "exp")
TP_COMPONENTS = frozenset({"embedding", "output_head", "kda", "mla", "dense_ffn", "shared_experts"})
TP_WHOLE = {  # tensors of a TP-cut component that every TP rank keeps whole (low-rank inputs, per-dim norms)
    "kda": (".f_down.weight", ".g_down.weight", ".o_norm.weight"),
    "mla": (".q_a_proj.weight", ".q_a_norm.weight", ".kv_a_proj.weight", ".kv_a_norm.weight"),
}


def tp_group(w: Weight) -> str:
    """The sharding group of weight `w`: "tp" (cut by tensor parallelism), "rep" (whole) or "exp" (routed experts)."""
    if w.component == "routed_experts":
        return "exp"
    if w.component in TP_COMPONENTS and not w.name.endswith(TP_WHOLE.get(w.component, ())):
        return "tp"
    return "rep"


def tp_widths(spec: Spec) -> dict[str, int]:
    """The widths tensor parallelism cuts, each of which the TP degree must divide."""
    widths = {"vocab_size": spec.vocab_size}
    if spec.kda is not None and MIXER_KDA in spec.mixers:
        widths["kda.num_heads"] = spec.kda.num_heads
    if spec.mla is not None and MIXER_MLA in spec.mixers:
        widths["mla.num_heads"] = spec.mla.num_heads
    if spec.dense_ffn is not None and spec.dense_layers:
        widths["dense_ffn.intermediate_size"] = spec.dense_ffn.intermediate_size
    if spec.moe is not None and spec.moe.num_shared_experts:
        widths["moe.shared_intermediate_size"] = spec.moe.shared_intermediate_size
    return widths


def _groups() -> dict[str, int]:
    return dict.fromkeys(GROUPS, 0)


@dataclass
class Unit:
    """One unit's numbers. Per group: parameter elements, fp32 optimiser-state elements, elements of Muon-routed
    matrices, serving bytes under the quantisation policy (whole, before any split)."""

    name: str  # "embed", "layers.<i>" or "head"
    layer: int | None = None
    params: dict[str, int] = field(default_factory=_groups)
    state: dict[str, int] = field(default_factory=_groups)
    muon: dict[str, int] = field(default_factory=_groups)
    policy: dict[str, int] = field(default_factory=_groups)
    act_tp: int = 0  # fp32 elements a token saves for backward without recomputation, cut by TP (heads, sequence)
    act_rep: int = 0  # ... and whole on every TP rank (MLA's shared latent)
    act_ckpt: int = 0  # fp32 elements a token keeps under per-layer activation checkpointing (cut by TP)
    tp_attention: int = 0  # TP regions (an all-gather in, a reduce-scatter out) in the forward: attention
    tp_ffn: int = 0  # ... the dense FFN or the shared experts
    moe: bool = False
    cache_token: int = 0  # decode-cache bytes per sequence and context token, whole on every TP rank (MLA latent)
    cache_sequence: int = 0  # decode-cache bytes per sequence independent of context, cut by TP (KDA state, conv)


def _optimizer_slots(spec: Spec, w: Weight) -> int:
    """fp32 state tensors per element: 1 for a Muon matrix (momentum), 2 for AdamW (exp_avg, exp_avg_sq)."""
    return 1 if _is_muon(spec, w) else 2


def _is_muon(spec: Spec, w: Weight) -> bool:
    return spec.training.optimizer != "adamw" and default_use_muon(w.name, torch.empty(w.shape, device="meta"))


def _layer_activations(spec: Spec, i: int, unit: Unit) -> None:
    """An estimate of what one token saves for backward in layer i (fp32 elements; docs/distributed.md)."""
    d = spec.hidden_size
    unit.act_tp += 10 * d  # norms, residual/AttnRes inputs, mixer and FFN inputs and outputs
    if spec.mixers[i] == MIXER_KDA:
        k = spec.kda
        unit.act_tp += 6 * k.num_heads * k.head_dim  # q, k, v, gate, decay, output
    else:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        unit.act_tp += m.num_heads * (2 * qk + 2 * m.v_head_dim)
        unit.act_rep += m.kv_lora_rank + m.qk_rope_head_dim
    if spec.is_moe_layer(i):
        moe = spec.moe
        w = moe.latent_size or d
        slots = min(moe.top_k * moe.capacity_factor, moe.num_experts)  # buffer rows per token
        unit.act_tp += math.ceil(slots * (2 * w + 3 * moe.expert_intermediate_size)) + 2 * w
        unit.act_tp += 3 * moe.num_shared_experts * (moe.shared_intermediate_size or 0)
    else:
        unit.act_tp += 3 * spec.dense_ffn.intermediate_size
    # Under checkpointing a layer keeps only what later layers read: its output (plain residual), the running sum
    # of its block (block AttnRes), or each sublayer's output (full AttnRes, one source per sublayer).
    full = spec.residual.kind == "attn_res" and spec.residual.mode == "full"
    unit.act_ckpt += (SUBLAYERS_PER_LAYER if full else 1) * d


def units(spec: Spec) -> list[Unit]:
    """[embed, layer 0, ..., layer L-1, head]: the embedding table is the first stage's, the final AttnRes, norm
    and output head the last stage's (with tied embeddings the table is in `embed`)."""
    L, d = spec.num_layers, spec.hidden_size
    out = [Unit("embed")] + [Unit(f"layers.{i}", i) for i in range(L)] + [Unit("head")]
    block = spec.quantization.block_size
    for w in weight_inventory(spec):
        u = out[0] if w.name.startswith("embed.") else out[-1] if w.layer is None else out[1 + w.layer]
        g = tp_group(w)
        u.params[g] += w.numel
        u.state[g] += _optimizer_slots(spec, w) * w.numel
        u.muon[g] += w.numel if _is_muon(spec, w) else 0
        u.policy[g] += storage_bytes(w.numel, w.format, block)
    out[0].act_ckpt = d  # the embedding output, the first AttnRes source
    out[-1].act_tp = out[-1].act_ckpt = 2 * spec.vocab_size  # logits and their fp32 softmax (never recomputed)
    for i, mixer in enumerate(spec.mixers):
        u = out[1 + i]
        _layer_activations(spec, i, u)
        u.moe = spec.is_moe_layer(i)
        u.tp_attention = 1
        u.tp_ffn = 0 if u.moe and not spec.moe.num_shared_experts else 1
        cache = layer_cache_bytes(spec, mixer, 1, 1)
        u.cache_token = cache.get("mla_latent", 0)
        u.cache_sequence = cache.get("kda_state", 0) + cache.get("short_conv", 0)
    return out


def carried_sources(spec: Spec, layer: int) -> int:
    """[B, T, D] tensors a pipeline stage starting at `layer` receives from the one before (and returns gradients
    for): the hidden state with plain residuals; with attention residuals every source that layer's first AttnRes
    reads, which covers all later ones: the embedding, each finished block's summary and the current block's
    partial sum (block mode), or the embedding and every earlier sublayer output (full mode)."""
    r = spec.residual
    if r.kind != "attn_res":
        return 1
    return len(source_plan(SUBLAYERS_PER_LAYER * layer, r.mode, r.block_size))
