"""`k3compile export`: a build's compiled graphs as ONNX files, the k3 ops as ONNX functions.

What is exported is what runs: the graph's module from the emitted package, captured by torch.export
and translated by torch's ONNX exporter, with the translation table of k3compile.emit.onnx.translate
for the k3 ops. Then, on the ONNX IR:
1. the main graph is converted from the exporter's opset (18) to the requested one. onnxscript's
   version converter inlines every function first, so the k3 functions are held aside while it runs and
   put back, with the k3 functions they call, written for the requested opset;
2. `mx="fp4"`: MXFP4 payloads and scales become FLOAT4E2M1 and FLOAT8E8M0 tensors (the same bytes:
   both put element 2i in the low nibble), which the k3 functions decode with DequantizeLinear;
3. `weights="none"`: the module's parameters and buffers become typed graph inputs with no data, so a
   meta-device build (Kimi K3, shapes only) exports its structure without allocating a weight;
4. the symbolic axes of the inputs get names (batch, seq), and the build's manifest goes into
   metadata_props (spec hash, compiler, graph, target).
The file is written only once all of it succeeded, through a temporary folder: bad input writes nothing.

torch.onnx.export(..., dynamo=True, custom_translation_table=...) always ends in onnxscript's version
converter, which inlines every local function, k3 ones included. So `trace` calls the function it wraps,
torch.onnx._internal.exporter._core.export, with the same registry (torchlib plus the translation
table) and no target opset, and step 1 converts the opset itself. torch is pinned (2.13) for this.

`graph_of` is the one place that knows how an emitted package exposes its graphs.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common
import torch
from onnxscript import version_converter
from torch import nn
from torch.export.graph_signature import TensorArgument
from torch.onnx._internal.exporter import _core, _fx_passes, _registration
from torch.onnx._internal.fx import passes
from torch.onnx._internal.fx.passes import type_promotion

from k3compile import safe_io
from k3compile.emit.onnx import DEFAULT_OPSET, FP4_MIN_OPSET, GRAPHS, MAX_OPSET, MIN_OPSET, MX_REPRESENTATIONS, WEIGHTS
from k3compile.emit.onnx import functions as k3fn
from k3compile.emit.onnx import translate
from k3compile.emit.onnx.layers import DOMAIN as LAYER_DOMAIN
from k3compile.emit.onnx.layers import k3_calls, outline_layers

PROTOBUF_LIMIT = 2**31 - 2**24  # a model file past 2 GB cannot hold its weights inline; keep a margin
EXAMPLE_TOKENS = (2, 100)  # traced with batch 2 and 100 tokens (two KDA chunks): sizes above 1 stay symbolic


class ExportError(ValueError):
    """Bad input to the export (not a build, unknown graph or option, opset too low): one line, nothing written."""


@dataclass
class ExportGraph:
    """One graph of a package as torch.export takes it, and the names its ONNX inputs and outputs get."""

    kind: str
    module: nn.Module
    args: tuple
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    dynamic_shapes: tuple
    axis_names: dict[str, tuple[str, ...]]  # input -> the names of its symbolic axes, in order


@dataclass
class Exported:
    """What one exported graph left: the file, its k3 function calls, and `check`'s findings when asked."""

    graph: str
    path: Path
    files: list[Path]
    bytes: int
    seconds: float
    functions: Counter  # k3 function calls, counted through the layer functions
    layers: Counter = field(default_factory=Counter)  # calls of each layer kind's function
    check: dict | None = None
    notes: list[str] = field(default_factory=list)


def available_graphs(package: ModuleType) -> list[str]:
    """The graph kinds an emitted package provides: infer, prefill and decode, when it has an InferenceModel."""
    return list(SERVING_GRAPHS) if hasattr(package, "InferenceModel") else []


