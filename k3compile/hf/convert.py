"""`k3compile import-hf`: a Hugging Face Kimi Linear folder -> spec.yaml, a build, and a weights folder.

    OUT/spec.yaml                  the spec equivalent to config.json (plus any --set overrides)
    OUT/build/<name>/              that spec, built (Model and/or InferenceModel)
    OUT/weights.safetensors        the checkpoint's tensors under the build's names and layouts
                                   (weights-0000i-of-0000N.safetensors + weights.safetensors.index.json past a shard)

Everything is checked before anything is written: the config (every field mapped or known), the
shard files, every tensor's name, shape and dtype (headers only). Conversion then streams: tensors are
read one at a time from the shards (the routed experts of a layer stacked into one tensor), a shard
is closed once its last tensor is converted, and the output is written a shard at a time, so the
memory held is about one output shard plus one tensor. For an inference build whose policy
stores weights in MX formats, each such weight is packed as it is converted. The folder appears only
when complete (written as a hidden sibling, then renamed).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import Tensor

from k3compile import safe_io
from k3compile.hf.config import TOKEN_IDS, HFError, spec_fields, storage_dtype
from k3compile.hf.io import hub_root, read_config, staged
from k3compile.hf.layout import DENSE_PREFIX, MOE_PREFIX, Pair, tensor_pairs
from k3compile.runtime.checkpoint import mismatches
from k3compile.runtime.shards import WEIGHTS, ShardReader, ShardWriter, dtype_name, weights_header
from k3compile.spec.schema import NAME_RE, Spec
from k3compile.spec.weights import keeps_fp32

SOURCE_STEM = "model"  # Hugging Face's model.safetensors[.index.json]
HF_TOKEN_IDS = "hf_token_ids"  # weights metadata: the source config's bos/eos/pad token ids
MODES = ("train", "infer", "both")


@dataclass
class HFImport:
    """What an import wrote: the folder, its spec, the build and the weight files (none with spec_only)."""

    out: Path
    spec: Spec
    build: Path | None
    weights: list[Path]
    tensors: int

    def model(self, inference: bool = False):
        """The build's Model (or InferenceModel) on the CPU, in eval mode, holding the imported weights."""
        from k3compile.runtime.generate import load_build, load_inference_model, read_training_state

        if inference:
            return load_inference_model(self.build, self.out, "cpu")
        model = load_build(self.build).Model(device="meta")
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        state = read_training_state(self.out, shapes, model.spec)
        model = model.to_empty(device="cpu")
        model.load_state_dict(state, strict=True)
        return model.eval()


def default_name(hf_dir: Path) -> str:
    """A spec name from the folder's name: 'Kimi-Linear-48B-A3B-Instruct' -> 'kimi-linear-48b-a3b-instruct'."""
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(os.path.abspath(hf_dir)).name.lower()).lstrip("._-")[:64]
    return name or "kimi-linear"


def ffn_prefixes(reader: ShardReader, spec: Spec):
    """Each layer's FFN module name as the checkpoint has it (`mlp` or `block_sparse_moe`; see layout)."""
    seen: dict[int, set[str]] = {}
    for n in reader.names:
        parts = n.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] in (DENSE_PREFIX, MOE_PREFIX):
            seen.setdefault(int(parts[2]), set()).add(parts[3])

    def prefix(i: int) -> str:
        found = seen.get(i, set())
        if len(found) == 1:
            return next(iter(found))
        return MOE_PREFIX if spec.is_moe_layer(i) else DENSE_PREFIX  # both or neither: the published name

    return prefix


def check_tensors(reader: ShardReader, pairs: list[Pair], dtype: str) -> None:
    """Names and shapes must be exactly the pairs'; dtypes the config's or float32 (what transformers keeps fp32)."""
    expected = {h: p.hf_shape for p in pairs for h in p.hf}
    problem = mismatches(expected, reader.shape)
    if problem:
        raise HFError(f"{reader.directory} does not match its config.json: {problem}")
    allowed = {dtype_name(getattr(torch, dtype)), dtype_name(torch.float32)}
    bad = next((n for n in expected if reader.dtype[n] not in allowed), None)
    if bad is not None:
        raise HFError(
            f"{reader.directory}: {bad} has dtype {reader.dtype[bad]}; a {dtype} checkpoint holds "
            f"{' or '.join(sorted(allowed))} tensors"
        )


def _assemble(reader: ShardReader, pair: Pair) -> Tensor:
    if len(pair.hf) == 1:
        return reader.get(pair.hf[0]).reshape(pair.shape)
    first = reader.get(pair.hf[0])
    out = torch.empty(pair.shape, dtype=first.dtype)
    out[0] = first
    for j, name in enumerate(pair.hf[1:], 1):
        out[j] = reader.get(name)
    return out


def _targets(model, pairs: list[Pair]) -> dict[str, tuple[int, ...]]:
    """The names and shapes conversion produces for `model` (packed weights as their data and scale)."""
    state = model.state_dict()
    out = {}
    for p in pairs:
        pack = model.PACKED.get(p.name)
        names = (pack["data"], pack["scale"]) if pack else (p.name,)
        out.update({n: tuple(state[n].shape) if n in state else p.shape for n in names})
    return out


