"""k3compile.ops: the public functional API over the k3 torch.library ops.

Importing this package registers every `torch.ops.k3.*` operator (emitted code
relies on that). Each op has a PyTorch reference in `k3compile.kernels`.
"""

from k3compile.kernels.activations.op import gelu, situ_glu, swiglu
from k3compile.kernels.attn_res.op import attn_res
from k3compile.kernels.attn_res_normed.op import attn_res_normed, rms_inv
from k3compile.kernels.balancing.op import (
    attach_aux_loss,
    aux_balance_loss,
    qb_histogram,
    qb_update_from_histogram,
    quantile_balance_update,
    quantile_balance_update_hist,
    sign_balance_update,
)
from k3compile.kernels.experts.op import (
    expert_glu,
    expert_matmul,
    expert_rows_ffn,
    expert_rows_matmul,
    mx_expert_glu,
    mx_expert_matmul,
)
from k3compile.kernels.fused.op import linear_glu
from k3compile.kernels.gla.op import gla, gla_decode_step
from k3compile.kernels.glu_train.op import glu_train
from k3compile.kernels.kda.op import kda, kda_decode_step, kda_gate
from k3compile.kernels.mla.op import mla_attention, mla_decode_absorbed, mla_rope, mla_rope_at
from k3compile.kernels.moe.op import expert_mlp, moe_combine, moe_dispatch, moe_dispatch_rows, route
from k3compile.kernels.mx.op import mx_dequantize, mx_fake_quantize, mx_linear, mx_quantize
from k3compile.kernels.norms.op import add_rms_norm, l2_norm, rms_norm, rms_norm_gate
from k3compile.kernels.short_conv.op import short_conv

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
