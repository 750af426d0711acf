"""Every C kernel entry point given tensors it cannot read directly: it copies (non-contiguous), runs the reference
(float64, a tensor subclass, a DTensor, another device) or raises KernelInputError (wrong dtype or size at the
ctypes call), and never hands the C library a bad pointer."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from k3compile.kernels.attn_res_normed import reference as attn_ref
from k3compile.kernels.attn_res_normed import c as attn_res_normed_c
from k3compile.kernels.glu_train import c as glu_c
from k3compile.kernels.kda import c as kda_gate_c
from k3compile.kernels.moe import c as moe_c
from k3compile.kernels.mx import c as mx_c
from k3compile.kernels._common import native
from k3compile.kernels.norms import c as norms_c
from k3compile.kernels.short_conv import c as short_conv_c
from k3compile.kernels.norms import reference as norms_ref
from k3compile.kernels.short_conv import reference as conv_ref
from k3compile.kernels.glu_train.reference import glu_train_ref
from k3compile.kernels.kda.reference import kda_gate_ref
from k3compile.kernels.moe.reference import combine_ref
from k3compile.kernels.mx.reference import mx_fake_quantize_fast

pytestmark = pytest.mark.skipif(not native.available()[0], reason="needs the C kernels built")


def _args(name: str, g: torch.Generator) -> list:
    """Arguments of entry point `name` (fp32, contiguous, on the CPU)."""
    x, dy = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    w, gate = torch.randn(16, generator=g), torch.randn(3, 5, 16, generator=g)
    src, rinv, q = torch.randn(4, 3, 5, 16, generator=g), torch.rand(4, 3, 5, generator=g) + 0.5, torch.randn(16, generator=g)
    f, A, dt = torch.randn(2, 5, 3, 8, generator=g), torch.randn(3, generator=g), torch.randn(24, generator=g)
    cx, cw, cs = torch.randn(2, 6, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(2, 8, 3, generator=g)
    rows, cw_TK = torch.randn(1, 12, 16, generator=g), torch.rand(5, 2, generator=g)
    slots = torch.randperm(12, generator=g)[:10].view(5, 2)
    return {
        "rms_norm": [x, w, 1e-6],
        "rms_norm_bwd": [[dy], x, w, 1e-6],
        "rms_norm_gate": [x, w, gate, 1e-6],
        "rms_norm_gate_bwd": [[dy], x, w, gate, 1e-6],
        "l2_norm": [x, 1e-6],
        "l2_norm_bwd": [[dy], x, 1e-6],
        "rms_inv": [x, 1e-6],
        "rms_inv_bwd": [[torch.randn(3, 5, generator=g)], x, 1e-6],
        "attn_res_normed": [src, rinv, q, w],
        "attn_res_normed_bwd": [[dy], src, rinv, q, w],
        "kda_gate": [f, A, dt, "softplus", -5.0],
        "kda_gate_bwd": [[torch.randn(2, 5, 3, 8, generator=g)], f, A, dt, "softplus", -5.0],
        "glu_train": [x, gate, "swiglu", 1.0, 1.0],
        "short_conv": [cx, cw, cs],
        "short_conv_bwd": [[torch.randn(2, 6, 8, generator=g), torch.randn(2, 8, 3, generator=g)], cx, cw, cs],
        "moe_combine": [rows, cw_TK, slots],
        "moe_combine_bwd": [[torch.randn(5, 16, generator=g)], rows, cw_TK, slots],
        "mx_fake_quantize": [x, "e4m3", 16],
    }[name]


def _backward_by_autograd(ref):
    """The gradients of `ref` for grads = [dy] (the entry points whose reference backward recomputes)."""

    def bwd(grads, *args):
        leaves = [a.detach().requires_grad_() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
        with torch.enable_grad():
            out = ref(*leaves)
            return list(torch.autograd.grad(out, [a for a in leaves if isinstance(a, Tensor) and a.requires_grad],
                                            grads[0]))

    return bwd


ENTRY_POINTS = {  # name: (the C entry point, its reference)
    "rms_norm": (norms_c.rms_norm, norms_ref.rms_norm_ref),
    "rms_norm_bwd": (norms_c.rms_norm_bwd, norms_ref.rms_norm_bwd_ref),
    "rms_norm_gate": (norms_c.rms_norm_gate, norms_ref.rms_norm_gate_ref),
    "rms_norm_gate_bwd": (norms_c.rms_norm_gate_bwd, norms_ref.rms_norm_gate_bwd_ref),
    "l2_norm": (norms_c.l2_norm, norms_ref.l2_norm_ref),
    "l2_norm_bwd": (norms_c.l2_norm_bwd, norms_ref.l2_norm_bwd_ref),
    "rms_inv": (attn_res_normed_c.rms_inv, attn_ref.rms_inv_ref),
    "rms_inv_bwd": (attn_res_normed_c.rms_inv_bwd, attn_ref.rms_inv_bwd_ref),
    "attn_res_normed": (attn_res_normed_c.attn_res_normed, attn_ref.attn_res_normed_ref),
    "attn_res_normed_bwd": (attn_res_normed_c.attn_res_normed_bwd, attn_ref.attn_res_normed_bwd_ref),
    "kda_gate": (kda_gate_c.kda_gate, kda_gate_ref),
    "kda_gate_bwd": (kda_gate_c.kda_gate_bwd, _backward_by_autograd(kda_gate_ref)),
    "glu_train": (glu_c.glu_train, glu_train_ref),
    "short_conv": (short_conv_c.short_conv, conv_ref.short_conv_ref),
    "short_conv_bwd": (short_conv_c.short_conv_bwd, conv_ref.short_conv_bwd_ref),
    "moe_combine": (moe_c.moe_combine, combine_ref),
    "moe_combine_bwd": (moe_c.moe_combine_bwd, _backward_by_autograd(combine_ref)),
    "mx_fake_quantize": (mx_c.mx_fake_quantize, mx_fake_quantize_fast),
}


def _map(fn, args: list) -> list:
    """`fn` applied to every floating-point tensor in args (slots and other integer tensors kept)."""
    return tree_map(lambda a: fn(a) if isinstance(a, Tensor) and a.is_floating_point() else a, args)


def _flat(out) -> list[Tensor]:
    out = out if isinstance(out, (list, tuple)) else [out]
    return [o for o in out if o is not None]


def _equal(got, want) -> None:
    got, want = _flat(got), _flat(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is Tensor and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_non_contiguous_inputs_are_copied_for_the_kernel(name):
    kernel, _ = ENTRY_POINTS[name]
    args = _args(name, torch.Generator().manual_seed(0))

    def strided(t: Tensor) -> Tensor:  # the same values, every other element of a wider tensor
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1])
        wide[..., ::2] = t
        return wide[..., ::2]

    spread = _map(strided, args)
    floats = [t for t in tree_leaves(spread) if isinstance(t, Tensor) and t.is_floating_point()]
    assert floats and all(not t.is_contiguous() for t in floats)
    _equal(kernel(*spread), kernel(*args))


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_float64_runs_the_reference(name):
    kernel, ref = ENTRY_POINTS[name]
    args = _map(lambda t: t.double(), _args(name, torch.Generator().manual_seed(1)))
    _equal(kernel(*args), ref(*args))


class Marked(Tensor):
    """A tensor subclass the C kernels do not know (as DTensor or FakeTensor): they must not read its pointer."""


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_tensor_subclass_runs_the_reference(name):
    kernel, ref = ENTRY_POINTS[name]
    args = _args(name, torch.Generator().manual_seed(2))
    got = kernel(*_map(lambda t: t.as_subclass(Marked), args))
    want = ref(*args)
    _equal(_map(lambda t: t.as_subclass(Tensor), _flat(got)), want)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_meta_tensors_run_the_reference(name):
    """Another device: the reference (here shapes only), never a pointer of the meta device."""
    kernel, ref = ENTRY_POINTS[name]
    args = _args(name, torch.Generator().manual_seed(3))
    got = _flat(kernel(*tree_map(lambda t: t.to("meta") if isinstance(t, Tensor) else t, args)))
    want = _flat(ref(*args))
    assert [(t.device.type, t.shape, t.dtype) for t in got] == [("meta", t.shape, t.dtype) for t in want]


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo world and its CPU mesh (what fully_shard's parameters live on)."""
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if owned:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_dtensor_parameters_run_the_reference(name, mesh):
    """fully_shard per layer hands the kernels DTensors (sharded parameters): the reference runs on them (where
    DTensor refuses one of the reference's ops, its own error, as the reference alone gives)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    kernel, ref = ENTRY_POINTS[name]
    args = _args(name, torch.Generator().manual_seed(4))
    sharded = _map(lambda t: distribute_tensor(t, mesh, [Shard(0)]), args)
    try:
        want = ref(*sharded)
    except RuntimeError as refused:
        with pytest.raises(RuntimeError, match=re.escape(str(refused).splitlines()[0])):
            kernel(*sharded)
        return
    _equal([t.full_tensor() for t in _flat(kernel(*sharded))], [t.full_tensor() for t in _flat(want)])
    _equal([t.full_tensor() for t in _flat(want)], ref(*args))


@pytest.mark.parametrize(("kernel", "argtypes", "bad", "why"), [
    ("k3_l2_norm", norms_c._L2, lambda x: x.double(), "torch.float64, expected torch.float32"),
    ("k3_l2_norm", norms_c._L2, lambda x: x.t(), "not contiguous"),
    ("k3_l2_norm", norms_c._L2, lambda x: x.to("meta"), "on meta"),
    ("k3_l2_norm", norms_c._L2, lambda x: x.as_subclass(Marked), "a Marked (a tensor subclass)"),
    ("k3_l2_norm", norms_c._L2, lambda x: x.to_sparse(), "torch.sparse_coo"),
    ("k3_moe_combine", moe_c._FWD, lambda x: x, "argument 2 is torch.float32, expected torch.int64"),
])
def test_the_ctypes_call_checks_every_tensor(kernel, argtypes, bad, why):
    """The last check before C: a bad tensor at a pointer argument is a KernelInputError naming it."""
    x = torch.randn(4, 8)
    args = [bad(x) if isinstance(a, native.Buffer) else 1 for a in argtypes]
    with pytest.raises(native.KernelInputError, match=re.escape(why)):
        native.function(kernel, argtypes)(*args)


def test_wrong_sizes_and_slot_dtypes_are_caught_before_the_kernel():
    x = torch.randn(3, 16)
    with pytest.raises(native.KernelInputError, match="weight has 8 elements, expected 16"):
        norms_c.rms_norm(x, torch.ones(8), 1e-6)
    rows, w = torch.randn(1, 12, 16), torch.rand(5, 2)
    slots32 = torch.arange(10, dtype=torch.int32).view(5, 2)  # not the int64 the kernel indexes with: the reference
    _equal(moe_c.moe_combine(rows, w, slots32), combine_ref(rows, w, slots32))


FULLY_SHARD_PER_LAYER = """
import sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import k3compile
from k3compile.build import BuildOptions, build
from k3compile.spec.load import load_spec
path, _ = build(load_spec(sys.argv[1]), tempfile.mkdtemp(), BuildOptions(target="cpu", mode="train"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = k3compile.load(path).Model()
for layer in model.layers:
    fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
tokens = torch.randint(0, 256, (1, 8))
model(tokens, tokens).backward()
"""


def test_fully_shard_per_layer_is_an_error_not_a_crash():
    """The emitted forward reads the layers' parameters itself, so sharding each layer hands the kernels DTensors:
    the process ends with a Python error (DTensor refusing a reference's mixed operands), never a signal."""
    import subprocess
    import sys
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "specs" / "k3-tiny.yaml"
    proc = subprocess.run([sys.executable, "-c", FULLY_SHARD_PER_LAYER, str(spec)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    assert proc.returncode == 0 or "DTensor" in proc.stderr
