"""The spec schema: every field of a Kimi-K3-class architecture, validated and frozen.

The Spec is the single source of truth; derived numbers (parameters, FLOPs,
bytes) are computed from it in `k3compile.analysis`, never stored here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Limits that reject absurd values before anything is allocated.
MAX_VOCAB = 4_194_304
MAX_HIDDEN = 131_072
MAX_LAYERS = 1_024
MAX_HEADS = 1_024
MAX_HEAD_DIM = 1_024
MAX_INTERMEDIATE = 1_048_576
MAX_EXPERTS = 65_536
MAX_CONTEXT = 1 << 26
MAX_DEGREE = 65_536
MAX_BATCH = 1 << 24
MAX_WORLD = 1 << 20  # GPUs in one job (what `plan` enumerates)

MIXER_KDA = "K"
MIXER_MLA = "M"

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
GLOB_RE = r"^[A-Za-z0-9_.*?\[\]-]{1,200}$"

Pos = Annotated[int, Field(ge=1)]

MX_FORMATS = ("mxfp8", "mxfp4")


class FieldError(ValueError):
    """A cross-field check failure naming its field, relative to the model that raises it (for file:line)."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


class _Frozen(BaseModel):
    # allow_inf_nan=False: a NaN fails every bound, so without it `lr: .nan` reads "should be <= 10"
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info):
        """YAML reads yes/no/on/off/true as booleans, which lax pydantic would take as 1/0 for numbers."""
        if cls.model_fields[info.field_name].annotation is not bool:
            for x in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(x, bool):
                    raise ValueError(f"a boolean ({str(x).lower()}) is not a valid value here")
        return v


class Layout(_Frozen):
    """Which token mixer each layer uses: K (KDA, linear) or M (Gated MLA, full)."""

    pattern: str | None = Field(
        default=None,
        description="Pattern of K/M letters tiled over the layers, e.g. 'KKKM' for 3 KDA : 1 MLA.",
        pattern=r"^[KM]{1,1024}$",
    )
    layers: tuple[Literal["K", "M"], ...] | None = Field(
        default=None, description="Explicit per-layer list of K/M, one per layer; excludes `pattern`."
    )
    last_layer_full: bool = Field(
        default=False, description="Force the last layer to full attention (M) whatever the pattern says."
    )

    @model_validator(mode="after")
    def _one_form(self) -> "Layout":
        if (self.pattern is None) == (self.layers is None):
            raise ValueError("give exactly one of `pattern` or `layers`")
        return self


class DecayGate(_Frozen):
    """How KDA turns the low-rank gate projection f into a log decay g <= 0."""

    form: Literal["lower_bounded_sigmoid", "softplus"] = Field(
        description="K3: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); "
        "Kimi Linear: g = -exp(A_log) * softplus(f + dt_bias)."
    )
    lower_bound: float | None = Field(
        default=None,
        description="Lower bound of g for the lower_bounded_sigmoid form (K3 uses -5.0); must be null for softplus.",
        ge=-100.0,
        lt=0.0,
    )
    rank: Pos | None = Field(
        default=None, description="Rank of the f = W_up W_down x projection; null means the KDA head dim."
    )
    granularity: Literal["channel", "head"] = Field(
        default="channel",
        description="channel (K3): one decay per key channel, f_up: rank -> H*dk, dt_bias [H*dk]; "
        "head (the Gated DeltaNet form): one decay per head, f_up: rank -> H, dt_bias [H].",
    )

    @model_validator(mode="after")
    def _bound_matches_form(self) -> "DecayGate":
        if self.form == "lower_bounded_sigmoid" and self.lower_bound is None:
            raise FieldError("lower_bound", "lower_bounded_sigmoid needs `lower_bound` (K3 uses -5.0)")
        if self.form == "softplus" and self.lower_bound is not None:
            raise FieldError("lower_bound", "`lower_bound` only applies to form lower_bounded_sigmoid")
        return self


class KDA(_Frozen):
    """Kimi Delta Attention: gated delta-rule linear attention with per-channel decay."""

    num_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)] = Field(description="Number of KDA heads H.")
    head_dim: Annotated[int, Field(ge=1, le=MAX_HEAD_DIM)] = Field(description="Key and value head dim (dk = dv).")
    short_conv_size: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4, description="Kernel size of the causal depthwise short convolution on q, k, v."
    )
    decay: DecayGate = Field(description="Decay-gate form and its lower bound.")
    output_gate_rank: Pos | None = Field(
        default=None,
        description="Rank of the sigmoid output gate W_g (d -> r -> H*dk); null means full rank (d -> H*dk).",
    )
    delta_rule: bool = Field(
        default=True,
        description="true (KDA): the gated delta rule S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T; "
        "false: plain gated linear attention S_t = diag(a_t) S_{t-1} + k_t v_t^T (no beta projection).",
    )


