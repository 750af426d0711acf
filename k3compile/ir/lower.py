"""Lowering: the model definition -> one torch.fx.GraphModule per graph kind (train, prefill, decode).

The tracer runs `K3Model`'s entry point for the graph and records every op, except two kinds of
submodule it keeps as calls: each layer's token mixer and each depth site (see
k3compile.modules.model). The passes decide what those become (interleave: KDA or MLA in the graph's
form; attn_res: plain or attention residuals), so a lowered graph is the skeleton every K3-class model
shares. MoE layers are kept too, and inlined at once from one trace per distinct layer: tracing each of
Kimi K3's 92 in each graph was half the lowering's time. Full-size specs lower on the meta device with
no weight memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from k3compile.ir.inline import inline_calls
from k3compile.ir.verify import eliminate_dead_code
from k3compile.modules.kda import KDAMixer, KDAState
from k3compile.modules.mla import MLAMixer
from k3compile.modules.moe import LatentMoE
from k3compile.modules.model import DEPTH_SITES, GRAPHS, K3Model, empty_caches
from k3compile.spec.schema import Spec

# Shapes used to verify graphs with fake tensors; sizes no model dimension is likely to share, so the
# emitted code's shape comments can name them (B, T, S). Decode positions T .. T + B - 1 fit in S.
EXAMPLE_BATCH, EXAMPLE_TOKENS, EXAMPLE_CACHE_LEN = 5, 11, 17
MIXERS = (KDAMixer, MLAMixer)
ENTRY = {"train": "forward", "prefill": "prefill", "decode": "decode"}


class FlatTracer(fx.Tracer):
    """Traces through every module (nn.Linear included) so the graph holds ops, not modules.

    Parameter- and buffer-to-name maps are built once per trace, so naming a tensor is not a scan of
    the model (fx's default is a linear search of all parameters or buffers for every tensor it meets).
    """

    def trace(self, root, concrete_args=None):
        if isinstance(root, nn.Module):
            self._names = {id(p): n for n, p in root.named_parameters()}
            self._buffer_names = {id(b): n for n, b in root.named_buffers()}
        return super().trace(root, concrete_args)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        name = self._names.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def create_arg(self, a):
        if isinstance(a, torch.Tensor):
            name = (self._names if isinstance(a, nn.Parameter) else self._buffer_names).get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)


class LowerTracer(FlatTracer):
    """Keeps token mixers and depth sites as `call_module` nodes whose outputs have the module's structure;
    MoE layers too, which `lower` inlines at once from one trace per distinct layer (not one per layer)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, MIXERS + DEPTH_SITES + (LatentMoE,))

    def call_module(self, m, forward, args, kwargs):
        out = super().call_module(m, forward, args, kwargs)
        if isinstance(m, MIXERS):  # (y, state): KDAState for KDA, the latent cache for MLA
            state = KDAState(*(out[1][j] for j in range(len(KDAState._fields)))) if isinstance(m, KDAMixer) else out[1]
            return out[0], state
        return out


@dataclass
class Lowered:
    gm: fx.GraphModule
    example_inputs: tuple  # the graph's inputs on its device, for verification and numerics


def example_tokens(spec: Spec, device: torch.device | str, batch: int = EXAMPLE_BATCH, tokens: int = EXAMPLE_TOKENS):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch, tokens), generator=gen)
    return ids.to(device)


def example_inputs(spec: Spec, graph: str, device: torch.device | str) -> tuple:
    """Inputs that exercise `graph`: tokens, then for prefill empty caches, for decode positions and caches."""
    if graph == "train":
        return (example_tokens(spec, device),)
    caches = empty_caches(spec, EXAMPLE_BATCH, EXAMPLE_CACHE_LEN, device)
    if graph == "prefill":
        return (example_tokens(spec, device), caches)
    positions = torch.arange(EXAMPLE_BATCH, device=device) + EXAMPLE_TOKENS  # sequences of different lengths
    return (example_tokens(spec, device, tokens=1), positions, caches)


def build_model(spec: Spec, device: torch.device | str = "meta") -> K3Model:
    """The model definition on `device`; off the meta device its weights are initialised (k3compile.modules.init)."""
    with torch.device(device):
        return K3Model(spec, init=torch.device(device).type != "meta")


def lower(spec: Spec, device: torch.device | str = "meta", graph: str = "train", model: K3Model | None = None) -> Lowered:
    """Trace `graph` of the model definition (built on `device`, or the given `model`, whose weights it shares)."""
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; expected one of {GRAPHS}")
    root = model if model is not None else build_model(spec, device)
    tracer = LowerTracer()
    tracer.traced_func_name = ENTRY[graph]
    traced = tracer.trace(root)
    # lazy: the Python code is generated when first run or read, not after each rewrite (passes and the
    # emitter work on the graph; regenerating a Kimi K3 graph's code costs about a second)
    gm = _LazyGraphModule(root, traced, class_name=_class_name(spec))
    moe = [(n, m, n.target, n.args, n.kwargs) for n in gm.graph.find_nodes(op="call_module")
           if isinstance(m := root.get_submodule(n.target), LatentMoE)]  # fmt: skip
    inline_calls(gm, moe)
    eliminate_dead_code(gm)  # tuple outputs a configuration leaves unread (router scores without QB)
    gm.recompile()
    _keep_buffer_persistence(root, gm)
    gm.meta["graph"] = graph
    device = next(root.parameters()).device
    return Lowered(gm, example_inputs(spec, graph, device))


def _keep_buffer_persistence(root: nn.Module, gm: fx.GraphModule) -> None:
    """fx copies buffers as persistent; mark the ones the modules keep out of state_dict again."""
    for path, module in root.named_modules():
        for leaf in module._non_persistent_buffers_set:
            try:
                owner = gm.get_submodule(path)
            except AttributeError:  # fx copied nothing of this module: the graph never reads it
                continue
            if hasattr(owner, leaf):
                owner._non_persistent_buffers_set.add(leaf)


def _class_name(spec: Spec) -> str:
    return "K3_" + "".join(c if c.isalnum() else "_" for c in spec.name)