SERVING_GRAPHS = ("infer", "prefill", "decode")
EXAMPLE_MAX_LEN = 128  # the MLA caches' length when traced: above the example tokens, so it stays its own axis
NEW = "new."  # a cache output's name: the input's with this prefix (ONNX names one value once)


@lru_cache(maxsize=None)
def _graph_class(cls: type, kind: str, caches: tuple[str, ...]) -> type:
    """`cls` whose forward is its `kind` graph over flat tensors, what torch.export traces: "infer" tokens ->
    logits from empty caches; "prefill" (tokens, *caches) -> (logits, *caches); "decode" (tokens, positions,
    *caches) -> (logits, *caches). The decode graph writes its MLA caches in place; they are copied first, so
    the graph reads its inputs and returns new caches (the copy and the write become one ScatterElements)."""
    from k3compile.modules.model import empty_caches

    if kind == "infer":
        def forward(self, tokens):
            fresh = empty_caches(self.spec, tokens.shape[0], tokens.shape[1], tokens.device, self.embed.weight.dtype)
            return self.prefill_graph(tokens, fresh)[0]
    elif kind == "prefill":
        def forward(self, tokens, *state):
            logits, new = self.prefill_graph(tokens, dict(zip(caches, state, strict=True)))
            return (logits, *(new[name] for name in caches))
    else:
        def forward(self, tokens, positions, *state):
            state = [t.clone() if name.startswith("mla_cache.") else t for name, t in zip(caches, state, strict=True)]
            logits, new = self.decode_graph(tokens, positions, dict(zip(caches, state)))
            return (logits, *(new[name] for name in caches))

    return type(f"{cls.__name__}{kind.title()}", (cls,), {"forward": forward})


def graph_of(package: ModuleType, kind: str) -> ExportGraph:
    """The `kind` graph of an emitted package, ready for torch.export.

    - "infer": the compiled prefill graph from empty caches, tokens [batch, seq] -> logits [batch, seq, vocab];
    - "prefill": tokens and the caches to fill (zeros; the MLA caches' length max_len is the room for decoding)
      -> logits and the filled caches;
    - "decode": one token per sequence [batch, 1], its position [batch] and the caches -> logits [batch, 1,
      vocab] and the caches moved on by one.
    Caches are named as k3compile.modules.model.cache_shapes names them (kda_state.<layer>,
    kda_conv_q.<layer>, ..., mla_cache.<layer>), outputs with the prefix "new.".
    """
    from k3compile.modules.model import cache_shapes

    if kind == "train" and hasattr(package, "Model"):
        raise ExportError("the train graph is not exported: its Quantile Balancing update "
                          "(k3::quantile_balance_update, a buffer write) has no ONNX translation")
    if kind not in available_graphs(package):
        have = ", ".join(available_graphs(package)) or "none"
        raise ExportError(f"the build has no {kind} graph (graphs in this build: {have})")
    model = package.InferenceModel().eval()
    shapes = cache_shapes(model.spec, EXAMPLE_TOKENS[0], EXAMPLE_MAX_LEN)
    names = tuple(shapes)
    model.__class__ = _graph_class(type(model), kind, names)  # same tensors and names, forward = the graph
    device = next(iter(model.state_dict().values())).device
    dynamic = torch.export.Dim.DYNAMIC
    batch = EXAMPLE_TOKENS[0]
    if kind == "infer":
        tokens = torch.zeros(EXAMPLE_TOKENS, dtype=torch.long, device=device)
        return ExportGraph(kind, model, (tokens,), ("tokens",), ("logits",), ({0: dynamic, 1: dynamic},),
                           {"tokens": ("batch", "seq")})
    dtype = model.embed.weight.dtype
    state = tuple(torch.zeros(shape, dtype=dt if name.startswith("kda_state.") else dtype, device=device)
                  for name, (shape, dt) in shapes.items())
    state_axes = tuple({0: dynamic, 1: dynamic} if name.startswith("mla_cache.") else {0: dynamic} for name in names)
    axis_names = {name: ("batch", "max_len") if name.startswith("mla_cache.") else ("batch",) for name in names}
    outputs = ("logits",) + tuple(NEW + name for name in names)
    if kind == "prefill":
        tokens = torch.zeros(EXAMPLE_TOKENS, dtype=torch.long, device=device)
        return ExportGraph(kind, model, (tokens, *state), ("tokens",) + names, outputs,
                           ({0: dynamic, 1: dynamic}, state_axes), {"tokens": ("batch", "seq"), **axis_names})
    tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
    positions = torch.full((batch,), EXAMPLE_TOKENS[1], dtype=torch.long, device=device)
    return ExportGraph(kind, model, (tokens, positions, *state), ("tokens", "positions") + names, outputs,
                       ({0: dynamic}, {0: dynamic}, state_axes),
                       {"tokens": ("batch",), "positions": ("batch",), **axis_names})


