"""CPU decode benchmark: tokens/s of the compiled decode graph, of torch.compile of it, and of all-MLA, at growing context.

    python bench/decode_cpu.py                      # contexts 256 .. 16384 (k3-tiny's context_length)
    python bench/decode_cpu.py --max-context 4096   # skip the largest contexts
    python bench/decode_cpu.py --no-compile         # the decode graph only (torch.compile takes a minute)
    python bench/decode_cpu.py --tiny               # seconds-long smoke run (contexts 16, 32)

Each spec is built (`--mode infer`) into a temporary folder and served by its InferenceModel (seeded
weights, fp32, batch 1, MX-packed experts): the prefill graph, then the decode graph. A context
point N prefills a short prompt into caches preallocated to N rows and marks the cache as holding
N - steps - 1 tokens (`--fill tile`: the prompt's MLA latent rows repeated up to there; the KDA
state, whose size does not depend on position, is the real one), or prefills N - steps - 1 real
tokens (`--fill prefill`). Then one untimed warm-up step and `--steps` timed steps: the cache ends
holding exactly N tokens, and its bytes are read there (`DecodeCache.nbytes()`). A decode step's
work depends only on the shapes and the positions, so both fills time the same computation.
Tokens/s is the inverse of the fastest step (on a shared machine slower steps measure the load);
CPU seconds per step (process time) are printed beside wall seconds. "compiled" runs
torch.compile(model.decode_graph) (inductor) over the same caches.
Nothing here is asserted on; the cache-bytes facts are tested in tests/runtime/test_generate.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"k3-tiny": ROOT / "specs" / "k3-tiny.yaml", "all-mla": ROOT / "specs" / "ablations" / "all-mla.yaml"}
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384)
TILE_PROMPT = 64  # real tokens prefilled before tiling


@torch.inference_mode()
def filled_cache(model, n: int, max_len: int, fill: str, seed: int = 0):
    """A batch-1 cache with room for `max_len` tokens that holds `n` (real, or a real prompt's latents tiled)."""
    gen = torch.Generator().manual_seed(seed)
    real = n if fill == "prefill" else min(n, TILE_PROMPT)
    tokens = torch.randint(0, model.spec.vocab_size, (1, real), generator=gen)
    _, cache = model.prefill(tokens, max_len)
    if real < n:
        for name, t in cache.tensors.items():
            if name.startswith("mla_cache"):
                reps = -(-n // real)
                t[:, :n] = t[:, :real].repeat(1, reps, 1)[:, :n]
        cache.positions.fill_(n)
        cache.lengths = [n]
    return cache


@torch.inference_mode()
def time_steps(step, model, cache, steps: int) -> tuple[float, float, object]:
    """(fastest wall seconds, mean CPU seconds) of `steps` decode steps after one warm-up, and the cache."""
    token = torch.zeros(1, dtype=torch.long)
    _, cache = step(token, cache)
    wall, cpu = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        _, cache = step(token, cache)
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return min(wall), sum(cpu) / len(cpu), cache


def compiled_step(model):
    """model.decode with its decode graph replaced by torch.compile of it (same caches, same weights)."""
    graph = torch.compile(model.decode_graph, dynamic=False)

    def step(tokens, cache):
        tokens = tokens.view(-1, 1)
        logits, tensors = graph(tokens, cache.positions, cache.tensors)
        cache.tensors.update(tensors)
        cache.positions += 1
        cache.lengths = [n + 1 for n in cache.lengths]
        return logits, cache

    return step


def measure(model, contexts: list[int], steps: int, fill: str = "tile", compile_too: bool = False, say=None):
    """One row per context N: bytes of the cache holding N tokens, decode tokens/s and CPU s/step just before N."""
    if min(contexts) <= steps + 1:
        raise ValueError(f"contexts must exceed steps + 1 = {steps + 1}")
    kinds = {"graph": model.decode}
    if compile_too:
        kinds["compiled"] = compiled_step(model)
    rows = []
    for n in sorted(contexts):
        row = {"context": n}
        for kind, step in kinds.items():
            cache = filled_cache(model, n - steps - 1, n, fill)
            wall, cpu, cache = time_steps(step, model, cache, steps)
            assert cache.lengths == [n]
            row.update(cache.nbytes())
            row[f"{kind}_tok_s"], row[f"{kind}_cpu_s"] = 1.0 / wall, cpu
        rows.append(row)
        if say:
            say(f"context {n}: {row['total']:,} cache bytes, {row['graph_tok_s']:.1f} tokens/s")
    return rows


def cache_bytes_by_context(model, contexts: list[int]) -> dict[int, dict[str, int]]:
    """context -> DecodeCache.nbytes() of a cache preallocated to, and filled up to, that many tokens."""
    return {n: filled_cache(model, n, n, "prefill").nbytes() for n in contexts}


def build_model(spec_path: Path, out: Path):
    """Build the spec (inference graphs) under `out` and return its InferenceModel."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    dest, _ = build(load_spec(spec_path), out, BuildOptions(mode="infer"))
    return load(dest).InferenceModel().eval()


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, "
            f"capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def render(results: dict[str, list[dict]]) -> str:
    """A Markdown table, one row per (variant, context); compiled columns when measured."""
    compiled = any("compiled_tok_s" in r for rows in results.values() for r in rows)
    head = "| variant | context | KDA cache bytes | MLA cache bytes | total bytes | graph tokens/s | graph CPU ms/step |"
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if compiled:
        head += " compiled tokens/s | compiled CPU ms/step |"
        rule += "---:|---:|"
    lines = [head, rule]
    for name, rows in results.items():
        for r in rows:
            line = (f"| {name} | {r['context']:,} | {r['kda_state']:,} | {r['mla_latent']:,} | {r['total']:,} "
                    f"| {r['graph_tok_s']:.2f} | {1e3 * r['graph_cpu_s']:.1f} |")
            if compiled and "compiled_tok_s" in r:
                line += f" {r['compiled_tok_s']:.2f} | {1e3 * r['compiled_cpu_s']:.1f} |"
            elif compiled:
                line += " - | - |"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-context", type=int, default=max(CONTEXTS), help="skip contexts above this (default 16384)")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per context point (default 12)")
    p.add_argument("--fill", choices=("prefill", "tile"), default="tile",
                   help="how the cache reaches each context: tile a real prompt's latents (default) or prefill all")
    p.add_argument("--variant", choices=sorted(VARIANTS), action="append", help="only these variants (repeatable)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the decode graph")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: one-token ops are too small to split; 0: torch's choice)")
    p.add_argument("--tiny", action="store_true", help="contexts 16 and 32, 2 steps, no compile: a smoke run")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [16, 32] if args.tiny else [n for n in CONTEXTS if n <= args.max_context]
    steps = 2 if args.tiny else args.steps
    compile_too = not (args.no_compile or args.tiny)
    results = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="k3-decode-bench-") as tmp:
        for name in args.variant or list(VARIANTS):
            model = build_model(VARIANTS[name], Path(tmp) / name)
            say = lambda text, name=name: print(f"{name}: {text}", file=sys.stderr, flush=True)
            results[name] = measure(model, contexts, steps, args.fill, compile_too and name == "k3-tiny", say)
            del model
    print(f"decode on CPU, batch 1, fp32, seeded weights; {machine()}; {time.strftime('%Y-%m-%d')}")
    print(f"cache fill: {args.fill}; {steps} timed decode steps per point; "
          f"{time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu_start:.0f} CPU s")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
