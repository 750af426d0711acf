"""The CPU target's C kernels: `kernels/*/*.c` compiled once per machine into one shared library, loaded by ctypes.

The C sources are plain C11 with OpenMP loops (no Python or PyTorch headers), so a build takes about a second
with the system compiler (`$CC`, else `cc`, `gcc` or `clang`), for this CPU (`-march=native`; without OpenMP,
single-threaded, where the compiler has none). Where glibc's
vector maths library (libmvec) links, `expf`/`tanhf` in `#pragma omp simd` loops call its vector forms
(K3_VECTOR_MATH); elsewhere the loops call the scalar libm functions. The library lands in
`$K3COMPILE_CACHE/kernels` (default `$XDG_CACHE_HOME/k3compile` or `~/.cache/k3compile`), named by a hash of
the sources, flags, compiler and CPU, written to a temporary name and renamed into place, so concurrent
processes never read a half-written file. `K3COMPILE_C_KERNELS=0` turns the kernels off for the process.
Without a compiler nothing fails: `available()` says why, and every op keeps its PyTorch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

KERNELS = Path(__file__).parent.parent  # the op folders: each C kernel beside its op, as <op>/<name>.c
INCLUDE = Path(__file__).parent  # k3.h, the helpers every C kernel shares


def sources() -> list[Path]:
    """Every op folder's C source, in a fixed order."""
    return sorted(KERNELS.glob("*/*.c"))
FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11",
         "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")  # contract off: the same bits on every x86 ISA
# Tried in turn: this CPU's instructions and OpenMP threads; OpenMP's simd loops only (a compiler without its
# runtime, as Apple's clang); plain C (a compiler that takes neither).
VARIANTS = (("-march=native", "-fopenmp"), ("-march=native", "-fopenmp-simd"), ())
_PROBE = """
__attribute__((simd("notinbranch"))) float expf(float);
void f(float *x, int n) {
#pragma omp simd
  for (int i = 0; i < n; i++) x[i] = expf(x[i]);
}
"""


class NativeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded on this machine (the message says why)."""


def cache_dir() -> Path:
    """Where compiled libraries are kept: $K3COMPILE_CACHE, else $XDG_CACHE_HOME/k3compile, else ~/.cache/k3compile."""
    root = os.environ.get("K3COMPILE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "k3compile"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run(cmd: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


def _machine(cc: str) -> str:
    """The compiler's version and what -march=native means here: a build for one CPU is never loaded on another."""
    version = _run([cc, "--version"]).stdout
    native = _run([cc, "-march=native", "-E", "-v", "-x", "c", os.devnull]).stderr
    return version + "\n".join(line for line in native.splitlines() if "march" in line)


def _vector_math(cc: str, work: str, flags: Sequence[str]) -> bool:
    """Whether libmvec's vector expf/tanhf link here (glibc 2.35 and later on x86-64)."""
    probe = Path(work) / "probe.c"
    probe.write_text(_PROBE)
    done = _run([cc, *flags, "-o", str(Path(work) / "probe.so"), str(probe), "-lmvec", "-lm"])
    return done.returncode == 0


def _build(cc: str, dest: Path) -> None:
    """Compile every op folder's C source into `dest` (the first of VARIANTS that compiles), through a temporary file renamed
    into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    files = [str(p) for p in sources()]
    with tempfile.TemporaryDirectory(prefix="k3cc-") as work:
        out = Path(work) / dest.name
        errors = []
        for variant in VARIANTS:
            flags = [*FLAGS, *variant]
            libs = ["-lmvec", "-lm"] if _vector_math(cc, work, flags) else ["-lm"]
            defines = ["-DK3_VECTOR_MATH=1"] if "-lmvec" in libs else []
            done = _run([cc, *flags, *defines, f"-I{INCLUDE}", "-o", str(out), *files, *libs])
            if done.returncode == 0:
                break
            errors.append(next((line for line in done.stderr.splitlines() if "error" in line),
                               done.stderr.strip()[:200]))
        else:
            raise NativeUnavailable(f"{Path(cc).name} could not compile the C kernels (kernels/*/*.c): {errors[0]}")
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        os.close(fd)
        shutil.copyfile(out, tmp)
        os.replace(tmp, dest)


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The loaded C kernels, built on first use; NativeUnavailable when they are off or cannot be built."""
    if os.environ.get("K3COMPILE_C_KERNELS", "1").lower() in ("0", "false", "off", "no"):
        raise NativeUnavailable("C kernels turned off (K3COMPILE_C_KERNELS=0)")
    cc = _compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler found ($CC, cc, gcc or clang)")
    key = hashlib.sha256()
    for part in (*FLAGS, *sum(VARIANTS, ()), _machine(cc), *(p.name + p.read_text() for p in sources())):
        key.update(part.encode())
    for h in sorted(INCLUDE.glob("*.h")):
        key.update(h.read_bytes())
    name = f"libk3cpu-{key.hexdigest()[:16]}.so"
    dest = cache_dir() / "kernels" / name
    if not dest.exists():
        try:
            _build(cc, dest)
        except OSError:  # the cache is not writable: build for this process only
            dest = Path(tempfile.mkdtemp(prefix="k3cpu-")) / name
            _build(cc, dest)
    try:
        return ctypes.CDLL(str(dest))
    except OSError as e:
        raise NativeUnavailable(f"cannot load {dest}: {e}") from None


