"""bind_kernels: choose an implementation for every op node for the target, record it, and set the op's backend.

A k3 node bound to a Triton kernel gets `backend="triton"`, so the emitted module runs that kernel (on CUDA,
or on CPU under TRITON_INTERPRET=1); every other k3 node gets `backend="torch"`, the PyTorch reference.
"""

from __future__ import annotations

from torch import fx

from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.kernels.binding import choose


def op_name(node: fx.Node) -> tuple[str, str] | None:
    """(namespace, name) of an op node: ('k3', 'rms_norm'), ('torch', 'linear'), ...; None for non-ops."""
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            ns, _, name = schema.name.partition("::")
            return ns, name
        return "torch", getattr(node.target, "__name__", str(node.target))
    if node.op == "call_method":
        return "torch", f"Tensor.{node.target}"
    return None


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    stats = {"k3_ops": 0, "triton": 0, "reference": 0, "native": 0}
    for node in gm.graph.nodes:
        name = op_name(node)
        if name is None:
            continue
        ns, op = name
        if ns == "k3":
            choice = choose(op, ctx.target)
            stats["k3_ops"] += 1
            stats["triton" if choice["impl"].startswith("triton") else "reference"] += 1
            node.meta["kernel"] = {"op": f"k3::{op}", **choice}
            node.kwargs = {**node.kwargs, "backend": "triton" if choice["impl"].startswith("triton") else "torch"}
        else:
            stats["native"] += 1
            node.meta["kernel"] = {"op": f"{ns}.{op}", "impl": "native", "reason": "PyTorch built-in"}
    return stats


PASS = GraphPass(
    name="bind_kernels",
    summary="choose PyTorch or Triton implementations per op for the target; record them and set each op's backend",
    preserves_numerics=True,
    statistics=("k3_ops", "triton", "reference", "native"),
    run=run,
)