def _load_build(build: str | Path) -> tuple[ModuleType, dict]:
    from k3compile.loader import BuildLoadError, load

    try:
        package = load(build)
    except (FileNotFoundError, BuildLoadError) as e:
        raise ExportError(str(e)) from None
    except (ImportError, SyntaxError) as e:
        raise ExportError(f"{build}: cannot import the build ({type(e).__name__}: {e}); rebuild it") from None
    try:  # verified by load; read again through the bounded reader (a build holds no links)
        manifest = safe_io.read_json(Path(package.__file__).parent / "manifest.json", follow=False)
    except safe_io.FileError as e:
        raise ExportError(f"{e}; rebuild it") from None
    return package, manifest


def _check_options(graph: str, weights: str | None, mx: str, opset: int) -> None:
    if graph not in GRAPHS + ("all",):
        raise ExportError(f"unknown graph {graph!r}; graphs are: {', '.join(GRAPHS)}, all")
    if weights is not None and weights not in WEIGHTS:
        raise ExportError(f"unknown weights mode {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    if mx not in MX_REPRESENTATIONS:
        raise ExportError(f"unknown MX representation {mx!r}; choose one of: {', '.join(MX_REPRESENTATIONS)}")
    if mx == "fp4" and opset < FP4_MIN_OPSET:
        raise ExportError(f"opset {opset} is too low for --mx fp4: FLOAT4E2M1 data with FLOAT8E8M0 scales in "
                          f"DequantizeLinear need opset {FP4_MIN_OPSET} (or use --mx uint8)")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported; choose {MIN_OPSET} to {MAX_OPSET}")


def export_onnx(
    build: str | Path,
    out_dir: str | Path,
    graph: str = "infer",
    weights: str | None = None,
    mx: str = "fp4",
    opset: int = DEFAULT_OPSET,
    check: bool = False,
    flat: bool = False,
) -> list[Exported]:
    """Export `graph` ("all": every graph the build has) of the build at `build` to `out_dir/<graph>.onnx`.

    weights: "inline" (initializers in the file; external data past 2 GB), "external" (`<graph>.onnx.data`
    beside it), "none" (structure only: weights are typed graph inputs); default inline, or none for a
    build on the meta device. mx: "fp4" (FLOAT4E2M1 + E8M0 through DequantizeLinear, opset >= 24) or
    "uint8" (packed bytes decoded by standard ops; runs in onnxruntime on CPU). check: run
    k3compile.emit.onnx.check on each file (checker, shape inference, numerics against PyTorch). flat: no layer
    functions (k3compile.emit.onnx.layers), every layer's ops in the main graph.
    """
    _check_options(graph, weights, mx, opset)
    package, manifest = _load_build(build)
    kinds = available_graphs(package) if graph == "all" else [graph]
    graphs = [graph_of(package, kind) for kind in kinds]
    modes = [weights or ("none" if _on_meta(g.module) else "inline") for g in graphs]
    if any(mode != "none" and _on_meta(g.module) for g, mode in zip(graphs, modes)):
        raise ExportError("the build's weights are on the meta device (shapes only): export it with --weights none")
    lib = k3fn.define(opset, mx)
    results = []
    for g, mode in zip(graphs, modes):
        start = time.perf_counter()
        model = finish(trace(g), g, lib, mode, manifest, flat=flat)
        files, notes = save(model, Path(out_dir), g.kind, mode)
        layers = Counter(n.op_type for n in model.graph if n.domain == LAYER_DOMAIN)
        result = Exported(g.kind, files[0], files, sum(p.stat().st_size for p in files),
                          time.perf_counter() - start, k3_calls(model), layers=layers, notes=notes)
        if check:
            from k3compile.emit.onnx.check import check_file

            result.check = check_file(result.path, g, lib, numerics=mode != "none", target=manifest["target"])
        results.append(result)
    return results


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.state_dict().values())


