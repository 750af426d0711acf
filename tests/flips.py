"""Comparing two correct computations of a graph that fake-quantises activations to MXFP8, claim by claim.

Two correct computations (different matmul shapes, chunked vs recurrent KDA) differ by ~1e-7; where an expert's
input sits on an e4m3 rounding midpoint that moves it a whole e4m3 step (6-12%), a flip. So an equivalence test
makes two claims: tight (1e-5) on the same spec with the experts' activations left unquantised (weights stay
MXFP4), and flip-aware on the shipped spec: a flip moves only the tokens from it on in its sequence, so the median
token agrees tightly, and the worst token is off by less than one e4m3 step (a flip moves one element by one).

The router's top-k is a second step function: where a token's k-th and (k+1)-th choice scores are nearly tied,
the same ~1e-7 swaps an expert. `RouteRecorder` records every routing decision of a run; `route_changes` finds the
tokens whose expert set differs between two runs, asserts each change is a near-tie (explained by the difference
of the router's inputs plus fp32 rounding, see `route_slack`), and returns the tokens it excuses: the changed one
and the later ones of its sequence, which both claims then leave out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

E4M3_STEP = 2.0**-3  # relative spacing of e4m3 values (3 significand bits): the size of one flip
TIGHT = 1e-5  # fp32 agreement of two orders of the same fp32 computation
FP32_EPS = 2.0**-23  # fp32's unit roundoff is half of it
SCORE_SLOPE = {"sigmoid": 0.25, "softmax": 0.5}  # the most a choice score moves per unit (inf-norm) of the logits


def without_activation_quantisation(spec) -> list[str]:
    """The --set override that keeps `spec`'s quantisation rules but drops their activation formats."""
    rules = ", ".join("{" + f'match: "{r.match}", weight: {r.weight}' + "}" for r in spec.quantization.rules)
    return [f"quantization.rules=[{rules}]"]


