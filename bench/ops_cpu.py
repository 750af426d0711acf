"""CPU benchmarks of the k3 ops: KDA's chunked vs recurrent form, each differentiable op's backward/forward
ratio, and KDA chunk's cost per token as T grows.

    python bench/ops_cpu.py --threads 1                                   # all three tables
    python bench/ops_cpu.py --threads 1 --only kda --batch 16 --seq 256 --heads 4   # k3-tiny's training shape
    python bench/ops_cpu.py --threads 1 --only ratios                     # backward/forward per op
    python bench/ops_cpu.py --threads 1 --only scaling                    # KDA chunk at T = 1024 and 16384
    python bench/ops_cpu.py --tiny                                        # seconds-long smoke run

Every table's title names the CPU capability torch dispatches to and the thread count. Times are medians
of --repeats runs after one warm-up, in process CPU seconds (all threads, user + system: the steady number on
a shared machine) beside wall seconds. Nothing here is asserted on.

kda: FLOPs (reference section 2), per head: 6*T*K^2 + 3*T*C*K + T*C^2 for one forward pass of KDA, times
B*H. The same count is used for both forms, so their GFLOP/s compare as throughput on the same work; a
forward+backward counts 3x the forward. The matmul row is an n x n x n fp32 matmul (2*n^3 FLOPs).

ratios: each op at k3-tiny's training shapes (batch 8 x 128, fp32): the forward with inputs that require
grad, then its backward (torch.autograd.grad with random cotangents), run in turn; bwd/fwd is the ratio of
their CPU times. The "recompute" columns time what a backward that recomputes the reference under
torch.func.vjp costs instead (the registry's generic backward), in the same run. Rows named c:<op> run the C
kernels a CPU build binds (backend "c"; absent where they cannot be built). A plain linear layer and KDA chunk
(both with their own backwards) are rows for scale.

scaling: KDA chunk forward (no grad) at B=1, H=--heads, K=V=--head-dim and T = 1024 and 16384: CPU
microseconds per token, and minor page faults per call (resource.getrusage ru_minflt: memory freshly mapped).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

import k3compile.ops  # noqa: F401  (registers torch.ops.k3.*)
from k3compile.kernels.kda.reference import chunk_for
from k3compile.kernels.kda.op import kda

Times = tuple[float, float]  # (wall, CPU) seconds


def kda_flops(B: int, T: int, H: int, K: int, C: int) -> float:
    """Forward FLOPs of KDA by the reference's formula (per head 6TK^2 + 3TCK + TC^2)."""
    return float(B * H * (6 * T * K * K + 3 * T * C * K + T * C * C))


def median_seconds(fn: Callable[[], object], repeats: int) -> Times:
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


def header(what: str) -> str:
    return (f"{what}; CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}")


def print_table(title: str, columns: Sequence[str], body: list[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(columns))
        for row in body:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for i, h in enumerate(columns):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)  # the op names whole
    for row in body:
        table.add_row(*row)
    Console(width=max(120, sum(len(c) + 3 for c in columns))).print(table)


# ---------------------------------------------------------------- kda: chunked vs recurrent


def run_kda(args: argparse.Namespace) -> list[tuple[str, Times, float]]:
    """Rows of (name, (wall, CPU) seconds, FLOPs)."""
    B, T, H, K, C = args.batch, args.seq, args.heads, args.head_dim, args.chunk
    n = args.matmul
    a, b = torch.randn(n, n), torch.randn(n, n)
    rows = [(f"matmul fp32 {n}x{n}x{n}", median_seconds(lambda: a @ b, args.repeats), 2.0 * n**3)]
    inputs = kda_inputs(B, T, H, K)
    flops = kda_flops(B, T, H, K, chunk_for(T, C))  # the chunk a short sequence runs
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


