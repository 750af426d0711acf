"""Base classes of emitted models: parameters from the generated tables, seeded init, the loss.

Emitted `model.py` files subclass these with their tables and a `graph` method
(the bound fx graph as Python); everything shared lives here, once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3compile.ir.init import initial_value
from k3compile.runtime.decoder import DecodeCache, Decoder
from k3compile.spec.schema import Spec
from k3compile.spec.weights import keeps_fp32

IGNORE_INDEX = -100


def _put(root: nn.Module, name: str, tensor: Tensor, parameter: bool, persistent: bool = True) -> None:
    *parents, leaf = name.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if parameter:
        module.register_parameter(leaf, nn.Parameter(tensor))
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


class GeneratedModule(nn.Module):
    """Creates the tables' tensors on `device`; off the meta device, initialises them from the spec.

    Parameters take `dtype`, except those the spec's `quantization.keep_fp32` names, which stay fp32 here and
    under later casts to a narrower float (`.to(torch.bfloat16)`, `.half()`).
    """

    SPEC_JSON: str
    PARAMETERS: tuple = ()
    BUFFERS: tuple = ()
    PACKED: dict = {}
    DEFAULT_DEVICE: str = "cpu"

    def __init__(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        device = torch.device(device or self.DEFAULT_DEVICE)
        self.spec = Spec.model_validate_json(self.SPEC_JSON)
        for name, shape, _ in self.PARAMETERS:
            dt = torch.float32 if keeps_fp32(self.spec, name) else dtype
            _put(self, name, torch.empty(shape, dtype=dt, device=device), True)
        for name, shape, dt, persistent in self.BUFFERS:
            _put(self, name, torch.zeros(shape, dtype=getattr(torch, dt), device=device), False, persistent)
        self._decoder = None
        if device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Seeded, documented init (k3compile.ir.init); packed MX buffers quantise their weight's init."""
        self._decoder = None  # an InferenceModule's decoder holds copies of the old weights
        for name, p in self.named_parameters():
            p.copy_(initial_value(name, tuple(p.shape), self.spec))
        buffers = dict(self.named_buffers())
        for weight, pack in self.PACKED.items():
            from k3compile.ops.mx import mx_quantize

            data, scale = mx_quantize(initial_value(weight, tuple(pack["shape"]), self.spec), pack["fmt"], pack["block"])
            buffers[pack["data"]].copy_(data.view(buffers[pack["data"]].dtype))
            buffers[pack["scale"]].copy_(scale)

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
        return out

    def graph(self, tokens: Tensor) -> Tensor:  # replaced by the generated method
        raise NotImplementedError


class TrainingModule(GeneratedModule):
    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits [B, T, V]; with labels (aligned with tokens, shifted here), the mean next-token loss."""
        logits = self.graph(tokens)
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX
        )


class InferenceModule(GeneratedModule):
    """Full forward through the bound graph (MX-packed weights), and prefill/decode with caches.

    Prefill and decode run the eager Decoder over copies of the same weights (packed ones
    dequantised once); it is rebuilt whenever this module's state_dict is loaded or it is moved.
    It is deliberately not a submodule: state_dict and parameters() hold only the model's own.
    """

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits [B, T, V] of a full forward."""
        return self.graph(tokens)

    def prefill(self, tokens: Tensor) -> tuple[Tensor, DecodeCache]:
        """Logits [B, T, V] of the prompt and the cache to continue from (KDA chunked)."""
        return self.decoder(tokens)

    def decode(self, tokens: Tensor, cache: DecodeCache) -> tuple[Tensor, DecodeCache]:
        """Logits of the next tokens [B, T] (usually T = 1) given the cache; returns the new cache."""
        return self.decoder(tokens, cache)

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            object.__setattr__(self, "_decoder", self._build_decoder())  # bypass submodule registration
        return self._decoder

    def _build_decoder(self) -> Decoder:
        from k3compile.ops.mx import mx_dequantize

        device = next(iter(self.state_dict().values())).device
        with torch.device(device):
            decoder = Decoder(self.spec)
        state = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        packed_buffers = {p[k] for p in self.PACKED.values() for k in ("data", "scale")}
        state.update({k: v for k, v in self.state_dict().items() if k in buffers and k not in packed_buffers})
        for weight, pack in self.PACKED.items():
            data = buffers[pack["data"]]
            state[weight] = mx_dequantize(data, buffers[pack["scale"]], pack["fmt"], pack["block"], torch.float32)
        decoder.load_state_dict({k: v.detach() for k, v in state.items()}, strict=True)
        return decoder.eval()

    def _load_from_state_dict(self, *args, **kwargs):
        self._decoder = None
        return super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        self._decoder = None  # .to() / .cuda() / .double(): rebuild on the new device and dtype
        return super()._apply(fn, recurse)
