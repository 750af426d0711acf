"""Initialisation: KDA's decay follows the published convention, so a fresh model keeps most of its state."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.modules.init import initial_value
from k3compile.modules.kda import KDAMixer
from k3compile.modules.model import K3Model
from k3compile.spec.load import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def published_retention(spec, samples: int = 64) -> float:
    """Median per-step retention exp(g) at f = 0 of the convention, drawn independently: A_log = log U(1, 16)
    per head, dt = exp(U(log 1e-3, log 1e-1)) per channel; the softplus form's decay is exp(A) * dt, which the
    lower-bounded form is initialised to match."""
    gen = torch.Generator().manual_seed(1234)
    H, K = spec.kda.num_heads, spec.kda.head_dim
    a = torch.empty(samples, H, 1).uniform_(1.0, 16.0, generator=gen)
    dt = torch.empty(samples, H, K).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    return float(torch.exp(-a * dt).median())


def test_k3_tiny_keeps_the_published_share_of_its_state_at_init():
    """Measured on a fresh model's own gate projections of real hidden states (lower-bounded sigmoid form)."""
    spec = load_spec(SPECS / "k3-tiny.yaml")
    model = K3Model(spec)
    tokens = torch.randint(0, spec.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    retention = []
    with torch.no_grad():
        x = F.embedding(tokens, model.embed.weight)
        for layer in model.layers:
            if isinstance(layer.attn, KDAMixer):
                m = layer.attn
                f = m.f_up(m.f_down(layer.attn_norm(x))).view(2, 64, m.num_heads, m.head_dim)
                retention.append(kda_gate_ref(f, m.A_log, m.dt_bias, m.decay_form, m.lower_bound).exp().flatten())
    measured = float(torch.cat(retention).median())
    assert abs(measured - published_retention(spec)) <= 0.05
    assert measured > 0.9  # not the 0.08 a dt_bias of zero gives


def test_kimi_linear_keeps_the_published_share_of_its_state_at_init():
    """The softplus form, from the init rules alone (the 48B model is never materialised), at f = 0."""
    spec = load_spec(SPECS / "kimi-linear-48b-a3b.yaml")
    H, K = spec.kda.num_heads, spec.kda.head_dim
    layers = [i for i, m in enumerate(spec.mixers) if m == "K"][:4]
    g = []
    for i in layers:
        a_log = initial_value(f"layers.{i}.attn.A_log", (H,), spec)
        dt_bias = initial_value(f"layers.{i}.attn.dt_bias", (H * K,), spec)
        g.append(kda_gate_ref(torch.zeros(1, 1, H, K), a_log, dt_bias, "softplus", 0.0).flatten())
    measured = float(torch.cat(g).exp().median())
    assert abs(measured - published_retention(spec)) <= 0.05


def test_the_lower_bounded_rule_matches_the_softplus_decay_at_f_zero():
    """dt_bias for K3's form gives g = -exp(A_log) * dt exactly where the softplus form's convention does."""
    spec = load_spec(SPECS / "k3-tiny.yaml")
    H, K = spec.kda.num_heads, spec.kda.head_dim
    a_log = initial_value("layers.0.attn.A_log", (H,), spec)
    dt_bias = initial_value("layers.0.attn.dt_bias", (H * K,), spec)
    g = kda_gate_ref(torch.zeros(1, 1, H, K), a_log, dt_bias, "lower_bounded_sigmoid", spec.kda.decay.lower_bound)
    dt = (-g[0, 0] / a_log.exp()[:, None]).flatten()  # the dt the rule encoded
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)


def test_each_parameter_is_drawn_on_its_own_device_in_one_call(monkeypatch, tmp_path):
    """The emitted modules initialise every parameter with one initial_value call on the parameter's device (on
    a GPU the GPU's generator: no pass through host memory, no loop over experts); on the CPU the numbers of the
    CPU generator, as they always were."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.runtime import generated

    from ..conftest import TOY_K3

    spec = load_spec(SPECS / "k3-tiny.yaml", list(TOY_K3))
    package = load(build(spec, tmp_path, BuildOptions(mode="train"))[0])
    calls = []
    real = generated.initial_value
    monkeypatch.setattr(generated, "initial_value", lambda *a: calls.append(a) or real(*a))
    params = dict(package.Model().named_parameters())
    assert sorted(c[0] for c in calls) == sorted(params)  # one call each, a whole expert stack at once
    assert all(torch.device(c[3]) == params[c[0]].device for c in calls)
    for name, p in params.items():
        assert torch.equal(p, initial_value(name, tuple(p.shape), spec)), name  # the CPU generator's numbers
