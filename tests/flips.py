"""Comparing two correct computations of a graph that fake-quantises activations to MXFP8, claim by claim.

Two correct computations (different matmul shapes, chunked vs recurrent KDA) differ by ~1e-7; where an expert's
input sits on an e4m3 rounding midpoint that moves it a whole e4m3 step (6-12%), a flip. So an equivalence test
makes two claims: tight (1e-5) on the same spec with the experts' activations left unquantised (weights stay
MXFP4), and flip-aware on the shipped spec: a flip moves only the tokens from it on in its sequence, so the median
token agrees tightly, and the worst token is off by less than one e4m3 step (a flip moves one element by one).
"""

from __future__ import annotations

import torch

E4M3_STEP = 2.0**-3  # relative spacing of e4m3 values (3 significand bits): the size of one flip
TIGHT = 1e-5  # fp32 agreement of two orders of the same fp32 computation


def without_activation_quantisation(spec) -> list[str]:
    """The --set override that keeps `spec`'s quantisation rules but drops their activation formats."""
    rules = ", ".join("{" + f'match: "{r.match}", weight: {r.weight}' + "}" for r in spec.quantization.rules)
    return [f"quantization.rules=[{rules}]"]


def per_token_rel(got_BTV: torch.Tensor, want_BTV: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| of each token's logits, in float64, flattened."""
    got, want = got_BTV.double(), want_BTV.double()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()


def assert_tight(got_BTV: torch.Tensor, want_BTV: torch.Tensor, tol: float = TIGHT) -> None:
    """Every token agrees to `tol`: the claim on a graph without activation quantisation."""
    worst = float(per_token_rel(got_BTV, want_BTV).max())
    assert worst <= tol, f"worst token's relative error {worst:.3e} > {tol:.0e}"


def assert_flip_aware(got_BTV: torch.Tensor, want_BTV: torch.Tensor, tol: float = TIGHT) -> None:
    """The median token agrees to `tol` (flips are rare), and no token is off by a whole e4m3 step."""
    rel_N = per_token_rel(got_BTV, want_BTV)
    median, worst = float(rel_N.median()), float(rel_N.max())
    assert median <= tol, f"median token's relative error {median:.3e} > {tol:.0e}: more than a few flips"
    assert worst < E4M3_STEP, f"worst token's relative error {worst:.3e} >= one e4m3 step {E4M3_STEP}"