def convert(reader: ShardReader, pairs: list[Pair], spec: Spec, model, writer: ShardWriter) -> int:
    """Stream every pair into `writer` (MX-packing what the model packs); returns the tensors written."""
    from k3compile.kernels.mx.op import mx_quantize

    state = model.state_dict()  # meta: names and dtypes only
    uses = Counter(reader.shard[h] for p in pairs for h in p.hf)
    written = 0
    for p in sorted(pairs, key=lambda p: (min(reader.shard[h] for h in p.hf), p.name)):
        t = _assemble(reader, p)
        if keeps_fp32(spec, p.name):
            t = t.float()
        pack = model.PACKED.get(p.name)
        if pack:
            data, scale = mx_quantize(t.float(), pack["fmt"], pack["block"])
            writer.add(pack["data"], data.view(state[pack["data"]].dtype))
            writer.add(pack["scale"], scale.view(state[pack["scale"]].dtype))
            written += 2
        else:
            writer.add(p.name, t)
            written += 1
        del t
        uses.subtract(reader.shard[h] for h in p.hf)
        reader.release(f for f in {reader.shard[h] for h in p.hf} if uses[f] == 0)
    return written


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "tiktoken.model", "vocab.json", "merges.txt", "chat_template.jinja")  # fmt: skip
MAX_TOKENIZER_BYTES = 256 << 20  # one tokenizer file is read whole, at most this


def copy_tokenizer(hf_dir: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files `hf_dir` holds (regular files inside its hub root, bounded reads) into `dest`;
    their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if not (hf_dir / name).exists():
            continue
        try:
            path = safe_io.confined(hf_dir, name, source=str(hf_dir), root=hub_root(hf_dir))
            data = safe_io.read_bytes(path, MAX_TOKENIZER_BYTES, what="a tokenizer file")
        except safe_io.FileError as e:
            raise HFError(str(e)) from None
        safe_io.write_atomic(dest / name, data)
        copied.append(name)
    return copied


def import_hf(
    hf_dir: str | Path,
    out: str | Path | None = None,
    *,
    name: str | None = None,
    mode: str = "both",
    overrides: list[str] | tuple[str, ...] = (),
    max_shard_bytes: int | None = None,
    spec_only: bool = False,
) -> HFImport:
    """Import `hf_dir` into `out` (default imports/<name>); see the module docstring. Bad input: HFError/SpecError.

    `spec_only` writes OUT/spec.yaml alone, from config.json alone (no shards needed).
    """
    from k3compile.build import BuildOptions, build
    from k3compile.spec.digest import spec_json
    from k3compile.loader import load
    from k3compile.runtime.shards import DEFAULT_SHARD_BYTES
    from k3compile.spec.load import load_spec

    hf_dir = Path(hf_dir)
    if mode not in MODES:
        raise HFError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    name = name or default_name(hf_dir)
    if not re.fullmatch(NAME_RE, name):
        raise HFError(f"{name!r} is not a valid spec name (letters, digits, '.', '_', '-'; at most 64)")
    config = read_config(hf_dir)
    fields = spec_fields(config, name)
    dtype = storage_dtype(config)
    reader = None if spec_only else ShardReader(hf_dir, SOURCE_STEM, root=hub_root(hf_dir))
    out = Path(out) if out is not None else Path("imports") / name
    with staged(out) as tmp:
        spec_path = tmp / "spec.yaml"
        safe_io.write_text(spec_path, yaml.safe_dump(fields, sort_keys=False))
        spec = load_spec(spec_path, list(overrides))
        note = f" with --set {' --set '.join(overrides)}" if overrides else ""
        safe_io.write_text(spec_path, f"# k3compile import-hf of {hf_dir.resolve() / 'config.json'}{note}\n"
                           + yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False))
        if reader is None:
            return HFImport(out, spec, None, [], 0)
        pairs, orphans = tensor_pairs(spec, ffn_prefixes(reader, spec))
        if orphans:
            raise HFError(f"the spec has tensors Kimi Linear checkpoints lack: {', '.join(orphans[:4])}")
        check_tensors(reader, pairs, dtype)
        dest, _ = build(spec, tmp / "build", BuildOptions(mode=mode))
        package = load(dest)
        model_class = "InferenceModel" if mode == "infer" else "Model"
        model = getattr(package, model_class)(device="meta")
        targets = _targets(model, pairs)
        problem = mismatches({k: tuple(v.shape) for k, v in model.state_dict().items()}, targets)
        if problem:
            raise HFError(f"the build's {model_class} does not take the converted tensors: {problem}")
        tokens = {k: config.get(k) for k in TOKEN_IDS}  # carried to export-hf: the spec has no token ids
        header = weights_header(spec_json(spec), spec.name, model_class, {HF_TOKEN_IDS: json.dumps(tokens)})
        writer = ShardWriter(tmp, WEIGHTS, max_shard_bytes or DEFAULT_SHARD_BYTES, header, header)
        try:
            count = convert(reader, pairs, spec, model, writer)
        finally:
            reader.close()
        files = [out / p.name for p in writer.close()]
        copy_tokenizer(hf_dir, tmp)
    return HFImport(out, spec, out / "build" / dest.name, files, count)
