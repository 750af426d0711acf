"""k3compile.kernels._common.native: the C kernels build once per machine into the cache, load, and step aside cleanly (a
reason, the references) where they cannot be built; ops bound to backend "c" run them, forward and backward."""

from __future__ import annotations

import warnings

import pytest
import torch

from k3compile.kernels import binding
from k3compile.kernels._common import native
from k3compile.kernels.norms import c as norms_c
from k3compile.kernels._common.registry import resolve


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A native module with its caches cleared, building into tmp_path; the real library again afterwards."""
    monkeypatch.setenv("K3COMPILE_CACHE", str(tmp_path))
    native.library.cache_clear()
    native.function.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    native.library.cache_clear()
    native.function.cache_clear()


def test_builds_once_into_the_cache(fresh):
    assert native.available() == (True, "C kernels built for this CPU")
    (lib,) = (fresh / "kernels").iterdir()
    assert lib.name.startswith("libk3cpu-") and lib.suffix == ".so"
    stamp = lib.stat().st_mtime_ns
    native.library.cache_clear()
    native.library()  # a second process: the cached library, not a rebuild
    assert [p.name for p in (fresh / "kernels").iterdir()] == [lib.name] and lib.stat().st_mtime_ns == stamp


def test_turned_off_or_without_a_compiler_the_references_run(fresh, monkeypatch):
    monkeypatch.setenv("K3COMPILE_C_KERNELS", "0")
    ok, why = native.available()
    assert not ok and "K3COMPILE_C_KERNELS=0" in why
    assert binding.choose("rms_norm", "cpu") == {"impl": "torch", "reason": f"PyTorch reference ({why})"}
    with pytest.raises(RuntimeError, match="C kernels requested but unavailable"):
        binding.choose("rms_norm", "cpu", "c")
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.warns(UserWarning, match="C kernels unavailable"):
        y = torch.ops.k3.rms_norm.default(x, w, 1e-5, backend="c")
    assert torch.equal(y, torch.ops.k3.rms_norm.default(x, w, 1e-5, backend="torch"))
    monkeypatch.delenv("K3COMPILE_C_KERNELS")
    native.library.cache_clear()
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert native.available() == (False, "no C compiler found ($CC, cc, gcc or clang)")


def test_a_failed_compile_names_the_error_and_leaves_no_file(fresh, monkeypatch, tmp_path_factory):
    src = tmp_path_factory.mktemp("csrc")
    (src / "broken.c").write_text("int f(void) { return }\n")
    monkeypatch.setattr(native, "sources", lambda: [src / "broken.c"])
    ok, why = native.available()
    assert not ok and "could not compile the C kernels" in why and "error" in why
    assert not any((fresh / "kernels").iterdir())


def test_backend_c_resolves_and_runs_the_kernel_forward_and_backward():
    assert resolve("rms_norm", "c", [torch.zeros(1)]) == "c"
    assert resolve("rms_norm", "c", [torch.zeros(1, dtype=torch.float64)]) == "torch"  # gradchecks: the reference
    assert resolve("rms_norm", "auto", [torch.zeros(1)]) == "torch"  # only a CPU build binds the C kernels
    with pytest.raises(ValueError, match="no C kernel"):
        resolve("kda_chunk", "c", [torch.zeros(1)])
    x = torch.randn(5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    dy = torch.randn(5, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torch.ops.k3.rms_norm.default(x, w, 1e-5, backend="c")
    assert torch.equal(y, norms_c.rms_norm(x.detach(), w.detach(), 1e-5))
    y.backward(dy)
    dx, dw = norms_c.rms_norm_bwd([dy], x.detach(), w.detach(), 1e-5)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)


def test_every_c_kernel_names_a_function():
    for op in binding.C_KERNELS:
        assert callable(binding.c_function(op)), op


def test_a_compiler_without_openmp_builds_the_single_threaded_form(fresh, monkeypatch):
    """The first variant a compiler refuses (here a flag it does not know, as Apple's clang refuses -fopenmp) gives
    way to the next: OpenMP's simd loops without its threads."""
    monkeypatch.setattr(native, "VARIANTS", (("-fno-such-flag",), ("-march=native", "-fopenmp-simd")))
    assert native.available()[0]
    x, w = torch.randn(40, 64), torch.randn(64)
    assert torch.allclose(norms_c.rms_norm(x, w, 1e-5), torch.ops.k3.rms_norm.default(x, w, 1e-5), atol=1e-6)