def per_token_rel(got_BTV: torch.Tensor, want_BTV: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| of each token's logits, in float64, flattened."""
    got, want = got_BTV.double(), want_BTV.double()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()


def _largest(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def _kept(rel_N: torch.Tensor, excused_BT: torch.Tensor | None) -> torch.Tensor:
    return rel_N if excused_BT is None else rel_N[~excused_BT.flatten()]


def assert_tight(
    got_BTV: torch.Tensor, want_BTV: torch.Tensor, tol: float = TIGHT, excused_BT: torch.Tensor | None = None
) -> None:
    """Every token agrees to `tol` (those `route_changes` excused aside): the claim without activation quantisation."""
    worst = _largest(_kept(per_token_rel(got_BTV, want_BTV), excused_BT))
    assert worst <= tol, f"worst token's relative error {worst:.3e} > {tol:.0e}"


def assert_flip_aware(
    got_BTV: torch.Tensor, want_BTV: torch.Tensor, tol: float = TIGHT, excused_BT: torch.Tensor | None = None
) -> None:
    """The median token agrees to `tol` (flips are rare), and no token (those `route_changes` excused aside) is
    off by a whole e4m3 step."""
    rel_N = per_token_rel(got_BTV, want_BTV)
    assert_flip_aware_errors(rel_N, tol, _kept(rel_N, excused_BT))


def assert_flip_aware_errors(errors: torch.Tensor | list[float], tol: float, worst_of=None) -> None:
    """The flip-aware claim on relative errors of any items (tokens, gradients): the median is within `tol`, the
    worst (of `worst_of`, by default all) below one e4m3 step."""
    errors = torch.as_tensor(errors, dtype=torch.float64)
    worst_of = errors if worst_of is None else torch.as_tensor(worst_of, dtype=torch.float64)
    median, worst = float(errors.median()), _largest(worst_of)
    assert median <= tol, f"median relative error {median:.3e} > {tol:.0e}: more than a few flips"
    assert worst < E4M3_STEP, f"worst relative error {worst:.3e} >= one e4m3 step {E4M3_STEP}"


@dataclass
class Routes:
    """One MoE layer's routing over a run: router input x [B, T, D], weight [E, D], choice scores (scores + bias)
    [B, T, E] and chosen experts [B, T, K]."""

    x_BTD: torch.Tensor
    weight_ED: torch.Tensor
    choice_BTE: torch.Tensor
    indices_BTK: torch.Tensor
    scoring: str


class RouteRecorder(TorchDispatchMode):
    """Records every k3::linear_route or k3::moe_route call (a whole forward's, or one decode step's), so a run's
    routing decisions can be laid out per layer over [B, T]: `with RouteRecorder() as r: ...; r.layers(B, layers)`."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in ("k3::linear_route", "k3::moe_route"):
            if name == "k3::linear_route":
                x, weight, bias, _, scoring = args[:5]
            else:  # a router on its logits: their projection is the identity
                x, bias, _, scoring = args[:4]
                weight = torch.eye(x.shape[-1], dtype=x.dtype)
            choice = out[2] if bias is None else out[2] + bias.to(out[2].dtype)
            self.calls.append((x.detach().clone(), weight.detach().clone(), choice.detach(), out[1].clone(), scoring))
        return out

    def layers(self, batch: int, moe_layers: int) -> list[Routes]:
        """Per MoE layer, its routing over all recorded forwards, concatenated along time (forwards come in order,
        each routing `moe_layers` times over batch * its token count rows)."""
        assert self.calls and len(self.calls) % moe_layers == 0, (len(self.calls), moe_layers)
        out = []
        for layer in range(moe_layers):
            calls = self.calls[layer::moe_layers]
            cat = lambda i: torch.cat([c[i].reshape(batch, -1, c[i].shape[-1]) for c in calls], 1)  # noqa: E731
            out.append(Routes(cat(0), calls[0][1], cat(2), cat(3), calls[0][4]))
        return out


def route_slack(a: Routes, b: Routes) -> torch.Tensor:
    """[B, T, E]: how far an expert's choice score may move between the runs a and b, from their router inputs.

    logit_e = w_e . x moves by at most ||w_e|| ||x_a - x_b|| plus each run's fp32 rounding of the D-term dot product
    (sqrt(D) ulps of ||w_e|| ||x||, the probabilistic bound: rounding errors of a sum add like a random walk); the
    score by at most SCORE_SLOPE times that, plus a few ulps for the scoring and the bias. Two experts swap only if
    their scores are within the sum of their slacks in both runs: a near-tie.
    """
    w_E = a.weight_ED.double().norm(dim=-1)
    xa, xb = a.x_BTD.double(), b.x_BTD.double()
    size = torch.maximum(xa.norm(dim=-1), xb.norm(dim=-1))
    dx = (xa - xb).norm(dim=-1) + 2 * xa.shape[-1] ** 0.5 * FP32_EPS * size  # [B, T]
    return SCORE_SLOPE[a.scoring] * dx[..., None] * w_E + 4 * FP32_EPS


def route_changes(runs_a: list[Routes], runs_b: list[Routes]) -> torch.Tensor:
    """Asserts every token whose expert set differs between two runs is at a near-tie; returns the excused tokens
    [B, T] (bool): each changed token and the later tokens of its sequence (the change reaches them)."""
    assert len(runs_a) == len(runs_b) and runs_a
    changed_BT = torch.zeros(runs_a[0].indices_BTK.shape[:2], dtype=torch.bool)
    for layer, (a, b) in enumerate(zip(runs_a, runs_b, strict=True)):
        assert a.indices_BTK.shape == b.indices_BTK.shape, (layer, a.indices_BTK.shape, b.indices_BTK.shape)
        E = a.choice_BTE.shape[-1]
        in_a = torch.zeros(*a.indices_BTK.shape[:2], E, dtype=torch.bool).scatter_(-1, a.indices_BTK, True)
        in_b = torch.zeros_like(in_a).scatter_(-1, b.indices_BTK, True)
        slack_BTE = route_slack(a, b)
        for bi, t in (in_a != in_b).any(-1).nonzero().tolist():
            only_a, only_b = in_a[bi, t] & ~in_b[bi, t], in_b[bi, t] & ~in_a[bi, t]
            s = slack_BTE[bi, t]
            pair_slack = s[only_a][:, None] + s[only_b][None, :]  # [a's extra experts, b's extra experts]
            gap_a = a.choice_BTE[bi, t][only_a].double()[:, None] - a.choice_BTE[bi, t][only_b].double()[None, :]
            gap_b = b.choice_BTE[bi, t][only_b].double()[None, :] - b.choice_BTE[bi, t][only_a].double()[:, None]
            assert bool((gap_a <= pair_slack).all() and (gap_b <= pair_slack).all()), (
                f"MoE layer {layer}, sequence {bi}, token {t}: experts {only_a.nonzero().flatten().tolist()} vs "
                f"{only_b.nonzero().flatten().tolist()} swapped with score gaps {gap_a.max():.2e} / {gap_b.max():.2e} "
                f"beyond the near-tie slack {pair_slack.max():.2e}"
            )
            changed_BT[bi, t] = True
    return changed_BT.int().cummax(dim=1).values.bool()


def near_ties(runs: list[Routes], tol: float = TIGHT) -> torch.Tensor:
    """Tokens [B, T] (and the later ones of their sequence) where some layer's k-th and (k+1)-th choice scores are
    close enough that another computation of the router's input agreeing to relative `tol` could swap them: what
    a comparison with a run that cannot be recorded (ONNX Runtime) excuses."""
    near_BT = torch.zeros(runs[0].indices_BTK.shape[:2], dtype=torch.bool)
    for r in runs:
        k = r.indices_BTK.shape[-1]
        top = r.choice_BTE.double().topk(k + 1, dim=-1).values
        x = r.x_BTD.double()
        moved = Routes(x * (1 + tol), r.weight_ED, r.choice_BTE, r.indices_BTK, r.scoring)  # ||dx|| = tol ||x||
        slack = route_slack(r, moved).amax(-1)
        near_BT |= top[..., k - 1] - top[..., k] <= 2 * slack
    return near_BT.int().cummax(dim=1).values.bool()


def moe_layers(spec) -> int:
    """How many layers of `spec` route (one linear_route call each per forward)."""
    return sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i))


def recorded(run, batch: int, spec) -> tuple:
    """(run()'s result, the routes of `spec`'s MoE layers over it, per layer), without autograd."""
    with torch.no_grad(), RouteRecorder() as rec:
        out = run()
    return out, rec.layers(batch, moe_layers(spec))


def first_tokens(runs: list[Routes], t: int) -> list[Routes]:
    """The routes of each layer's first `t` tokens (a longer run's prefix, to compare with a shorter run)."""
    return [Routes(r.x_BTD[:, :t], r.weight_ED, r.choice_BTE[:, :t], r.indices_BTK[:, :t], r.scoring) for r in runs]
