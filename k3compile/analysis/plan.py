"""`k3compile plan`: per-rank memory and traffic of every dp x ep layout of N GPUs, from the spec alone.

Training holds what `k3compile train` holds: fp32 parameters, fp32 gradients and the optimiser's fp32 state
(Per-Head Muon: one momentum per matrix; AdamW: two moments per tensor), sharded as FSDP2 shards them
(non-expert parameters over all dp x ep ranks, each EP rank's routed experts over its dp ranks). `gathered`
adds what `k3compile train`'s root-level FSDP2 holds during a step: the whole model's weights and
gradients, gathered from the forward until the reduce-scatter at the end of backward (per-layer wrapping
would gather one layer at a time).
Activations are an estimate of what one step saves for backward without recomputation (fp32, formula in
docs/distributed.md). Serving holds the weights under the quantisation policy (routed experts split over
ep, the rest on every rank) and the decode caches of its share of the sequences. A layout fits when its
total is at most FIT_FRACTION of the GPU's memory (the rest: workspace, allocator, communication buffers).
"""

from __future__ import annotations

import math

import torch

from k3compile.analysis.formats import storage_bytes
from k3compile.analysis.memory import cache_bytes
from k3compile.ops.moe import expert_capacity
from k3compile.runtime.muon import default_use_muon
from k3compile.spec.schema import MIXER_KDA, Spec
from k3compile.spec.weights import weight_inventory

GPU_MEMORY = {  # bytes of HBM per GPU (NVIDIA datasheets: A100 80GB, H100 SXM, H200, HGX B200)
    "a100": 80 * 10**9,
    "h100": 80 * 10**9,
    "h200": 141 * 10**9,
    "b200": 180 * 10**9,
}
FIT_FRACTION = 0.9
FP32 = 4


def _optimizer_slots(spec: Spec, name: str, shape: tuple[int, ...]) -> int:
    """fp32 state tensors per element: 1 for a Muon matrix (momentum), 2 for AdamW (exp_avg, exp_avg_sq)."""
    muon = spec.training.optimizer != "adamw" and default_use_muon(name, torch.empty(shape, device="meta"))
    return 1 if muon else 2


def activation_elements_per_token(spec: Spec) -> int:
    """fp32 elements one token saves for backward in one step (an estimate; see docs/distributed.md)."""
    d = spec.hidden_size
    total = 2 * spec.vocab_size  # logits and their fp32 softmax
    for i, mixer in enumerate(spec.mixers):
        total += 10 * d  # norms, residual/AttnRes inputs, mixer and FFN inputs and outputs
        if mixer == MIXER_KDA:
            k = spec.kda
            total += 6 * k.num_heads * k.head_dim  # q, k, v, gate, decay, output
        else:
            m = spec.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            total += m.num_heads * (2 * qk + 2 * m.v_head_dim) + m.kv_lora_rank + m.qk_rope_head_dim
        if spec.is_moe_layer(i):
            moe = spec.moe
            w = moe.latent_size or d
            slots = min(moe.top_k * moe.capacity_factor, moe.num_experts)  # buffer rows per token
            total += math.ceil(slots * (2 * w + 3 * moe.expert_intermediate_size)) + 2 * w
            total += 3 * moe.num_shared_experts * (moe.shared_intermediate_size or 0)
        else:
            total += 3 * spec.dense_ffn.intermediate_size
    return total


def layouts(spec: Spec, gpus: int) -> list[tuple[int, int]]:
    """Every (dp, ep) with dp x ep = gpus and ep dividing the routed experts, by ep (found among the experts'
    divisors: the work is bounded by the spec, not by `gpus`)."""
    experts = spec.moe.num_experts if spec.moe is not None else 1
    return [(gpus // ep, ep) for ep in range(1, min(gpus, experts) + 1) if gpus % ep == 0 and experts % ep == 0]


def plan(spec: Spec, gpus: int, gpu: str, batch: int | None = None, seq: int | None = None) -> dict:
    """Per-rank bytes of every dp x ep layout of `gpus` GPUs of kind `gpu`, at a global batch of `batch` sequences
    (default: one per rank, a micro-batch) of `seq` tokens (default: the spec's training.seq_len); JSON-ready."""
    batch = gpus if batch is None else batch
    seq = spec.training.seq_len if seq is None else seq
    memory = GPU_MEMORY[gpu]
    block = spec.quantization.block_size
    expert = dense = 0  # parameter elements
    expert_state = dense_state = 0  # optimiser state elements
    expert_policy = dense_policy = 0  # serving bytes under the policy
    for w in weight_inventory(spec):
        slots = _optimizer_slots(spec, w.name, w.shape) * w.numel
        b = storage_bytes(w.numel, w.format, block)
        if w.component == "routed_experts":
            expert, expert_state, expert_policy = expert + w.numel, expert_state + slots, expert_policy + b
        else:
            dense, dense_state, dense_policy = dense + w.numel, dense_state + slots, dense_policy + b
    per_token = activation_elements_per_token(spec)
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    rows = []
    for dp, ep in layouts(spec, gpus):
        world = dp * ep
        tokens = math.ceil(batch / world) * seq  # this rank's rows of the global batch
        params = math.ceil(expert // ep / dp) + math.ceil(dense / world)
        state = math.ceil(expert_state // ep / dp) + math.ceil(dense_state / world)
        activations = tokens * per_token * FP32
        train = (2 * params + state) * FP32 + activations
        gathered = train + 2 * (expert // ep + dense) * FP32  # + the step's whole weights and gradients
        a2a = 0
        if spec.moe is not None and ep > 1:
            m = spec.moe
            cap = expert_capacity(tokens, m.num_experts, m.top_k, m.capacity_factor)
            sent = m.num_experts * cap * (m.latent_size or spec.hidden_size) * (ep - 1) // ep
            a2a = 4 * moe_layers * sent * FP32  # dispatch and return, forward and backward
        sequences = math.ceil(batch / world)
        cache = cache_bytes(spec, seq, sequences)["total"]
        serve = expert_policy // ep + dense_policy + cache
        rows.append({
            "dp": dp, "ep": ep,
            "experts_per_rank": (spec.moe.num_experts // ep) if spec.moe is not None else 0,
            "params_per_rank": params,
            "param_bytes": params * FP32,
            "grad_bytes": params * FP32,
            "optimizer_bytes": state * FP32,
            "activation_bytes": activations,
            "train_bytes": train,
            "train_fits": train <= FIT_FRACTION * memory,
            "train_bytes_gathered": gathered,
            "train_fits_gathered": gathered <= FIT_FRACTION * memory,
            "all_to_all_bytes_per_step": a2a,
            "routed_expert_bytes_per_rank": expert_policy // ep,
            "serve_weight_bytes": expert_policy // ep + dense_policy,
            "serve_cache_bytes": cache,
            "serve_bytes": serve,
            "serve_fits": serve <= FIT_FRACTION * memory,
        })  # fmt: skip
    return {
        "spec": spec.name,
        "gpus": gpus,
        "gpu": gpu,
        "gpu_memory_bytes": memory,
        "fit_fraction": FIT_FRACTION,
        "batch": batch,
        "seq": seq,
        "params": {"total": expert + dense, "routed_experts": expert, "other": dense},
        "layouts": rows,
    }
