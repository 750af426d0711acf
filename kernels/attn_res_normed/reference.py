"""PyTorch reference for AttnRes with each source normalised once: 1/rms per source, then the depth mix.

`attn_res_ref` normalises every source again at every site that reads it. Since
RMSNorm(v) . (q * w) = r(v) * (v . (q * w)) with r(v) = 1/sqrt(mean(v^2) + eps), the factor r is a
property of the source alone: computed once when the source is made (`rms_inv_ref`), it is read by
every later site (`attn_res_normed_ref`). Legend: S sources, B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.norms.reference import _inv_rms, as_dtype, upcast


def rms_inv_ref(x_BTD: Tensor, eps: float) -> Tensor:
    """r [B, T] = 1/sqrt(mean(x^2, last dim) + eps), in at least fp32."""
    return _inv_rms(upcast(x_BTD), eps).squeeze(-1)


def rms_inv_bwd_ref(grads: list[Tensor], x_BTD: Tensor, eps: float) -> list[Tensor]:
    """[dx] of `rms_inv_ref` for grads = [dr]: dr/dx = -r^3 x / D."""
    xf = upcast(x_BTD)
    r = _inv_rms(xf, eps)
    coef = (upcast(grads[0]).unsqueeze(-1) * r.pow(3)).div_(-xf.shape[-1])
    return [as_dtype(coef * xf, x_BTD.dtype)]


def attn_res_normed_ref(sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor) -> Tensor:
    """h = sum_i softmax_i(r_i (v_i . (query * norm_weight))) v_i: attn_res with the 1/rms factors given."""
    v = upcast(sources_SBTD)
    u_D = upcast(query_D) * upcast(norm_weight_D)
    z_SBT = (v @ u_D).mul_(upcast(rinv_SBT))
    p_SBT = torch.softmax(z_SBT, dim=0)
    return as_dtype((p_SBT.unsqueeze(-1) * v).sum(dim=0), sources_SBTD.dtype)


def attn_res_normed_bwd_ref(
    grads: list[Tensor], sources_SBTD: Tensor, rinv_SBT: Tensor, query_D: Tensor, norm_weight_D: Tensor
) -> list[Tensor]:
    """[dsources, drinv, dquery, dnorm_weight] of `attn_res_normed_ref` for grads = [dh], hand-derived.

    With u = query * norm_weight, s_i = v_i . u, z_i = r_i s_i, p = softmax(z) and h = sum_i p_i v_i:
    dz_i = p_i (dh . v_i - dh . h), dv_i = p_i dh + dz_i r_i u, dr_i = dz_i s_i, du = sum dz_i r_i v_i.
    """
    v = upcast(sources_SBTD)
    S, D = v.shape[0], v.shape[-1]
    v_SND = v.reshape(S, -1, D)
    r_SN = upcast(rinv_SBT).reshape(S, -1)
    dh_ND = upcast(grads[0]).reshape(-1, D)
    q, w = upcast(query_D), upcast(norm_weight_D)
    u = q * w
    s_SN = v_SND @ u
    p_SN = torch.softmax(s_SN * r_SN, dim=0)
    dp_SN = (v_SND * dh_ND).sum(dim=-1)
    dz_SN = (dp_SN - (p_SN * dp_SN).sum(dim=0)).mul_(p_SN)
    c_u = dz_SN * r_SN
    dv = p_SN.unsqueeze(-1) * dh_ND
    dv.addcmul_(c_u.unsqueeze(-1), u)
    du = (c_u.reshape(1, -1) @ v_SND.reshape(-1, D)).reshape(D)
    return [
        dv.view(sources_SBTD.shape).to(sources_SBTD.dtype),
        (dz_SN * s_SN).view(rinv_SBT.shape).to(rinv_SBT.dtype),
        (du * w).to(query_D.dtype),
        (du * q).to(norm_weight_D.dtype),
    ]
