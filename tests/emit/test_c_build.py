"""A CPU build binds the C kernels (kernels/*/*.c), and they compute what the same build over the PyTorch references
does: one training step's loss and gradients, inference logits, and prefill-then-decode.

As with the Triton build (tests/emit/test_triton_build.py), MXFP8 activation rounding is a step function: the C
kernels agree with the references to fp32 rounding, and a 1e-7 difference upstream can move an element across a
rounding midpoint, a whole e4m3 step (tests/flips.py). So each comparison is made twice: tight on k3-tiny without
activation quantisation (QAT off for training; the MXFP8 activation format dropped for serving, MXFP4 weights
kept), flip-aware on the shipped spec (the typical gradient or token tight, none off by a whole e4m3 step), with
router near-ties excused as recorded.
"""

from __future__ import annotations

import pytest
import torch

from k3compile.build import BuildOptions
from k3compile.kernels.binding import C_KERNELS
from k3compile.kernels._common.compare import rel_rms

from flips import assert_flip_aware, assert_flip_aware_errors, assert_tight, recorded, route_changes
from flips import without_activation_quantisation

SEQ = 21  # ragged against KDA's chunk and the MX blocks
DECODED = 4  # tokens decoded after a prompt of SEQ - DECODED


def both(mode: str = "both") -> dict:
    """The C kernels' build and the references' build, by cpu_kernels."""
    return {kernels: BuildOptions(mode=mode, cpu_kernels=kernels) for kernels in ("c", "torch")}


@pytest.fixture(scope="module")
def packages(tmp_path_factory, tiny_spec, build_variants):
    return build_variants(tiny_spec, tmp_path_factory, both())


@pytest.fixture(scope="module")
def packages_no_act_quant(tmp_path_factory, tiny_path, tiny_spec, build_variants):
    """Serving builds of k3-tiny with the experts' activations unquantised (MXFP4 weights kept)."""
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path, overrides=without_activation_quantisation(tiny_spec))
    return build_variants(spec, tmp_path_factory, both("infer"))


@pytest.fixture(scope="module")
def packages_no_qat(tmp_path_factory, tiny_path, build_variants):
    from k3compile.spec.load import load_spec

    spec = load_spec(tiny_path, overrides=["quantization.qat=false"])
    return build_variants(spec, tmp_path_factory, both("train"))


def test_every_graph_calls_the_c_kernels(packages):
    source = (packages["c"][0] / "model.py").read_text()
    train = source[: source.index("class Model(")]
    for op in ("expert_rows_ffn", "attn_res_normed", "mx_fake_quantize", "rms_norm", "short_conv", "kda_gate"):
        assert f"direct.c.{op}(" in train, op
    assert "backend = 'c'" in source  # the inference module: through the dispatcher, on backend "c"
    assert "direct.c." not in (packages["torch"][0] / "model.py").read_text()
    assert all(op in C_KERNELS for op in ("moe_combine", "glu_train", "rms_inv", "l2_norm", "rms_norm_gate"))


def test_training_step_matches_the_reference_build(packages, step_differences):
    """Shipped spec (QAT): the loss to 1e-4; the gradients flip-aware, the median to the fp32 bound 1e-4 of the
    comparison without QAT below, none a whole e4m3 step off."""
    loss_err, errors = step_differences(packages, "torch", "c", 2, SEQ)
    worst = max(errors, key=errors.get)
    print(f"QAT: loss rel diff {loss_err:.1e}; worst gradient {worst} {errors[worst]:.1e}")
    assert loss_err <= 1e-4
    assert_flip_aware_errors(list(errors.values()), 1e-4)


def test_training_step_without_qat_matches_every_gradient(packages_no_qat, step_differences):
    loss_err, errors = step_differences(packages_no_qat, "torch", "c", 2, SEQ)
    worst = max(errors, key=errors.get)
    print(f"no QAT: loss rel diff {loss_err:.1e}; worst gradient {worst} {errors[worst]:.1e}")
    assert loss_err <= 1e-5 and errors[worst] <= 1e-4


def _served(packages) -> dict:
    """{kernels: (prefill-then-decode logits, one prefill's, their routes)} on seeded tokens."""
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    prompt = SEQ - DECODED
    runs = {}
    for kernels, (_, package) in packages.items():
        model = package.InferenceModel()

        def stepped():
            out, cache = model.prefill(tokens[:, :prompt], max_len=SEQ)
            outs = [out]
            for t in range(prompt, SEQ):
                out, cache = model.decode(tokens[:, t : t + 1], cache)
                outs.append(out)
            return torch.cat(outs, dim=1)

        stepped_logits, stepped_routes = recorded(stepped, 2, model.spec)
        (whole, _), whole_routes = recorded(lambda: model.prefill(tokens, max_len=SEQ), 2, model.spec)
        runs[kernels] = (stepped_logits, whole, stepped_routes, whole_routes)
    return runs


def _claim(runs: dict, claim) -> None:
    """`claim` on C vs references (prefill-then-decode, and one prefill) and prefill-then-decode vs one prefill,
    each on all tokens; the tight claim also on the decoded ones alone (not the flip-aware one: a flip in the prompt
    moves the later tokens of its sequence by ~1e-5, so the decoded few have no tight median)."""
    c, ref = runs["c"], runs["torch"]
    pairs = [(c[0], ref[0], route_changes(c[2], ref[2])), (c[1], ref[1], route_changes(c[3], ref[3])),
             (c[0], c[1], route_changes(c[2], c[3]))]  # fmt: skip
    print(f"c vs torch: rel RMS {rel_rms(c[0], ref[0]):.2e} stepped, {rel_rms(c[1], ref[1]):.2e} whole")
    for got, want, excused in pairs:
        claim(got, want, excused_BT=excused)
        if claim is assert_tight:
            claim(got[:, -DECODED:], want[:, -DECODED:], excused_BT=excused[:, -DECODED:])


def test_prefill_then_decode_matches_the_reference_build_and_one_prefill(packages):
    """Shipped spec (MXFP8 expert activations): equal up to e4m3 flips and router near-ties."""
    _claim(_served(packages), assert_flip_aware)


def test_prefill_then_decode_without_activation_quantisation_matches_tightly(packages_no_act_quant):
    """Expert activations unquantised: every token to 1e-5, router near-ties aside."""
    _claim(_served(packages_no_act_quant), assert_tight)
