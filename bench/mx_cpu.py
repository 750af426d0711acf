"""CPU benchmark of MX fake-quantise / quantise / dequantise: float64 reference vs the fast path the ops run.

    python bench/mx_cpu.py                  # QAT shapes: expert weights [32,128,128] e2m1, activations [4096,128] e4m3
    python bench/mx_cpu.py --threads 1      # pin torch's intra-op threads (steadier on a shared machine)
    python bench/mx_cpu.py --tiny           # seconds-long smoke run

Both paths are timed in the same run, interleaved (reference, fast, reference, ...), so load from other
processes hits both alike; each row also checks that the two outputs have the same bits (NaN-free inputs).
Times are medians of --repeats runs after one warm-up: wall clock, and process CPU time (all threads),
which is the steadier of the two on a shared machine. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from k3compile.kernels.mx import reference as mx
from k3compile.kernels.mx import op as ops

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[tuple[float, float]]:
    """(median wall seconds, median CPU seconds) of each function, run in turn `repeats` times after a warm-up."""
    for fn in fns:
        fn()
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            ts.append((time.perf_counter() - wall, time.process_time() - cpu))
    return [(statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for ts in times]


def same_bits(a, b) -> bool:
    """Every output tensor equal bit for bit (payload, scales or values)."""
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def cases(tiny: bool) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(name, reference call, fast call) rows: the float64 reference functions vs the registered ops."""
    gen = torch.Generator().manual_seed(0)
    experts, rows = (4, 512) if tiny else (32, 4096)
    w = torch.randn(experts, 128, 128, generator=gen) * 0.02  # routed-expert weights, one projection
    a = torch.randn(rows, 128, generator=gen)  # activations
    wb = w.to(torch.bfloat16)
    fake, quant = (mx.mx_fake_quantize_ref, ops.mx_fake_quantize), (mx.mx_quantize_ref, ops.mx_quantize)
    rows = [(fake, w, "e2m1"), (fake, a, "e4m3"), (fake, wb, "e2m1"), (quant, w, "e2m1"), (quant, a, "e4m3")]
    out = [
        (f"{fast.__name__} {fmt} {str(t.dtype)[6:]} {list(t.shape)}", partial(ref, t, fmt), partial(fast, t, fmt))
        for (ref, fast), t, fmt in rows
    ]
    data, scale = mx.mx_quantize_ref(w, "e2m1", 32)
    dequant = (mx.mx_dequantize_ref, ops.mx_dequantize)
    out.append((f"mx_dequantize e2m1 float32 {list(w.shape)}", *(partial(fn, data, scale, "e2m1") for fn in dequant)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--tiny", action="store_true", help="small shapes, 3 repeats")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.tiny else args.repeats
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    print(f"{'case':46s} {'ref ms':>8s} {'fast ms':>8s} {'x':>6s}   {'ref CPU ms':>10s} {'fast':>6s} {'x':>6s}  bits")
    with torch.no_grad():
        for name, ref_fn, fast_fn in cases(args.tiny):
            (w_ref, c_ref), (w_fast, c_fast) = interleaved_medians([ref_fn, fast_fn], repeats)
            bits = "same" if same_bits(ref_fn(), fast_fn()) else "DIFFER"
            walls = f"{w_ref * 1e3:8.2f} {w_fast * 1e3:8.2f} {w_ref / w_fast:5.1f}x"
            cpus = f"{c_ref * 1e3:10.2f} {c_fast * 1e3:6.2f} {c_ref / max(c_fast, 1e-9):5.1f}x"
            print(f"{name:46s} {walls}   {cpus}  {bits}")

if __name__ == "__main__":
    main()
