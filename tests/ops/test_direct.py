"""k3compile.ops.direct: the emitted CPU training module calls the ops' references and C kernels without the
dispatcher, with the dispatcher's values and gradients bit for bit."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import k3compile
from k3compile.build import build
from k3compile.emit.codegen import direct_calls
from k3compile.ops import direct
from k3compile.spec.load import load_spec

K3_TINY = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    dest, _ = build(load_spec(K3_TINY), tmp_path_factory.mktemp("direct"))
    return dest


def dispatching_twin(dest: Path, tmp: Path):
    """The emitted model.py with every direct call put back through torch.ops.k3: `direct.<op>` on backend
    "auto" (on CPU tensors the reference, as "torch"), `direct.c.<op>` on backend "c"."""
    src = re.sub(r"\bdirect\.c\.(\w+)\(", r"c_op('\1')(", (dest / "model.py").read_text())
    src = re.sub(r"\bdirect\.(\w+)\(", r"torch.ops.k3.\1.default(", src)
    src += "\n\ndef c_op(name):\n    return lambda *args: getattr(torch.ops.k3, name).default(*args, backend='c')\n"
    path = tmp / "twin.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("dispatching_twin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_code(source: str) -> list[str]:
    """The lines of the training module's code (its sublayer functions and Model.graph), comments dropped."""
    blocks = re.findall(r"^def train_\w+\(.*?(?=^\S)", source, flags=re.M | re.S)
    blocks += re.findall(r"^    def graph\(self, tokens\):.*?(?=^class |\Z)", source[source.index("class Model("):],
                         flags=re.M | re.S)  # fmt: skip
    return [line.split("#")[0] for block in blocks for line in block.splitlines()]


def test_cpu_training_code_calls_the_references_directly(built):
    """The training module's k3 calls are direct; the inference module's keep the dispatcher (torch.export and
    ONNX read them)."""
    source = (built / "model.py").read_text()
    train = train_code(source)
    assert "from k3compile.ops import direct" in source
    calls = {name for line in train for name in re.findall(r"\bdirect\.(\w+)\(", line)}
    assert {"kda_chunk", "quantile_balance_update", "moe_dispatch_rows", "linear_route"} <= calls
    c_calls = {name for line in train for name in re.findall(r"\bdirect\.c\.(\w+)\(", line)}
    assert {"expert_rows_ffn", "attn_res_normed", "mx_fake_quantize", "rms_norm", "short_conv"} <= c_calls
    assert len(train) > 100 and not any("torch.ops.k3" in line or "backend" in line for line in train)
    infer = source[source.index("def prefill_"):source.index("class Model(")]
    assert "torch.ops.k3.kda_chunk.default(" in infer and "direct." not in infer


def test_one_step_equals_the_dispatched_ops_bit_for_bit(built, tmp_path):
    """Loss, every gradient and every buffer the step updates (Quantile Balancing's bias, the load counters)."""
    package = k3compile.load(built)
    ours, twin = package.Model().train(), dispatching_twin(built, tmp_path).Model().train()
    twin.load_state_dict(ours.state_dict())
    losses = []
    for m in (ours, twin):
        loss = m(TOKENS, TOKENS)
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    for (name, a), b in zip(ours.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name


def test_non_differentiable_ops_return_no_graph():
    scores = torch.rand(16, 8, requires_grad=True)
    bias = torch.zeros(8)
    out = direct.quantile_balance_update(scores, bias, 2)
    assert not out.requires_grad
    assert torch.equal(out, torch.ops.k3.quantile_balance_update.default(scores.detach(), bias, 2))


def test_unknown_names_and_bound_kernels_are_refused():
    with pytest.raises(AttributeError):
        direct.no_such_op  # noqa: B018
    with pytest.raises(ValueError, match="backend 'torch' or 'c'"):
        direct_calls("y = torch.ops.k3.rms_norm.default(x, w, 1e-05, backend = 'triton')")
    with pytest.raises(AttributeError, match="no C kernel"):
        direct.c.kda_chunk  # noqa: B018
    assert direct_calls("y = torch.ops.k3.rms_norm.default(x, w, 1e-05, backend = 'c')  # [B, T, 256]") == (
        "y = direct.c.rms_norm(x, w, 1e-05)  # [B, T, 256]"
    )
