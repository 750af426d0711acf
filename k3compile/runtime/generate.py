"""Text generation from a build: byte-level tokens, a compiled prefill, then compiled decode steps.

`load_inference_model(build, checkpoint)` turns a training checkpoint into the build's
InferenceModel (packing the MX weights). `generate_tokens` serves through its compiled graphs:
the prefill graph runs the prompt (KDA chunked form, MLA latents written to the preallocated
cache), then each new token is one step of the decode graph through the fp32 KDA state, the
short-conv tails and the MLA latent cache; on a GPU each step is one replay of the step captured
as a CUDA graph (k3compile.runtime.decode_graph). `generate_batch` decodes prompts of different
lengths together. `stream_text` turns bytes into text as soon as they form valid UTF-8.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from k3compile.runtime.generated import DecodeCache
from k3compile.spec.schema import Spec

BYTE_VOCAB = 256


class GenerateError(ValueError):
    """Bad input to generation (prompt, sampling options, build, checkpoint): one line, no traceback."""


# ---------------------------------------------------------------- builds and checkpoints


def load_build(build: str | Path | ModuleType) -> ModuleType:
    """The emitted package at `build` (already imported modules pass through)."""
    if isinstance(build, ModuleType):
        return build
    from k3compile.loader import BuildLoadError, load

    try:
        return load(build)
    except BuildLoadError as e:
        raise GenerateError(str(e)) from None


def build_spec(module: ModuleType) -> Spec:
    """The spec a loaded build was compiled from."""
    return Spec.model_validate_json(module.SPEC_JSON)


def read_training_state(
    checkpoint: str | Path, expected: dict[str, tuple[int, ...]], spec: Spec
) -> dict[str, Tensor]:
    """The training Model's weights (names and shapes as `expected`) from a k3compile checkpoint of `spec`.

    `checkpoint` is a checkpoint's JSON or tensor file, a folder (the newest checkpoint in it or
    in its `checkpoints/`), or a weights folder (`k3compile import-hf` output). Extra tensors are
    accepted only as more state of modules the build has (the router's balancing statistics); any
    other difference is a one-line error.
    """
    from k3compile.runtime import checkpoint as ckpt_io
    from k3compile.runtime import shards

    path = Path(checkpoint)
    if not path.exists():
        raise GenerateError(f"checkpoint {path} does not exist")
    if path.is_dir() and shards.holds(path, shards.WEIGHTS):
        try:
            meta, state = shards.read_weights(path)
        except shards.ShardError as e:
            raise GenerateError(_one_line(e)) from None
    else:
        if path.suffix == ".safetensors":
            path = path.with_suffix(".json")
        if path.is_dir() and ckpt_io.latest(path) is None and ckpt_io.latest(path / "checkpoints") is not None:
            path = path / "checkpoints"
        try:
            ckpt = ckpt_io.load(path)
        except ckpt_io.CheckpointError as e:
            raise GenerateError(_one_line(e)) from None
        path, meta = ckpt.path, ckpt.meta
        prefix = "model/"  # checkpoint.model_tensors' namespace for the model's parameters and buffers
        state = {k[len(prefix) :]: v for k, v in ckpt.tensors.items() if k.startswith(prefix)}
    _check_architecture(meta, path, spec)
    modules = {k.rpartition(".")[0] for k in expected}
    found = {k: tuple(v.shape) for k, v in state.items() if k in expected or k.rpartition(".")[0] not in modules}
    problem = ckpt_io.mismatches(expected, found)
    if problem:
        raise GenerateError(
            f"checkpoint {path} (spec {meta.get('spec_name', '?')!r}) does not match the build: {problem}"
        )
    bad = next((k for k in expected if state[k].is_floating_point() and not torch.isfinite(state[k]).all()), None)
    if bad is not None:
        raise GenerateError(f"checkpoint {path} holds non-finite values in {bad}")
    return {k: state[k] for k in expected}


# Fields a checkpoint's weights do not depend on: serving may change them.
SERVING_FIELDS = {"name", "training", "quantization", "target", "parallel", "context_length"}


def _check_architecture(meta: dict, path: Path, spec: Spec) -> None:
    """Refuse a checkpoint whose recorded spec describes another model (same shapes, other numerics)."""
    if "spec" not in meta:
        return
    if not isinstance(meta["spec"], dict):
        raise GenerateError(f"checkpoint {path} records a spec that is not an object")
    try:
        trained = Spec.model_validate(meta["spec"]).model_dump(exclude=SERVING_FIELDS)
    except ValueError:
        raise GenerateError(f"checkpoint {path} records a spec that does not validate") from None
    built = spec.model_dump(exclude=SERVING_FIELDS)
    changed = sorted(k for k in built if built[k] != trained.get(k))
    if changed:
        raise GenerateError(
            f"checkpoint {path} was trained on spec {meta.get('spec_name', '?')!r}, whose {', '.join(changed)} "
            f"differ from the build's ({spec.name!r})"
        )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _training_shapes(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the training state_dict an InferenceModel is packed from."""
    packed = {p[k] for p in model.PACKED.values() for k in ("data", "scale")}
    shapes = {k: model.full_shape(k, tuple(v.shape)) for k, v in model.state_dict().items() if k not in packed}
    shapes.update({w: tuple(p["shape"]) for w, p in model.PACKED.items()})
    return shapes


@torch.no_grad()
def serving_device(module: ModuleType, build: str | Path | ModuleType | None = None) -> torch.device:
    """The device a build serves on here (cuda:LOCAL_RANK for a GPU target); a one-line GenerateError where this
    machine cannot run its kernels."""
    from k3compile.runtime.device import DeviceError, runtime_device

    target = getattr(module, "TARGET", "cpu")
    where = build if isinstance(build, (str, Path)) else "the build"
    try:
        return runtime_device(target, f"{where} was built for {target}")
    except DeviceError as e:
        raise GenerateError(str(e)) from None


def load_inference_model(
    build: str | Path | ModuleType, checkpoint: str | Path | None = None, device: torch.device | str | None = None
):
    """The build's InferenceModel (eval mode) with a training checkpoint's weights packed in, on `device`
    (default: the build's, `serving_device`).

    Without a checkpoint, the seeded initial weights. Every weight in InferenceModel.PACKED
    is MX-quantised into its `<w>_mx` / `<w>_scale` buffers; everything else is copied by name.
    A weights folder written for the InferenceModel (`import-hf --mode infer`) loads as it is.
    """
    from k3compile.runtime.shards import weights_class

    from k3compile.runtime.shards import ShardError

    module = load_build(build)
    device = torch.device(device) if device is not None else serving_device(module, build)
    check_weights(module, checkpoint)
    if not hasattr(module, "InferenceModel"):
        raise GenerateError(f"{build}: a train-only build has no InferenceModel; build with --mode infer or both")
    if checkpoint is None:
        return module.InferenceModel(device=device).eval()
    model = module.InferenceModel(device="meta")
    try:
        kind = weights_class(checkpoint)
    except ShardError as e:
        raise GenerateError(_one_line(e)) from None
    if kind == "InferenceModel":
        own = {k: model.full_shape(k, tuple(v.shape)) for k, v in model.state_dict().items()}
        state = {k: model.local_rows(k, v) for k, v in read_training_state(checkpoint, own, model.spec).items()}
    else:
        state = model.packed_training_state(read_training_state(checkpoint, _training_shapes(model), model.spec))
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    return model.eval()


# ---------------------------------------------------------------- tokens and sampling


def encode(text: str) -> list[int]:
    """Byte-level tokens: the UTF-8 bytes of `text`.

    Bytes that are not UTF-8 reach Python from argv as surrogate escapes (U+DC80..U+DCFF); they are given back
    as the bytes they stand for. Any other lone surrogate is not text and is refused.
    """
    try:
        return list(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError as e:
        where = f"a lone surrogate {text[e.start]!r} at {e.start}"
        raise GenerateError(f"the prompt is not text: it holds {where}") from None


def check_weights(module: ModuleType, checkpoint: str | Path | None) -> None:
    """Refuse to generate from a shapes-only build (lowered on the meta device) without a checkpoint's weights."""
    from k3compile.loader import shapes_only

    if checkpoint is None and shapes_only(module):
        raise GenerateError(
            "the build has no weights (a shapes-only build: its spec was too large to initialise, so it was "
            "lowered on the meta device); pass --checkpoint with trained weights, or generate from a build of a "
            "smaller spec (k3compile build specs/k3-tiny.yaml -o build)"
        )


def check_request(spec: Spec, prompt: list[int], max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Reject what cannot be generated, with one line each: empty prompt, ids, context, sampling options."""
    if not prompt:
        raise GenerateError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt if not 0 <= t < spec.vocab_size), None)
    if bad is not None:
        raise GenerateError(f"prompt token id {bad} is outside the vocabulary [0, {spec.vocab_size})")
    if max_new_tokens < 0:
        raise GenerateError(f"max-new-tokens must be at least 0, got {max_new_tokens}")
    total = len(prompt) + max_new_tokens
    if total > spec.context_length:
        raise GenerateError(
            f"prompt ({len(prompt)} tokens) + max-new-tokens ({max_new_tokens}) = {total} exceeds the spec's "
            f"context_length {spec.context_length}"
        )
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerateError(f"temperature must be a finite number >= 0, got {temperature}")
    if not (0 < top_p <= 1):
        raise GenerateError(f"top-p must be in (0, 1], got {top_p}")


def top_p_filter(probs_V: Tensor, top_p: float) -> Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p (not renormalised)."""
    if top_p >= 1:
        return probs_V
    sorted_p, order = probs_V.sort(descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p  # the mass before a token is still short of top_p
    return torch.zeros_like(probs_V).scatter(-1, order, sorted_p * keep)


def sample_next(logits_V: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy (first maximum) at temperature 0, else a top-p sample of softmax(logits / temperature)."""
    logits_V = logits_V.float()
    scaled = logits_V / temperature if temperature > 0 else logits_V
    if temperature == 0 or not torch.isfinite(scaled).all():  # a temperature so small it overflows is greedy
        return int(logits_V.argmax())
    probs = top_p_filter(torch.softmax(scaled, dim=-1), top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


# ---------------------------------------------------------------- the loop


def decoder(model, cache: DecodeCache) -> tuple[Callable[[Tensor], Tensor], DecodeCache]:
    """(step: tokens [B] -> logits [B, 1, V] of the next position, the cache it advances) from a prefilled cache:
    on a GPU a replay of the model's captured decode graph for the batch's bucket (the logits are its static output,
    overwritten by the next step), elsewhere the eager decode graph."""
    if cache.positions.device.type == "cuda":
        runner = model.decode_graph_runner(len(cache.lengths), cache.max_len)
        runner.load(cache)
        return runner.decode, runner.cache

    def step(tokens: Tensor) -> Tensor:
        return model.decode(tokens, cache)[0]

    return step, cache


def generate_tokens(
    model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    on_cache: Callable[[DecodeCache], None] | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids of an InferenceModel, each as soon as it is chosen.

    The input is checked before any work; the caches are preallocated to prompt + new tokens;
    `on_cache` sees the final cache (for reporting). Sampling is seeded.
    """
    check_request(model.spec, prompt, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return
    generator = torch.Generator().manual_seed(seed)
    device = next(iter(model.state_dict().values())).device
    with torch.no_grad():
        logits, cache = model.prefill(torch.tensor([prompt], device=device), len(prompt) + max_new_tokens)
        step, cache = decoder(model, cache)
        logits = logits[0, -1]
        for i in range(max_new_tokens):
            token = sample_next(logits.cpu(), temperature, top_p, generator)
            yield token
            if i + 1 < max_new_tokens:
                logits = step(torch.tensor([token], device=device))[0, -1]
    if on_cache is not None:
        on_cache(cache)


def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0
) -> list[list[int]]:
    """New tokens for several prompts of any lengths, decoded together (each sequence at its own position)."""
    if not prompts:
        raise GenerateError("no prompts given")
    for prompt in prompts:
        check_request(model.spec, prompt, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    generator = torch.Generator().manual_seed(seed)
    device = next(iter(model.state_dict().values())).device
    max_len = max(len(p) for p in prompts) + max_new_tokens
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        logits, cache = model.prefill_batch([torch.tensor(p, device=device) for p in prompts], max_len)
        step, cache = decoder(model, cache)
        for i in range(max_new_tokens):
            rows = logits.cpu()  # the batch's logits in one copy
            tokens = [sample_next(row, temperature, top_p, generator) for row in rows]
            for seq, t in zip(out, tokens):
                seq.append(t)
            if i + 1 < max_new_tokens:
                logits = step(torch.tensor(tokens, device=device))[:, -1]
    return out


def stream_text(tokens: Iterable[int], write: Callable[[str], object]) -> None:
    """Write byte tokens as text, holding bytes back until they complete a UTF-8 character.

    Invalid sequences (and a dangling partial character at the end) become U+FFFD; ids that
    are not bytes (>= 256, possible when the vocabulary is larger) are written as U+FFFD too.
    """
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in tokens:
        text = utf8.decode(bytes([t])) if t < BYTE_VOCAB else utf8.decode(b"", final=True) + "\ufffd"
        if text:
            write(text)
    text = utf8.decode(b"", final=True)
    if text:
        write(text)
