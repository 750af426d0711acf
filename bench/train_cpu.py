"""CPU training throughput of k3-tiny: the emitted Model, an eager composition of the same modules, torch.compile.

    python bench/train_cpu.py                      # the spec's batch and seq_len, 3 timed steps each
    python bench/train_cpu.py --batch 8 --seq 128 --steps 5
    python bench/train_cpu.py --tiny               # seconds-long smoke run (batch 2 x 32, no torch.compile)

A step is forward + mean next-token loss + backward + the spec's optimizer step (Per-Head Muon), exactly as
`k3compile train` runs it, on random bytes. Rows:
  emitted   the built package's Model (the bound fx graph as Python, QAT fake quantisation inside);
  eager     the model definition (k3compile.modules.model.K3Model) run eagerly in train mode with the same
            weights, no passes: experts at the spec's capacity, no quantisation;
  compiled  torch.compile of the emitted Model (compile time reported separately, not in tokens/s).
Columns: the first (warm-up) step, then medians over --steps of forward + backward, the optimizer step and
the whole step; tokens/s = batch * seq / median step seconds. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import k3compile
from k3compile.modules.model import K3Model
from k3compile.runtime.train import make_optimizer
from k3compile.spec.load import load_spec

ROOT = Path(__file__).resolve().parent.parent


def trainer(model: torch.nn.Module, loss_fn: Callable, spec, tokens: torch.Tensor) -> Callable[[], tuple[float, float]]:
    """One training step of `model` (loss_fn(model, tokens) -> loss) with the spec's optimizer; returns the
    seconds of forward + backward and of the optimizer step."""
    named = list(model.named_parameters())
    opt = make_optimizer(spec, named)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        loss_fn(model, tokens).backward()
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - middle

    return step


def emitted_loss(model, tokens):
    return model(tokens, tokens)


def eager_loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def eager_model(spec, state: dict) -> K3Model:
    """The model definition over the emitted Model's weights, in train mode (the lowering input, no passes)."""
    model = K3Model(spec, init=False)
    model.load_state_dict(state, strict=True)
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(ROOT / "specs" / "k3-tiny.yaml"))
    parser.add_argument("--build", help="an existing build folder (default: build the spec into a temp dir)")
    parser.add_argument("--batch", type=int, help="batch size (default: the spec's training.batch_size)")
    parser.add_argument("--seq", type=int, help="sequence length (default: the spec's training.seq_len)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row after one warm-up (default 3)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--tiny", action="store_true", help="batch 2 x 32, 2 steps, no torch.compile")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.seq, args.steps, args.no_compile = args.batch or 2, args.seq or 32, 2, True
    spec = load_spec(args.spec)
    batch, seq = args.batch or spec.training.batch_size, args.seq or spec.training.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        if args.build:
            package = k3compile.load(args.build)
        else:
            from k3compile.build import BuildOptions, build

            start = time.perf_counter()
            dest, _ = build(spec, Path(tmp), BuildOptions(mode="train"))
            package = k3compile.load(dest)
            print(f"built {spec.name} (train) in {time.perf_counter() - start:.1f} s")
        run(package, spec, batch, seq, args.steps, not args.no_compile)


def run(package, spec, batch: int, seq: int, steps: int, compile_too: bool) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (batch, seq))
    print(f"{spec.name}: batch {batch} x seq {seq} = {batch * seq} tokens/step, {torch.get_num_threads()} threads")
    emitted = package.Model().train()
    state = {k: v.detach().clone() for k, v in emitted.state_dict().items()}
    rows: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("emitted", lambda: trainer(emitted, emitted_loss, spec, tokens)),
        ("eager", lambda: trainer(eager_model(spec, state), eager_loss, spec, tokens)),
    ]
    if compile_too:

        def compiled():
            model = package.Model().train()
            model.load_state_dict(state)
            return trainer(torch.compile(model), emitted_loss, spec, tokens)

        rows.append(("compiled", compiled))
    print(f"{'row':<10} {'first step s':>13} {'fwd+bwd s':>10} {'optim s':>8} {'step s':>7} {'tokens/s':>9}")
    for name, make in rows:
        step = make()
        first = sum(step())  # warm-up (for compiled: includes compilation)
        times = [step() for _ in range(steps)]
        model_s, optim_s = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        total = statistics.median(sum(t) for t in times)
        print(
            f"{name:<10} {first:>13.2f} {model_s:>10.2f} {optim_s:>8.2f} {total:>7.2f} {batch * seq / total:>9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
