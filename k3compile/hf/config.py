"""Kimi Linear's `config.json` and k3compile specs, both ways.

Every field of a config is mapped onto a spec field, checked to hold the one value transformers'
Kimi Linear implements, or known not to change the weights or the logits (token ids, cache flags).
Anything else is a one-line error naming the field: an import never guesses. The other way, a spec
feature Kimi Linear lacks (AttnRes, SiTU-GLU, latent experts, ...) is an error naming the spec field.

Conventions of the published checkpoints (transformers' `models/kimi_linear`):
- layers are listed 1-based in `linear_attn_config` (`full_attn_layers`, `kda_layers`); a saved
  config may carry transformers' per-layer `layer_types` / `mlp_layer_types` as well;
- the KDA decay is the softplus form with a rank-`head_dim` gate projection, the output gate is
  low rank (d -> head_dim -> P), MLA has no output gate and no RoPE;
- the MLA latent norms use eps 1e-6 whatever `rms_norm_eps` is;
- the shared experts are one SwiGLU MLP of width `moe_intermediate_size * num_shared_experts`;
- routing is sigmoid scores plus a selection bias, renormalised, times `routed_scaling_factor`.
"""

from __future__ import annotations

from pydantic import ValidationError

from k3compile import safe_io
from k3compile.spec.schema import MAX_LAYERS, MIXER_KDA, MIXER_MLA, Spec

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default, which q_a_layernorm and kv_a_layernorm keep
LINEAR, FULL = "linear_attention", "full_attention"
DENSE, SPARSE = "dense", "sparse"
TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # config dtype -> the spec's storage format

# Two names for one field: transformers' attribute names and those its saved (and the published) configs use.
ALIASES = {
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "max_position_embeddings": "model_max_length",
    "dtype": "torch_dtype",
}
# Fields whose only importable value is the one transformers' Kimi Linear implements.
FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "rope_scaling": None,
}
MAPPED = {
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings", "rms_norm_eps",
    "initializer_range", "layer_types", "linear_attn_config", "linear_num_heads", "linear_head_dim",
    "linear_conv_kernel_dim", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mlp_layer_types", "first_k_dense_replace",
    "intermediate_size", "moe_intermediate_size", "routed_scaling_factor", "topk_group",
}  # fmt: skip
# Fields that change neither the weights nor the logits (transformers recomputes head_dim and qk_head_dim;
# the model is NoPE, so rope_theta is unused).
IGNORED = {
    "architectures", "auto_map", "transformers_version", "_name_or_path", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "output_router_logits", "pretraining_tp", "head_dim", "qk_head_dim", "rope_theta",
    "use_grouped_topk",
}  # fmt: skip
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
LINEAR_ATTN_KEYS = {"full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size"}
KNOWN = MAPPED | set(FIXED) | IGNORED | set(ALIASES) | set(ALIASES.values())
_REQUIRED = object()


def _shown(value) -> str:
    """A config's value in an error: its repr, clipped (a 600 kB list is not echoed whole)."""
    return safe_io.shown(value, 40, quote=True)


class HFError(ValueError):
    """A Hugging Face config or checkpoint k3compile cannot take, or a spec it cannot write as one; one line."""


def _value(config: dict, key: str, default=_REQUIRED):
    names = [key, ALIASES[key]] if key in ALIASES else [key]
    present = [n for n in names if n in config]
    if len(present) == 2 and config[present[0]] != config[present[1]]:
        a, b = present
        raise HFError(f"config.json: {a} ({_shown(config[a])}) and {b} ({_shown(config[b])}) disagree")
    if present:
        return config[present[0]]
    if default is _REQUIRED:
        raise HFError(f"config.json: missing field {key!r}")
    return default


