"""PyTorch reference for Attention Residuals: a softmax over depth sources with one learned pseudo-query.

Legend: S sources (embedding, block summaries or sublayer outputs), B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.norms.reference import as_dtype, rms_norm_ref, upcast


def attn_res_ref(sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float) -> Tensor:
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over the S sources, per token.

    The norm only shapes the logits; the mix is of the raw sources. Computed in at least fp32
    (a bf16 softmax over depth would round small weights away); returned in the sources' dtype.
    A zero query gives equal weights: the plain average of the sources.
    """
    v = upcast(sources_SBTD)
    logits_SBT = (rms_norm_ref(v, norm_weight_D, eps) * upcast(query_D)).sum(dim=-1)
    p_SBT = torch.softmax(logits_SBT, dim=0)
    return as_dtype((p_SBT.view(*p_SBT.shape, 1) * v).sum(dim=0), sources_SBTD.dtype)


def attn_res_bwd_ref(
    grads: list[Tensor], sources_SBTD: Tensor, query_D: Tensor, norm_weight_D: Tensor, eps: float
) -> list[Tensor]:
    """[dsources, dquery, dnorm_weight] of `attn_res_ref` for grads = [dh], hand-derived.

    With u = query * norm_weight, r_i = 1/rms(v_i) and logits z_i = r_i (v_i . u), p = softmax(z) and
    h = sum_i p_i v_i: dz_i = p_i (dh . v_i - dh . h) (dh . h = sum_j p_j dh . v_j), and
      dv_i = p_i dh + dz_i r_i u - dz_i z_i r_i^2 / D v_i,   du = sum_(i, tokens) dz_i r_i v_i,
    dquery = du * norm_weight, dnorm_weight = du * query. The per-token statistics are recomputed from the
    sources (two reads); the rest is three passes writing dsources and two matrix-vector products.
    """
    v = upcast(sources_SBTD)
    S, D = v.shape[0], v.shape[-1]
    v_SND = v.reshape(S, -1, D)
    dh_ND = upcast(grads[0]).reshape(-1, D)
    q, w = upcast(query_D), upcast(norm_weight_D)
    u = q * w
    r_SN = torch.rsqrt(v_SND.pow(2).mean(dim=-1) + eps)
    z_SN = (v_SND @ u).mul_(r_SN)
    p_SN = torch.softmax(z_SN, dim=0)
    dp_SN = (v_SND * dh_ND).sum(dim=-1)  # dh . v_i
    dz_SN = (dp_SN - (p_SN * dp_SN).sum(dim=0)).mul_(p_SN)
    c_u = dz_SN * r_SN  # coefficient of u in dv_i, and of v_i in du
    c_v = (dz_SN * z_SN).mul_(r_SN.square()).div_(-D)  # coefficient of v_i
    dv = p_SN.unsqueeze(-1) * dh_ND
    dv.addcmul_(c_u.unsqueeze(-1), u).addcmul_(c_v.unsqueeze(-1), v_SND)
    du = (c_u.reshape(1, -1) @ v_SND.reshape(-1, D)).reshape(D)
    return [dv.view(sources_SBTD.shape).to(sources_SBTD.dtype), (du * w).to(query_D.dtype),
            (du * q).to(norm_weight_D.dtype)]
