"""pack_mxfp4: apply the quantisation policy to the weights (and matmul inputs) it selects.

Inference build: each selected weight becomes packed MX data plus E8M0 scales
(buffers `<weight>_mx` and `<weight>_scale`); a linear on it becomes `k3::mx_linear`,
other matmuls read `k3::mx_dequantize` (the decode graph's expert gathers gather the packed
data and scales first, so only the picked experts are dequantised; its absorbed MLA reads kv_b_proj
dequantised and, under an MX activation policy, the latent's c_kv part fake-quantised, as kv_b_proj's
input is in the expanded form). Training build with QAT: the weight is read through
`k3::mx_fake_quantize` (straight-through). In both, a matmul input whose policy format is MX goes
through `k3::mx_fake_quantize` along its last dim, so the two builds compute the same numbers.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

import k3compile.kernels.mx.op  # noqa: F401  (registers the k3 MX ops)
from k3compile.analysis.formats import ELEMENT_OF_POLICY, storage_bytes
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.spec.weights import activation_format, weight_inventory

K3 = torch.ops.k3
LINEARS = (F.linear, torch._C._nn.linear)
MATMULS = (torch.matmul, operator.matmul, torch.bmm)
TRANSPOSES = ("transpose", "t", "mT")
VIEWS = (torch.unflatten,)  # shard_experts' rank-major view [ep, E/ep, ...] of stacked expert weights
CASTS = ("to", "float")  # the router reads its weight cast to fp32
ABSORBED = K3.mla_decode_absorbed.default  # reads kv_b_proj.weight (w_kvb, argument 2) whole


def _formats(ctx: PassContext) -> dict[str, tuple[str, str]]:
    """(weight format, activation format) per weight name, from the weight inventory so build and analysis agree."""
    return {w.name: (w.format, activation_format(ctx.spec, w.module)) for w in weight_inventory(ctx.spec)}


def _is_gather(node: fx.Node) -> bool:
    """routing's decode-graph gather of the experts each token picked."""
    return "expert_gather" in node.meta


def _readers(value: fx.Node):
    """(user, the node it reads) for each use of `value`, looking through rank-major views, dtype casts
    and expert gathers."""
    for user in value.users:
        view = user.op == "call_function" and user.target in VIEWS or user.op == "call_method" and user.target in CASTS
        view = view or _is_gather(user)
        if view and user.args[0] is value:
            yield from _readers(user)
        else:
            yield user, value