@lru_cache(maxsize=1)
def _recording_library() -> k3fn.Library:
    """The functions the translation records calls of. Their bodies are replaced by the requested opset's and
    MX representation's in `finish`, so one trace serves every opset and representation."""
    return k3fn.define(MIN_OPSET, "uint8")


PRIVATE_EXPORTER_TORCH = (2, 13)  # the torch whose internal exporter (torch.onnx._internal.exporter) `trace` calls


def _check_torch() -> None:
    """`trace` calls torch's internal exporter, whose functions change between releases: only the pinned torch."""
    have = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if have != PRIVATE_EXPORTER_TORCH:
        want = ".".join(map(str, PRIVATE_EXPORTER_TORCH))
        raise ExportError(f"k3compile export needs torch {want}.x (it calls torch's internal ONNX exporter), this is "
                          f"torch {torch.__version__}; torch.onnx.export with k3compile.onnx_translations() is the "
                          "public path (docs/onnx.md)")


def trace(g: ExportGraph) -> ir.Model:
    """torch.export of `g`, translated by torch's exporter: the main graph at the exporter's opset (18), its
    k3 ops as calls of k3 functions, inputs and outputs named. The expensive half of an export; `finish`
    makes it a model.

    The exporter normally re-traces the program through run_decompositions first; for a graph whose every op
    it can translate as captured (the k3 graphs: k3 ops and a few dozen ATen ops, no mutation) that retrace
    is skipped. It is most of the cost, and quadratic in the number of weights (torch's signature
    bookkeeping): on Kimi K3 (3012 weights) it took 78 s of CPU, the rest of the export 35.
    """
    _check_torch()
    with _quiet(), torch.no_grad(), _lean_tracing():
        registry = _registration.ONNXRegistry.from_torchlib()
        for target, translation in translate.table(_recording_library()).items():
            registry.register_op(target, translation)
        program = torch.export.export(g.module, g.args, dynamic_shapes=g.dynamic_shapes, strict=False)
        _write_copies_functionally(program)
        if _translatable_as_captured(program.graph, registry):
            _prepare_captured(program)
            model = _core._exported_program_to_onnx_program(program, registry=registry).model
        else:
            model = _core.export(program, registry=registry, optimize=False, verbose=False).model
    user_inputs = [v for v in model.graph.inputs if not v.is_initializer()]
    for value, name in zip(user_inputs, g.input_names, strict=True):
        value.name = name
    for value, name in zip(model.graph.outputs, g.output_names, strict=True):
        value.name = name
    return model


_ASSERTIONS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
               torch.ops.aten.sym_constrain_range_for_size.default)


