"""PyTorch reference for Attention Residuals: a softmax over depth sources with one learned pseudo-query.

Legend: S sources (embedding, block summaries or sublayer outputs), B batch, T tokens, D hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.kernels.norms import as_dtype, rms_norm_ref, upcast


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