def _weight_consumers(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(matmul-like node, the value it reads the weight through) for every use of a weight node."""
    out = []
    for user, via in _readers(node):
        if user.op == "call_function" and user.target in LINEARS and user.args[1] is via:
            out.append((user, via))
        elif (user.op == "call_method" and user.target in TRANSPOSES) or (
            user.op == "call_function" and user.target in (torch.transpose,)
        ):
            for mm, t in _readers(user):
                if mm.op == "call_function" and mm.target in MATMULS and mm.args[1] is t:
                    out.append((mm, t))
        elif user.op == "call_function" and user.target is ABSORBED and user.args[2] is via:
            out.append((user, via))
    return out


def _quantize_latent(gm: fx.GraphModule, mm: fx.Node, L: int, fmt: str, block: int) -> bool:
    """Absorbed MLA: fake-quantise the latent's first L values (c_kv), what kv_b_proj reads when expanded."""
    latent = mm.args[1]
    with gm.graph.inserting_before(mm):
        c_kv = gm.graph.call_function(operator.getitem, (latent, (Ellipsis, slice(None, L))))
        k_pe = gm.graph.call_function(operator.getitem, (latent, (Ellipsis, slice(L, None))))
        fq = gm.graph.call_function(K3.mx_fake_quantize.default, (c_kv, ELEMENT_OF_POLICY[fmt], block))
        mm.update_arg(1, gm.graph.call_function(torch.cat, ([fq, k_pe],), {"dim": -1}))
    return True


def _repeats(x: fx.Node) -> list[fx.Node]:
    """The views from routing's repeated rows x back to the rows they repeat (x first), or [] for other inputs."""
    source, chain = x.meta.get("rows_of"), [x]
    while source is not None and chain[-1].op == "call_method" and chain[-1].target in ("view", "expand", "reshape"):
        if chain[-1].args[0] is source:
            return chain
        chain.append(chain[-1].args[0])
    return []


def _quantize_activation(gm: fx.GraphModule, mm: fx.Node, fmt: str, block: int, done: dict) -> bool:
    """Route the matmul's input through one fake-quantise per (input, format); True if a new one was made.

    An input that only repeats another's rows (routing's one row per choice, `rows_of`) is fake-quantised
    before the repeat: the same values (blocks run along rows), from top_k times fewer rows."""
    x = mm.args[0]
    key = (x, fmt)
    fresh = key not in done
    if fresh:
        chain = _repeats(x)
        source = chain[-1].args[0] if chain else x
        g = gm.graph
        with g.inserting_after(source):
            fq = g.call_function(K3.mx_fake_quantize.default, (source, ELEMENT_OF_POLICY[fmt], block))
        if chain:
            mapping = {source: fq}
            with g.inserting_before(x):
                for n in reversed(chain):
                    mapping[n] = g.node_copy(n, lambda a: mapping.get(a, a))
            fq = mapping[x]
        done[key] = fq
    mm.replace_input_with(x, done[key])
    return fresh


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    block = ctx.spec.quantization.block_size
    infer = ctx.mode == "infer"
    stats = {"weights_packed": 0, "weights_fake_quantized": 0, "activations_quantized": 0, "bytes_saved": 0}
    packed = dict(gm.meta.get("packed", {}))
    params = dict(gm.named_parameters())
    quantized: dict = {}
    formats = _formats(ctx)
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target not in params:
            continue
        wfmt, afmt = formats.get(node.target, ("bf16", "bf16"))
        consumers = _weight_consumers(node)
        if not consumers or wfmt not in ELEMENT_OF_POLICY and afmt not in ELEMENT_OF_POLICY:
            continue
        for mm, _ in consumers:
            if afmt in ELEMENT_OF_POLICY and (infer or ctx.spec.quantization.qat):
                if mm.target is ABSORBED:
                    L = params[node.target].shape[1]
                    stats["activations_quantized"] += _quantize_latent(gm, mm, L, afmt, block)
                else:
                    stats["activations_quantized"] += _quantize_activation(gm, mm, afmt, block, quantized)
        if wfmt not in ELEMENT_OF_POLICY:
            continue
        element = ELEMENT_OF_POLICY[wfmt]
        w = params[node.target]
        if not infer:
            if ctx.spec.quantization.qat:
                with gm.graph.inserting_after(node):
                    fq = gm.graph.call_function(K3.mx_fake_quantize.default, (node, element, block))
                node.replace_all_uses_with(fq, delete_user_cb=lambda u: u is not fq)
                stats["weights_fake_quantized"] += 1
            continue
        data, scale = K3.mx_quantize.default(w.detach(), element, block)
        data_name, scale_name = f"{node.target}_mx", f"{node.target}_scale"
        owner, _, leaf = node.target.rpartition(".")
        holder = gm.get_submodule(owner)
        holder.register_buffer(f"{leaf}_mx", data.view(torch.uint8) if data.dtype != torch.uint8 else data)
        holder.register_buffer(f"{leaf}_scale", scale)
        with gm.graph.inserting_before(node):
            d = gm.graph.get_attr(data_name)
            s = gm.graph.get_attr(scale_name)
        for mm, via in consumers:
            if mm.target in LINEARS and via is node:
                with gm.graph.inserting_before(mm):
                    new = gm.graph.call_function(K3.mx_linear.default, (mm.args[0], d, s, element, block, None))
                mm.replace_all_uses_with(new)
                gm.graph.erase_node(mm)
        for gather in [u for u in node.users if _is_gather(u)]:  # dequantise only the gathered experts
            index = gather.args[1]
            with gm.graph.inserting_before(gather):
                picked = [gm.graph.call_function(operator.getitem, (t, index)) for t in (d, s)]
                deq = gm.graph.call_function(K3.mx_dequantize.default, (*picked, element, block, w.dtype))
            gather.replace_all_uses_with(deq)
            gm.graph.erase_node(gather)
        if node.users:  # matmuls that read the weight itself (stacked experts) get the dequantised tensor
            with gm.graph.inserting_before(node):
                deq = gm.graph.call_function(K3.mx_dequantize.default, (d, s, element, block, w.dtype))
            node.replace_all_uses_with(deq)
        gm.graph.erase_node(node)
        delattr(holder, leaf)
        packed[node.target] = {"data": data_name, "scale": scale_name, "fmt": element, "block": block, "shape": list(w.shape)}
        stats["weights_packed"] += 1
        stats["bytes_saved"] += storage_bytes(w.numel(), "bf16") - storage_bytes(w.numel(), wfmt, block)
    gm.meta["packed"] = packed
    return stats


PASS = GraphPass(
    name="pack_mxfp4",
    summary="pack policy-selected weights as MX data + E8M0 scales (infer) or fake-quantise them (QAT train)",
    preserves_numerics=False,
    statistics=("weights_packed", "weights_fake_quantized", "activations_quantized", "bytes_saved"),
    run=run,
    mode_dependent=True,
)