def _linear_value(config: dict, key: str, flat: str):
    """A KDA size from `linear_attn_config` (the published form) or transformers' flattened field."""
    nested = config.get("linear_attn_config") or {}
    if key in nested and flat in config and nested[key] != config[flat]:
        raise HFError(f"config.json: linear_attn_config.{key} ({_shown(nested[key])}) and {flat} "
                      f"({_shown(config[flat])}) disagree")
    if key in nested:
        return nested[key]
    return _value(config, flat)


def is_token_id(value) -> bool:
    """Whether `value` is what a config's bos/eos/pad_token_id may be: null, an id or a list of ids."""
    ids = value if isinstance(value, list) else [value]
    return value is None or len(ids) <= 1024 and all(type(i) is int and 0 <= i < 1 << 31 for i in ids)


def _layer_list(values, field: str, num_layers: int, allowed: tuple[str, str]) -> list[str]:
    if not isinstance(values, list) or len(values) != num_layers or any(v not in allowed for v in values):
        raise HFError(f"config.json: {field} must list {num_layers} entries, each {allowed[0]!r} or {allowed[1]!r}")
    return values


def _mixers(config: dict, num_layers: int) -> list[str]:
    """Per-layer K/M from `layer_types` or the 1-based lists of `linear_attn_config`; both must agree."""
    nested = config.get("linear_attn_config") or {}
    from_lists = None
    if "full_attn_layers" in nested or "kda_layers" in nested:
        full, kda = nested.get("full_attn_layers", []), nested.get("kda_layers", [])
        for name, value in (("full_attn_layers", full), ("kda_layers", kda)):
            if not isinstance(value, list) or not all(type(v) is int for v in value):
                raise HFError(f"config.json: linear_attn_config.{name} must be a list of layer numbers, "
                              f"got {_shown(value)}")
        numbers = full + kda
        if len(numbers) != num_layers or sorted(numbers) != list(range(1, num_layers + 1)):
            raise HFError(
                "config.json: linear_attn_config.full_attn_layers and kda_layers must together list the layers "
                f"1..{num_layers} once each"
            )
        full = set(full)
        from_lists = [FULL if i + 1 in full else LINEAR for i in range(num_layers)]
    types = config.get("layer_types")
    if types is not None:
        types = _layer_list(types, "layer_types", num_layers, (LINEAR, FULL))
        if from_lists is not None and types != from_lists:
            raise HFError("config.json: layer_types and linear_attn_config.full_attn_layers disagree")
    elif from_lists is None:
        raise HFError("config.json: no layer_types or linear_attn_config.full_attn_layers: the layout is not given")
    return [MIXER_MLA if t == FULL else MIXER_KDA for t in types or from_lists]


def _dense_layers(config: dict, num_layers: int) -> list[int]:
    """0-based dense-FFN layers from `mlp_layer_types` or `first_k_dense_replace`; both must agree."""
    first = config.get("first_k_dense_replace")
    from_first = None
    if first is not None:
        if type(first) is not int or not 0 <= first <= num_layers:
            raise HFError(f"config.json: first_k_dense_replace must be an integer in [0, {num_layers}], "
                          f"got {_shown(first)}")
        from_first = [DENSE if i < first else SPARSE for i in range(num_layers)]
    types = config.get("mlp_layer_types")
    if types is not None:
        types = _layer_list(types, "mlp_layer_types", num_layers, (DENSE, SPARSE))
        if from_first is not None and types != from_first:
            raise HFError("config.json: mlp_layer_types and first_k_dense_replace disagree")
    elif from_first is None:
        raise HFError("config.json: no mlp_layer_types or first_k_dense_replace: the dense layers are not given")
    return [i for i, t in enumerate(types or from_first) if t == DENSE]


def _periods(seq: list[str]) -> list[int]:
    """Every p in 1..len(seq) with seq[i] == seq[i + p] throughout (seq tiles by its first p entries), ascending;
    from the prefix function (Knuth-Morris-Pratt), in time linear in len(seq)."""
    border = [0] * len(seq)
    for i in range(1, len(seq)):
        k = border[i - 1]
        while k and seq[i] != seq[k]:
            k = border[k - 1]
        border[i] = k + (seq[i] == seq[k])
    periods, k = [], border[-1] if seq else 0
    while k:
        periods.append(len(seq) - k)
        k = border[k - 1]
    return periods + [len(seq)]


