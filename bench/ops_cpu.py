"""CPU benchmark of the KDA core op: chunked vs recurrent form, against a plain fp32 matmul in the same run.

    python bench/ops_cpu.py --threads 1                                   # B=1, T=4096, H=8, K=V=64, chunk 64
    python bench/ops_cpu.py --threads 1 --batch 16 --seq 256 --heads 4    # k3-tiny's training shape
    python bench/ops_cpu.py --tiny                                        # seconds-long smoke run

FLOPs (reference section 2), per head: 6*T*K^2 + 3*T*C*K + T*C^2 for one forward pass of KDA, times B*H.
The same count is used for both forms, so their GFLOP/s compare as throughput on the same work; a
forward+backward counts 3x the forward. The matmul row is an n x n x n fp32 matmul (2*n^3 FLOPs).
Times are the median of --repeats runs after one warm-up, wall clock and process CPU time (the CPU time
is the steadier number on a shared machine; it sums over threads). Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from k3compile.ops.kda import kda


def kda_flops(B: int, T: int, H: int, K: int, C: int) -> float:
    """Forward FLOPs of KDA by the reference's formula (per head 6TK^2 + 3TCK + TC^2)."""
    return float(B * H * (6 * T * K * K + 3 * T * C * K + T * C * C))


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of fn over `repeats` runs after one warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(wall), statistics.median(cpu)


def kda_inputs(B: int, T: int, H: int, K: int, seed: int = 0) -> list[torch.Tensor]:
    """Realistic inputs: L2-normalised q, k; g = -5 * sigmoid(.); beta = sigmoid(.)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [q, k, v, g, beta]


def run(args: argparse.Namespace) -> list[tuple[str, tuple[float, float], float]]:
    """Rows of (name, (wall, CPU) seconds, FLOPs)."""
    B, T, H, K, C = args.batch, args.seq, args.heads, args.head_dim, args.chunk
    n = args.matmul
    a, b = torch.randn(n, n), torch.randn(n, n)
    rows = [(f"matmul fp32 {n}x{n}x{n}", median_seconds(lambda: a @ b, args.repeats), 2.0 * n**3)]
    inputs = kda_inputs(B, T, H, K)
    flops = kda_flops(B, T, H, K, C)
    with torch.no_grad():
        rows.append(("kda chunk fwd", median_seconds(lambda: kda(*inputs, chunk_size=C), args.repeats), flops))
        if not args.no_recurrent:
            times = median_seconds(lambda: kda(*inputs, mode="recurrent"), max(1, args.repeats // 2))
            rows.append(("kda recurrent fwd", times, flops))
    if not args.no_backward:
        leaves = [x.clone().requires_grad_() for x in inputs]

        def fwd_bwd():
            o, _ = kda(*leaves, chunk_size=C)
            o.sum().backward()

        rows.append(("kda chunk fwd+bwd", median_seconds(fwd_bwd, args.repeats), 3 * flops))
    return rows


def render(rows: list[tuple[str, tuple[float, float], float]], args: argparse.Namespace) -> None:
    peak = rows[0][2] / rows[0][1][0]
    tokens = args.batch * args.seq
    title = (f"KDA on CPU: B={args.batch} T={args.seq} H={args.heads} K=V={args.head_dim} C={args.chunk}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    header = ("case", "ms", "CPU ms", "tokens/s", "GFLOP/s", "% of matmul")
    body = []
    for name, (sec, cpu), flops in rows:
        is_mm = name.startswith("matmul")
        body.append((name, f"{sec * 1e3:.1f}", f"{cpu * 1e3:.1f}", "-" if is_mm else f"{tokens / sec:,.0f}",
                     f"{flops / sec / 1e9:.1f}", f"{100 * flops / sec / peak:.1f}"))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(header))
        for row in body:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in body:
        table.add_row(*row)
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--matmul", type=int, default=2048, help="size n of the n x n x n fp32 matmul baseline")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's choice")
    p.add_argument("--no-backward", action="store_true", help="skip the chunked forward+backward row")
    p.add_argument("--no-recurrent", action="store_true", help="skip the (slow) recurrent row")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke test")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.heads, args.head_dim, args.chunk, args.matmul, args.repeats = 40, 2, 8, 16, 64, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    render(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
