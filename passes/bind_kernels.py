"""bind_kernels: choose an implementation for every op node for the target, record it, and set the op's backend.

A k3 node bound to a Triton kernel gets `backend="triton"`, so the emitted module runs that kernel (on CUDA,
or on CPU under TRITON_INTERPRET=1); one bound to a C kernel (the CPU target, where they build) gets
`backend="c"`; every other k3 node gets `backend="torch"`, the PyTorch reference.
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
    stats = {"k3_ops": 0, "triton": 0, "c": 0, "reference": 0, "native": 0}
    for node in gm.graph.nodes:
        name = op_name(node)
        if name is None:
            continue
        ns, op = name
        if ns == "k3":
            choice = choose(op, ctx.target, ctx.cpu_kernels)
            backend = choice["impl"].partition(":")[0]  # "triton", "c" or "torch"
            stats["k3_ops"] += 1
            stats["reference" if backend == "torch" else backend] += 1
            node.meta["kernel"] = {"op": f"k3::{op}", **choice}
            node.kwargs = {**node.kwargs, "backend": backend}
        else:
            stats["native"] += 1
            node.meta["kernel"] = {"op": f"{ns}.{op}", "impl": "native", "reason": "PyTorch built-in"}
    return stats


PASS = GraphPass(
    name="bind_kernels",
    summary="choose PyTorch, Triton or C implementations per op for the target; record them and set each op's backend",
    preserves_numerics=True,
    statistics=("k3_ops", "triton", "c", "reference", "native"),
    run=run,
    # Kernels agree with the references to fp32 rounding, not bit for bit (other summation orders, libmvec's
    # expf/tanhf); downstream of an MX fake quantisation such a difference can flip a rounding by a whole element
    # step, which QAT graphs show as up to about 1e-4 of the outputs (k3-tiny: 7.7e-5).
    rtol=1e-3,
)