def layout_fields(mixers: list[str]) -> dict:
    """The shortest `pattern` (with `last_layer_full` if that helps) that tiles to `mixers`, else explicit layers."""
    n_layers = len(mixers)
    whole = set(_periods(mixers))
    head = set(_periods(mixers[:-1])) if mixers and mixers[-1] == MIXER_MLA else set()
    for n in range(1, n_layers):  # a tiling of all the layers, or of all but a last full-attention one
        for last_full, periods in ((False, whole), (True, head)):
            if n in periods:
                return {"pattern": "".join(mixers[:n]), "last_layer_full": last_full}
    return {"layers": list(mixers)}


def storage_dtype(config: dict) -> str:
    """The config's tensor dtype as transformers names it ('float32' when it says nothing, as transformers)."""
    dtype = _value(config, "dtype", "float32")
    if not isinstance(dtype, str) or dtype not in TORCH_DTYPES:
        raise HFError(f"config.json: dtype {_shown(dtype)} cannot be expressed (k3compile stores "
                      f"{' or '.join(TORCH_DTYPES)})")
    return dtype


def spec_fields(config: dict, name: str) -> dict:
    """The spec (as YAML-ready fields) equivalent to a Kimi Linear config, validated; HFError names a bad field."""
    if not isinstance(config, dict):
        raise HFError("config.json does not hold a JSON object")
    if config.get("model_type") != MODEL_TYPE:
        raise HFError(f"config.json: unsupported model_type {_shown(config.get('model_type'))}; k3compile imports "
                      f"{MODEL_TYPE!r}")
    unknown = sorted(set(config) - KNOWN)
    if unknown:
        more = f" (+{len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise HFError(f"config.json: field {_shown(unknown[0])}{more} has no k3compile counterpart")
    for key, value in FIXED.items():
        if key in config and config[key] != value:
            raise HFError(f"config.json: {key}={_shown(config[key])} cannot be expressed (Kimi Linear in "
                          f"k3compile: {value!r})")
    nested = config.get("linear_attn_config") or {}
    if not isinstance(nested, dict) or set(nested) - LINEAR_ATTN_KEYS:
        bad = sorted(set(nested) - LINEAR_ATTN_KEYS) if isinstance(nested, dict) else ["(not an object)"]
        raise HFError(f"config.json: linear_attn_config.{safe_io.shown(bad[0], 60)} has no k3compile counterpart")
    n_layers = _value(config, "num_hidden_layers")  # bounded before any per-layer list is made
    if type(n_layers) is not int or not 1 <= n_layers <= MAX_LAYERS:
        raise HFError(f"config.json: num_hidden_layers must be an integer in [1, {MAX_LAYERS}], got {_shown(n_layers)}")
    bad = next((k for k in TOKEN_IDS if not is_token_id(config.get(k))), None)
    if bad is not None:
        raise HFError(f"config.json: {bad} must be a token id, a list of them or null, got {_shown(config[bad])}")
    mixers = _mixers(config, n_layers)
    dense = _dense_layers(config, n_layers)
    dtype = storage_dtype(config)
    fields: dict = {
        "name": name,
        "vocab_size": _value(config, "vocab_size"),
        "hidden_size": _value(config, "hidden_size"),
        "num_layers": n_layers,
        "tie_embeddings": _value(config, "tie_word_embeddings", False),
        "norm_eps": _value(config, "rms_norm_eps"),
        "context_length": _value(config, "max_position_embeddings"),
    }
    if "initializer_range" in config:
        fields["init_std"] = config["initializer_range"]
    fields["layout"] = layout_fields(mixers)
    if MIXER_KDA in mixers:
        head_dim = _linear_value(config, "head_dim", "linear_head_dim")
        fields["kda"] = {
            "num_heads": _linear_value(config, "num_heads", "linear_num_heads"),
            "head_dim": head_dim,
            "short_conv_size": _linear_value(config, "short_conv_kernel_size", "linear_conv_kernel_dim"),
            "decay": {"form": "softplus", "rank": head_dim},
            "output_gate_rank": head_dim,
        }
    if MIXER_MLA in mixers:
        heads = _value(config, "num_attention_heads")
        kv_heads = _value(config, "num_key_value_heads", heads)
        if kv_heads != heads:
            raise HFError(f"config.json: num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) in MLA")
        fields["mla"] = {
            "num_heads": heads,
            "q_lora_rank": _value(config, "q_lora_rank", None),
            "kv_lora_rank": _value(config, "kv_lora_rank"),
            "qk_nope_head_dim": _value(config, "qk_nope_head_dim"),
            "qk_rope_head_dim": _value(config, "qk_rope_head_dim"),
            "v_head_dim": _value(config, "v_head_dim"),
            "rope": False,
            "output_gate": False,
            "latent_norm_eps": LATENT_NORM_EPS,
        }
    if dense:
        fields["dense_ffn"] = {"layers": dense, "intermediate_size": _value(config, "intermediate_size")}
    if len(dense) < n_layers:
        fields["moe"] = _moe_fields(config)
    fields["activation"] = {"kind": "swiglu"}
    if TORCH_DTYPES[dtype] != "bf16":  # bf16 is the spec's default policy
        fields["quantization"] = {"default_weight": TORCH_DTYPES[dtype], "default_activation": TORCH_DTYPES[dtype]}
    try:
        Spec.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "<spec>"
        raise HFError(f"config.json describes an invalid spec: {where}: {err['msg']}") from None
    return fields


