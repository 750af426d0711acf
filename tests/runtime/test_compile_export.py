"""The emitted InferenceModel under torch.compile(fullgraph=True): its forward (prefill from empty caches) and a
decode step give eager's logits and caches; torch.export of the decode graph with dynamic batch and cache length."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import k3compile
from k3compile.build import BuildOptions, build
from k3compile.spec.load import load_spec

K3_TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    dest, _ = build(load_spec(K3_TINY), tmp_path_factory.mktemp("tiny"), BuildOptions())
    return k3compile.load(dest)


def test_inference_forward_compiles_fullgraph(pkg):
    """fullgraph=True raises on any graph break (the host-side id check is skipped while tracing)."""
    model = pkg.InferenceModel()
    tokens = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(1))
    eager = model(tokens)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(tokens)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 256\)"):
        model(torch.full_like(tokens, -1))  # eager keeps the check


def test_decode_step_compiles_fullgraph(pkg):
    """decode() checks on the host and calls decode_graph: a compiled decode_graph gives eager's step."""
    model = pkg.InferenceModel()
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(2))
    logits, cache = model.prefill(tokens, max_len=32)
    step = logits[:, -1].argmax(-1)
    eager_logits, eager_cache = model.decode(step, copy.deepcopy(cache))
    model.decode_graph = torch.compile(model.decode_graph, fullgraph=True, backend="aot_eager")
    got_logits, got_cache = model.decode(step, cache)
    torch.testing.assert_close(got_logits, eager_logits, rtol=0, atol=0)
    for name, t in eager_cache.tensors.items():
        torch.testing.assert_close(got_cache.tensors[name], t, rtol=0, atol=0, msg=name)
    assert got_cache.lengths == [21, 21, 21]


class _Decode(torch.nn.Module):
    """The decode graph as a module: what torch.export takes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, caches):
        return self.model.decode_graph(tokens, positions, caches)


def test_decode_graph_exports_with_dynamic_batch_and_cache_length(pkg):
    """torch.export with the batch and the MLA caches' length dynamic up to context_length (no range narrowed);
    the exported step at other sizes than traced gives eager's logits and caches."""
    from k3compile.modules.model import empty_caches

    model = pkg.InferenceModel().eval()
    ctx = model.spec.context_length
    batch, max_len = torch.export.Dim("batch", max=1024), torch.export.Dim("max_len", max=ctx)
    caches = empty_caches(model.spec, 2, 128)
    dims = ({0: batch}, {0: batch}, {n: {0: batch, 1: max_len} if n.startswith("mla_cache.") else {0: batch}
                                     for n in caches})
    with torch.no_grad():
        program = torch.export.export(_Decode(model), (torch.zeros(2, 1, dtype=torch.long), torch.full((2,), 100),
                                                       caches), dynamic_shapes=dims, strict=False)
    assert sorted(r.upper for r in program.range_constraints.values()) == [1024, ctx]
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(3))
    logits, cache = model.prefill(tokens, max_len=32)
    step = logits[:, -1].argmax(-1).view(-1, 1)
    eager_logits, eager_cache = model.decode(step, copy.deepcopy(cache))
    got_logits, got_caches = program.module()(step, cache.positions.clone(),
                                               {n: t.clone() for n, t in cache.tensors.items()})
    torch.testing.assert_close(got_logits, eager_logits, rtol=0, atol=0)
    for name, t in eager_cache.tensors.items():
        torch.testing.assert_close(got_caches[name], t, rtol=0, atol=0, msg=name)
