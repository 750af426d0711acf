"""k3compile.ops: the public functional API over the k3 torch.library ops.

Importing this package registers every `torch.ops.k3.*` operator (emitted code
relies on that). Each op has a PyTorch reference in `k3compile.kernels`.
"""

from k3compile.ops.activations import gelu, situ_glu, swiglu
from k3compile.ops.attn_res import attn_res
from k3compile.ops.attn_res_normed import attn_res_normed, rms_inv
from k3compile.ops.balancing import (
    attach_aux_loss,
    aux_balance_loss,
    qb_histogram,
    qb_update_from_histogram,
    quantile_balance_update,
    quantile_balance_update_hist,
    sign_balance_update,
)
from k3compile.ops.experts import (
    expert_glu,
    expert_matmul,
    expert_rows_ffn,
    expert_rows_matmul,
    mx_expert_glu,
    mx_expert_matmul,
)
from k3compile.ops.fused import linear_glu
from k3compile.ops.gla import gla, gla_decode_step
from k3compile.ops.glu_train import glu_train
from k3compile.ops.kda import kda, kda_decode_step, kda_gate
from k3compile.ops.mla import mla_attention, mla_decode_absorbed, mla_rope, mla_rope_at
from k3compile.ops.moe import expert_mlp, moe_combine, moe_dispatch, moe_dispatch_rows, route
from k3compile.ops.mx import mx_dequantize, mx_fake_quantize, mx_linear, mx_quantize
from k3compile.ops.norms import add_rms_norm, l2_norm, rms_norm, rms_norm_gate
from k3compile.ops.short_conv import short_conv

__all__ = [
    "add_rms_norm",
    "attach_aux_loss",
    "attn_res",
    "attn_res_normed",
    "aux_balance_loss",
    "expert_glu",
    "expert_matmul",
    "expert_mlp",
    "expert_rows_ffn",
    "expert_rows_matmul",
    "gelu",
    "gla",
    "gla_decode_step",
    "glu_train",
    "kda",
    "kda_decode_step",
    "kda_gate",
    "l2_norm",
    "linear_glu",
    "mla_attention",
    "mla_decode_absorbed",
    "mla_rope",
    "mla_rope_at",
    "moe_combine",
    "moe_dispatch",
    "moe_dispatch_rows",
    "mx_dequantize",
    "mx_expert_glu",
    "mx_expert_matmul",
    "mx_fake_quantize",
    "mx_linear",
    "mx_quantize",
    "qb_histogram",
    "qb_update_from_histogram",
    "quantile_balance_update",
    "quantile_balance_update_hist",
    "rms_norm",
    "rms_inv",
    "rms_norm_gate",
    "route",
    "short_conv",
    "sign_balance_update",
    "situ_glu",
    "swiglu",
]