def _moe_fields(config: dict) -> dict:
    groups, top_groups = _value(config, "n_group", 1), _value(config, "topk_group", 1)
    if groups != 1 and top_groups != groups:
        raise HFError(
            f"config.json: num_expert_group={groups} with topk_group={top_groups} (group-limited routing) "
            "cannot be expressed"
        )
    shared = _value(config, "n_shared_experts")
    if not isinstance(shared, int) or shared < 1:
        raise HFError(f"config.json: num_shared_experts={shared!r}: transformers' Kimi Linear always runs shared experts")
    width = _value(config, "moe_intermediate_size")
    experts, top_k = _value(config, "num_local_experts"), _value(config, "num_experts_per_tok")
    return {
        "num_experts": experts,
        "top_k": top_k,
        # transformers' Kimi Linear drops no expert choice: a buffer of n/k * T * k / n = T tokens per expert
        "capacity_factor": experts / top_k if isinstance(experts, int) and isinstance(top_k, int) and top_k > 0 else None,
        "expert_intermediate_size": width,
        "num_shared_experts": shared,
        "shared_intermediate_size": width,
        "router": {
            "scoring": "sigmoid",
            "routed_scaling": _value(config, "routed_scaling_factor"),
            "renormalize": _value(config, "norm_topk_prob", True),
            "balancing": "bias_sign",
        },
    }


# ---------------------------------------------------------------- spec -> config


def _unsupported(field: str, value, why: str) -> HFError:
    return HFError(f"spec field {field}={value!r} cannot be written as Kimi Linear: {why}")


