"""k3compile: YAML specs of Kimi-K3-class models, analysed, lowered and emitted as PyTorch modules."""

__version__ = "0.1.0"


def load(path):
    """Import an emitted package (see k3compile.loader.load)."""
    from k3compile.loader import load as _load

    return _load(path)


def train(spec_or_build, steps, data=None, out=None, resume=False, overrides=(), eval_every=None, progress=True,
          stop_after=None, init_from=None, extends_anywhere=False, log_every=None, callbacks=(), log=(), tokenizer=None,
          data_dtype=None):
    """Train a spec's or a build's Model; returns the metrics records (see k3compile.training.train).

    `callbacks`: functions called with each metrics record as it is logged; `log=("tensorboard",)` writes
    TensorBoard events under the run folder.
    """
    from k3compile.training import train as _train

    return _train(spec_or_build, steps, data, out, resume, overrides, eval_every, progress, stop_after, init_from,
                  extends_anywhere, log_every, callbacks, log, tokenizer, data_dtype)


def balance(model):
    """Load balancing for your own loop: update `model`'s router biases from the training forwards since the last
    call, by its spec's rule; call after each optimizer step (see k3compile.runtime.balance.balance)."""
    from k3compile.runtime.balance import balance as _balance

    return _balance(model)


def from_hf(hf_dir, out=None, *, name=None, mode="both", overrides=(), max_shard_bytes=None, spec_only=False):
    """Import a Hugging Face Kimi Linear folder: spec, build and weights (k3compile.hf.convert.import_hf).

    Returns an HFImport; `.model()` is the build's Model holding the imported weights.
    """
    from k3compile.hf.convert import import_hf

    return import_hf(hf_dir, out, name=name, mode=mode, overrides=overrides, max_shard_bytes=max_shard_bytes,
                     spec_only=spec_only)


def export_onnx(build, out_dir, graph="infer", weights=None, mx="fp4", opset=None, check=False):
    """Export a build's compiled graph to `out_dir/<graph>.onnx` (see k3compile.emit.onnx.export.export_onnx)."""
    from k3compile.emit.onnx import DEFAULT_OPSET
    from k3compile.emit.onnx.export import export_onnx as _export_onnx

    return _export_onnx(build, out_dir, graph, weights, mx, DEFAULT_OPSET if opset is None else opset, check)


def onnx_translations(opset=18, mx="uint8"):
    """The k3 ops' translations for torch.onnx.export(..., dynamo=True, custom_translation_table=...) (docs/onnx.md)."""
    from k3compile.emit.onnx.public import translations

    return translations(opset, mx)


def onnx_add_functions(onnx_program, opset=18, mx="uint8"):
    """Complete torch.onnx.export's program (in place) with the k3 functions other k3 functions call (docs/onnx.md)."""
    from k3compile.emit.onnx.public import add_functions

    add_functions(onnx_program, opset, mx)


def ablate(base, variants=(), grid=(), steps=None, tokens=None, seeds=None, tasks=None, mqar=None, data=None,
           overrides=(), eval_every=None, jobs=None, out=None, progress=False):
    """Train a base spec and its variants on the same data, seeds and budget; returns results.json's document
    (see k3compile.ablation.ablate)."""
    from k3compile.ablation import ablate as _ablate

    return _ablate(base, variants, grid, steps, tokens, seeds, tasks, mqar, data, overrides, eval_every, jobs, out,
                   progress)