def _translatable_as_captured(graph: torch.fx.Graph, registry) -> bool:
    """No op mutates, and every op (or size arithmetic) has a translation, is an assertion, or computes a dtype
    (folded)."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node.target in _ASSERTIONS:
            continue
        if node.target is torch.ops.aten.promote_types.default:
            continue
        if not isinstance(node.target, torch._ops.OpOverload):  # size arithmetic (operator.mul) is translated
            if registry.is_registered(node.target):
                continue
            return False
        if node.target._schema.is_mutable:
            return False
        if not registry.is_registered(node.target):
            return False
    return True


def _write_copies_functionally(program: torch.export.ExportedProgram) -> None:
    """An in-place ATen op whose target is a fresh copy no one else reads (`cache.clone().scatter_(...)`) becomes
    the op's functional form on the original: the same values, and no mutation left to functionalise."""
    gm = program.graph_module
    renamed: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not node.args:
            continue
        name = target._schema.name.removeprefix("aten::")
        copy = node.args[0]
        if not name.endswith("_") or target.namespace != "aten" or not isinstance(copy, torch.fx.Node):
            continue
        functional = getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)
        if copy.target is not torch.ops.aten.clone.default or len(copy.users) != 1 or functional is None:
            continue
        with gm.graph.inserting_before(node):
            replacement = gm.graph.call_function(functional, (copy.args[0], *node.args[1:]), node.kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        renamed[node.name] = replacement.name
        gm.graph.erase_node(node)
        gm.graph.erase_node(copy)
    for spec in program.graph_signature.output_specs:  # outputs are named by their node
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
    if renamed:
        gm.recompile()


def _prepare_captured(program: torch.export.ExportedProgram) -> None:
    """What the exporter's own preparation does after its retrace, on the captured graph: dtype arithmetic
    (`torch.promote_types` in emitted code) folded to its value, unused outputs (the ops' extra outputs for
    their backward) dropped, explicit type promotion, assertions removed."""
    gm = program.graph_module
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten.promote_types.default:
            for user in list(node.users):
                user.replace_input_with(node, node.meta["val"])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    for module in gm.modules():
        promotion = passes.InsertTypePromotion(module)
        promotion.interpreter.__class__ = _PromotionOnly
        promotion.run()
    program._graph_module = _fx_passes.remove_assertion_nodes(gm)


class _PromotionOnly(type_promotion._TypePromotionInterpreter):
    """The exporter's type promotion pass, without re-running the ops it has no rule for: they keep their traced
    value (k3 ops, views, matmuls), where the pass would execute the whole graph again on fake tensors (on Kimi
    K3, a sixth of the export). Ops with a rule run as before, so their casts and new values are the same."""

    def run_node(self, n: torch.fx.Node):
        if (n.op == "call_function" and "val" in n.meta
                and type_promotion.get_type_promotion_rule(n, self.type_promotion_table) is None):
            return n.meta["val"]
        return super().run_node(n)


def finish(model: ir.Model, g: ExportGraph, lib: k3fn.Library, weights: str, manifest: dict,
           flat: bool = False) -> ir.Model:
    """`trace`'s model (changed in place) at lib's opset with lib's k3 functions, MX payloads and weights as
    asked, each layer kind one function (unless `flat`), axes named and the build described in metadata_props."""
    _convert_opset(model, lib)
    state = set(g.module.state_dict()) | {name for name, _ in getattr(g.module, "MERGED", ())}  # + stacked weights
    if weights == "none":
        _weights_as_inputs(model, state)
    if lib.mx == "fp4":
        _fp4_payloads(model)
    spec = getattr(g.module, "spec", None)  # a model's graph has layers; a module of a few ops does not
    if not flat and spec is not None:
        outline_layers(model, spec, g.kind, state)
    _name_axes(model, g.axis_names)
    model.metadata_props.update({
        "k3compile.spec": manifest["spec"]["name"],
        "k3compile.spec_sha256": manifest["spec"]["sha256"],
        "k3compile.compiler": manifest["compiler"],
        "k3compile.graph": g.kind,
        "k3compile.target": manifest["target"],
        "k3compile.mx": lib.mx,
        "k3compile.weights": weights,
    })
    model.graph.doc_string = f"{manifest['spec']['name']}: the {g.kind} graph of a k3compile build"
    return model


class _quiet:
    """Silences torch.export's and the exporter's warnings and progress lines: the CLI prints its own summary."""

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._logger = logging.getLogger("torch")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)
        return self._warnings.__exit__(*exc)


