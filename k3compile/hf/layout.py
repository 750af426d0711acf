"""Tensor names and layouts: each k3compile tensor and the Kimi Linear checkpoint tensors it is made of.

The published checkpoints (and transformers' `save_pretrained`) store, per layer `model.layers.{i}.`:

| k3compile `layers.{i}.`               | checkpoint                                         | layout                        |
|---------------------------------------|----------------------------------------------------|-------------------------------|
| `attn_norm`, `ffn_norm`               | `input_layernorm`, `post_attention_layernorm`      | same                          |
| KDA `attn.{q,k,v}_conv.weight` [P, W] | `self_attn.{q,k,v}_conv1d.weight` [P, 1, W]        | Conv1d's group axis           |
| KDA `attn.A_log` [H]                  | `self_attn.A_log` [1, 1, H, 1]                     | broadcast axes                |
| KDA `attn.f_down/f_up/g_down/g_up`    | `self_attn.f_a_proj/f_b_proj/g_a_proj/g_b_proj`    | same                          |
| MLA `attn.kv_a_proj`, `*_a_norm`      | `self_attn.kv_a_proj_with_mqa`, `*_a_layernorm`    | same                          |
| `moe.router.weight`, `.bias`          | `block_sparse_moe.gate.weight`, `.e_score_correction_bias` | same                  |
| `moe.experts.{gate,up,down}_proj` [E, ...] | `block_sparse_moe.experts.{j}.{w1,w3,w2}.weight` | one per expert, stacked |
| `ffn.*`, `moe.shared_experts.*`       | `mlp.*`, `block_sparse_moe.shared_experts.*`       | same                          |

and `embed.weight`, `final_norm.weight`, `lm_head.weight` are `model.embed_tokens.weight`,
`model.norm.weight`, `lm_head.weight`. Every other name (q/k/v/o/b projections, `o_norm`, `dt_bias`,
MLA's q and kv_b projections) is the same. transformers' own modules concatenate the three convs and
the gate/up experts at load time; the files keep them apart, as above. transformers saves a dense
layer under `block_sparse_moe.` too (its load renames both prefixes to `mlp.`), so either is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from k3compile.spec.schema import MIXER_KDA, Spec
from k3compile.spec.weights import weight_inventory

DENSE_PREFIX, MOE_PREFIX = "mlp", "block_sparse_moe"  # the published names of a layer's FFN module
TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
       "lm_head.weight": "lm_head.weight"}  # fmt: skip
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
KDA_MODULES = {"q_conv": "q_conv1d", "k_conv": "k_conv1d", "v_conv": "v_conv1d", "f_down": "f_a_proj",
               "f_up": "f_b_proj", "g_down": "g_a_proj", "g_up": "g_b_proj"}  # fmt: skip
MLA_MODULES = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm"}
CONVS = ("q_conv", "k_conv", "v_conv")
MOE_TENSORS = {"router.weight": "gate.weight", "router.bias": "gate.e_score_correction_bias"}
EXPERT_PROJ = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_LAYER = re.compile(r"layers\.(\d+)\.([a-z_]+)\.(.+)")


@dataclass(frozen=True)
class Pair:
    """A k3compile tensor and the checkpoint tensors it is: one (reshaped), or one per expert (stacked on dim 0)."""

    name: str
    shape: tuple[int, ...]
    hf: tuple[str, ...]
    hf_shape: tuple[int, ...]  # of each checkpoint tensor


def published_prefix(spec: Spec) -> Callable[[int], str]:
    """The FFN module name of each layer as the published checkpoints write it."""
    return lambda i: MOE_PREFIX if spec.is_moe_layer(i) else DENSE_PREFIX


def k3_tensors(spec: Spec) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a spec's state_dict: the weight inventory and each router's selection bias (a buffer)."""
    out = [(w.name, w.shape) for w in weight_inventory(spec)]
    for i in range(spec.num_layers):
        if spec.is_moe_layer(i):
            out.append((f"layers.{i}.moe.router.bias", (spec.moe.num_experts,)))
    return out


def _pair(spec: Spec, name: str, shape: tuple[int, ...], ffn_prefix: Callable[[int], str]) -> Pair | None:
    if name in TOP:
        return Pair(name, shape, (TOP[name],), shape)
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    i, part, rest = int(m.group(1)), m.group(2), m.group(3)
    base = f"model.layers.{i}"
    if part in NORMS and rest == "weight":
        return Pair(name, shape, (f"{base}.{NORMS[part]}.weight",), shape)
    if part == "attn":
        module, dot, leaf = rest.partition(".")
        table = KDA_MODULES if spec.mixers[i] == MIXER_KDA else MLA_MODULES
        hf = f"{base}.self_attn.{table.get(module, module)}{dot}{leaf}"
        if spec.mixers[i] == MIXER_KDA and module in CONVS:
            return Pair(name, shape, (hf,), (shape[0], 1, shape[1]))
        if spec.mixers[i] == MIXER_KDA and module == "A_log":
            return Pair(name, shape, (hf,), (1, 1, shape[0], 1))
        return Pair(name, shape, (hf,), shape)
    prefix = f"{base}.{ffn_prefix(i)}"
    if part == "ffn":
        return Pair(name, shape, (f"{prefix}.{rest}",), shape)
    if part != "moe":
        return None
    if rest in MOE_TENSORS:
        return Pair(name, shape, (f"{prefix}.{MOE_TENSORS[rest]}",), shape)
    if rest.startswith("shared_experts."):
        return Pair(name, shape, (f"{prefix}.{rest}",), shape)
    proj = rest.removeprefix("experts.").removesuffix(".weight")
    if rest == f"experts.{proj}.weight" and proj in EXPERT_PROJ:
        hf = tuple(f"{prefix}.experts.{j}.{EXPERT_PROJ[proj]}.weight" for j in range(shape[0]))
        return Pair(name, shape, hf, shape[1:])
    return None


def tensor_pairs(spec: Spec, ffn_prefix: Callable[[int], str]) -> tuple[list[Pair], list[str]]:
    """(a Pair per k3compile tensor, the k3compile tensors Kimi Linear has no counterpart for)."""
    pairs, orphans = [], []
    for name, shape in k3_tensors(spec):
        pair = _pair(spec, name, shape, ffn_prefix)
        if pair is None:
            orphans.append(name)
        else:
            pairs.append(pair)
    return pairs, orphans
