"""runtime.decoder: the eager serving model against the compiled training graph, its policy hooks and its checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import k3compile
from k3compile.build import BuildOptions, build
from k3compile.modules.moe import RoutedExperts
from k3compile.runtime.decoder import DecodeCache, Decoder
from k3compile.spec.load import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOKENS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """The training Model of the bf16 ablation (no quantisation anywhere), capacity factor 8 so that nothing is
    dropped (capacity min(T, ceil(8 T 4 / 32)) = T), as in the Decoder; fp32 parameters."""
    spec = load_spec(SPECS / "ablations" / "bf16.yaml", ["moe.capacity_factor=8"])
    dest, _ = build(spec, tmp_path_factory.mktemp("bf16"), BuildOptions(mode="train"))
    return k3compile.load(dest).Model()


def test_unquantised_training_graph_equals_the_decoder(bf16_model):
    """With no quantisation and no drops, the training graph after every pass (interleave, attn_res rewrite,
    routing, fuse, ...) computes the same function as the eager composition of the modules; the Decoder's
    parameter names are the Model's (strict load)."""
    decoder = Decoder(bf16_model.spec)
    decoder.load_state_dict(bf16_model.state_dict(), strict=True)
    with torch.no_grad():
        want = bf16_model(TOKENS)
        got, cache = decoder.eval()(TOKENS)
        assert rel(got, want) <= 1e-5
        routers = [m for name, m in bf16_model.named_modules() if name.endswith(".moe.router")]
        assert len(routers) == 7 and all(int(r.dropped) == 0 for r in routers)
        # not vacuous: the last layer's experts (reached only through routing) change the output
        decoder.layers[-1].moe.experts.down_proj.weight.mul_(1.5)
        changed, _ = decoder(TOKENS)
    assert rel(changed, want) > 1e-4
    assert cache.position == TOKENS.shape[1]


def test_activation_policy_hooks_follow_the_spec():
    tiny = Decoder(load_spec(SPECS / "k3-tiny.yaml"))  # rule: layers.*.moe.experts.* -> mxfp4 weights, mxfp8 inputs
    experts = [m for m in tiny.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 7 and {m.act_quant for m in experts} == {("e4m3", 32)}
    assert not any(m._forward_pre_hooks for m in tiny.modules() if isinstance(m, nn.Linear))
    plain = Decoder(load_spec(SPECS / "ablations" / "bf16.yaml"))
    assert {m.act_quant for m in plain.modules() if isinstance(m, RoutedExperts)} == {None}


@pytest.fixture(scope="module")
def small_decoder():
    spec = load_spec(SPECS / "k3-tiny.yaml", ["num_layers=4", "context_length=64", "training.seq_len=64"])
    return Decoder(spec).eval()


@pytest.mark.parametrize(
    "tokens, match",
    [
        (torch.zeros(3, dtype=torch.long), r"tokens must be \[batch, time\]"),
        (torch.tensor([[0, 256]]), r"token ids must be in \[0, 256\)"),
        (torch.tensor([[-1, 2]]), r"token ids must be in \[0, 256\)"),
    ],
)
def test_bad_tokens_are_refused(small_decoder, tokens, match):
    with pytest.raises(ValueError, match=match):
        small_decoder(tokens)


def test_context_length_is_enforced(small_decoder):
    with pytest.raises(ValueError, match="exceeds the spec's context_length 64"):
        small_decoder(torch.zeros(1, 65, dtype=torch.long))
    full = DecodeCache(layers=[None] * 4, position=64)
    with pytest.raises(ValueError, match="context of 65 tokens"):
        small_decoder(torch.zeros(1, 1, dtype=torch.long), full)
