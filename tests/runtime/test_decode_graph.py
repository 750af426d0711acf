"""The decode step a GPU captures as a CUDA graph, checked on CPU under the same static-buffer discipline: no host
read and no value-dependent shape inside the step, every buffer at a fixed address from step to step, the numbers
of the eager decode. On the graph a GPU build serves (built for h200 with its ops left unbound, so they run their
PyTorch references on CPU tensors), its k3 ops watched from outside (k3compile.runtime.syncs)."""

from __future__ import annotations

import pytest
import torch

from k3compile.runtime import syncs
from k3compile.runtime.decode_graph import bucket
from k3compile.runtime.generate import decoder, generate_batch
from k3compile.spec.load import load_spec

from ..conftest import K3_TINY, TOY_K3

MAX_LEN = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load

    spec = load_spec(K3_TINY, list(TOY_K3))
    options = BuildOptions(mode="infer", target="h200", disabled=frozenset({"bind_kernels"}))
    return load(build(spec, tmp_path_factory.mktemp("decode"), options)[0]).InferenceModel().eval()


def _prompts(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(0, 256, (5 + 3 * i,), generator=gen) for i in range(n)]


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 33, 64, 65)] == [1, 2, 4, 4, 8, 64, 64, 128]
    with pytest.raises(ValueError):
        bucket(0)


def _buffers(runner) -> dict[str, int]:
    tensors = {**runner.caches, "positions": runner.positions, "tokens": runner.tokens, "logits": runner.logits}
    return {k: t.data_ptr() for k, t in tensors.items()}


@pytest.mark.parametrize("n", [4, 3])  # a full bucket, and 3 sequences in the first rows of a bucket of 4
def test_the_static_step_reads_nothing_keeps_its_buffers_and_gives_the_eager_numbers(model, n):
    _, cache = model.prefill_batch(_prompts(n), MAX_LEN)
    _, eager_cache = model.prefill_batch(_prompts(n), MAX_LEN)
    runner = model.decode_graph_runner(n, MAX_LEN, capture=False)
    assert runner.size == bucket(n)
    runner.load(cache)
    addresses = _buffers(runner)
    tokens = torch.randint(0, 256, (6, n), generator=torch.Generator().manual_seed(9))
    for t in tokens:
        with syncs.watch() as found:
            logits = runner.decode(t)
        assert [str(r) for r in found] == []
        assert _buffers(runner) == addresses  # every step reads and writes the same memory
        expected, eager_cache = model.decode(t, eager_cache)
        if n == runner.size:
            assert torch.equal(logits, expected)
        else:  # the padded rows change the matmuls' shapes, not the rows' values beyond rounding
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert runner.cache.lengths == eager_cache.lengths
    assert torch.equal(runner.cache.positions, eager_cache.positions)
    for name, t in eager_cache.tensors.items():
        torch.testing.assert_close(runner.cache.tensors[name], t, rtol=1e-5, atol=1e-6)


def test_the_runner_is_made_once_per_bucket_and_refuses_what_does_not_fit(model):
    a = model.decode_graph_runner(3, MAX_LEN, capture=False)
    assert model.decode_graph_runner(4, MAX_LEN, capture=False) is a
    assert model.decode_graph_runner(5, MAX_LEN, capture=False) is not a
    _, cache = model.prefill_batch(_prompts(2), MAX_LEN // 2)
    with pytest.raises(ValueError, match="does not fit this decode graph"):
        a.load(cache)
    _, cache = model.prefill_batch(_prompts(2), MAX_LEN)
    a.load(cache)
    with pytest.raises(ValueError, match="3 tokens for a cache of 2 sequences"):
        a.decode(torch.zeros(3, dtype=torch.long))


def test_the_cache_of_the_static_step_fills_up_like_the_eager_one(model):
    prompt = torch.randint(0, 256, (MAX_LEN - 2,), generator=torch.Generator().manual_seed(3))
    _, cache = model.prefill_batch([prompt], MAX_LEN)
    runner = model.decode_graph_runner(1, MAX_LEN, capture=False)
    runner.load(cache)
    runner.decode(torch.tensor([1]))
    runner.decode(torch.tensor([2]))
    with pytest.raises(ValueError, match="the cache is full"):
        runner.decode(torch.tensor([3]))


def test_generation_on_cpu_keeps_the_eager_decode(model, monkeypatch):
    """`decoder` picks the graph runner only for CUDA caches; greedy batch generation is unchanged on CPU."""
    _, cache = model.prefill_batch(_prompts(2), MAX_LEN)
    step, same = decoder(model, cache)
    assert same is cache
    monkeypatch.setattr(type(model), "decode_graph_runner", lambda *a, **k: pytest.fail("no graph on CPU"))
    out = generate_batch(model, [p.tolist() for p in _prompts(2)], 4, temperature=0.0)
    assert [len(o) for o in out] == [4, 4]


def test_new_weights_drop_the_captured_steps(model):
    """A captured step reads the weights' addresses: loading a state_dict (which re-stacks the merged projections)
    or moving the model makes the next request capture again."""
    a = model.decode_graph_runner(1, MAX_LEN, capture=False)
    model.load_state_dict(model.state_dict())
    b = model.decode_graph_runner(1, MAX_LEN, capture=False)
    assert b is not a
    model.float()
    assert model.decode_graph_runner(1, MAX_LEN, capture=False) is not b