class MLA(_Frozen):
    """Gated multi-head latent attention (full attention with a compressed KV cache)."""

    num_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)] = Field(description="Number of attention heads.")
    q_lora_rank: Pos | None = Field(
        default=None, description="Rank of the query down-projection; null means a plain W_q."
    )
    kv_lora_rank: Annotated[int, Field(ge=1, le=MAX_HIDDEN)] = Field(description="Width of the cached KV latent c_kv.")
    qk_nope_head_dim: Annotated[int, Field(ge=0, le=MAX_HEAD_DIM)] = Field(
        description="Per-head query/key dims without position encoding."
    )
    qk_rope_head_dim: Annotated[int, Field(ge=0, le=MAX_HEAD_DIM)] = Field(
        description="Per-head query dims matched to the shared key k_pe (rotated only when `rope` is true)."
    )
    v_head_dim: Annotated[int, Field(ge=1, le=MAX_HEAD_DIM)] = Field(description="Per-head value dim.")
    rope: bool = Field(default=False, description="Apply rotary embeddings to the rope part (K3 and Kimi Linear: NoPE).")
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base, used only when `rope` is true.")
    output_gate: bool = Field(default=True, description="Sigmoid output gate attn_out * sigmoid(W_g x) before o_proj.")
    latent_norm_eps: float = Field(
        default=1e-6,
        gt=0,
        le=1e-1,
        description="Epsilon of the latent RMSNorms (q_a_norm, kv_a_norm); transformers' Kimi Linear and DeepSeek V3 "
        "use 1e-6 whatever the model's norm_eps.",
    )

    @model_validator(mode="after")
    def _qk_nonempty(self) -> "MLA":
        if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
            raise FieldError("qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be positive")
        return self


class DenseFFN(_Frozen):
    """Dense feed-forward layers (K3: layer 0)."""

    layers: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        default=(), description="0-based indices of layers that use a dense FFN instead of MoE."
    )
    intermediate_size: Annotated[int, Field(ge=1, le=MAX_INTERMEDIATE)] = Field(
        description="Intermediate size of the dense FFN."
    )

    @field_validator("layers")
    @classmethod
    def _sorted_unique(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(v)) != len(v):
            raise ValueError("dense layer indices must be unique")
        return tuple(sorted(v))


class Router(_Frozen):
    """Router scoring, weighting and load balancing."""

    scoring: Literal["sigmoid", "softmax"] = Field(default="sigmoid", description="Score function on router logits.")
    routed_scaling: float = Field(
        default=1.0, gt=0, le=100, description="Factor applied to the renormalised routed weights."
    )
    renormalize: bool = Field(default=True, description="Renormalise the top-k weights to sum to one.")
    balancing: Literal["quantile", "bias_sign", "aux_loss", "none"] = Field(
        default="quantile",
        description="quantile: Quantile Balancing of the selection bias; bias_sign: DeepSeek-V3 sign update; "
        "aux_loss: auxiliary load-balancing loss; none.",
    )
    histogram_bins: Annotated[int, Field(ge=2, le=1_000_000)] | None = Field(
        default=None, description="Quantile Balancing from a histogram of this many bins; null means exact quantiles."
    )
    bias_update_rate: float = Field(default=1e-3, gt=0, le=1, description="Step size of the bias_sign update.")
    aux_loss_coef: float = Field(default=1e-3, ge=0, le=10, description="Weight of the auxiliary balancing loss.")


