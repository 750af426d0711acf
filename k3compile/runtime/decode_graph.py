"""A decode step as one CUDA graph replay: static buffers per batch-size bucket, caches updated in place.

A decode step of an InferenceModel dispatches about 130 k3 ops and as many kernels, each through Python, so on a
GPU the host sets its pace (27 ms a step for k3-tiny on an H200, slower than a CPU). A CUDA graph records the
step's kernels once and replays them with one call. A replay needs every input at a fixed address and a step that
never reads a value on the host or sizes a tensor by one: `DecodeGraph` holds the token, position and cache
tensors of one batch size (a bucket: 1, 2, 4, ... sequences; fewer sequences ride in the first rows) and the
max length, allocated once; the step copies the caches the decode graph returns back into them (the MLA cache is
written in place by the graph itself) and advances the positions, all inside the graph. Off CUDA (`capture=False`)
the same step runs eagerly over the same buffers: what tests on CPU check (tests/runtime/test_decode_graph.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3compile.runtime.generated import DecodeCache

WARMUP_STEPS = 2  # eager steps on a side stream before capture: Triton compiles, cuBLAS and the allocator settle


def bucket(batch: int) -> int:
    """The captured batch size that serves `batch` sequences: the next power of two."""
    if batch < 1:
        raise ValueError(f"a decode batch needs at least one sequence, got {batch}")
    return 1 << (batch - 1).bit_length()


class DecodeGraph:
    """One decode step of `model` for `size` sequences with caches of `max_len` tokens, at fixed addresses.

    `load(cache)` copies a prefilled cache of up to `size` sequences into the static buffers; `decode(tokens)` runs
    one step (a graph replay on CUDA) and returns the logits [n, 1, V] of the loaded sequences, a view of the static
    output: read or copy it before the next step. `cache` is the loaded sequences' DecodeCache (views of the buffers).
    """

    def __init__(self, model, size: int, max_len: int, capture: bool | None = None):
        self.model, self.size = model, size
        static = model.new_cache(size, max_len)
        self.caches, self.positions = static.tensors, static.positions
        self.tokens = torch.zeros(size, 1, dtype=torch.int64, device=self.positions.device)
        self.cache = DecodeCache({}, self.positions[:0], [], max_len)
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture is None:
            capture = self.positions.device.type == "cuda"
        if capture:
            self._capture()
        else:
            self.logits = self._step()  # the output buffer every step writes (a capture fixes it the same way)
            self._reset()

    @torch.inference_mode()
    def _step(self) -> Tensor:
        """The step as captured: the decode graph over the static buffers, its caches written back, positions + 1."""
        logits, written = self.model.decode_graph(self.tokens, self.positions, self.caches)
        for name, t in written.items():
            if t.data_ptr() != self.caches[name].data_ptr():
                self.caches[name].copy_(t)
        self.positions.add_(1)
        return logits

    @torch.inference_mode()
    def _reset(self) -> None:
        for t in (*self.caches.values(), self.positions, self.tokens):
            t.zero_()

    def _capture(self) -> None:
        side = torch.cuda.Stream(device=self.positions.device)
        side.wait_stream(torch.cuda.current_stream(self.positions.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream(self.positions.device).wait_stream(side)
        self._reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.logits = self._step()  # recorded, not run: the buffers keep their (reset) values

    @torch.inference_mode()
    def load(self, cache: DecodeCache) -> None:
        """Take over a prefilled cache (`InferenceModel.prefill`/`prefill_batch`) of at most `size` sequences."""
        n = len(cache.lengths)
        if not 0 < n <= self.size or cache.max_len != self.cache.max_len:
            raise ValueError(f"a cache of {n} sequences x {cache.max_len} tokens does not fit this decode graph "
                             f"({self.size} x {self.cache.max_len})")  # fmt: skip
        self._reset()
        for name, t in cache.tensors.items():
            self.caches[name][:n].copy_(t)
        self.positions[:n].copy_(cache.positions)
        self.cache = DecodeCache({k: v[:n] for k, v in self.caches.items()}, self.positions[:n], list(cache.lengths),
                                 cache.max_len)  # fmt: skip

    @torch.inference_mode()
    def decode(self, tokens: Tensor) -> Tensor:
        """Logits [n, 1, V] of one new token per loaded sequence (tokens [n] or [n, 1], on any device)."""
        n = len(self.cache.lengths)
        if tokens.numel() != n:
            raise ValueError(f"{tokens.numel()} tokens for a cache of {n} sequences")
        if max(self.cache.lengths) >= self.cache.max_len:
            raise ValueError(f"the cache is full ({self.cache.max_len} tokens): prefill with a larger max_len")
        self.tokens[:n].copy_(tokens.view(n, 1), non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits.copy_(self._step())
        self.cache.lengths = [k + 1 for k in self.cache.lengths]
        return self.logits[:n]
