"""Compile Triton kernels for an NVIDIA GPU on any machine and read what the GPU would run.

No GPU is needed: Triton lowers a kernel for a named target (sm_80, sm_90a, sm_100a), which gives its shared
memory and TTGIR (tensor-core products show as `warp_group_dot` for Hopper's wgmma, `tc_gen5_mma` for
Blackwell's tcgen05, `mma` layouts for Ampere's mma.sync), and the ptxas shipped inside the triton package
(`ptxas -v`) reports registers and spills. Two ways in:

    report = compile(kernel_fn, {"x_ptr": "*bf16", "n": "i32"}, {"BLOCK": 128}, target="h200", num_warps=4)
    for launch in launches(lambda: my_wrapper(x_meta), target="h200"):  # what a wrapper would launch there
        report = launch.compile()

`launches` runs a kernel wrapper on meta tensors (no data, any size) with Triton's launch intercepted and the
launch configurations of the named target, and returns each kernel launch it would make with its arguments,
specialised as Triton's runtime would (16-byte alignment, integer divisibility, constants). Run it in a
process where TRITON_INTERPRET is off (the interpreter replaces the kernels with Python functions).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from k3compile.kernels._common.launch import DEVICES, interpreting, planning

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def arch_of(target: str | int) -> int:
    """Compute capability x 10 of a target: "h200", "sm_90a", "90" or 90 -> 90."""
    if isinstance(target, int):
        return target
    if target in DEVICES:
        return DEVICES[target].arch
    found = re.fullmatch(r"(?:sm_)?(\d+)a?", target)
    if not found:
        raise ValueError(f"unknown target {target!r}: a device ({', '.join(DEVICES)}) or an sm_XX architecture")
    return int(found.group(1))


def shared_limit(target: str | int) -> int:
    """The most shared memory one program may use on `target` (bytes)."""
    arch = arch_of(target)
    return min(d.shared for d in DEVICES.values() if d.arch == arch)


@dataclass
class Report:
    """What one compiled kernel uses on its target, per program (shared) and per thread (registers, spills)."""

    name: str
    arch: int
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    spill_bytes: int
    wgmma: bool  # Hopper's warp-group MMA (TTGIR warp_group_dot)
    tcgen05: bool  # Blackwell's tensor-memory MMA (TTGIR tc_gen5_mma)
    mma: bool  # any tensor-core product: wgmma, tcgen05 or Ampere's mma.sync
    wgmma_serialized: bool  # ptxas serialised the wgmma pipeline (no overlap with other instructions)
    ttgir: str = field(repr=False)
    ptxas_log: str = field(repr=False, default="")
    cubin: bytes = field(repr=False, default=b"")

    def __getitem__(self, key: str):  # reports read as dicts too: report["shared"]
        return getattr(self, key)

    def sass(self) -> str:
        """The kernel's machine code (SASS), disassembled by the nvdisasm bundled with triton."""
        from triton import knobs

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernel.cubin"
            path.write_bytes(self.cubin)
            return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", str(path)], capture_output=True, text=True,
                                  check=True).stdout

    @property
    def products(self) -> str:
        """"wgmma", "tcgen05", "mma.sync" or "fma": what runs the kernel's tl.dot products."""
        return "wgmma" if self.wgmma else "tcgen05" if self.tcgen05 else "mma.sync" if self.mma else "fma"

    def summary(self) -> str:
        products = self.products
        if self.wgmma_serialized:
            products += " (serialized by ptxas)"
        return (f"{self.name} sm_{self.arch} w{self.num_warps}s{self.num_stages}: {self.shared / 1024:.1f} KiB shared, "
                f"{self.registers} registers, {self.spill_bytes} B spills, {products}")


