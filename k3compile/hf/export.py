"""`k3compile export-hf`: a build and its weights -> a folder transformers' KimiLinearForCausalLM loads.

    HF_DIR/config.json                                    the spec as a Kimi Linear config (published names)
    HF_DIR/model.safetensors                              the weights in the published layout, or shards
    HF_DIR/model-0000i-of-0000N.safetensors + model.safetensors.index.json

The weights come from a training checkpoint or a weights folder (`k3compile import-hf` output; its
source's token ids are carried over), checked against the build like `k3compile generate` does.
Tensors keep their dtype; config.json's `dtype` is that of every tensor the precision policy does not
keep in fp32 (they must agree). The checkpoint is read whole, then written a shard at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from k3compile import safe_io
from k3compile.hf.config import TOKEN_IDS, TORCH_DTYPES, HFError, check_exportable, hf_config, is_token_id
from k3compile.hf.convert import HF_TOKEN_IDS, SOURCE_STEM
from k3compile.hf.io import check_out, staged
from k3compile.hf.layout import Pair, published_prefix, tensor_pairs
from k3compile.runtime.shards import DEFAULT_SHARD_BYTES, WEIGHTS, ShardReader, ShardWriter, holds
from k3compile.spec.schema import Spec
from k3compile.spec.weights import keeps_fp32


def _pieces(pair: Pair, t: Tensor):
    """The checkpoint tensors of one k3compile tensor: reshaped, or one per expert."""
    if len(pair.hf) == 1:
        yield pair.hf[0], t.reshape(pair.hf_shape)
        return
    for j, name in enumerate(pair.hf):
        yield name, t[j].clone()


def storage_dtype(spec: Spec, state: dict[str, Tensor]) -> str:
    """The one dtype of the tensors outside `quantization.keep_fp32`, as config.json names it."""
    found = {str(t.dtype).removeprefix("torch.") for n, t in state.items() if not keeps_fp32(spec, n)}
    if len(found) != 1 or not found <= set(TORCH_DTYPES):
        raise HFError(f"the weights mix dtypes {sorted(found)}; Kimi Linear checkpoints hold one of {sorted(TORCH_DTYPES)}")
    return found.pop()


def _token_ids(checkpoint: Path) -> dict:
    """The source config's token ids a weights folder carries (import-hf's), checked: an object of ids."""
    if not holds(checkpoint, WEIGHTS):
        return {}
    text = ShardReader(checkpoint, WEIGHTS).metadata.get(HF_TOKEN_IDS, "{}")
    try:
        ids = safe_io.parse_json(text, f"{checkpoint}: {HF_TOKEN_IDS}") if isinstance(text, str) else None
    except safe_io.FileError as e:
        raise HFError(str(e)) from None
    if not isinstance(ids, dict) or set(ids) - set(TOKEN_IDS) or not all(map(is_token_id, ids.values())):
        raise HFError(f"{checkpoint}: its {HF_TOKEN_IDS} metadata is not an object of {', '.join(TOKEN_IDS)}")
    return ids


def export_hf(build: str | Path, checkpoint: str | Path, out: str | Path, max_shard_bytes: int | None = None) -> list[Path]:
    """Write `out` (absent or empty) from `build` and `checkpoint`; returns the files written."""
    from k3compile.runtime.generate import build_spec, load_build, read_training_state

    module = load_build(build)
    spec = build_spec(module)
    check_exportable(spec)
    if not hasattr(module, "Model"):
        raise HFError(f"{build} has no training Model (built with --mode infer); export from a train or both build")
    out = Path(out)
    check_out(out)
    model = module.Model(device="meta")
    state = read_training_state(checkpoint, {k: tuple(v.shape) for k, v in model.state_dict().items()}, spec)
    pairs, orphans = tensor_pairs(spec, published_prefix(spec))
    if orphans:
        raise HFError(f"the build has tensors Kimi Linear lacks: {', '.join(orphans[:4])}")
    config = hf_config(spec, storage_dtype(spec, state), _token_ids(Path(checkpoint)))
    with staged(out) as tmp:
        safe_io.write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        writer = ShardWriter(tmp, SOURCE_STEM, max_shard_bytes or DEFAULT_SHARD_BYTES, {"format": "pt"})
        with torch.no_grad():
            for pair in pairs:
                for name, piece in _pieces(pair, state[pair.name]):
                    writer.add(name, piece)
        files = [out / p.name for p in writer.close()]
    return [out / "config.json", *files]