def available() -> tuple[bool, str]:
    """(whether the C kernels run here, why not when they don't)."""
    try:
        library()
    except NativeUnavailable as e:
        return False, str(e)
    return True, "C kernels built for this CPU"


def threads() -> int:
    """OpenMP threads a kernel may use: torch's intra-op thread count."""
    return torch.get_num_threads()


class KernelInputError(TypeError):
    """A C kernel was handed a tensor it cannot read (the message names the kernel, the argument and why)."""


class Buffer(NamedTuple):
    """A pointer argument of a C kernel: the dtype it reads and whether NULL (a None tensor) is allowed."""

    dtype: torch.dtype
    optional: bool = False


F32 = Buffer(torch.float32)
F32_OR_NULL = Buffer(torch.float32, optional=True)
I64 = Buffer(torch.int64)
_F64 = torch.float64
_PLAIN = (Tensor, torch.nn.Parameter)  # exact types: a subclass (DTensor, FakeTensor, ...) may have no CPU memory


def takes(*tensors: Tensor | None) -> bool:
    """Whether the C kernels can run on these tensors (after the fp32/contiguous copies `f32` makes): plain
    strided CPU tensors, none float64 (gradchecks keep the references). False: the caller runs the reference."""
    for t in tensors:
        if t is not None and not (type(t) in _PLAIN and t.is_cpu and t.layout is torch.strided and t.dtype is not _F64):
            return False
    return True


def check(kernel: str, index: int, t: Tensor | None, want: Buffer) -> int | None:
    """The data address of `t` for pointer argument `index` of C kernel `kernel`, after checking that the kernel
    can read it (a plain, dense, contiguous CPU tensor of the declared dtype); KernelInputError otherwise."""
    if t is None:
        if want.optional:
            return None
        raise KernelInputError(f"{kernel}: argument {index} is None, expected a {want.dtype} tensor")
    if type(t) in _PLAIN and t.is_cpu and t.dtype is want.dtype and t.layout is torch.strided and t.is_contiguous():
        return t.data_ptr()
    if type(t) not in _PLAIN:
        why = f"a {type(t).__name__} (a tensor subclass); the C kernels read plain CPU tensors"
    elif not t.is_cpu:
        why = f"on {t.device}; the C kernels run on the CPU"
    elif t.layout != torch.strided:
        why = f"a {t.layout} tensor; the C kernels read dense ones"
    elif t.dtype != want.dtype:
        why = f"{t.dtype}, expected {want.dtype}"
    else:
        why = "not contiguous"
    raise KernelInputError(f"{kernel}: argument {index} is {why}")


class Kernel:
    """A C function of the library, called with tensors for its pointer arguments: each one checked (`check`)."""

    def __init__(self, name: str, argtypes: tuple):
        self.name = name
        self.buffers = tuple((i, a) for i, a in enumerate(argtypes) if isinstance(a, Buffer))
        self.fn = getattr(library(), name)
        self.fn.argtypes = [ctypes.c_void_p if isinstance(a, Buffer) else a for a in argtypes]
        self.fn.restype = None

    def __call__(self, *args) -> None:
        if len(args) != len(self.fn.argtypes):
            raise KernelInputError(f"{self.name}: {len(args)} arguments, expected {len(self.fn.argtypes)}")
        args = list(args)
        for i, want in self.buffers:
            args[i] = check(self.name, i, args[i], want)
        self.fn(*args)


def f32(t: Tensor) -> Tensor:
    """`t` as the kernels read it: fp32, contiguous (no copy when it already is)."""
    return t.to(torch.float32).contiguous()


def expect_numel(kernel: str, what: str, t: Tensor, numel: int) -> None:
    """KernelInputError unless `t` has `numel` elements: the C kernels size every read from other arguments."""
    if t.numel() != numel:
        raise KernelInputError(f"{kernel}: {what} has {t.numel()} elements, expected {numel}")


@lru_cache(maxsize=None)
def function(name: str, argtypes: tuple) -> Kernel:
    """C function `name` of the library with its arguments declared (F32/F32_OR_NULL/I64 for tensors, ctypes.c_int64,
    c_int or c_float for numbers): a Kernel, which checks every tensor it is given."""
    return Kernel(name, argtypes)
