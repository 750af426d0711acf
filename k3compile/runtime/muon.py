"""Per-Head Muon (reference section 7): Muon on matrices, each attention head's Q/K/V block on its own, AdamW elsewhere.

Muon groups reproduce `torch.optim.Muon` step for step (EMA momentum, optional Nesterov, quintic Newton-Schulz in
bf16, decoupled weight decay, `adjust_lr_fn`), except that a matrix may be cut along its rows into blocks (heads)
that are orthogonalised, and learning-rate-adjusted, separately. AdamW groups call torch's own functional AdamW, so
they match `torch.optim.AdamW` exactly. QK-clip (Kimi K2) rescales the heads whose max attention logit exceeds tau.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam as _functional_adam

__all__ = ["ADAMW_NAME_PATTERNS", "NS_COEFFICIENTS", "PerHeadMuon", "default_use_muon", "newton_schulz", "qk_clip_"]

# Quintic coefficients (a, b, c) of torch.optim.Muon / Keller Jordan's Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Name patterns that go to AdamW even when 2-D: the token embedding and output head (common practice) and the
# depthwise short-conv kernels, which are per-channel filters rather than matmul weights.
ADAMW_NAME_PATTERNS = ("*embed*", "*lm_head*", "*conv*")

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

HeadSplit = int | tuple[int, ...]


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """Approximate the orthogonal factor U V^T of a 2-D `g` by `steps` quintic Newton-Schulz iterations in bf16.

    X <- a X + (b X X^T + c (X X^T)^2) X on the wide orientation of g after scaling it to unit Frobenius norm;
    same op sequence as torch.optim.Muon so the numbers agree bit for bit. Returns bf16.
    """
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.bfloat16()
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # out of place: never touch a bf16 momentum buffer
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's per-matrix learning rate: sqrt(max(1, A/B)) ("original"/None) or 0.2 sqrt(max(A, B)) (AdamW RMS)."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def _block_sizes(rows: int, split: HeadSplit) -> list[int]:
    """Row counts of the blocks a matrix with `rows` rows is cut into (int: that many equal heads)."""
    if isinstance(split, int):
        if split < 1 or rows % split:
            raise ValueError(f"head split {split} does not divide {rows} rows")
        return [rows // split] * split
    if sum(split) != rows or min(split) < 1:
        raise ValueError(f"head split sizes {split} do not partition {rows} rows")
    return list(split)


def _blocks(t: Tensor, sizes: list[int]) -> list[Tensor]:
    """Views of every head block of every matrix in `t` ([..., rows, cols]; leading dims stack matrices)."""
    mats = t.unsqueeze(0) if t.ndim == 2 else t.flatten(0, -3)
    return [blk for mat in mats for blk in torch.split(mat, sizes, dim=0)]


def _scalar_dtype() -> torch.dtype:
    """dtype of AdamW's `step` counter, as torch.optim.AdamW picks it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def qk_clip_(
    w_q: Tensor, w_k: Tensor, max_logits_H: Tensor, tau: float, head_dim_q: int, head_dim_k: int
) -> Tensor:
    """QK-clip in place: heads whose max q.k logit exceeds tau get their W_q and W_k rows scaled by sqrt(tau/max).

    The clipped heads' max logit becomes tau; other heads are multiplied by exactly 1. `w_q` is [H*head_dim_q, D]
    (or an [H, head_dim_q, D] view, e.g. `w.view(H, d, D)[:, :d_nope]` for a fused layout), `w_k`
    likewise. No host sync. Returns the fp32 per-head factors [H].
    """
    H = max_logits_H.numel()
    for w, d, what in ((w_q, head_dim_q, "w_q"), (w_k, head_dim_k, "w_k")):
        if not ((w.ndim == 2 and w.shape[0] == H * d) or (w.ndim == 3 and tuple(w.shape[:2]) == (H, d))):
            raise ValueError(f"{what} of shape {tuple(w.shape)} does not hold {H} heads of {d} rows")
    m = max_logits_H.detach().reshape(H).float()
    scale = torch.where(m > tau, (tau / m).sqrt(), torch.ones_like(m))
    for w, d in ((w_q, head_dim_q), (w_k, head_dim_k)):
        blocks = w.view(H, d, -1)
        s = scale.to(blocks.device, torch.promote_types(blocks.dtype, torch.float32))[:, None, None]
        blocks.copy_(blocks.to(s.dtype) * s)
    return scale


def default_use_muon(name: str, p: Tensor) -> bool:
    """Default routing: Muon for matrices (ndim >= 2; leading dims stack experts), AdamW for vectors and scalars
    and for the embedding, output head and short-conv kernels (names matching ADAMW_NAME_PATTERNS)."""
    return p.ndim >= 2 and not any(fnmatch.fnmatchcase(name, pat) for pat in ADAMW_NAME_PATTERNS)


