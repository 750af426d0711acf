"""The weight inventory: every tensor a spec implies, with its name, shape, component and format.

One list drives parameter counts, weight bytes, MX block checks and sharding plans,
and lowering creates exactly these parameters (a test compares the two).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from k3compile.spec.schema import MIXER_KDA, MX_FORMATS, Spec

COMPONENTS = (
    "embedding",
    "output_head",
    "kda",
    "mla",
    "dense_ffn",
    "router",
    "latent_proj",
    "shared_experts",
    "routed_experts",
    "norms",
    "attn_res",
)


@dataclass(frozen=True)
class Weight:
    """One parameter tensor of the model."""

    name: str
    shape: tuple[int, ...]
    component: str
    matmul: bool  # a matmul weight [.., out, in]: quantisable, counted in FLOPs
    active: float  # fraction of the tensor a token's forward pass uses
    format: str  # storage format under the spec's quantisation policy
    layer: int | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def in_dim(self) -> int:
        return self.shape[-1]

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def _format(spec: Spec, module: str, matmul: bool) -> str:
    q = spec.quantization
    if matmul:
        for rule in q.rules:
            if fnmatch.fnmatchcase(module, rule.match):
                return rule.weight
        return q.default_weight
    return q.default_weight if q.default_weight not in MX_FORMATS else "bf16"


def keeps_fp32(spec: Spec, name: str) -> bool:
    """Whether tensor `name` (a parameter or buffer) is held in fp32 where the policy would store it in bf16."""
    return any(fnmatch.fnmatchcase(name, glob) for glob in spec.quantization.keep_fp32)


def activation_format(spec: Spec, module: str) -> str:
    """Format of the activations entering the matmul of `module` under the policy."""
    for rule in spec.quantization.rules:
        if fnmatch.fnmatchcase(module, rule.match):
            return rule.activation
    return spec.quantization.default_activation


class _Builder:
    def __init__(self, spec: Spec):
        self.spec = spec
        self.out: list[Weight] = []

    def add(self, name, shape, component, *, matmul=False, active=1.0, layer=None):
        module = name.removesuffix(".weight")
        fmt = _format(self.spec, module, matmul)
        if fmt == "bf16" and keeps_fp32(self.spec, name):
            fmt = "fp32"
        self.out.append(Weight(name, tuple(shape), component, matmul, active, fmt, layer))

    def linear(self, name, out_dim, in_dim, component, **kw):
        self.add(f"{name}.weight", (out_dim, in_dim), component, matmul=True, **kw)

    def mlp(self, prefix, d, inter, component, *, active=1.0, layer=None, experts=None):
        """Gated (gate/up/down) or ungated (up/down) MLP; `experts` stacks n of them."""
        lead = (experts,) if experts else ()
        names = ("gate_proj", "up_proj") if self.spec.activation.gated else ("up_proj",)
        for n in names:
            self.add(f"{prefix}.{n}.weight", lead + (inter, d), component, matmul=True, active=active, layer=layer)
        self.add(f"{prefix}.down_proj.weight", lead + (d, inter), component, matmul=True, active=active, layer=layer)


def _kda(b: _Builder, p: str, i: int) -> None:
    s, c = b.spec, "kda"
    k = s.kda
    d, H, K = s.hidden_size, k.num_heads, k.head_dim
    P, r = H * K, k.decay.rank or K
    for n in ("q", "k", "v"):
        b.linear(f"{p}.{n}_proj", P, d, c, layer=i)
    for n in ("q", "k", "v"):
        b.add(f"{p}.{n}_conv.weight", (P, k.short_conv_size), c, layer=i)
    decays = H if k.decay.granularity == "head" else P  # one decay per head, or per key channel
    b.linear(f"{p}.f_down", r, d, c, layer=i)
    b.linear(f"{p}.f_up", decays, r, c, layer=i)
    b.add(f"{p}.A_log", (H,), c, layer=i)
    b.add(f"{p}.dt_bias", (decays,), c, layer=i)
    if k.delta_rule:
        b.linear(f"{p}.b_proj", H, d, c, layer=i)
    if k.output_gate_rank is None:
        b.linear(f"{p}.g_proj", P, d, c, layer=i)
    else:
        b.linear(f"{p}.g_down", k.output_gate_rank, d, c, layer=i)
        b.linear(f"{p}.g_up", P, k.output_gate_rank, c, layer=i)
    b.add(f"{p}.o_norm.weight", (K,), c, layer=i)
    b.linear(f"{p}.o_proj", d, P, c, layer=i)


def _mla(b: _Builder, p: str, i: int) -> None:
    s, c = b.spec, "mla"
    m = s.mla
    d, H = s.hidden_size, m.num_heads
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank is None:
        b.linear(f"{p}.q_proj", H * dq, d, c, layer=i)
    else:
        b.linear(f"{p}.q_a_proj", m.q_lora_rank, d, c, layer=i)
        b.add(f"{p}.q_a_norm.weight", (m.q_lora_rank,), c, layer=i)
        b.linear(f"{p}.q_b_proj", H * dq, m.q_lora_rank, c, layer=i)
    b.linear(f"{p}.kv_a_proj", m.kv_lora_rank + m.qk_rope_head_dim, d, c, layer=i)
    b.add(f"{p}.kv_a_norm.weight", (m.kv_lora_rank,), c, layer=i)
    b.linear(f"{p}.kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, c, layer=i)
    if m.output_gate:
        b.linear(f"{p}.g_proj", H * m.v_head_dim, d, c, layer=i)
    b.linear(f"{p}.o_proj", d, H * m.v_head_dim, c, layer=i)


def _moe(b: _Builder, p: str, i: int) -> None:
    s = b.spec
    m = s.moe
    d, n = s.hidden_size, m.num_experts
    b.linear(f"{p}.router", n, d, "router", layer=i)
    w = m.latent_size or d
    if m.latent_size is not None:
        b.linear(f"{p}.latent_down", w, d, "latent_proj", layer=i)
        if m.latent_norm:
            b.add(f"{p}.latent_norm.weight", (w,), "latent_proj", layer=i)
        b.linear(f"{p}.latent_up", d, w, "latent_proj", layer=i)
    b.mlp(f"{p}.experts", w, m.expert_intermediate_size, "routed_experts", active=m.top_k / n, layer=i, experts=n)
    if m.num_shared_experts:
        b.mlp(f"{p}.shared_experts", d, m.num_shared_experts * m.shared_intermediate_size, "shared_experts", layer=i)


def _attn_res(b: _Builder, prefix: str, layer: int | None) -> None:
    d = b.spec.hidden_size
    b.add(f"{prefix}.query", (d,), "attn_res", layer=layer)
    b.add(f"{prefix}.norm.weight", (d,), "attn_res", layer=layer)


@lru_cache(maxsize=64)
def weight_inventory(spec: Spec) -> tuple[Weight, ...]:
    """Every parameter of the model the spec describes, in a stable order (buffers excluded)."""
    b = _Builder(spec)
    d, V = spec.hidden_size, spec.vocab_size
    attn_res = spec.residual.kind == "attn_res"
    # The input table is a lookup (not active); tied, it is also the head's matmul.
    b.add("embed.weight", (V, d), "embedding", active=1.0 if spec.tie_embeddings else 0.0)
    for i, mixer in enumerate(spec.mixers):
        p = f"layers.{i}"
        if attn_res:
            _attn_res(b, f"{p}.attn_res", i)
        b.add(f"{p}.attn_norm.weight", (d,), "norms", layer=i)
        (_kda if mixer == MIXER_KDA else _mla)(b, f"{p}.attn", i)
        if attn_res:
            _attn_res(b, f"{p}.ffn_res", i)
        b.add(f"{p}.ffn_norm.weight", (d,), "norms", layer=i)
        if spec.is_moe_layer(i):
            _moe(b, f"{p}.moe", i)
        else:
            b.mlp(f"{p}.ffn", d, spec.dense_ffn.intermediate_size, "dense_ffn", layer=i)
    if attn_res:
        _attn_res(b, "final_res", None)
    b.add("final_norm.weight", (d,), "norms")
    if not spec.tie_embeddings:
        b.linear("lm_head", V, d, "output_head")
    return tuple(b.out)