def _ptxas_stats(ptx: str, arch: int) -> tuple[int, int, str]:
    """(registers, spilled bytes per thread: the larger of spill stores and loads, ptxas's log) from the bundled
    ptxas; its log is kept beside Triton's own cache, keyed by the PTX, so a second look costs nothing."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path
    key = hashlib.sha256(f"{ptxas}\0{arch}\0{ptx}".encode()).hexdigest()
    cached = Path(knobs.cache.dir) / "k3_ptxas" / f"{key}.log"
    if cached.is_file():
        log = cached.read_text()
    else:
        log = _run_ptxas(ptxas, ptx, sm_arch_from_capability(arch))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{key}.{os.getpid()}")
        tmp.write_text(log)
        os.replace(tmp, cached)
    registers = max((int(r) for r in _REGISTERS.findall(log)), default=0)
    spills = max((max(int(s), int(l)) for s, l in _SPILLS.findall(log)), default=0)
    return registers, spills, log


def _run_ptxas(ptxas: str, ptx: str, gpu_name: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu_name}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
    return done.stdout + done.stderr


def _report(kernel, arch: int, num_warps: int, num_stages: int) -> Report:
    ttgir = kernel.asm["ttgir"]
    registers, spills, log = _ptxas_stats(kernel.asm["ptx"], arch)
    return Report(
        name=kernel.name, arch=arch, num_warps=num_warps, num_stages=num_stages, shared=kernel.metadata.shared,
        registers=registers, spill_bytes=spills,
        wgmma="ttng.warp_group_dot " in ttgir, tcgen05=bool(re.search(r"ttng\.tc_gen5_mma(_scaled)? ", ttgir)),
        mma=bool(re.search(r"ttng\.warp_group_dot |ttng\.tc_gen5_mma(_scaled)? |versionMajor = 2", ttgir)),
        wgmma_serialized="wgmma.mma_async instructions are serialized" in log,
        ttgir=ttgir, ptxas_log=log, cubin=kernel.asm["cubin"],
    )


def _gpu_target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def compile(
    kernel_fn, signature: dict[str, str], constexprs: dict | None = None, target: str | int = "h200",
    num_warps: int = 4, num_stages: int = 3, attrs: dict | None = None,
) -> Report:
    """Compile the @triton.jit `kernel_fn` for `target` and report its resources.

    signature: runtime argument -> Triton type ("*bf16", "*fp32", "i32", "i64", "fp32"); an "i32:16" or "*bf16:16"
    adds Triton's divisible-by-16 hint (pointers get it unless given ":1", as Triton's runtime gives 16-byte
    aligned tensors). constexprs: constexpr argument -> value. attrs: Triton's own attribute dict, if needed.
    """
    import triton
    from triton.compiler import ASTSource

    constexprs = dict(constexprs or {})
    sig, hints = {}, dict(attrs or {})
    names = kernel_fn.arg_names
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name not in signature:
            raise ValueError(f"{kernel_fn.__name__}: no type for argument {name!r}")
        kind, _, hint = signature[name].partition(":")
        sig[name] = kind
        if hint == "16" or (kind.startswith("*") and hint != "1"):
            hints.setdefault((names.index(name),), [["tt.divisibility", 16]])
    arch = arch_of(target)
    source = ASTSource(kernel_fn, sig, constexprs=constexprs, attrs=hints)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(source, target=_gpu_target(arch), options=options)
    return _report(kernel, arch, num_warps, num_stages)


@dataclass
class Launch:
    """One intercepted kernel launch: the kernel, its bound arguments and launch options, for one target."""

    kernel_fn: object
    args: tuple
    kwargs: dict
    arch: int

    @property
    def name(self) -> str:
        return self.kernel_fn.__name__

    @property
    def num_warps(self) -> int:
        return self.kwargs.get("num_warps", 4)

    @property
    def num_stages(self) -> int:
        return self.kwargs.get("num_stages", 3)

    def constants(self) -> dict:
        """The launch's constexpr arguments by name (block sizes, flags)."""
        fn = self.kernel_fn
        bound = fn.signature.bind(*self.args, **{k: v for k, v in self.kwargs.items() if k in fn.arg_names})
        return {p.name: bound.arguments.get(p.name) for p in fn.params if p.is_constexpr}

    def compile(self) -> Report:
        """Compile exactly what Triton's runtime would for these arguments (its own specialisation rules)."""
        import triton
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        fn = self.kernel_fn
        backend = make_backend(_gpu_target(self.arch))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*self.args, **self.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, self.kwargs, bound, specialization, options)
        source = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(source, target=_gpu_target(self.arch), options=options.__dict__)
        return _report(kernel, self.arch, options.num_warps, options.num_stages)


@contextmanager
def _intercepted(arch: int) -> Iterator[list[Launch]]:
    from triton.runtime.jit import JITFunction

    seen: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append(Launch(self, args, kwargs, arch))

    original = JITFunction.run
    JITFunction.run = record
    try:
        yield seen
    finally:
        JITFunction.run = original


def launches(call: Callable[[], object], target: str = "h200") -> list[Launch]:
    """The kernel launches `call()` makes on `target` (a device name: its configs and SM count), without running them.

    `call` should pass meta tensors (torch.empty(..., device="meta")): nothing is allocated or computed.
    """
    if interpreting():
        raise RuntimeError("sm_check.launches needs TRITON_INTERPRET off: the interpreter has no kernels to compile")
    if target not in DEVICES:
        raise ValueError(f"launches needs a device target ({', '.join(DEVICES)}), got {target!r}")
    with planning(target), _intercepted(DEVICES[target].arch) as seen:
        call()
    return list(seen)


__all__ = ["Launch", "Report", "arch_of", "compile", "launches", "shared_limit"]
