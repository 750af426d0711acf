"""CPU training throughput of k3-tiny: the emitted Model, an eager composition of the same modules, torch.compile.

    python bench/train_cpu.py                      # the spec's batch and seq_len, 3 timed steps each
    python bench/train_cpu.py --batch 8 --seq 128 --steps 5
    python bench/train_cpu.py --tiny               # seconds-long smoke run (batch 2 x 32, no torch.compile)
    python bench/train_cpu.py --threads 1 --no-compile   # the steadiest CPU seconds on a shared machine

A step is forward + mean next-token loss + backward + the spec's optimizer step (Per-Head Muon), exactly as
`k3compile train` runs it, on random bytes. Rows:
  emitted   the built package's Model (the bound fx graph as Python, QAT fake quantisation inside; on the CPU
            target its k3 calls run the C kernels bind_kernels chose, or the references, directly through
            k3compile.ops.direct);
  emitted-ref  (--references) the same build with every op on its PyTorch reference (cpu_kernels="torch"):
            what the C kernels add;
  eager     the model definition (k3compile.modules.model.K3Model) run eagerly in train mode with the same
            weights, no passes: experts at the spec's capacity, and with quantization.qat the same fake
            quantisation as the emitted Model (`K3Model.quantize_as_trained`: the routed experts' weights and
            matmul inputs through k3::mx_fake_quantize), so both rows compute the same loss (printed);
  compiled  torch.compile of the emitted Model (compile time reported separately, not in tokens/s).
Columns: the first (warm-up) step, then medians over --steps of forward + backward, the optimizer step and
the whole step, each in process CPU seconds (all threads, user + system: the number to compare on a shared
machine) and wall seconds; tokens/s = batch * seq / median wall step seconds; the first step's loss (the
rows compute the same loss). The timed steps run round-robin over the rows, one step of each in turn, so a
change in a shared machine's load falls on every row alike; the last lines give each row's fwd+bwd CPU
seconds over the emitted Model's, as the ratio of the medians and round by round (the median and range of the
per-round ratios: their spread is the measurement's noise). The header names the CPU
capability torch dispatches to, the thread count, the CPU time of one bf16 and one fp32 Gram matmul (a
256 x 768 Newton-Schulz step: bf16 is native where the two are close, emulated where it is 5-45x slower)
and the precision Muon's Newton-Schulz runs in (see `training.muon_precision`). Nothing here is asserted on.

To measure a CPU without native bf16 on one that has it, restrict PyTorch and oneDNN to AVX2:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/train_cpu.py --batch 8 --seq 128
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import k3compile
from k3compile.kernels._common import native
from k3compile.modules.model import K3Model
from k3compile.runtime.muon import muon_precision
from k3compile.runtime.train import make_optimizer
from k3compile.spec.load import load_spec

ROOT = Path(__file__).resolve().parent.parent


Times = tuple[float, float, float, float]  # CPU s fwd+bwd, CPU s optimizer, wall s fwd+bwd, wall s optimizer


def trainer(model: torch.nn.Module, loss_fn: Callable, spec, tokens: torch.Tensor) -> Callable[[], Times]:
    """One training step of `model` (loss_fn(model, tokens) -> loss) with the spec's optimizer; returns the
    CPU and wall seconds of forward + backward and of the optimizer step. `step.losses` collects the losses."""
    named = list(model.named_parameters())
    opt = make_optimizer(spec, named)

    def step() -> Times:
        wall, cpu = time.perf_counter(), time.process_time()
        loss = loss_fn(model, tokens)
        loss.backward()
        wall_mid, cpu_mid = time.perf_counter(), time.process_time()
        step.losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return cpu_mid - cpu, time.process_time() - cpu_mid, wall_mid - wall, time.perf_counter() - wall_mid

    step.losses = []
    return step


def gram_cpu_ms(dtype: torch.dtype, repeats: int = 10) -> float:
    """CPU milliseconds of one 256 x 768 Gram matmul x x^T in `dtype` (after a warm-up)."""
    x = torch.randn(256, 768).to(dtype)
    x @ x.T
    start = time.process_time()
    for _ in range(repeats):
        x @ x.T
    return (time.process_time() - start) / repeats * 1e3


def emitted_loss(model, tokens):
    return model(tokens, tokens)


def eager_loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def eager_model(spec, state: dict) -> K3Model:
    """The model definition over the emitted Model's weights, in train mode (the lowering input, no passes),
    fake-quantising what the training build does (QAT of the routed experts, through the same k3 ops)."""
    model = K3Model(spec, init=False)
    model.load_state_dict(state, strict=True)
    return model.quantize_as_trained().train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(ROOT / "specs" / "k3-tiny.yaml"))
    parser.add_argument("--build", help="an existing build folder (default: build the spec into a temp dir)")
    parser.add_argument("--batch", type=int, help="batch size (default: the spec's training.batch_size)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the spec's training.seq_len)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row after one warm-up (default 3)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice); on a shared "
                        "machine 1 thread gives the steadiest CPU seconds (idle threads spin-waiting count too)")
    parser.add_argument("--tiny", action="store_true", help="batch 2 x 32, 2 steps, no torch.compile")
    parser.add_argument("--references", action="store_true",
                        help="also time the build over the PyTorch references (no C kernels) as row emitted-ref")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.seq, args.steps, args.no_compile = args.batch or 2, args.seq or 32, 2, True
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = load_spec(args.spec)
    batch, seq = args.batch or spec.training.batch_size, args.seq or spec.training.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        from k3compile.build import BuildOptions, build

        if args.build:
            package = k3compile.load(args.build)
        else:
            start = time.perf_counter()
            dest, _ = build(spec, Path(tmp), BuildOptions(mode="train"))
            package = k3compile.load(dest)
            print(f"built {spec.name} (train) in {time.perf_counter() - start:.1f} s")
        references = None
        if args.references:
            dest, _ = build(spec, Path(tmp) / "references", BuildOptions(mode="train", cpu_kernels="torch"))
            references = k3compile.load(dest)
        run(package, spec, batch, seq, args.steps, not args.no_compile, references)


def c_kernel_calls(package) -> str:
    """How many of the training module's k3 call sites run C kernels, from the package's model.py."""
    source = Path(package.__file__).with_name("model.py").read_text()
    c, ref = source.count("direct.c."), len(re.findall(r"\bdirect\.(?!c\.)\w+\(", source))
    return f"emitted: {c} of {c + ref} k3 call sites in model.py on C kernels ({native.available()[1]})"


def run(package, spec, batch: int, seq: int, steps: int, compile_too: bool, references=None) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq))
    print(
        f"{spec.name}: batch {batch} x seq {seq} = {batch * seq} tokens/step; CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"256 x 768 Gram matmul: bf16 {gram_cpu_ms(torch.bfloat16):.2f} CPU ms, fp32 {gram_cpu_ms(torch.float32):.2f} CPU ms")
    print(muon_precision(spec.training.muon_precision)[1])
    print(c_kernel_calls(package))
    emitted = package.Model().train()
    state = {k: v.detach().clone() for k, v in emitted.state_dict().items()}
    rows: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("emitted", lambda: trainer(emitted, emitted_loss, spec, tokens)),
        ("eager", lambda: trainer(eager_model(spec, state), eager_loss, spec, tokens)),
    ]
    if references is not None:

        def emitted_references():
            model = references.Model().train()
            model.load_state_dict(state)
            return trainer(model, emitted_loss, spec, tokens)

        rows.append(("emitted-ref", emitted_references))
    if compile_too:

        if torch.backends.cpu.get_cpu_capability() == "AVX2":
            import torch._inductor.config as inductor

            inductor.cpp.enable_loop_tail_vec = False  # its AVX2 vectorised loop tails give a NaN loss here
            print("compiled: inductor's loop-tail vectorisation off on AVX2 (docs/benchmarks.md)")

        def compiled():
            model = package.Model().train()
            model.load_state_dict(state)
            return trainer(torch.compile(model), emitted_loss, spec, tokens)

        rows.append(("compiled", compiled))
    print(f"{'':<11} {'first step':>10}  {'CPU seconds (median)':^26}  {'wall seconds (median)':^26}")
    print(f"{'row':<11} {'CPU s':>10}  {'fwd+bwd':>8} {'optim':>8} {'step':>8}  {'fwd+bwd':>8} {'optim':>8} "
          f"{'step':>8}  {'tokens/s':>8}  first loss")
    steppers = {name: make() for name, make in rows}
    first = {name: step() for name, step in steppers.items()}  # warm-up (for compiled: includes compilation)
    times: dict[str, list[Times]] = {name: [] for name in steppers}
    for _ in range(steps):  # round-robin, so a change in the machine's load falls on every row alike
        for name, step in steppers.items():
            times[name].append(step())
    for name, step in steppers.items():
        med = [statistics.median(t[i] for t in times[name]) for i in range(4)]
        cpu_total = statistics.median(t[0] + t[1] for t in times[name])
        wall_total = statistics.median(t[2] + t[3] for t in times[name])
        print(
            f"{name:<11} {first[name][0] + first[name][1]:>10.2f}  {med[0]:>8.2f} {med[1]:>8.2f} {cpu_total:>8.2f}  "
            f"{med[2]:>8.2f} {med[3]:>8.2f} {wall_total:>8.2f}  {batch * seq / wall_total:>8.0f}  {step.losses[0]:.6f}",
            flush=True,
        )
    base = statistics.median(t[0] for t in times["emitted"])
    for name in steppers:
        if name != "emitted":
            paired = sorted(t[0] / e[0] for t, e in zip(times[name], times["emitted"]))
            print(f"fwd+bwd CPU s {name} / emitted: {statistics.median(t[0] for t in times[name]) / base:.2f}x "
                  f"(round by round: median {statistics.median(paired):.2f}x, range {paired[0]:.2f}-{paired[-1]:.2f}x)")


if __name__ == "__main__":
    main()
