"""`k3compile export --check`: is the written file valid ONNX, and does it compute what the PyTorch graph does?

1. onnx.checker with full_check (schemas, types, function bodies), from the path so external data counts;
2. ONNX shape inference in strict mode, into the k3 functions and their Loop and Scan bodies;
3. when the file holds weights: random tokens (and for prefill and decode, caches: see `random_inputs`) through
   the ONNX model and through the PyTorch module it was exported from; every output is compared. onnxruntime runs it unless it holds FLOAT4E2M1 weights (onnxruntime's CPU provider has no
   FP4 DequantizeLinear), then onnx.reference.ReferenceEvaluator does. The error of each output is reported
   as max|onnx - torch| / max|torch| ("max relative") and ||onnx - torch||_2 / ||torch||_2 ("rms relative").

MX fake quantisation (the activation format of MX-quantised experts) rounds to a coarse grid, so an input
that differs from PyTorch's in the last bit can land on the other side of a rounding tie: a few such flips
dominate the max relative error of an MX graph while its rms relative error stays small.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import torch

from k3compile.emit.onnx.functions import DOMAIN, Library
from k3compile.emit.onnx.layers import DOMAIN as LAYER_DOMAIN

CHECK_TOKENS = (3, 37)  # other sizes than the traced ones (2, 100): the axes must really be dynamic
CHECK_MAX_LEN = 48  # the caches' length (traced: 128)
CHECK_PROMPTS = (37, 20, 5)  # the decode check's prompt lengths
SEED = 0


def k3_calls(model: onnx.ModelProto) -> Counter:
    """The k3 functions the main graph calls, with their counts, through the layer functions (each call of one
    counts the k3 calls in its body)."""
    bodies = {(f.domain, f.name): f for f in model.functions}
    calls = Counter()
    for node in model.graph.node:
        if node.domain == DOMAIN:
            calls[node.op_type] += 1
        elif node.domain == LAYER_DOMAIN:
            calls.update(n.op_type for n in bodies[node.domain, node.op_type].node if n.domain == DOMAIN)
    return calls


def layer_calls(model: onnx.ModelProto) -> Counter:
    """The layer kinds' functions the main graph calls, with their counts."""
    return Counter(n.op_type for n in model.graph.node if n.domain == LAYER_DOMAIN)


def _holds_fp4(model: onnx.ModelProto) -> bool:
    fp4 = onnx.TensorProto.FLOAT4E2M1
    return any(t.data_type == fp4 for t in model.graph.initializer) or any(
        i.type.tensor_type.elem_type == fp4 for i in model.graph.input
    )


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"ONNX output shape {got.shape} differs from PyTorch's {want.shape}")
    diff = got - want
    return (float(np.abs(diff).max() / max(np.abs(want).max(), 1e-30)),
            float(np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30)))


def random_inputs(graph, vocab: int) -> tuple[torch.Tensor, ...]:
    """Seeded inputs for `graph` (an ExportGraph), in its input order.

    infer: random tokens [3, 37]; prefill: the same with zeroed caches of CHECK_MAX_LEN; decode: one random token
    per sequence after prompts of different lengths (CHECK_PROMPTS, each prefilled by PyTorch into its row),
    so every sequence reads its own cache length.
    """
    gen = torch.Generator().manual_seed(SEED)
    module = graph.module
    if graph.kind == "infer":
        return (torch.randint(0, vocab, CHECK_TOKENS, generator=gen),)
    if graph.kind == "prefill":
        tokens = torch.randint(0, vocab, CHECK_TOKENS, generator=gen)
        cache = module.new_cache(CHECK_TOKENS[0], CHECK_MAX_LEN)
        return (tokens, *(cache.tensors[name] for name in graph.input_names[1:]))
    if graph.kind == "decode":
        device = next(iter(module.state_dict().values())).device
        prompts = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in CHECK_PROMPTS]
        with torch.no_grad():
            _, cache = module.prefill_batch(prompts, CHECK_MAX_LEN)
        tokens = torch.randint(0, vocab, (len(prompts), 1), generator=gen)
        return (tokens, cache.positions.clone(), *(cache.tensors[name] for name in graph.input_names[2:]))
    raise NotImplementedError(f"numerical check of the {graph.kind} graph")


def run_onnx(path: Path, feeds: dict[str, np.ndarray], reference: bool) -> tuple[list[np.ndarray], str]:
    """The model's outputs on `feeds`, and the engine that computed them."""
    if reference:
        from onnx.reference import ReferenceEvaluator

        return ReferenceEvaluator(str(path)).run(None, feeds), "onnx.reference"
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # constant folding's notes about CastLike are not findings
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds), "onnxruntime"


def reference_device(target: str) -> str | None:
    """Where PyTorch can run a build for `target`: its graph calls the Triton kernels of a GPU target, which
    need CUDA, or CPU tensors under TRITON_INTERPRET=1; None when neither is here."""
    from k3compile.kernels._common.launch import GPU_TARGETS, interpreting

    if target not in GPU_TARGETS or interpreting():
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def check_file(path: Path, graph, lib: Library, numerics: bool = True, target: str = "cpu") -> dict:
    """Check the ONNX file at `path`, exported from `graph` (an ExportGraph) of a build for `target` with
    `lib`; returns the findings.

    Raises onnx's own errors (onnx.checker.ValidationError, InferenceError) when the file is invalid.
    """
    start = time.perf_counter()
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    calls = k3_calls(model)
    found = {
        "checker": "passed (full check)",
        "shape_inference": "passed (strict)",
        "functions": dict(sorted(calls.items())),
        "layers": dict(sorted(layer_calls(model).items())),
        "k3_ops": dict(sorted(Counter(lib.ops[name] for name in calls.elements()).items())),
        "nested_functions": sorted({f.name for f in model.functions if f.domain == DOMAIN} - set(calls)),
    }
    device = reference_device(target)
    if numerics and device is not None:
        graph.module.to(device)
        inputs = random_inputs(graph, int(graph.module.spec.vocab_size))
        with torch.no_grad():
            want = graph.module.to(device)(*(t.to(device) for t in inputs))
        want = [want] if isinstance(want, torch.Tensor) else list(want)
        feeds = {name: t.cpu().numpy() for name, t in zip(graph.input_names, inputs)}
        got, engine = run_onnx(path, feeds, reference=_holds_fp4(model))
        errors = {name: _errors(g, w.float().cpu().numpy()) for name, g, w in zip(graph.output_names, got, want)}
        found.update(
            engine=engine,
            inputs={name: list(t.shape) for name, t in zip(graph.input_names, inputs) if "." not in name},
            max_relative_error=max(e[0] for e in errors.values()),
            rms_relative_error=max(e[1] for e in errors.values()),
            errors={name: {"max_relative": e[0], "rms_relative": e[1]} for name, e in errors.items()},
        )
    elif numerics:
        found["numerics"] = (f"skipped: the build's graph runs Triton kernels (target {target}), which need a GPU "
                             "or TRITON_INTERPRET=1")
    else:
        found["numerics"] = "skipped: the file holds no weights (--weights none)"
    found["seconds"] = time.perf_counter() - start
    return found
