"""Per-Head Muon (reference section 7): Muon on matrices, each attention head's Q/K/V block on its own, AdamW elsewhere.

Muon groups reproduce `torch.optim.Muon` step for step (EMA momentum, optional Nesterov, quintic Newton-Schulz in
bf16, decoupled weight decay, `adjust_lr_fn`), except that a matrix may be cut along its rows into blocks (heads)
that are orthogonalised, and learning-rate-adjusted, separately, and that the Newton-Schulz dtype is a setting
(`ns_dtype`): bf16 reproduces torch.optim.Muon bit for bit; fp32 is the fast one where the hardware has no native
bf16 matmul (`muon_precision` decides, once per run). In fp32 one step orthogonalises every block of one shape,
across all parameters (stacked experts, per-head blocks), as one chain over the stack, kept in a buffer reused from
step to step (on a CPU the chain runs matrix by matrix, each matrix's iterations in cache, the matrices side by side
on the intra-op threads: twice the GEMM rate of torch.bmm there); bf16 goes matrix by matrix,
because a batched bf16 matmul does not round exactly as the 2-D ones of torch.optim.Muon do (on oneDNN, about 1%
of entries land one ulp away). AdamW groups call torch's own functional AdamW, so they match `torch.optim.AdamW`
exactly. QK-clip (Kimi K2) rescales the heads whose max attention logit exceeds tau. An FSDP2-sharded (DTensor)
Muon parameter has its update gathered whole for Newton-Schulz, and each rank keeps its own rows of the result
(Moonshot's Distributed Muon), so head blocks are never cut by a shard.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch
from torch import Tensor
from torch.optim.adam import adam as _functional_adam

from k3compile.kernels._common.threads import side_by_side

__all__ = [
    "ADAMW_NAME_PATTERNS",
    "MUON_PRECISIONS",
    "NS_COEFFICIENTS",
    "PerHeadMuon",
    "default_use_muon",
    "muon_precision",
    "native_bf16_matmul",
    "newton_schulz",
    "qk_clip_",
]

# Quintic coefficients (a, b, c) of torch.optim.Muon / Keller Jordan's Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Name patterns that go to AdamW even when 2-D: the token embedding and output head (common practice) and the
# depthwise short-conv kernels, which are per-channel filters rather than matmul weights.
ADAMW_NAME_PATTERNS = ("*embed*", "*lm_head*", "*conv*")

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")

HeadSplit = int | tuple[int, ...]

MUON_PRECISIONS = ("auto", "bf16", "fp32")
_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# oneDNN's CPU ISAs from the first with a native bf16 dot product (AVX512_BF16's vdpbf16ps, or AMX) up, as
# ONEDNN_MAX_CPU_ISA (formerly DNNL_MAX_CPU_ISA) names them. Below them oneDNN emulates bf16 matmuls through
# conversions: 2.6x slower than fp32 at AVX512_CORE and 4.6-5.3x at AVX2 on an AVX-512 CPU, 25-45x on CPUs
# without AVX-512 (reference kimi-k3.md).
_ONEDNN_BF16_ISAS = frozenset({
    "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
})


def native_bf16_matmul(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(whether a bf16 matmul on `device` runs in native bf16 instructions, why, in a few words).

    CUDA: the GPU's own bf16 support (Ampere and later), emulation not counted. CPU: PyTorch hands bf16
    matmuls to oneDNN, so they are native when the CPU has AVX512_BF16 or AMX, oneDNN is available and
    enabled, and ONEDNN_MAX_CPU_ISA does not restrict it below those ISAs. ATEN_CPU_CAPABILITY (what
    `torch.backends.cpu.get_cpu_capability()` reports) only picks ATen's own vectorised kernels: at AVX2 on a
    CPU with AVX512_BF16, oneDNN's bf16 Newton-Schulz stays 2.6x faster than fp32, so it does not count.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} has native bf16"
        return False, f"{name} emulates bf16"
    if device.type != "cpu":
        return False, f"no native bf16 matmul known on {device.type}"
    capability = torch.backends.cpu.get_cpu_capability()
    amx = torch.cpu._is_amx_tile_supported()
    if not (amx or torch.cpu._is_avx512_bf16_supported()):
        return False, f"CPU capability {capability}, no AVX512_BF16 or AMX"
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if isa and isa.upper() not in _ONEDNN_BF16_ISAS:
        return False, f"CPU capability {capability}, oneDNN restricted to {isa} by ONEDNN_MAX_CPU_ISA"
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False, f"CPU capability {capability}, oneDNN unavailable or disabled"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, f"CPU capability {capability}, oneDNN finds no bf16 support"
    return True, f"CPU capability {capability}, oneDNN with {'AMX' if amx else 'AVX512_BF16'}"


def muon_precision(setting: str, device: torch.device | str = "cpu") -> tuple[torch.dtype, str]:
    """(the Newton-Schulz dtype for `setting` ("auto", "bf16" or "fp32") on `device`, a line saying why).

    "auto" takes bf16 where bf16 matmul is native (`native_bf16_matmul`), fp32 elsewhere; the other two force
    their dtype. Decided once per run: the answer depends on the machine and environment only.
    """
    if setting not in MUON_PRECISIONS:
        raise ValueError(f"muon precision must be one of {MUON_PRECISIONS}, got {setting!r}")
    if setting != "auto":
        return _NS_DTYPES[setting], f"Muon's Newton-Schulz in {setting} (training.muon_precision)"
    native, why = native_bf16_matmul(device)
    chosen = "bf16" if native else "fp32"
    return _NS_DTYPES[chosen], f"Muon's Newton-Schulz in {chosen} (auto: {why})"


def newton_schulz(
    g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype = torch.bfloat16,
    out: Tensor | None = None,
) -> Tensor:
    """Approximate the orthogonal factor U V^T of each matrix in `g` [..., A, B] by `steps` quintic Newton-Schulz
    iterations in `dtype`, all matrices at once (one chain over the batch).

    X <- a X + (b X X^T + c (X X^T)^2) X on the wide orientation of each matrix after scaling it to unit
    Frobenius norm: the op sequence of torch.optim.Muon, whose numbers it matches bit for bit on one bf16 matrix
    (batches of several agree to rounding). Returns `dtype`, shaped like g; into `out` when given (g itself
    allowed). A batch of fp32 CPU matrices runs matrix by matrix, each through its whole chain in cache (2-D
    GEMMs run at 56-64 GFLOP/s against 28-42 for torch.bmm/baddbmm of the same 128 x 128 matrices on an AVX2
    EPYC, docs/benchmarks.md); elsewhere the chain is batched matmuls.
    """
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    if dtype == torch.float32 and g.device.type == "cpu" and g.dim() > 2:
        mats = g.reshape(-1, *g.shape[-2:])
        dest = out if out is not None else torch.empty(g.shape, dtype=dtype, device=g.device)
        _newton_schulz_each(mats, dest.view(mats.shape), coefficients, steps, eps, tall)
        return dest
    x = g.to(dtype)
    if x.ndim > 3:
        x = x.flatten(0, -3)
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm  # one matrix: torch.optim.Muon's 2-D ops (and faster)
    if tall:
        x = x.mT
    x = (x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)).contiguous()  # keeps g
    for _ in range(steps):
        gram = x @ x.mT
        poly = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, poly, x, beta=a)
    result = (x.mT if tall else x).reshape(g.shape)
    return result if out is None else out.copy_(result)


def _newton_schulz_each(
    mats: Tensor, out: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, tall: bool
) -> None:
    """`newton_schulz` of each fp32 matrix of `mats` [M, A, B] into out[i] (out may be mats), through four small
    reused buffers: no temporary the size of the batch. With several torch threads the matrices go side by side,
    each single-threaded (k3compile.kernels._common.threads)."""
    norms = torch.linalg.vector_norm(mats, dim=(-2, -1)).clamp_(min=eps)
    side_by_side(lambda share: _newton_schulz_range(mats, out, norms, coefficients, steps, tall, share),
                 range(mats.shape[0]))


def _newton_schulz_range(
    mats: Tensor, out: Tensor, norms: Tensor, coefficients: tuple[float, float, float], steps: int, tall: bool,
    indices: Sequence[int],
) -> None:
    a, b, c = coefficients
    wide = mats.mT if tall else mats
    rows, cols = wide.shape[-2:]
    cur, nxt = mats.new_empty(rows, cols), mats.new_empty(rows, cols)
    gram, poly = mats.new_empty(rows, rows), mats.new_empty(rows, rows)
    for i in indices:
        torch.div(wide[i], norms[i], out=cur)
        for _ in range(steps):
            torch.mm(cur, cur.T, out=gram)
            torch.addmm(gram, gram, gram, beta=b, alpha=c, out=poly)
            torch.addmm(cur, poly, cur, beta=a, out=nxt)
            cur, nxt = nxt, cur
        (out[i].T if tall else out[i]).copy_(cur)


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


def _block_stacks(t: Tensor, sizes: list[int]) -> list[Tensor]:
    """Views [M, size, cols] of the blocks of `t` ([..., rows, cols]; leading dims stack M matrices): one view
    per block position, holding that block of every matrix (stacked experts' head blocks line up)."""
    mats = t.unsqueeze(0) if t.ndim == 2 else t.flatten(0, -3)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [mats[:, start : start + size] for start, size in zip(starts, sizes)]


def _is_sharded(t: Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP2 shard) rather than a whole tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


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
    ns_steps, ns_dtype (the Newton-Schulz dtype: bf16 as torch.optim.Muon, or fp32, see `muon_precision`),
    adjust_lr_fn and `head_split` (int H: cut dim -2 into H equal blocks; tuple: block row counts; 1 = whole
    matrix). AdamW groups: lr, betas, eps, weight_decay. A plain tensor list is routed by ndim (>= 2: Muon);
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
        ns_dtype: torch.dtype = torch.bfloat16,
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
        if ns_dtype not in _NS_DTYPES.values():
            raise ValueError(f"ns_dtype must be one of {list(_NS_DTYPES.values())}, got {ns_dtype}")
        self._kind_defaults = {
            True: dict(
                lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, ns_dtype=ns_dtype,
                adjust_lr_fn=adjust_lr_fn, head_split=1,
            ),
            False: dict(
                lr=lr if adamw_lr is None else adamw_lr, betas=tuple(betas), eps=adamw_eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            ),
        }
        self.qk_clip_tau = qk_clip_tau
        self._buffers: dict[tuple, Tensor] = {}  # Newton-Schulz workspaces by (shape, dtype, device), not state
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
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        if max_logits:
            self.qk_clip_(max_logits)
        return loss

    def state_layout(self, p: Tensor) -> dict[str, tuple[int, ...]]:
        """Slot -> shape of the state kept for parameter `p` once it has stepped (what a checkpoint may restore)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if group["use_muon"]:
            return {"momentum_buffer": tuple(p.shape)}
        return {"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}

    def _muon_step(self, groups: list[dict]) -> None:
        """Momentum and weight decay per parameter; then the Newton-Schulz iterations, in fp32 one batched chain
        per block shape (and iteration settings) over every block of every group, in bf16 matrix by matrix; then
        each block's learning-rate-scaled update."""
        batches: dict[tuple, list[tuple[Tensor, Tensor, float]]] = {}
        gathered: list[tuple[Tensor, Tensor]] = []  # (sharded parameter, its full-size update)
        for group in groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], group["ns_dtype"])
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
                target = p
                if _is_sharded(p):  # Newton-Schulz needs whole head blocks: gather the update, keep this rank's rows
                    update = update.full_tensor()
                    target = torch.zeros_like(update)
                    gathered.append((p, target))
                sizes = _block_sizes(p.shape[-2], group["head_split"])
                for p_blk, u_blk in zip(_block_stacks(target, sizes), _block_stacks(update, sizes)):
                    rows, cols = u_blk.shape[1:]
                    alpha = -_adjusted_lr(lr, group["adjust_lr_fn"], rows, cols)
                    batches.setdefault((rows, cols, p.device, *settings), []).append((p_blk, u_blk, alpha))
        for (*_, coefficients, steps, eps, dtype), items in batches.items():
            if dtype == torch.bfloat16:
                # torch.optim.Muon's numbers, bit for bit: one matrix at a time (where oneDNN runs bf16 matmuls, a
                # batched one rounds about 1% of its entries one ulp away from the 2-D ones torch.optim.Muon takes)
                for p_blk, u_blk, alpha in items:
                    for p_mat, u_mat in zip(p_blk, u_blk):
                        p_mat.add_(newton_schulz(u_mat, coefficients, steps, eps, dtype), alpha=alpha)
                continue
            stacked = self._workspace(items, dtype)
            ortho = newton_schulz(stacked, coefficients, steps, eps, dtype, out=stacked)
            for (p_blk, _, alpha), o in zip(items, ortho.split([u.shape[0] for _, u, _ in items])):
                p_blk.add_(o, alpha=alpha)
        for p, delta in gathered:
            from torch.distributed.tensor import distribute_tensor

            p.add_(distribute_tensor(delta, p.device_mesh, p.placements, src_data_rank=None))  # local rows, no comms

    def _workspace(self, items: list[tuple[Tensor, Tensor, float]], dtype: torch.dtype) -> Tensor:
        """The blocks' updates stacked [M, rows, cols] in `dtype`, in a buffer kept from step to step (a fresh one of
        tens of MB would be mapped, and its pages faulted in, at every step)."""
        shape = (sum(u.shape[0] for _, u, _ in items), *items[0][1].shape[1:])
        key = (shape, dtype, items[0][1].device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=key[2])
        return torch.cat([u for _, u, _ in items], out=buf) if len(items) > 1 else buf.copy_(items[0][1])

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
