"""Parameter counts by component, total and active per token, from the weight inventory."""

from __future__ import annotations

from k3compile.spec.schema import Spec
from k3compile.spec.weights import COMPONENTS, Weight, weight_inventory


def active_numel(w: Weight) -> int:
    """Elements of `w` a token's forward pass touches (routed experts: top-k of n)."""
    return round(w.numel * w.active)


def param_counts(spec: Spec) -> dict:
    """{'total', 'active', 'by_component': {name: {'total', 'active'}}}; every component listed."""
    by = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    for w in weight_inventory(spec):
        by[w.component]["total"] += w.numel
        by[w.component]["active"] += active_numel(w)
    return {
        "total": sum(c["total"] for c in by.values()),
        "active": sum(c["active"] for c in by.values()),
        "by_component": by,
    }
