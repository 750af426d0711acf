"""The emitted k3-tiny modules (runtime.generated): compile, numerics against each other and the Decoder, decoding.

Built once with `--set moe.capacity_factor=8`: the per-expert capacity is min(T, ceil(cf * T * top_k / E)) =
min(T, ceil(8 * T * 4 / 32)) = T, the most one expert can receive (a token picks an expert at most once), so
the training graph drops no token. k3-tiny's own 1.5 gives C = 5 for these 24 tokens and drops 2 to 10
assignments per MoE layer (measured), while the inference graph and the Decoder are drop-free: with drops the
three could not agree, with none they must.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import k3compile
from k3compile.analysis.formats import ELEMENT_OF_POLICY
from k3compile.build import BuildOptions, build
from k3compile.kernels.mx.op import mx_fake_quantize
from k3compile.modules.model import K3Model
from k3compile.modules.moe import RoutedExperts
from k3compile.spec.load import load_spec
from k3compile.spec.weights import activation_format, weight_inventory

from flips import assert_flip_aware, assert_tight, without_activation_quantisation

K3_TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
LABELS = TOKENS.clone()
LABELS[0, 5] = -100  # an ignored position


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _routers(module) -> list:
    return [m for name, m in module.named_modules() if name.endswith(".moe.router")]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """k3-tiny over the PyTorch references (the claims here are to 1e-5 and below; the C kernels' build is compared
    with this one in tests/emit/test_c_build.py)."""
    spec = load_spec(K3_TINY, ["moe.capacity_factor=8"])
    dest, _ = build(spec, tmp_path_factory.mktemp("cf8"), BuildOptions(cpu_kernels="torch"))
    return k3compile.load(dest)


@pytest.fixture(scope="module")
def infer_unquantised(tmp_path_factory):
    """k3-tiny's InferenceModel with the experts' activations not quantised (weights still MXFP4)."""
    spec = load_spec(K3_TINY, ["moe.capacity_factor=8"])
    spec = load_spec(K3_TINY, ["moe.capacity_factor=8", *without_activation_quantisation(spec)])
    dest, _ = build(spec, tmp_path_factory.mktemp("noact"), BuildOptions(cpu_kernels="torch"))
    return k3compile.load(dest).InferenceModel()


@pytest.fixture(scope="module")
def model(pkg):
    return pkg.Model()


@pytest.fixture(scope="module")
def infer(pkg):
    return pkg.InferenceModel()


@pytest.fixture(scope="module")
def train_logits(model):
    with torch.no_grad():
        return model(TOKENS)


@pytest.fixture(scope="module")
def infer_logits(infer):
    with torch.no_grad():
        return infer(TOKENS)


@pytest.fixture(scope="module")
def prefilled(infer):
    """InferenceModel.prefill(TOKENS): (logits, cache) through the compiled prefill graph."""
    with torch.no_grad():
        return infer.prefill(TOKENS, max_len=TOKENS.shape[1])


def eager_with_policy(spec, state: dict) -> K3Model:
    """The model definition with `state`, its routed experts' inputs fake-quantised per the activation policy
    and drop-free routing: the eager counterpart of the served graphs."""
    model = K3Model(spec, init=False)
    model.load_state_dict(state, strict=True)
    for name, m in model.named_modules():
        if isinstance(m, RoutedExperts):
            fmt = activation_format(spec, f"{name}.up_proj")
            m.act_quant = (ELEMENT_OF_POLICY[fmt], spec.quantization.block_size) if fmt in ELEMENT_OF_POLICY else None
        if hasattr(m, "capacity_factor"):
            m.capacity_factor = None
    return model.eval()


@pytest.fixture(scope="module")
def eager_step(pkg):
    """A fresh Model's loss on (TOKENS, LABELS), after backward."""
    model = pkg.Model()
    loss = model(TOKENS, LABELS)
    loss.backward()
    return model, loss


def test_loss_is_the_mean_next_token_cross_entropy(eager_step, train_logits):
    _, loss = eager_step
    want = F.cross_entropy(train_logits[:, :-1].reshape(-1, 256), LABELS[:, 1:].reshape(-1), ignore_index=-100)
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()
    assert train_logits.shape == (2, 12, 256) and train_logits.dtype == torch.float32


def test_training_model_compiles_fullgraph_forward_and_backward(pkg, eager_step):
    """fullgraph=True raises on any graph break; the compiled loss, gradients and buffer updates equal eager."""
    from torch._dynamo.utils import counters

    eager, loss_e = eager_step
    compiled = pkg.Model()
    torch._dynamo.reset()
    counters.clear()
    loss_c = torch.compile(compiled, fullgraph=True, backend="aot_eager")(TOKENS, LABELS)
    loss_c.backward()
    assert not counters["graph_break"]
    assert abs(loss_c.item() - loss_e.item()) <= 1e-5 * abs(loss_e.item())
    grads_e = {n: p.grad for n, p in eager.named_parameters()}
    for n, p in compiled.named_parameters():
        assert (p.grad is None) == (grads_e[n] is None), n
        if p.grad is not None and grads_e[n].norm() > 0:
            assert rel(p.grad, grads_e[n]) <= 1e-5, n
    buffers_e = dict(eager.named_buffers())
    for n, b in compiled.named_buffers():  # in-place routing statistics survive compilation
        assert torch.equal(b, buffers_e[n]), n


