"""Bytes: weights under the quantisation policy, decode caches, expert-parallel shards."""

from __future__ import annotations

from k3compile.analysis.formats import storage_bytes
from k3compile.spec.schema import MIXER_MLA, Spec
from k3compile.spec.weights import weight_inventory

CACHE_BYTES = 2  # bf16 MLA latent cache and short-conv state
STATE_BYTES = 4  # fp32 KDA recurrent state (bf16 would round decays near 1)


def weight_bytes(spec: Spec) -> dict:
    """Weight bytes under the spec's policy (MX payload + E8M0 scales exactly) and under plain bf16."""
    block = spec.quantization.block_size
    by_format: dict[str, int] = {}
    policy = bf16 = 0
    for w in weight_inventory(spec):
        b = storage_bytes(w.numel, w.format, block)
        by_format[w.format] = by_format.get(w.format, 0) + b
        policy += b
        bf16 += storage_bytes(w.numel, "bf16")
    return {"policy": policy, "bf16": bf16, "by_format": dict(sorted(by_format.items()))}


def layer_cache_bytes(spec: Spec, mixer: str, context: int, batch: int) -> dict:
    """Decode cache of one layer with token mixer `mixer` at `context` tokens and `batch` sequences, by kind."""
    if mixer == MIXER_MLA:
        m = spec.mla
        return {"mla_latent": batch * context * (m.kv_lora_rank + m.qk_rope_head_dim) * CACHE_BYTES}
    H, K, W = spec.kda.num_heads, spec.kda.head_dim, spec.kda.short_conv_size
    return {"kda_state": batch * H * K * K * STATE_BYTES, "short_conv": batch * 3 * H * K * (W - 1) * CACHE_BYTES}


def cache_bytes(spec: Spec, context: int, batch: int) -> dict:
    """Decode cache at `context` tokens and `batch` sequences, and the all-full-attention equivalent."""
    by_kind = {"mla_latent": 0, "kda_state": 0, "short_conv": 0}
    for mixer in spec.mixers:
        for kind, b in layer_cache_bytes(spec, mixer, context, batch).items():
            by_kind[kind] += b
    full = None
    if spec.mla is not None:
        full = spec.num_layers * layer_cache_bytes(spec, MIXER_MLA, context, batch)["mla_latent"]
    return {
        "total": sum(by_kind.values()),
        **by_kind,
        "all_full_attention": full,
        "context": context,
        "batch": batch,
    }


def expert_parallel(spec: Spec) -> dict:
    """Routed experts per expert-parallel rank and the bytes of their weights under the policy."""
    ep = spec.parallel.ep
    if spec.moe is None:
        return {"ep": ep, "experts_per_rank": 0, "routed_expert_bytes_per_rank": 0}
    block = spec.quantization.block_size
    total = sum(
        storage_bytes(w.numel, w.format, block) for w in weight_inventory(spec) if w.component == "routed_experts"
    )
    return {
        "ep": ep,
        "experts_per_rank": spec.moe.num_experts // ep,
        "routed_expert_bytes_per_rank": total // ep,
    }
