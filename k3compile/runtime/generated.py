"""Base classes of emitted models: parameters from the generated tables, seeded init, the loss.

Emitted `model.py` files subclass these with their tables and a `graph` method
(the bound fx graph as Python); everything shared lives here, once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.modules.init import initial_value
from k3compile.ops import expert_parallel
from k3compile.modules.model import empty_caches
from k3compile.spec.schema import Spec
from k3compile.spec.weights import keeps_fp32

IGNORE_INDEX = -100


def local_expert_rows(spec: Spec) -> tuple[int, int] | None:
    """[start, stop) of the routed experts this process holds under its expert-parallel group, or None (all)."""
    g = expert_parallel.size()
    if spec.moe is None or spec.parallel.ep == 1 or g == 1:
        return None
    if g != spec.parallel.ep:
        raise ValueError(f"the expert-parallel group has {g} ranks but the build's parallel.ep is {spec.parallel.ep}")
    per = spec.moe.num_experts // g
    return expert_parallel.rank() * per, (expert_parallel.rank() + 1) * per


def check_tokens(spec: Spec, tokens: Tensor, what: str = "tokens", ignore: int | None = None) -> None:
    """One ValueError line for input an emitted model cannot take: not an integer tensor [batch, time], no
    sequence or no position, more positions than context_length, ids outside [0, vocab_size) (`ignore` allowed
    too). The ids are read on the host only, and not while torch.compile traces (either would wait or break)."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise ValueError(f"{what} must be a tensor [batch, time], got {getattr(tokens, 'shape', type(tokens).__name__)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{what} must hold integer token ids, got {tokens.dtype}")
    if 0 in tokens.shape:
        raise ValueError(f"{what} of shape {list(tokens.shape)} holds no sequence or no position")
    if tokens.shape[1] > spec.context_length:
        raise ValueError(f"{what} has {tokens.shape[1]} positions, more than context_length {spec.context_length}")
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = tokens.aminmax()
        if (low < 0 and (ignore is None or bool(((tokens < 0) & (tokens != ignore)).any()))) or high >= spec.vocab_size:
            raise ValueError(f"{what} ids must be in [0, {spec.vocab_size}), got {int(low)}..{int(high)}")


def _put(root: nn.Module, name: str, tensor: Tensor, parameter: bool, persistent: bool = True) -> None:
    *parents, leaf = name.split(".")
    module = root
    for k, part in enumerate(parents):
        if not hasattr(module, part):  # `layers` holds numbered children: a ModuleList, so layers[3] works
            numbered = k + 1 < len(parents) and parents[k + 1].isdigit()
            module.add_module(part, nn.ModuleList() if numbered else nn.Module())
        module = getattr(module, part)
    if parameter:
        module.register_parameter(leaf, nn.Parameter(tensor))
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def layer_table(kinds: tuple, layers: tuple, top: tuple = (), tail: tuple = (), names: int = 1) -> tuple:
    """A table the emitter wrote once per sublayer kind: the rows of `top`, then per layer i the rows of each
    of its kinds (their first `names` fields prefixed with "layers.<i>."), then `tail`."""
    rows = list(top)
    for i, parts in enumerate(layers):
        for kind in parts:
            rows += [tuple(f"layers.{i}.{v}" if j < names else v for j, v in enumerate(row)) for row in kinds[kind]]
    return tuple(rows) + tuple(tail)


def layer_steps(rows: tuple, caches: tuple) -> tuple:
    """The emitted loop's steps: each row (layer i, sublayer kind, ...) gains the names of the caches its kind
    reads and writes (`caches[kind]`, each as "<cache>.<i>"), made once here rather than at every step."""
    return tuple((*row, tuple(f"{c}.{row[0]}" for c in caches[row[1]])) for row in rows)


def packed_table(rows: tuple) -> dict:
    """PACKED from (weight, data buffer, scale buffer, element format, block, weight shape) rows."""
    return {w: {"data": d, "scale": s, "fmt": f, "block": b, "shape": list(shape)} for w, d, s, f, b, shape in rows}


class GeneratedModule(nn.Module):
    """Creates the tables' tensors on `device`; off the meta device, initialises them from the spec.

    Parameters take `dtype`, except those the spec's `quantization.keep_fp32` names, which stay fp32 here and
    under later casts to a narrower float (`.to(torch.bfloat16)`, `.half()`).
    """

    SPEC_JSON: str
    PARAMETERS: tuple = ()
    BUFFERS: tuple = ()
    PACKED: dict = {}
    MERGED: tuple = ()  # (stacked buffer, member weight) rows of merge_projections: members are views of its rows
    DEFAULT_DEVICE: str = "cpu"

    EXPERT_PARALLEL: bool = False  # holds only this rank's experts under an expert-parallel group

    def __init__(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        ambient = torch.get_default_device()  # `with torch.device("meta"):` (or cuda) wins over the build's default
        device = torch.device(device or (ambient if ambient.type != "cpu" else self.DEFAULT_DEVICE))
        self.spec = Spec.model_validate_json(self.SPEC_JSON)
        self.expert_rows = local_expert_rows(self.spec) if self.EXPERT_PARALLEL else None
        self.expert_shards: set[str] = set()  # parameters (and packed buffers) holding rows expert_rows of the experts
        for name, shape, _ in self.PARAMETERS:
            dt = torch.float32 if keeps_fp32(self.spec, name) else dtype
            shape = self._local_shape(name, tuple(shape))
            _put(self, name, torch.empty(shape, dtype=dt, device=device), True)
        for name, shape, dt, persistent in self.BUFFERS:  # packed (MX) expert stacks are split like parameters
            shape = self._local_shape(name, tuple(shape))
            _put(self, name, torch.zeros(shape, dtype=getattr(torch, dt), device=device), False, persistent)
        self._tie_merged()
        if self.MERGED:  # load_state_dict(assign=True) gives weights their own tensors: stack them again
            self.register_load_state_dict_post_hook(lambda module, _: module._tie_merged())
        if device.type != "meta":
            self.reset_parameters()

    def _tie_merged(self) -> None:
        """Stack each MERGED group's weights by rows, hold the stack's transpose as its buffer (not saved) and make
        the weights views of its rows, so the decode graph's one matmul and the prefill graph's per-weight
        matmuls read the same memory."""
        self.__dict__.pop("_decode_graphs", None)  # captured decode steps read the old tensors: capture again
        groups: dict[str, list[str]] = {}
        for stacked, member in self.MERGED:
            groups.setdefault(stacked, []).append(member)
        for stacked, members in groups.items():
            params = [self.get_parameter(m) for m in members]
            rows = torch.cat([p.detach() for p in params])
            owner, _, leaf = stacked.rpartition(".")
            self.get_submodule(owner).register_buffer(leaf, rows.t(), persistent=False)  # held as [in, out]
            start = 0
            for p in params:
                p.data = rows[start : start + p.shape[0]]
                start += p.shape[0]

    def is_expert_shard(self, name: str, shape: tuple) -> bool:
        """Whether tensor `name` (of full shape `shape`) is a stacked routed-expert weight split over EP ranks."""
        return self.expert_rows is not None and ".experts." in name and shape[0] == self.spec.moe.num_experts

    def _local_shape(self, name: str, shape: tuple) -> tuple:
        if not self.is_expert_shard(name, shape):
            return shape
        self.expert_shards.add(name)
        start, stop = self.expert_rows
        return (stop - start, *shape[1:])

    def full_shape(self, name: str, local: tuple) -> tuple:
        """The shape tensor `name` has in the whole model (its local shape but for expert shards)."""
        return (self.spec.moe.num_experts, *local[1:]) if name in self.expert_shards else local

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Seeded, documented init (k3compile.modules.init), drawn on the parameters' device; every buffer back to
        zero (the routing statistics and the selection bias start there), packed MX buffers quantise their
        weight's init."""
        for name, p in self.named_parameters():
            full = self.full_shape(name, tuple(p.shape))
            value = initial_value(name, full, self.spec, p.device)
            p.copy_(self.local_rows(name, value))
        stacked = {name for name, _ in self.MERGED}
        for name, b in self.named_buffers():
            if name not in stacked:  # a stacked buffer holds the weights just set
                b.zero_()
        buffers = dict(self.named_buffers())
        for weight, pack in self.PACKED.items():
            from k3compile.kernels.mx.op import mx_quantize

            value = initial_value(weight, tuple(pack["shape"]), self.spec, buffers[pack["data"]].device)
            data, scale = mx_quantize(value, pack["fmt"], pack["block"])
            buffers[pack["data"]].copy_(self.local_rows(pack["data"], data.view(buffers[pack["data"]].dtype)))
            buffers[pack["scale"]].copy_(self.local_rows(pack["scale"], scale))

    def local_rows(self, name: str, full: Tensor) -> Tensor:
        """This rank's part of tensor `name` given whole: its expert rows for an expert shard, else all of it."""
        return full[slice(*self.expert_rows)] if name in self.expert_shards else full

    def _apply(self, fn, recurse=True):
        kept = {n: t.detach() for n, t in self.state_dict(keep_vars=True).items()
                if t.dtype == torch.float32 and keeps_fp32(self.spec, n)}  # fmt: skip
        out = super()._apply(fn, recurse)
        for name, old in kept.items():  # follow the device move, keep the fp32 values
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner)
            new = getattr(module, leaf)
            if new.is_floating_point() and torch.finfo(new.dtype).bits < 32:
                if leaf in module._parameters:
                    new.data = old.to(new.device)
                else:
                    module._buffers[leaf] = old.to(new.device)
        self._tie_merged()  # the move gave each weight its own tensor: stack them again
        return out

    def graph(self, tokens: Tensor) -> Tensor:  # replaced by the generated method
        raise NotImplementedError


class TrainingModule(GeneratedModule):
    EXPERT_PARALLEL = True  # the train graph exchanges expert buffers (shard_experts) when parallel.ep > 1

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits [B, T, V]; with labels (aligned with tokens, shifted here), the mean next-token loss."""
        check_tokens(self.spec, tokens)
        if labels is not None:
            check_tokens(self.spec, labels, "labels", IGNORE_INDEX)
            if labels.shape != tokens.shape or tokens.shape[1] < 2:
                raise ValueError(f"labels {list(labels.shape)} must be shaped like tokens {list(tokens.shape)}, with at "
                                 "least 2 positions (the loss predicts each next one)")
        logits = self.graph(tokens)
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
        )


@dataclass
class DecodeCache:
    """Serving state of a batch: the graphs' cache tensors, and per sequence the tokens it holds.

    `positions` [B] (int64, on the model's device) is what the decode graph reads; `lengths` is the same
    count on the host, so checking the room left never waits for the device.
    """

    tensors: dict[str, Tensor]
    positions: Tensor
    lengths: list[int]
    max_len: int

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split into KDA state (recurrent + conv tails) and MLA latent cache."""
        kda = sum(t.numel() * t.element_size() for n, t in self.tensors.items() if n.startswith("kda_"))
        mla = sum(t.numel() * t.element_size() for n, t in self.tensors.items() if n.startswith("mla_"))
        return {"kda_state": kda, "mla_latent": mla, "total": kda + mla}


class InferenceModule(GeneratedModule):
    """Serving through the compiled prefill and decode graphs, over the packed (MX) weights.

    prefill(tokens) fills fresh caches preallocated to `max_len` tokens; decode(tokens, cache) takes one
    token per sequence at each sequence's own position. Several prompts of different lengths are
    prefilled one by one into the rows of one batch (`prefill_batch`) and then decode together. They run
    under torch.inference_mode (a decode step of k3-tiny costs a fifth less than under no_grad), so
    their logits and caches are inference tensors: read them anywhere, change them only through these.
    """

    EXPERT_PARALLEL = True  # the inference graphs exchange expert buffers too (shard_experts) when parallel.ep > 1

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits [B, T, V] of a full forward (the prefill graph from empty caches), without gradients.

        torch.compile(fullgraph=True) and torch.export take it as it is: the token ids are checked on the host
        in eager mode only (check_tokens), and the caches are made in the graph."""
        check_tokens(self.spec, tokens)
        with torch.no_grad():
            caches = empty_caches(self.spec, tokens.shape[0], tokens.shape[1], self.embed.weight.device,
                                  self._activation_dtype())
            return self.prefill_graph(tokens, caches)[0]

    @torch.inference_mode()
    def new_cache(self, batch: int, max_len: int | None = None) -> DecodeCache:
        """Empty caches for `batch` sequences of up to `max_len` tokens (default: the spec's context)."""
        max_len = self.spec.context_length if max_len is None else max_len
        if not 0 < max_len <= self.spec.context_length:
            raise ValueError(f"max_len must be in [1, {self.spec.context_length}] (context_length), got {max_len}")
        device = next(iter(self.state_dict().values())).device
        tensors = empty_caches(self.spec, batch, max_len, device, self._activation_dtype())
        positions = torch.zeros(batch, dtype=torch.int64, device=device)
        return DecodeCache(tensors, positions, [0] * batch, max_len)

    @torch.inference_mode()
    def prefill(self, tokens: Tensor, max_len: int | None = None) -> tuple[Tensor, DecodeCache]:
        """Logits [B, T, V] of equal-length prompts and the caches to continue from."""
        check_tokens(self.spec, tokens)
        cache = self.new_cache(tokens.shape[0], max_len)
        if tokens.shape[1] > cache.max_len:
            raise ValueError(f"{tokens.shape[1]} prompt tokens do not fit max_len {cache.max_len}")
        logits, tensors = self.prefill_graph(tokens, cache.tensors)
        cache.tensors.update(tensors)
        cache.positions.fill_(tokens.shape[1])
        cache.lengths = [tokens.shape[1]] * tokens.shape[0]
        return logits, cache

    @torch.inference_mode()
    def prefill_batch(self, prompts: list[Tensor], max_len: int | None = None) -> tuple[Tensor, DecodeCache]:
        """Prompts of any lengths, each prefilled on its own into its row: (last logits [B, V], cache)."""
        cache = self.new_cache(len(prompts), max_len)
        last = []
        for b, prompt in enumerate(prompts):
            logits, one = self.prefill(prompt.view(1, -1), cache.max_len)
            for name, t in one.tensors.items():
                cache.tensors[name][b] = t[0]
            cache.positions[b] = prompt.numel()
            cache.lengths[b] = prompt.numel()
            last.append(logits[0, -1])
        return torch.stack(last), cache

    @torch.inference_mode()
    def decode(self, tokens: Tensor, cache: DecodeCache) -> tuple[Tensor, DecodeCache]:
        """Logits [B, 1, V] of one new token per sequence (tokens [B] or [B, 1]); the cache moves on by one."""
        tokens = tokens.view(-1, 1)
        check_tokens(self.spec, tokens)
        if tokens.shape[0] != len(cache.lengths):
            raise ValueError(f"{tokens.shape[0]} tokens for a cache of {len(cache.lengths)} sequences")
        if max(cache.lengths) >= cache.max_len:
            raise ValueError(f"the cache is full ({cache.max_len} tokens): prefill with a larger max_len")
        logits, tensors = self.decode_graph(tokens, cache.positions, cache.tensors)
        cache.tensors.update(tensors)
        cache.positions += 1
        cache.lengths = [n + 1 for n in cache.lengths]
        return logits, cache

    def decode_graph_runner(self, batch: int, max_len: int, capture: bool | None = None):
        """The decode step for `batch` sequences with caches of `max_len` tokens as a CUDA graph (on CUDA; eager over
        the same static buffers elsewhere): a `k3compile.runtime.decode_graph.DecodeGraph` for the batch's bucket,
        captured once and kept (one per bucket and max_len). `load(cache)` it with a prefilled cache, then
        `decode(tokens)` replays one step."""
        from k3compile.runtime.decode_graph import DecodeGraph, bucket

        graphs = self.__dict__.setdefault("_decode_graphs", {})
        key = (bucket(batch), max_len, capture)
        if key not in graphs:
            graphs[key] = DecodeGraph(self, key[0], max_len, capture)
        return graphs[key]

    @torch.no_grad()
    def dense_state_dict(self) -> dict[str, Tensor]:
        """The training Model's state_dict this model serves: packed weights dequantised (fp32), the rest as is."""
        from k3compile.kernels.mx.op import mx_dequantize

        state = self.state_dict()
        packed = {p[k] for p in self.PACKED.values() for k in ("data", "scale")}
        out = {k: v for k, v in state.items() if k not in packed}
        for weight, p in self.PACKED.items():
            out[weight] = mx_dequantize(state[p["data"]], state[p["scale"]], p["fmt"], p["block"], torch.float32)
        return out

    @classmethod
    def from_training(cls, model: nn.Module, device: torch.device | str | None = None) -> InferenceModule:
        """This build's InferenceModel (eval mode) serving a trained Model's weights, packed as the build says;
        `device` defaults to the Model's. The Model must hold all its experts (not an expert-parallel rank)."""
        served = cls(device=device or next(model.parameters()).device)
        served.load_training_state_dict(model.state_dict())
        return served.eval()

    def load_training_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load a training Model's (whole) state_dict: `load_state_dict` alone would miss every packed buffer."""
        self.load_state_dict(self.packed_training_state(state), strict=True)

    @torch.no_grad()
    def packed_training_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """This model's state_dict from a whole training one: each PACKED weight MX-quantised into its data and
        scale buffers, the rest by name; an expert-parallel rank keeps its experts' rows."""
        from k3compile.kernels.mx.op import mx_quantize

        targets = self.state_dict()
        packed = {b for p in self.PACKED.values() for b in (p["data"], p["scale"])}
        missing = sorted(n for n in [*self.PACKED, *(n for n in targets if n not in packed)] if n not in state)
        if missing:
            raise KeyError(f"the training state lacks {len(missing)} tensors of this build, e.g. {missing[0]!r}")
        out = {}
        for weight, pack in self.PACKED.items():
            data, scale = mx_quantize(state[weight].float(), pack["fmt"], pack["block"])
            out[pack["data"]] = data.view(targets[pack["data"]].dtype)
            out[pack["scale"]] = scale.view(targets[pack["scale"]].dtype)
        for name in targets:
            if name not in out:
                out[name] = state[name]
        return {name: self.local_rows(name, t) for name, t in out.items()}

    def _activation_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def prefill_graph(self, tokens: Tensor, caches: dict) -> tuple[Tensor, dict]:  # replaced by the generated method
        raise NotImplementedError

    def decode_graph(self, tokens: Tensor, positions: Tensor, caches: dict) -> tuple[Tensor, dict]:  # generated
        raise NotImplementedError