def test_packed_inference_build_matches_the_qat_training_build(model, train_logits, infer_logits):
    """Same seeded weights: QAT fake-quantises expert weights where inference stores them packed; same numbers."""
    routers = _routers(model)  # the premise: the training graph dropped nothing
    assert len(routers) == 7 and all(int(r.dropped) == 0 for r in routers)
    assert rel(infer_logits, train_logits) <= 1e-4


def test_inference_graph_equals_the_eager_model_over_the_dequantised_weights(infer, prefilled):
    """Bound prefill graph (packed weights, in-graph dequantise, MX activations) == the model definition run
    eagerly over the dequantised weights with the policy's activation format: packing and quantisation
    placement are right."""
    logits, cache = prefilled
    with torch.no_grad():
        want = eager_with_policy(infer.spec, infer.dense_state_dict())(TOKENS)
    assert rel(logits, want) <= 1e-5
    assert cache.lengths == [12, 12]


def test_qat_training_graph_equals_the_eager_model_over_quantised_weights(model, train_logits):
    """Train graph (fake-quantised weights and activations) == the model definition given the training weights
    quantised per the spec's weight inventory (not the packing tables): QAT simulates exactly what is served."""
    spec = model.spec
    fmt = {w.name: w.format for w in weight_inventory(spec)}
    state = {}
    for name, value in model.state_dict().items():
        element = ELEMENT_OF_POLICY.get(fmt.get(name, ""))
        state[name] = mx_fake_quantize(value, element, spec.quantization.block_size) if element else value
    assert sum(1 for n in state if ELEMENT_OF_POLICY.get(fmt.get(n, ""))) == 21  # 7 MoE layers x 3 expert weights
    with torch.no_grad():
        logits = eager_with_policy(spec, state)(TOKENS)
    assert rel(train_logits, logits) <= 1e-5