class MoE(_Frozen):
    """Stable LatentMoE: routed experts (optionally at a latent width) plus shared experts."""

    num_experts: Annotated[int, Field(ge=1, le=MAX_EXPERTS)] = Field(description="Number of routed experts n.")
    top_k: Annotated[int, Field(ge=1, le=MAX_EXPERTS)] = Field(description="Routed experts per token k.")
    expert_intermediate_size: Annotated[int, Field(ge=1, le=MAX_INTERMEDIATE)] = Field(
        description="Intermediate size of one routed expert."
    )
    num_shared_experts: Annotated[int, Field(ge=0, le=64)] = Field(default=0, description="Number of shared experts.")
    shared_intermediate_size: Annotated[int, Field(ge=1, le=MAX_INTERMEDIATE)] | None = Field(
        default=None, description="Intermediate size of each shared expert (they run at full width d)."
    )
    latent_size: Annotated[int, Field(ge=1, le=MAX_HIDDEN)] | None = Field(
        default=None, description="Width at which routed experts run (W_down: d -> latent); null means no latent."
    )
    latent_norm: bool = Field(default=True, description="RMSNorm on the weighted expert sum before W_up (latent only).")
    capacity_factor: float = Field(
        default=1.25,
        gt=0,
        le=MAX_EXPERTS,
        description="Per-expert buffer = min(tokens, ceil(capacity_factor * tokens * k / n)); n / k drops nothing.",
    )
    router: Router = Field(default_factory=Router, description="Router scoring and balancing.")

    @model_validator(mode="after")
    def _consistent(self) -> "MoE":
        if self.top_k > self.num_experts:
            raise FieldError("top_k", f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if self.num_shared_experts > 0 and self.shared_intermediate_size is None:
            raise FieldError("shared_intermediate_size", "num_shared_experts > 0 needs shared_intermediate_size")
        return self


class Activation(_Frozen):
    """The gated MLP nonlinearity."""

    kind: Literal["situ_glu", "swiglu", "gelu"] = Field(description="situ_glu (K3), swiglu or gelu (ungated).")
    beta1: float | None = Field(default=None, gt=0, le=1e4, description="SiTU-GLU gate bound (K3: 4).")
    beta2: float | None = Field(default=None, gt=0, le=1e4, description="SiTU-GLU up bound (K3: 25).")

    @model_validator(mode="after")
    def _betas(self) -> "Activation":
        has = (self.beta1 is not None, self.beta2 is not None)
        if self.kind == "situ_glu" and has != (True, True):
            raise FieldError("kind", "situ_glu needs beta1 and beta2 (K3: 4 and 25)")
        if self.kind != "situ_glu" and any(has):
            raise FieldError("kind", f"beta1/beta2 only apply to situ_glu, not {self.kind}")
        return self

    @property
    def gated(self) -> bool:
        return self.kind != "gelu"


class Residual(_Frozen):
    """How sublayer outputs are combined across depth."""

    kind: Literal["plain", "attn_res"] = Field(default="plain", description="plain residual adds or attention residuals.")
    mode: Literal["block", "full"] | None = Field(
        default=None, description="attn_res only: block (summaries of block_size layers) or full (one source per layer)."
    )
    block_size: Annotated[int, Field(ge=1, le=MAX_LAYERS)] | None = Field(
        default=None, description="Layers per block for block attention residuals (K3: 12)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "Residual":
        if self.kind == "plain" and (self.mode is not None or self.block_size is not None):
            raise FieldError("kind", "mode/block_size only apply to kind attn_res")
        if self.kind == "attn_res" and self.mode is None:
            raise FieldError("kind", "attn_res needs mode: block or full")
        if self.mode == "block" and self.block_size is None:
            raise FieldError("mode", "block attention residuals need block_size")
        if self.mode == "full" and self.block_size is not None:
            raise FieldError("block_size", "block_size only applies to mode block")
        return self


Format = Literal["fp32", "bf16", "mxfp8", "mxfp4"]


class QuantRule(_Frozen):
    """Formats for the weights (and matmul inputs) of modules whose name matches a glob."""

    match: str = Field(
        description="fnmatch glob over parameter-owning module names, e.g. 'layers.*.moe.experts'.", pattern=GLOB_RE
    )
    weight: Format = Field(description="Storage format of the matched weights.")
    activation: Format = Field(default="bf16", description="Format of the activations entering the matched matmuls.")


class Quantization(_Frozen):
    """Quantisation policy: first matching rule wins, else the defaults."""

    default_weight: Format = Field(default="bf16", description="Weight format where no rule matches.")
    default_activation: Format = Field(default="bf16", description="Activation format where no rule matches.")
    block_size: Literal[16, 32, 64] = Field(default=32, description="MX block size (values sharing one E8M0 scale).")
    qat: bool = Field(default=False, description="Train with fake quantisation per the rules (straight-through).")
    rules: tuple[QuantRule, ...] = Field(default=(), description="Ordered rules; the first match wins.")
    keep_fp32: tuple[Annotated[str, Field(pattern=GLOB_RE)], ...] = Field(
        default=("*.router.weight", "*.router.bias", "*.A_log", "*.dt_bias"),
        description="fnmatch globs over parameter and buffer names held in fp32 where the policy would store bf16 "
        "(weight bytes, and models made or cast in bf16). The default is transformers' Kimi Linear convention: "
        "router weight and selection bias, A_log and dt_bias (a bf16 router weight re-routes about 0.9% of tokens).",
    )


class Parallel(_Frozen):
    """Parallel degrees; their product is the world size."""

    dp: Annotated[int, Field(ge=1, le=MAX_DEGREE)] = Field(default=1, description="Data-parallel degree.")
    tp: Annotated[int, Field(ge=1, le=MAX_DEGREE)] = Field(default=1, description="Tensor-parallel degree.")
    ep: Annotated[int, Field(ge=1, le=MAX_DEGREE)] = Field(default=1, description="Expert-parallel degree.")
    pp: Annotated[int, Field(ge=1, le=MAX_DEGREE)] = Field(default=1, description="Pipeline-parallel degree.")


class Schedule(_Frozen):
    """Learning-rate schedule."""

    kind: Literal["cosine", "linear", "constant"] = Field(default="cosine", description="Decay after warmup.")
    warmup_steps: Annotated[int, Field(ge=0, le=10_000_000)] = Field(default=0, description="Linear warmup steps.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Final lr as a fraction of the peak lr.")


class Training(_Frozen):
    """Training settings used by `k3compile train`."""

    optimizer: Literal["per_head_muon", "muon", "adamw"] = Field(
        default="per_head_muon", description="Matrix optimiser; non-matrix parameters always use AdamW."
    )
    lr: float = Field(default=2e-3, gt=0, le=10, description="Peak learning rate.")
    weight_decay: float = Field(default=0.1, ge=0, le=10, description="Decoupled weight decay.")
    schedule: Schedule = Field(default_factory=Schedule, description="Learning-rate schedule.")
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] = Field(default=8, description="Sequences per step.")
    seq_len: Annotated[int, Field(ge=2, le=MAX_CONTEXT)] = Field(
        default=256, description="Tokens per sequence (at least 2: the loss predicts each token from those before)."
    )
    grad_clip: float | None = Field(default=1.0, gt=0, description="Global gradient-norm clip; null disables.")
    qk_clip_tau: float | None = Field(default=None, gt=0, description="QK-clip threshold (Kimi K2: 100); null disables.")
    muon_precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="dtype of Muon's Newton-Schulz iterations: bf16 (as torch.optim.Muon), fp32, or auto: bf16 where "
        "the hardware multiplies bf16 natively (CUDA, CPUs with AVX512_BF16 or AMX), fp32 elsewhere (decided and "
        "printed once per run).",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="Compute precision of training: bf16 (the forward and its backward under torch.autocast to "
        "bfloat16, over fp32 master weights, gradients and optimizer state), fp32, or auto: bf16 on a CUDA GPU with "
        "native bf16, fp32 on the CPU (decided and printed once per run).",
    )
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = Field(default=0, description="Seed for init and data order.")