def render_kda(rows: list[tuple[str, Times, float]], args: argparse.Namespace) -> None:
    peak = rows[0][2] / rows[0][1][0]
    tokens = args.batch * args.seq
    runs = chunk_for(args.seq, args.chunk)
    chunk = f"C={args.chunk}" + (f" (runs {runs}: T is shorter)" if runs != args.chunk else "")
    title = header(f"KDA on CPU: B={args.batch} T={args.seq} H={args.heads} K=V={args.head_dim} {chunk}")
    body = []
    for name, (sec, cpu), flops in rows:
        is_mm = name.startswith("matmul")
        body.append((name, f"{sec * 1e3:.1f}", f"{cpu * 1e3:.1f}", "-" if is_mm else f"{tokens / sec:,.0f}",
                     f"{flops / sec / 1e9:.1f}", f"{100 * flops / sec / peak:.1f}"))
    print_table(title, ("case", "ms", "CPU ms", "tokens/s", "GFLOP/s", "% of matmul"), body)


# ---------------------------------------------------------------- ratios: backward / forward per op


class Case:
    """One op call: `fn(*leaves, *rest)` differentiated w.r.t. the leaves; `reference(*leaves, *rest)` is the
    composition a recomputing backward differentiates (None: the op's backward is the only one)."""

    def __init__(self, name: str, shape: str, fn: Callable, leaves: list[torch.Tensor], rest: tuple = (),
                 reference: Callable | None = None):
        self.name, self.shape, self.fn, self.rest, self.reference = name, shape, fn, rest, reference
        self.leaves = [t.requires_grad_() for t in leaves]

    def outputs(self, fn: Callable, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = fn(*leaves, *self.rest)
        return list(out) if isinstance(out, (tuple, list)) else [out]


def ratio_cases(tiny: bool) -> list[Case]:
    """The ops with hand-written backwards at k3-tiny's training shapes (batch 8 x 128), their C kernels, and two
    for scale."""
    from k3compile.kernels.activations import reference as activations
    from k3compile.kernels.attn_res import reference as attn_res
    from k3compile.kernels.experts import reference as experts
    from k3compile.kernels.fused import reference as fused
    from k3compile.kernels.norms import reference as norms
    from k3compile.kernels.short_conv import reference as short_conv

    gen = torch.Generator().manual_seed(0)
    N, D, H, Kh, I, E, Cap, L = (64, 32, 2, 16, 48, 4, 16, 16) if tiny else (1024, 256, 4, 64, 768, 32, 192, 128)
    S = 4

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    ops = torch.ops.k3
    return [
        Case("attn_res", f"S={S} [{N}, {D}]", ops.attn_res.default,
             [randn(S, 8, N // 8, D), randn(D, scale=0.1), 1 + randn(D, scale=0.1)], (1e-5,), attn_res.attn_res_ref),
        Case("rms_norm", f"[{N}, {D}]", ops.rms_norm.default, [randn(N, D), randn(D)], (1e-5,), norms.rms_norm_ref),
        Case("add_rms_norm", f"[{N}, {D}]", ops.add_rms_norm.default, [randn(N, D), randn(N, D), randn(D)], (1e-5,),
             norms.add_rms_norm_ref),
        Case("rms_norm_gate", f"[{N}, {H}, {Kh}]", ops.rms_norm_gate.default,
             [randn(N, H, Kh), randn(Kh), randn(N, H, Kh)], (1e-5,), norms.rms_norm_gate_ref),
        Case("l2_norm", f"[{N}, {H}, {Kh}]", ops.l2_norm.default, [randn(N, H, Kh)], (1e-6,), norms.l2_norm_ref),
        Case("short_conv", f"[8, {N // 8}, {D}] W=4", ops.short_conv.default, [randn(8, N // 8, D), randn(D, 4, scale=0.5)],
             (None,), short_conv.short_conv_ref),
        Case("situ_glu", f"[{N}, {I}]", ops.situ_glu.default, [randn(N, I, scale=2), randn(N, I, scale=2)], (4.0, 25.0),
             activations.situ_glu_ref),
        Case("glu_train", f"[{N}, {I}]", lambda g, u, *r: ops.glu_train.default(g, u, *r)[0],
             [randn(N, I, scale=2), randn(N, I, scale=2)], ("situ_glu", 4.0, 25.0),
             lambda g, u, kind, b1, b2: activations.situ_glu_ref(g, u, b1, b2)),
        Case("linear_glu", f"[{N}, {D}] x [{I}, {D}]", ops.linear_glu.default,
             [randn(N, D), randn(I, D, scale=D**-0.5), randn(I, D, scale=D**-0.5)], ("situ_glu", 4.0, 25.0),
             fused.linear_glu_ref),
        Case("expert_glu", f"[{E}, {Cap}, {L}] x [{E}, {L}, {L}]", ops.expert_glu.default,
             [randn(E, Cap, L), randn(E, L, L, scale=L**-0.5), randn(E, L, L, scale=L**-0.5)], ("situ_glu", 4.0, 25.0),
             experts.expert_glu_ref),
        Case("expert_matmul", f"[{E}, {Cap}, {L}] x [{E}, {L}, {L}]", ops.expert_matmul.default,
             [randn(E, Cap, L), randn(E, L, L, scale=L**-0.5)], (), experts.expert_matmul_ref),
        *c_kernel_cases(randn, N, D, H, Kh, I),
        Case("linear (scale)", f"[{N}, {D}] x [{I}, {D}]", F.linear, [randn(N, D), randn(I, D, scale=D**-0.5)]),
        Case("kda_chunk (scale)", f"B=8 T={N // 8} H={H} K=V={Kh}",
             lambda *a: kda(*a, chunk_size=16 if tiny else 64)[0], kda_inputs(8, N // 8, H, Kh)),
    ]


def c_kernel_cases(randn: Callable, N: int, D: int, H: int, Kh: int, I: int) -> list[Case]:
    """The same ops through their C kernels (backend "c", what a CPU build binds), and the C kernels of the ops
    only a CPU build runs (attn_res_normed, kda_gate, moe_combine); none where the C kernels cannot be built."""
    from k3compile.kernels._common import native

    if not native.available()[0]:
        return []
    ops = torch.ops.k3

    def c(op):
        return lambda *args: op(*args, backend="c")

    S, T = 4, N // 8
    slots = torch.randperm(N * 4, generator=torch.Generator().manual_seed(1)).view(N, 4)
    return [
        Case("c:attn_res_normed", f"S={S} [{N}, {D}]", c(ops.attn_res_normed.default),
             [randn(S, 8, T, D), 1 + randn(S, 8, T, scale=0.1), randn(D, scale=0.1), 1 + randn(D, scale=0.1)]),
        Case("c:rms_norm", f"[{N}, {D}]", c(ops.rms_norm.default), [randn(N, D), randn(D)], (1e-5,)),
        Case("c:rms_norm_gate", f"[{N}, {H}, {Kh}]", c(ops.rms_norm_gate.default),
             [randn(N, H, Kh), randn(Kh), randn(N, H, Kh)], (1e-5,)),
        Case("c:l2_norm", f"[{N}, {H}, {Kh}]", c(ops.l2_norm.default), [randn(N, H, Kh)], (1e-6,)),
        Case("c:short_conv", f"[8, {T}, {D}] W=4", c(ops.short_conv.default),
             [randn(8, T, D), randn(D, 4, scale=0.5)], (None,)),
        Case("c:glu_train", f"[{N}, {I}]", lambda g, u, *r: ops.glu_train.default(g, u, *r, backend="c")[0],
             [randn(N, I, scale=2), randn(N, I, scale=2)], ("situ_glu", 4.0, 25.0)),
        Case("c:kda_gate", f"[8, {T}, {H}, {Kh}]", c(ops.kda_gate.default),
             [randn(8, T, H, Kh), randn(H, scale=0.5), randn(H * Kh)], ("lower_bounded_sigmoid", -5.0)),
        Case("c:moe_combine", f"[{N * 4}, {D}] K=4", c(ops.moe_combine.default),
             [randn(1, N * 4, D), randn(N, 4).abs()], (slots,)),
    ]


def time_ratio(case: Case, repeats: int) -> dict[str, Times]:
    """Median (wall, CPU) seconds of the forward, the op's backward and (if any) a recomputing backward."""
    cotangents = [torch.randn_like(o) for o in case.outputs(case.fn, case.leaves)]
    samples: dict[str, list[Times]] = {"fwd": [], "bwd": [], "recompute": []}

    def timed(key: str, fn: Callable[[], object]):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        samples[key].append((time.perf_counter() - wall, time.process_time() - cpu))
        return out

    def recompute():
        def f(*d):
            return tuple(case.outputs(case.reference, d))

        _, vjp = torch.func.vjp(f, *[t.detach() for t in case.leaves])
        return vjp(tuple(cotangents))

    for i in range(repeats + 1):  # the first round warms up
        outs = timed("fwd", lambda: case.outputs(case.fn, case.leaves))
        timed("bwd", lambda: torch.autograd.grad(outs, case.leaves, cotangents))
        if case.reference is not None:
            timed("recompute", recompute)
        if i == 0:
            samples = {k: [] for k in samples}
    return {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in samples.items() if v}


def render_ratios(cases: list[Case], repeats: int) -> None:
    body = []
    for case in cases:
        t = time_ratio(case, repeats)
        (fw, fc), (bw, bc) = t["fwd"], t["bwd"]
        rc = t["recompute"][1] if "recompute" in t else None
        body.append((case.name, case.shape, f"{fc * 1e3:.2f}", f"{bc * 1e3:.2f}", f"{bc / fc:.2f}",
                     "-" if rc is None else f"{rc * 1e3:.2f}", "-" if rc is None else f"{rc / fc:.2f}",
                     f"{fw * 1e3:.2f}", f"{bw * 1e3:.2f}"))
    columns = ("op", "shape", "fwd CPU ms", "bwd CPU ms", "bwd/fwd", "recompute CPU ms", "recompute/fwd",
               "fwd ms", "bwd ms")
    print_table(header(f"Backward / forward CPU time, fp32, median of {repeats}"), columns, body)


# ---------------------------------------------------------------- scaling: KDA chunk cost per token in T


def render_scaling(args: argparse.Namespace, lengths: Sequence[int]) -> None:
    body = []
    for T in lengths:
        inputs = kda_inputs(1, T, args.heads, args.head_dim)
        with torch.no_grad():
            kda(*inputs, chunk_size=args.chunk)  # warm-up
            faults, walls, cpus = [], [], []
            for _ in range(args.repeats):
                before = resource.getrusage(resource.RUSAGE_SELF)
                wall, cpu = time.perf_counter(), time.process_time()
                kda(*inputs, chunk_size=args.chunk)
                cpus.append(time.process_time() - cpu)
                walls.append(time.perf_counter() - wall)
                after = resource.getrusage(resource.RUSAGE_SELF)
                faults.append(after.ru_minflt - before.ru_minflt)
        cpu, wall = statistics.median(cpus), statistics.median(walls)
        body.append((f"T={T}", f"{cpu * 1e6 / T:.2f}", f"{wall * 1e6 / T:.2f}", f"{cpu * 1e3:.1f}",
                     f"{statistics.median(faults):,.0f}"))
    title = header(f"KDA chunk forward per token: B=1 H={args.heads} K=V={args.head_dim} C={args.chunk}")
    print_table(title, ("length", "CPU us/token", "wall us/token", "CPU ms/call", "minor faults/call"), body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("kda", "ratios", "scaling"), help="one table (default: all three)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--matmul", type=int, default=2048, help="size n of the n x n x n fp32 matmul baseline")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ratio-repeats", type=int, default=15, help="rounds of the ratios table (default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's choice")
    p.add_argument("--no-backward", action="store_true", help="skip the chunked forward+backward row")
    p.add_argument("--no-recurrent", action="store_true", help="skip the (slow) recurrent row")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a smoke test")
    args = p.parse_args(argv)
    lengths = (1024, 16384)
    if args.tiny:
        args.seq, args.heads, args.head_dim, args.chunk, args.matmul, args.repeats = 40, 2, 8, 16, 64, 1
        args.ratio_repeats, lengths = 1, (32, 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only in (None, "kda"):
        render_kda(run_kda(args), args)
    if args.only in (None, "ratios"):
        render_ratios(ratio_cases(args.tiny), args.ratio_repeats)
    if args.only in (None, "scaling"):
        render_scaling(args, lengths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
