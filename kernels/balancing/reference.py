"""PyTorch references for MoE load balancing: Quantile Balancing (exact and histogram), sign update, aux loss.

Shapes: T tokens, E experts, K experts per token, B histogram bins. Scores are router scores in [0, 1]
(sigmoid or softmax); all statistics are computed in fp32 and no function synchronises with the host.

Quantile Balancing (QB) derivation. With the old bias b, token t ranks s_t + b; call its (K+1)-th largest
value alpha_t, the best score that just misses the top K. Holding the cutoffs fixed, token t picks expert j
under a new bias b' when s_tj + b'_j > alpha_t, i.e. when s_tj - alpha_t > -b'_j. Expert j is then chosen
by the fraction of tokens whose s_tj - alpha_t exceeds -b'_j; asking for a fraction K/E (an even load of
T*K/E tokens) gives -b'_j = quantile_{1-K/E}(s[:, j] - alpha), so b'_j = -quantile_{1-K/E}(s[:, j] - alpha).
A common shift of all biases changes no token's top K, so b' is centred to mean zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def cutoff_margin(scores_TE: Tensor, bias_E: Tensor, k: int) -> Tensor:
    """margin_TE = s + b - alpha_t, alpha_t the (k+1)-th largest of s_t + b; fp32. Needs k < E."""
    biased = scores_TE.float() + bias_E.float()
    alpha_T = torch.topk(biased, k + 1, dim=-1).values[:, k]
    return biased - alpha_T[:, None]


def upper_quantile(x_ET: Tensor, frac: float) -> Tensor:
    """Per row, torch.quantile(x, 1 - frac) (linear interpolation), via a top-r instead of a full sort."""
    t = x_ET.shape[-1]
    pos = (1.0 - frac) * (t - 1)  # ascending position, as torch.quantile
    lo, hi = math.floor(pos), math.ceil(pos)
    top = torch.topk(x_ET, t - lo, dim=-1).values  # ascending index i sits at descending index t-1-i
    return torch.lerp(top[:, t - 1 - lo], top[:, t - 1 - hi], pos - lo)


def quantile_balance_update(scores_TE: Tensor, bias_E: Tensor, k: int) -> Tensor:
    """Exact QB: b'_j = -quantile_{1-k/E}(s[:, j] - alpha), centred (derivation in the module docstring).

    Returns the new fp32 bias [E]; it is meant for the next batch, never the one it was measured on.
    """
    e = scores_TE.shape[-1]
    if k >= e:  # every expert is always chosen: the bias has nothing to decide
        return torch.zeros_like(bias_E, dtype=torch.float32)
    # quantile(s_j - alpha) = quantile(margin_j) - b_j, since b_j is a constant per expert
    margin_ET = cutoff_margin(scores_TE, bias_E, k).t()
    b_hat = bias_E.float() - upper_quantile(margin_ET, k / e)
    return b_hat - b_hat.mean()


MARGIN_SCALE = 1e-4  # bins near margin 0 are about this wide; at 1000 bins, farther ones ~2% of |margin|


def margin_bin_edges(bias_E: Tensor, bins: int) -> Tensor:
    """The `bins + 1` fixed edges of the QB margin histogram, uniform in asinh(margin / MARGIN_SCALE).

    They span +-(1 + max b - min b), every margin s + b - alpha can take for scores in [0, 1], and are
    derived from the bias alone, which every rank holds identically, so all ranks bin alike. The log-like
    spacing keeps bins narrow at the cutoff (margin 0), where a balanced expert's quantile lies.
    """
    half = 1.0 + (bias_E.float().max() - bias_E.float().min())
    u_max = torch.asinh(half / MARGIN_SCALE)
    steps = torch.linspace(-1.0, 1.0, bins + 1, device=bias_E.device)
    return MARGIN_SCALE * torch.sinh(steps * u_max)


def _margin_bin(margin: Tensor, bias_E: Tensor, bins: int) -> Tensor:
    """Bin index of each margin under `margin_bin_edges` (clamped into the outer bins)."""
    half = 1.0 + (bias_E.float().max() - bias_E.float().min())
    u = torch.asinh(margin / MARGIN_SCALE) / torch.asinh(half / MARGIN_SCALE)
    return ((u + 1.0) * (bins / 2)).floor().clamp(0, bins - 1).long()


def qb_histogram(scores_TE: Tensor, bias_E: Tensor, k: int, bins: int) -> Tensor:
    """Per-expert histogram of the QB margins over `bins` fixed bins: int64 counts [E, bins].

    The one tensor a data-parallel run all-reduces (sums) before `qb_update_from_histogram`.
    """
    e = scores_TE.shape[-1]
    if k >= e:
        return torch.zeros(e, bins, dtype=torch.int64, device=scores_TE.device)
    bin_TE = _margin_bin(cutoff_margin(scores_TE, bias_E, k), bias_E, bins)
    flat = (bin_TE + torch.arange(e, device=bin_TE.device) * bins).reshape(-1)
    counts = torch.zeros(e * bins, dtype=torch.int64, device=scores_TE.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts.view(e, bins)


def qb_update_from_histogram(counts_EB: Tensor, bias_E: Tensor, k: int) -> Tensor:
    """QB from a margin histogram: per expert, the margin with a fraction k/E of the counts above it.

    Reads the bin where the count from the top reaches T*k/E and interpolates linearly between its
    edges (values taken as uniform within a bin); then b'_j = b_j - that margin, centred.
    """
    e, bins = counts_EB.shape
    if k >= e:
        return torch.zeros_like(bias_E, dtype=torch.float32)
    edges = margin_bin_edges(bias_E, bins)
    counts = counts_EB.float()
    target_E = counts.sum(-1) * (k / e)
    above_EB = counts.flip(-1).cumsum(-1).flip(-1)  # above[:, t] = count in bins t .. bins-1
    top_bin = ((above_EB >= target_E[:, None]).sum(-1) - 1).clamp(0, bins - 1)
    in_bin = counts.gather(-1, top_bin[:, None]).squeeze(-1)
    above_next = above_EB.gather(-1, top_bin[:, None]).squeeze(-1) - in_bin
    frac = (target_E - above_next) / in_bin.clamp_min(1.0)
    q_E = torch.lerp(edges[top_bin + 1], edges[top_bin], frac)
    b_hat = bias_E.float() - q_E
    return b_hat - b_hat.mean()


def quantile_balance_update_hist(scores_TE: Tensor, bias_E: Tensor, k: int, bins: int = 1000) -> Tensor:
    """Histogram QB on one rank: `qb_update_from_histogram(qb_histogram(...))`."""
    return qb_update_from_histogram(qb_histogram(scores_TE, bias_E, k, bins), bias_E, k)


def sign_balance_update(load_E: Tensor, bias_E: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3 aux-loss-free update: b_j += rate * sign(mean load - load_j)."""
    load = load_E.float()
    return bias_E.float() + rate * torch.sign(load.mean() - load)


def aux_balance_loss(scores_TE: Tensor, indices_TK: Tensor) -> Tensor:
    """Switch/DeepSeek auxiliary loss E * sum_j f_j P_j (1 at a perfectly even load).

    f_j is the fraction of the T*K assignments that went to expert j (not differentiable), P_j the mean
    over tokens of the scores normalised to sum one per token (differentiable w.r.t. the scores).
    """
    t, e = scores_TE.shape
    flat = indices_TK.reshape(-1)
    counts_E = torch.zeros(e, dtype=torch.float32, device=scores_TE.device)
    counts_E = counts_E.scatter_add(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
    s = scores_TE.float() if scores_TE.dtype != torch.float64 else scores_TE
    p_E = (s / s.sum(-1, keepdim=True)).mean(0)
    f_E = counts_E.to(p_E.dtype) / flat.numel()
    return e * (f_E * p_E).sum()