def _prefill_then_decode(infer, tokens_BT: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of a prefill of the first `split` tokens then one decode step per remaining token."""
    T = tokens_BT.shape[1]
    with torch.no_grad():
        logits, cache = infer.prefill(tokens_BT[:, :split], max_len=T)
        steps = [logits]
        for t in range(split, T):
            step, cache = infer.decode(tokens_BT[:, t : t + 1], cache)
            steps.append(step)
    assert cache.lengths == [T] * tokens_BT.shape[0]
    return torch.cat(steps, dim=1)


def test_prefill_then_decode_equals_one_prefill(infer, prefilled):
    """Shipped spec (MXFP8 expert activations): equal up to e4m3 flips (tests/flips.py)."""
    assert_flip_aware(_prefill_then_decode(infer, TOKENS, 8), prefilled[0])


def test_prefill_then_decode_equals_one_prefill_without_activation_quantisation(infer_unquantised):
    """Expert activations left unquantised (MXFP4 weights kept): every token to 1e-5."""
    with torch.no_grad():
        full, _ = infer_unquantised.prefill(TOKENS, max_len=TOKENS.shape[1])
    assert_tight(_prefill_then_decode(infer_unquantised, TOKENS, 8), full)


@pytest.mark.slow
def test_prefill_then_decode_equals_one_prefill_over_many_token_seeds(infer, infer_unquantised):
    """20 token seeds (TOKENS' shape, decode the last 4): tight without activation quantisation, flip-aware with."""
    for seed in range(20):
        tokens_BT = torch.randint(0, 256, TOKENS.shape, generator=torch.Generator().manual_seed(100 + seed))
        for model, claim in ((infer_unquantised, assert_tight), (infer, assert_flip_aware)):
            with torch.no_grad():
                full, _ = model.prefill(tokens_BT, max_len=TOKENS.shape[1])
            claim(_prefill_then_decode(model, tokens_BT, 8), full)


def test_cache_bytes_kda_constant_mla_preallocated(infer, prefilled):
    """Static shapes: the KDA state is constant, the MLA cache holds max_len rows from the start."""
    spec = infer.spec
    batch = TOKENS.shape[0]
    n_mla = sum(1 for m in spec.mixers if m == "M")
    n_kda = spec.num_layers - n_mla
    k, m = spec.kda, spec.mla
    p = k.num_heads * k.head_dim
    kda_bytes = batch * n_kda * 4 * (k.num_heads * k.head_dim * k.head_dim + (k.short_conv_size - 1) * 3 * p)
    mla_per_token = batch * n_mla * 4 * (m.kv_lora_rank + m.qk_rope_head_dim)  # fp32 [c_kv, k_pe]
    assert prefilled[1].nbytes() == {"kda_state": kda_bytes, "mla_latent": 12 * mla_per_token,
                                     "total": kda_bytes + 12 * mla_per_token}  # fmt: skip
    with torch.no_grad():
        _, cache = infer.prefill(TOKENS[:, :1], max_len=5)
        sizes = [cache.nbytes()]
        for t in range(2, 5):
            _, cache = infer.decode(TOKENS[:, t - 1 : t], cache)
            sizes.append(cache.nbytes())
    assert sizes == [{"kda_state": kda_bytes, "mla_latent": 5 * mla_per_token, "total": kda_bytes + 5 * mla_per_token}] * 4


def test_serving_holds_only_the_tables_tensors_and_follows_loaded_weights(pkg, infer, prefilled):
    """Serving keeps no copy of the weights: state_dict is the tables', and prefill reads loaded weights."""
    state = infer.state_dict()
    assert len(list(infer.parameters())) == len(pkg.InferenceModel.PARAMETERS)
    pkg.InferenceModel(device="meta").load_state_dict(state, strict=True, assign=True)
    original = {k: v.clone() for k, v in state.items()}
    doubled = {**original, "lm_head.weight": 2 * original["lm_head.weight"]}
    try:
        infer.load_state_dict(doubled, strict=True)
        with torch.no_grad():
            logits, _ = infer.prefill(TOKENS, max_len=12)
    finally:
        infer.load_state_dict(original, strict=True)
    assert rel(logits, 2 * prefilled[0]) <= 1e-5


@pytest.mark.parametrize("cls", ["Model", "InferenceModel"])
def test_meta_build_then_to_empty_and_init_equals_a_direct_build(pkg, cls):
    """The FSDP2 idiom: build on the meta device (the ambient device wins), materialise, initialise."""
    direct = getattr(pkg, cls)()
    with torch.device("meta"):
        lazy = getattr(pkg, cls)()
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for kind in ("named_parameters", "named_buffers"):
        got, want = dict(getattr(lazy, kind)()), dict(getattr(direct, kind)())
        assert got.keys() == want.keys() and got
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_the_eager_definition_quantized_as_trained_equals_the_qat_training_model(pkg, eager_step):
    """K3Model.quantize_as_trained() (QAT of the routed experts' weights and inputs, in train mode) computes
    the emitted Model's loss and gradients: the eager row of bench/train_cpu.py runs the same computation."""
    emitted, loss_e = eager_step
    state = {k: v.detach().clone() for k, v in pkg.Model().state_dict().items()}
    model = K3Model(load_spec(K3_TINY, ["moe.capacity_factor=8"]), init=False)
    model.load_state_dict(state, strict=True)
    model.quantize_as_trained().train()
    logits = model(TOKENS)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), LABELS[:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    assert abs(loss.item() - loss_e.item()) <= 1e-5 * loss_e.item()
    grads = dict(model.named_parameters())
    for n, p in emitted.named_parameters():
        if p.grad.norm() > 0:
            assert rel(grads[n].grad, p.grad) <= 1e-4, n
        else:  # a site with one source: its query's gradient is exactly zero
            assert grads[n].grad.norm() == 0, n


@pytest.mark.parametrize("tokens, why", [
    (torch.zeros(0, 8, dtype=torch.long), "holds no sequence or no position"),
    (torch.zeros(2, 0, dtype=torch.long), "holds no sequence or no position"),
    (torch.zeros(2, 8), "must hold integer token ids, got torch.float32"),
    (torch.zeros(2, 8, dtype=torch.bool), "must hold integer token ids"),
    (torch.full((2, 8), 256), r"ids must be in \[0, 256\), got 256..256"),
    (torch.full((2, 8), -100), r"ids must be in \[0, 256\)"),
    (torch.zeros(8, dtype=torch.long), r"must be a tensor \[batch, time\]"),
    ([[1, 2]], r"must be a tensor \[batch, time\]"),
])  # fmt: skip
def test_emitted_models_refuse_input_they_cannot_take_in_one_line(small_build, tokens, why):
    """B = 0, T = 0, float tokens and ids past the vocabulary were internal errors (a raw IndexError); now one
    ValueError line, the same from Model and InferenceModel."""
    package = k3compile.load(small_build)
    for run in (package.Model(), lambda t: package.InferenceModel().prefill(t)):
        with pytest.raises(ValueError, match=why) as e:
            run(tokens)
        assert "\n" not in str(e.value)


def test_emitted_models_refuse_more_positions_than_the_context(small_build):
    """Model accepted T > context_length, which InferenceModel refused; both refuse it now. Labels are checked too."""
    package = k3compile.load(small_build)
    model = package.Model()
    too_long = torch.zeros(1, model.spec.context_length + 1, dtype=torch.long)
    for run in (model, package.InferenceModel()):
        with pytest.raises(ValueError, match="more than context_length"):
            run(too_long)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="labels ids must be in"):
        model(tokens, torch.full((2, 8), 300))
    with pytest.raises(ValueError, match="must be shaped like tokens"):
        model(tokens, tokens[:, :4])
    labels = tokens.clone()
    labels[0, 3] = -100  # ignored positions are labels too
    assert torch.isfinite(model(tokens, labels))