@contextlib.contextmanager
def _lean_tracing():
    """Two costs of an export that buy nothing here, off while tracing. torch.export records each node's Python stack
    (the ONNX file would carry it per node as metadata); and torch's exporter builds an ONNX op's signature from its
    schema at every op it emits (24k times on Kimi K3), though it depends on the schema alone: built once per schema."""
    import torch.fx.config as fx_config

    cls = ir.schemas.OpSignature
    original = cls.__dict__["from_op_schema"]
    built: dict[tuple, ir.schemas.OpSignature] = {}

    def from_op_schema(op_schema):
        key = (op_schema.domain, op_schema.name, op_schema.since_version)
        if key not in built:
            built[key] = original.__get__(None, cls)(op_schema)
        return built[key]

    stack_traces = fx_config.do_not_emit_stack_traces
    cls.from_op_schema = staticmethod(from_op_schema)
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        cls.from_op_schema = original
        fx_config.do_not_emit_stack_traces = stack_traces


def _convert_opset(model: ir.Model, lib: k3fn.Library) -> None:
    """Main graph to lib.opset with the k3 functions held aside; then the k3 functions it calls, and theirs."""
    for key in [key for key in model.functions if key[0] == k3fn.DOMAIN]:
        del model.functions[key]
    version_converter.convert_version(model, lib.opset)
    called = {n.op_type for n in model.graph if n.domain == k3fn.DOMAIN}
    for proto in lib.protos(called):
        function = ir.serde.deserialize_function(proto)
        model.functions[function.identifier()] = function
    model.opset_imports[""] = lib.opset
    model.opset_imports[k3fn.DOMAIN] = 1


def _weights_as_inputs(model: ir.Model, state: set[str]) -> None:
    """Every initializer holding a parameter or buffer of the module becomes a typed graph input, data dropped."""
    for name in [name for name in model.graph.initializers if name in state]:
        value = model.graph.initializers.pop(name)
        value.const_value = None
        model.graph.inputs.append(value)


def _fp4_payloads(model: ir.Model) -> None:
    """MXFP4 operands of the k3 MX functions to their ONNX types: payload UINT8 [..., n/2] -> FLOAT4E2M1
    [..., n], scales UINT8 -> FLOAT8E8M0, same bytes. An operand is a weight (initializer or graph input), or a
    Reshape of its leading dims (shard_experts' [ranks, experts, ...] view), retyped back to the weight; such a
    Reshape gets its static target as a constant, so the Shape ops that computed it (from the packed shape) go."""
    done: dict[str, ir.Value] = {}
    for node in model.graph:
        operands = k3fn.MX_OPERANDS.get(node.op_type, ()) if node.domain == k3fn.DOMAIN else ()
        for data_at, scale_at in operands:
            _retype(model.graph, node.inputs[data_at], True, done)
            _retype(model.graph, node.inputs[scale_at], False, done)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    for value in done.values():  # a payload's shape now counts elements, no longer bytes
        if value.type.dtype == ir.DataType.FLOAT4E2M1 and any(use.node.op_type == "Shape" for use in value.uses()):
            raise ExportError(f"the shape of MX operand {value.name} is read in the graph; export with --mx uint8")