def check_exportable(spec: Spec) -> None:
    """Raise HFError naming the first spec field transformers' Kimi Linear cannot express."""
    if spec.residual.kind != "plain":
        raise _unsupported("residual.kind", spec.residual.kind, "it has plain residuals")
    if spec.activation.kind != "swiglu":
        raise _unsupported("activation.kind", spec.activation.kind, "its MLPs are SwiGLU")
    if MIXER_KDA in spec.mixers:
        k = spec.kda
        if k.decay.form != "softplus":
            raise _unsupported("kda.decay.form", k.decay.form, "its decay is the softplus form")
        if (k.decay.rank or k.head_dim) != k.head_dim:
            raise _unsupported("kda.decay.rank", k.decay.rank, f"the gate projection has rank head_dim ({k.head_dim})")
        if not k.delta_rule:
            raise _unsupported("kda.delta_rule", k.delta_rule, "its KDA uses the delta rule")
        if k.decay.granularity != "channel":
            raise _unsupported("kda.decay.granularity", k.decay.granularity, "its decay is per channel")
        if k.output_gate_rank != k.head_dim:
            raise _unsupported("kda.output_gate_rank", k.output_gate_rank, f"the output gate has rank head_dim ({k.head_dim})")
    if MIXER_MLA in spec.mixers:
        m = spec.mla
        if m.rope:
            raise _unsupported("mla.rope", m.rope, "its MLA is NoPE")
        if m.output_gate:
            raise _unsupported("mla.output_gate", m.output_gate, "its MLA has no output gate")
        if m.latent_norm_eps != LATENT_NORM_EPS:
            raise _unsupported("mla.latent_norm_eps", m.latent_norm_eps, f"its latent norms use {LATENT_NORM_EPS}")
    if spec.moe is not None:
        e = spec.moe
        if e.latent_size is not None:
            raise _unsupported("moe.latent_size", e.latent_size, "its experts run at full width")
        if e.num_shared_experts < 1:
            raise _unsupported("moe.num_shared_experts", e.num_shared_experts, "it always runs shared experts")
        if e.shared_intermediate_size != e.expert_intermediate_size:
            raise _unsupported("moe.shared_intermediate_size", e.shared_intermediate_size,
                               f"shared experts have the routed width ({e.expert_intermediate_size})")  # fmt: skip
        if e.router.scoring != "sigmoid":
            raise _unsupported("moe.router.scoring", e.router.scoring, "its router scores are sigmoids")


def hf_config(spec: Spec, dtype: str, token_ids: dict | None = None) -> dict:
    """The Kimi Linear config.json of `spec` (published field names) for tensors stored in `dtype`."""
    check_exportable(spec)
    mixers = spec.mixers
    config: dict = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "dtype": dtype,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "tie_word_embeddings": spec.tie_embeddings,
        "rms_norm_eps": spec.norm_eps,
        "model_max_length": spec.context_length,
        "initializer_range": spec.init_std,
        "hidden_act": FIXED["hidden_act"],
        "attention_bias": FIXED["attention_bias"],
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, m in enumerate(mixers) if m == MIXER_MLA],
            "kda_layers": [i + 1 for i, m in enumerate(mixers) if m == MIXER_KDA],
        },
    }
    if MIXER_KDA in mixers:
        k = spec.kda
        config["linear_attn_config"].update(num_heads=k.num_heads, head_dim=k.head_dim, short_conv_kernel_size=k.short_conv_size)
    if MIXER_MLA in mixers:
        m = spec.mla
        config.update(
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
            v_head_dim=m.v_head_dim, mla_use_nope=FIXED["mla_use_nope"],
        )  # fmt: skip
    dense = sorted(spec.dense_layers)
    if dense == list(range(len(dense))):
        config["first_k_dense_replace"] = len(dense)
    else:
        config["mlp_layer_types"] = [DENSE if i in spec.dense_layers else SPARSE for i in range(spec.num_layers)]
    if dense:
        config["intermediate_size"] = spec.dense_ffn.intermediate_size
    if spec.moe is not None:
        e = spec.moe
        config.update(
            num_experts=e.num_experts, num_experts_per_token=e.top_k, moe_intermediate_size=e.expert_intermediate_size,
            num_shared_experts=e.num_shared_experts, moe_renormalize=e.router.renormalize,
            routed_scaling_factor=e.router.routed_scaling, moe_router_activation_func=FIXED["moe_router_activation_func"],
            num_expert_group=1, topk_group=1,
        )  # fmt: skip
    config.update({k: (token_ids or {}).get(k) for k in TOKEN_IDS})
    return config