class Spec(_Frozen):
    """A Kimi-K3-class language model: architecture, quantisation, target and training settings."""

    name: str = Field(description="Model name; also the emitted package's folder name.", pattern=NAME_RE)
    vocab_size: Annotated[int, Field(ge=2, le=MAX_VOCAB)] = Field(description="Vocabulary size.")
    hidden_size: Annotated[int, Field(ge=1, le=MAX_HIDDEN)] = Field(description="Model width d.")
    num_layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)] = Field(description="Number of transformer layers.")
    tie_embeddings: bool = Field(default=False, description="Share the input embedding with the output head.")
    norm_eps: float = Field(default=1e-5, gt=0, le=1e-1, description="RMSNorm epsilon.")
    context_length: Annotated[int, Field(ge=1, le=MAX_CONTEXT)] = Field(description="Maximum context in tokens.")
    init_std: float = Field(default=0.02, gt=0, le=1, description="Std of the normal init of matrices.")
    layout: Layout = Field(description="Per-layer choice of KDA or MLA token mixer.")
    kda: KDA | None = Field(default=None, description="KDA settings; required when any layer is K.")
    mla: MLA | None = Field(default=None, description="Gated MLA settings; required when any layer is M.")
    dense_ffn: DenseFFN | None = Field(default=None, description="Dense FFN layers; null means every layer is MoE.")
    moe: MoE | None = Field(default=None, description="Mixture of experts; null means every layer is dense.")
    activation: Activation = Field(description="MLP nonlinearity, for dense FFN, shared and routed experts alike.")
    residual: Residual = Field(default_factory=Residual, description="Residual wiring across depth.")
    quantization: Quantization = Field(default_factory=Quantization, description="Quantisation policy.")
    target: Literal["cpu", "a100", "h100", "h200", "b200"] = Field(default="cpu", description="Kernel target.")
    parallel: Parallel = Field(default_factory=Parallel, description="Parallel degrees.")
    training: Training = Field(default_factory=Training, description="Training settings.")

    # ----- derived views (computed, never stored) -----

    @property
    def mixers(self) -> tuple[str, ...]:
        """Per-layer mixer letters after tiling the pattern and forcing the last layer."""
        if self.layout.layers is not None:
            seq = list(self.layout.layers)
        else:
            pat = self.layout.pattern or ""
            seq = [pat[i % len(pat)] for i in range(self.num_layers)]
        if self.layout.last_layer_full and seq:
            seq[-1] = MIXER_MLA
        return tuple(seq)

    @property
    def dense_layers(self) -> frozenset[int]:
        if self.moe is None:
            return frozenset(range(self.num_layers))
        return frozenset(self.dense_ffn.layers) if self.dense_ffn else frozenset()

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    # ----- cross-field checks -----

    @model_validator(mode="after")
    def _cross_field(self) -> "Spec":
        L = self.num_layers
        if self.layout.layers is not None and len(self.layout.layers) != L:
            raise FieldError("layout.layers", f"layout.layers has {len(self.layout.layers)} entries but num_layers is {L}")
        if self.layout.pattern is not None and len(self.layout.pattern) > L:
            raise FieldError("layout.pattern", f"layout.pattern is longer ({len(self.layout.pattern)}) than num_layers ({L})")
        mixers = self.mixers
        if MIXER_KDA in mixers and self.kda is None:
            raise FieldError("kda", "the layout has KDA layers (K) but no `kda` section")
        if MIXER_MLA in mixers and self.mla is None:
            raise FieldError("mla", "the layout has full-attention layers (M) but no `mla` section")
        if self.moe is None and self.dense_ffn is None:
            raise FieldError("moe", "give `moe`, `dense_ffn` or both")
        if self.dense_ffn is not None:
            bad = [i for i in self.dense_ffn.layers if i >= L]
            if bad:
                raise FieldError("dense_ffn.layers", f"dense layer {bad[0]} is out of range for {L} layers")
        if self.moe is not None:
            if self.dense_ffn is not None and len(self.dense_ffn.layers) == L:
                raise FieldError("moe", "every layer is dense, so `moe` is never used")
            if self.moe.num_experts % self.parallel.ep:
                raise FieldError("parallel.ep", f"parallel.ep ({self.parallel.ep}) does not divide moe.num_experts ({self.moe.num_experts})")
            if self.moe.latent_size is not None and self.moe.latent_size > self.hidden_size:
                raise FieldError(
                    "moe.latent_size",
                    f"latent_size ({self.moe.latent_size}) is wider than hidden_size ({self.hidden_size})",
                )
            if self.moe.router.balancing != "quantile" and self.moe.router.histogram_bins is not None:
                raise FieldError("moe.router.histogram_bins", "histogram_bins only applies to quantile balancing")
        tp = self.parallel.tp
        for section in ("kda", "mla"):
            heads = getattr(self, section).num_heads if getattr(self, section) is not None else None
            if heads is not None and heads % tp:
                raise FieldError("parallel.tp", f"parallel.tp ({tp}) does not divide {section}.num_heads ({heads})")
        if self.parallel.pp > L:
            raise FieldError("parallel.pp", f"parallel.pp ({self.parallel.pp}) exceeds num_layers ({L})")
        if self.mla is not None and self.mla.rope and self.mla.qk_rope_head_dim % 2:
            raise FieldError("mla.qk_rope_head_dim", "RoPE needs an even qk_rope_head_dim")
        if self.residual.block_size is not None and self.residual.block_size > L:
            raise FieldError(
                "residual.block_size", f"residual.block_size ({self.residual.block_size}) exceeds num_layers ({L})"
            )
        if self.training.seq_len > self.context_length:
            raise FieldError("training.seq_len", f"training.seq_len ({self.training.seq_len}) exceeds context_length ({self.context_length})")
        self._check_quant_blocks()
        return self

    def _check_quant_blocks(self) -> None:
        """Every dimension an MX block runs along (a matmul's input dim) must be a multiple of the block."""
        from k3compile.spec.weights import weight_inventory  # local: the inventory reads the schema

        block = self.quantization.block_size
        for w in weight_inventory(self):
            if w.format in MX_FORMATS and w.in_dim % block:
                raise FieldError(
                    "quantization.rules",
                    f"{w.name} is {w.format} but its input dim {w.in_dim} is not a multiple of the MX block {block}",
                )