def _retype(graph: ir.Graph, value: ir.Value, packed: bool, done: dict[str, ir.Value]) -> None:
    if value.name in done:
        return
    allowed = {"Reshape", "Shape"}
    if not all((u.node.domain == k3fn.DOMAIN and u.node.op_type in k3fn.MX_OPERANDS) or u.node.op_type in allowed
               for u in value.uses()):
        raise ExportError(f"MX operand {value.name} is read by ops other than the MX functions; export with --mx uint8")
    producer = value.producer()
    dims = list(value.shape)
    if value.is_initializer() or value.is_graph_input():
        pass
    elif producer is not None and producer.op_type == "Reshape" and _keeps_last_dim(producer):
        _retype(graph, producer.inputs[0], packed, done)
        if packed:
            target = np.array(dims[:-1] + [2 * dims[-1]], dtype=np.int64)
            shape = ir.node("Constant", [], attributes={"value": ir.tensor(target)})
            graph.insert_before(producer, shape)
            producer.replace_input_with(1, shape.outputs[0])
    else:
        raise ExportError(f"MX operand {value.name} is computed in the graph, not a weight; export with --mx uint8")
    if packed:
        dims[-1] *= 2
    dtype = ir.DataType.FLOAT4E2M1 if packed else ir.DataType.FLOAT8E8M0
    if value.const_value is not None:
        raw = value.const_value.numpy()
        if packed:
            value.const_value = ir.PackedTensor(raw, dtype, shape=dims, name=value.name)
        else:
            value.const_value = ir.Tensor(raw.view(ml_dtypes.float8_e8m0fnu), name=value.name)
    value.type = ir.TensorType(dtype)
    value.shape = ir.Shape(dims)
    done[value.name] = value


def _keeps_last_dim(reshape: ir.Node) -> bool:
    """Whether a Reshape only regroups leading dims into a static shape: the same static last dim in and out."""
    source, out = reshape.inputs[0].shape, reshape.outputs[0].shape
    if source is None or out is None or not all(isinstance(d, int) for d in out):
        return False
    return isinstance(source[-1], int) and out[-1] == source[-1]


def _name_axes(model: ir.Model, axis_names: dict[str, tuple[str, ...]]) -> None:
    """Rename the symbols of the named inputs' dynamic axes (s27 -> seq) wherever a value's shape holds them."""
    rename = {}
    for value in model.graph.inputs:
        for dim, name in zip(value.shape or (), axis_names.get(value.name, ())):
            if isinstance(dim, ir.SymbolicDim) and dim.value:
                rename[dim.value] = name
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b")

    def renamed(shape: ir.Shape) -> ir.Shape:
        return ir.Shape([pattern.sub(lambda m: rename[m.group(1)], d.value)
                         if isinstance(d, ir.SymbolicDim) and d.value else d for d in shape])

    values = list(model.graph.inputs) + [v for node in ir.traversal.RecursiveGraphIterator(model.graph)
                                         for v in node.outputs]
    for value in values:
        if value.shape is not None:
            value.shape = renamed(value.shape)


def save(model: ir.Model, out_dir: Path, kind: str, weights: str) -> tuple[list[Path], list[str]]:
    """Write `<kind>.onnx` (and `<kind>.onnx.data` for external weights) into out_dir, all or nothing."""
    notes = []
    weight_bytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    external = weights == "external" or weight_bytes > PROTOBUF_LIMIT
    if external and weights == "inline":
        notes.append(f"{weight_bytes / 2**30:.1f} GiB of weights do not fit a 2 GB ONNX file: written as external data")
    name = f"{kind}.onnx"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}.onnx.tmp-", dir=out_dir))
    except OSError as e:
        raise ExportError(f"cannot write {out_dir}: {e.strerror or e}") from None
    try:
        ir.save(model, tmp / name, external_data=f"{name}.data" if external else None)
        written = sorted(tmp.iterdir(), key=lambda p: p.name != name)  # the model file last, after its data
        for path in reversed(written):
            os.replace(path, out_dir / path.name)
    except OSError as e:
        raise ExportError(f"cannot write {out_dir / name}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not external:
        stale = out_dir / f"{name}.data"
        stale.unlink(missing_ok=True)
    return [out_dir / p.name for p in written], notes