class PerHeadMuon(torch.optim.Optimizer):
    """Muon with per-head blocks for Q/K/V projections, AdamW for non-matrix parameters, optional QK-clip.

    Each param group carries `use_muon`. Muon groups: lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
    ns_steps, adjust_lr_fn and `head_split` (int H: cut dim -2 into H equal blocks; tuple: block row counts; 1 =
    whole matrix). AdamW groups: lr, betas, eps, weight_decay. A plain tensor list is routed by ndim (>= 2: Muon);
    use `from_named_parameters` for name-based routing and head splits. The default adjust_lr_fn is
    "match_rms_adamw", so one learning rate serves both kinds (adamw_lr defaults to lr).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        *,
        adamw_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        qk_clip_tau: float | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError("lr, momentum and weight_decay must be >= 0")
        if adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if not 0 <= ns_steps < 100:
            raise ValueError("ns_steps must be in [0, 100)")
        self._kind_defaults = {
            True: dict(
                lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                head_split=1,
            ),
            False: dict(
                lr=lr if adamw_lr is None else adamw_lr, betas=tuple(betas), eps=adamw_eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            ),
        }
        self.qk_clip_tau = qk_clip_tau
        self._qk_pairs: dict[str, tuple[Tensor, Tensor, int, int]] = {}
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [
                {"params": ps, "use_muon": m}
                for m, ps in ((True, [p for p in groups if p.ndim >= 2]), (False, [p for p in groups if p.ndim < 2]))
                if ps
            ]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict) -> None:
        """Fill the group's kind-specific defaults (kind from `use_muon`, else from ndim) and check its params."""
        ps = param_group["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        if "use_muon" not in param_group:
            kinds = {p.ndim >= 2 for p in ps}
            if len(kinds) != 1:
                raise ValueError("a group mixing matrices and vectors needs an explicit 'use_muon'")
            param_group["use_muon"] = kinds.pop()
        for k, v in self._kind_defaults[bool(param_group["use_muon"])].items():
            param_group.setdefault(k, v)
        if param_group["use_muon"]:
            split = param_group["head_split"]
            if not isinstance(split, int):
                param_group["head_split"] = split = tuple(split)
            for p in ps:
                if p.ndim < 2:
                    raise ValueError(f"Muon needs matrices, got a parameter of shape {tuple(p.shape)}")
                if p.ndim > 2 and not p.is_contiguous():
                    raise ValueError("stacked (ndim > 2) Muon parameters must be contiguous")
                _block_sizes(p.shape[-2], split)
        super().add_param_group(param_group)

    @classmethod
    def from_named_parameters(
        cls,
        named_params: Iterable[tuple[str, Tensor]],
        head_splits: Mapping[str, int | Sequence[int]] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        adamw_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        *,
        use_muon: Callable[[str, Tensor], bool] | Collection[str] = default_use_muon,
        qk_clip_pairs: Mapping[str, tuple[str, str]] | None = None,
        **kwargs,
    ) -> PerHeadMuon:
        """Route named parameters by `use_muon` (a predicate or the set of Muon names) and give each Muon parameter
        the head split of the first glob in `head_splits` matching its name (else 1). `qk_clip_pairs` maps a key to
        (q name, k name); their head dims come from those params' int head splits. Other kwargs go to __init__."""
        named = list(named_params)
        is_muon = use_muon if callable(use_muon) else (lambda n, p, s=frozenset(use_muon): n in s)
        splits = {}
        for name, p in named:
            globs = [g for g in (head_splits or {}) if fnmatch.fnmatchcase(name, g)]
            if globs and not is_muon(name, p):
                raise ValueError(f"{name} has a head split but is routed to AdamW")
            s = head_splits[globs[0]] if globs else 1
            splits[name] = s if isinstance(s, int) else tuple(s)
        groups: dict[HeadSplit, list[Tensor]] = {}
        adamw = []
        for name, p in named:
            (groups.setdefault(splits[name], []) if is_muon(name, p) else adamw).append(p)
        param_groups = [{"params": ps, "use_muon": True, "head_split": s} for s, ps in groups.items()]
        if adamw:
            param_groups.append({"params": adamw, "use_muon": False})
        opt = cls(param_groups, lr=lr, weight_decay=weight_decay, adamw_lr=adamw_lr, betas=betas, **kwargs)
        by_name = dict(named)
        for key, (qn, kn) in (qk_clip_pairs or {}).items():
            hq, hk = splits[qn], splits[kn]
            if not (isinstance(hq, int) and isinstance(hk, int) and hq == hk):
                raise ValueError(f"QK-clip pair {key} needs equal int head splits, got {hq} and {hk}")
            wq, wk = by_name[qn], by_name[kn]
            opt.register_qk_clip(key, wq, wk, wq.shape[0] // hq, wk.shape[0] // hk)
        return opt

    def register_qk_clip(self, key: str, w_q: Tensor, w_k: Tensor, head_dim_q: int, head_dim_k: int) -> None:
        """Name one attention layer's (W_q, W_k) pair (params or views of them) for QK-clip after steps."""
        self._qk_pairs[key] = (w_q, w_k, head_dim_q, head_dim_k)

    def qk_clip_(self, max_logits: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """QK-clip (tau = qk_clip_tau) of each registered layer in `max_logits` (key -> [H]); returns the factors."""
        if self.qk_clip_tau is None:
            raise ValueError("QK-clip needs qk_clip_tau")
        out = {}
        for key, m in max_logits.items():
            w_q, w_k, dq, dk = self._qk_pairs[key]
            out[key] = qk_clip_(w_q, w_k, m, self.qk_clip_tau, dq, dk)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, max_logits: Mapping[str, Tensor] | None = None):
        """One update of every group; then QK-clip for the layers in `max_logits` (key -> per-head max logit [H])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        if max_logits:
            self.qk_clip_(max_logits)
        return loss

    def state_layout(self, p: Tensor) -> dict[str, tuple[int, ...]]:
        """Slot -> shape of the state kept for parameter `p` once it has stepped (what a checkpoint may restore)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if group["use_muon"]:
            return {"momentum_buffer": tuple(p.shape)}
        return {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}

    def _muon_step(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse or torch.is_complex(p):
                raise RuntimeError("Muon supports dense real parameters only")
            grad, state = p.grad, self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            p.mul_(1 - lr * wd)
            sizes = _block_sizes(p.shape[-2], group["head_split"])
            for p_blk, u_blk in zip(_blocks(p, sizes), _blocks(update, sizes)):
                o = newton_schulz(u_blk, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p_blk.add_(o, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], *u_blk.shape))

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            has_complex=any(torch.is_complex(p) for p in params), decoupled_weight_decay=True,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )
