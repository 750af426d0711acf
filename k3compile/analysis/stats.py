"""All static numbers of a spec in one JSON-ready document (no tensors, milliseconds)."""

from __future__ import annotations

from k3compile.analysis.flops import forward_flops_per_token
from k3compile.analysis.memory import cache_bytes, expert_parallel, weight_bytes
from k3compile.analysis.params import param_counts
from k3compile.spec.schema import MIXER_KDA, MIXER_MLA, Spec


def spec_stats(spec: Spec, context: int | None = None, batch: int = 1) -> dict:
    """Parameters, FLOPs, weight bytes, cache bytes and EP shards; context defaults to the spec's."""
    context = spec.context_length if context is None else context
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    return {
        "spec": spec.name,
        "layers": {
            "total": spec.num_layers,
            "kda": spec.mixers.count(MIXER_KDA),
            "mla": spec.mixers.count(MIXER_MLA),
            "moe": moe_layers,
            "dense": spec.num_layers - moe_layers,
        },
        "params": param_counts(spec),
        "flops_per_token": forward_flops_per_token(spec, context),
        "weight_bytes": weight_bytes(spec),
        "cache_bytes": cache_bytes(spec, context, batch),
        "expert_parallel": expert_parallel(spec),
    }
