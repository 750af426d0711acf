"""The model definition run eagerly: the reference the compiled graphs are compared against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import k3compile
from k3compile.build import BuildOptions, build
from k3compile.modules.model import K3Model, cache_shapes, empty_caches
from k3compile.spec.load import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOKENS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """The training Model of the bf16 ablation (no quantisation anywhere), capacity factor 8 so that nothing is
    dropped (capacity min(T, ceil(8 T 4 / 32)) = T); fp32 parameters."""
    spec = load_spec(SPECS / "ablations" / "bf16.yaml", ["moe.capacity_factor=8"])
    dest, _ = build(spec, tmp_path_factory.mktemp("bf16"), BuildOptions(mode="train"))
    return k3compile.load(dest).Model()


def test_unquantised_training_graph_equals_the_model_definition(bf16_model):
    """With no quantisation and no drops, the training graph after every pass (interleave, attn_res rewrite,
    routing, fuse, ...) computes the same function as the model definition run eagerly; the definition's
    parameter names are the Model's (strict load)."""
    eager = K3Model(bf16_model.spec, init=False)
    eager.load_state_dict(bf16_model.state_dict(), strict=True)
    with torch.no_grad():
        want = bf16_model(TOKENS)
        got = eager.eval()(TOKENS)
        assert rel(got, want) <= 1e-5
        routers = [m for name, m in bf16_model.named_modules() if name.endswith(".moe.router")]
        assert len(routers) == 7 and all(int(r.dropped) == 0 for r in routers)
        # not vacuous: the last layer's experts (reached only through routing) change the output
        eager.layers[-1].moe.experts.down_proj.weight.mul_(1.5)
        changed = eager(TOKENS)
    assert rel(changed, want) > 1e-4


def test_eager_prefill_then_decode_equals_the_eager_forward():
    """The definition's own three entry points agree: prefill 7 tokens, decode 3 one at a time."""
    spec = load_spec(SPECS / "ablations" / "bf16.yaml", ["moe.capacity_factor=8"])
    model = K3Model(spec).eval()
    for layer in model.layers:
        if hasattr(layer, "moe"):
            layer.moe.capacity_factor = None  # serving never drops a token
    with torch.no_grad():
        full = model(TOKENS)
        logits, caches = model.prefill(TOKENS[:, :7], empty_caches(spec, 2, 10))
        caches = {**empty_caches(spec, 2, 10), **caches}
        steps = [logits]
        for t in range(7, 10):
            positions = torch.full((2,), t)
            step, new = model.decode(TOKENS[:, t : t + 1], positions, caches)
            caches.update(new)
            steps.append(step)
    assert rel(torch.cat(steps, 1), full) <= 1e-5


def test_cache_layout_follows_the_layout():
    spec = load_spec(SPECS / "k3-tiny.yaml")
    shapes = cache_shapes(spec, batch=3, max_len=40)
    kda = [i for i, m in enumerate(spec.mixers) if m == "K"]
    mla = [i for i, m in enumerate(spec.mixers) if m == "M"]
    assert sorted(shapes) == sorted(
        [f"{n}.{i}" for i in kda for n in ("kda_state", "kda_conv_q", "kda_conv_k", "kda_conv_v")]
        + [f"mla_cache.{i}" for i in mla]
    )
    k, m = spec.kda, spec.mla
    assert shapes[f"kda_state.{kda[0]}"] == ((3, k.num_heads, k.head_dim, k.head_dim), torch.float32)
    assert shapes[f"kda_conv_q.{kda[0]}"] == ((3, k.num_heads * k.head_dim, k.short_conv_size - 1), torch.float32)
    assert shapes[f"mla_cache.{mla[0]}"] == ((3, 40, m.kv_lora_rank + m.qk_rope_head_dim), torch.float32)
