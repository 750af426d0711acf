"""interleave: resolve each layer's token mixer into KDA or Gated MLA ops, per the layout and the graph.

Lowering keeps `layers.<i>.attn` as a call of the layout's mixer; this pass inlines it in the form the
graph needs: KDA chunked (train, prefill) or as the one-token recurrent step (decode); MLA expanded
(train, prefill, writing the latent cache in prefill) or absorbed over the preallocated cache (decode).
"""

from __future__ import annotations

from torch import fx

from k3compile.ir.inline import inline_calls
from k3compile.ir.pass_manager import GraphPass, PassContext
from k3compile.modules.kda import KDAMixer
from k3compile.modules.mla import MLAMixer


def run(gm: fx.GraphModule, ctx: PassContext) -> dict[str, int]:
    counts = {"kda_layers": 0, "mla_layers": 0, "nodes_added": 0}
    before = len(gm.graph.nodes)
    calls = []
    for node in gm.graph.find_nodes(op="call_module"):
        mixer = gm.get_submodule(node.target)
        if isinstance(mixer, (KDAMixer, MLAMixer)):
            calls.append((node, mixer, node.target, node.args, node.kwargs))
            counts["kda_layers" if isinstance(mixer, KDAMixer) else "mla_layers"] += 1
    inline_calls(gm, calls)
    counts["nodes_added"] = len(gm.graph.nodes) - before
    return counts


PASS = GraphPass(
    name="interleave",
    summary="resolve each layer's token mixer into KDA or Gated MLA ops in the graph's form, per the layout",
    preserves_numerics=True,
    statistics=("kda_layers", "mla_layers", "nodes_added"),
    run=run,
)
