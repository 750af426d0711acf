"""CPU decode benchmark: decode tokens/s and cache bytes at growing context, hybrid KDA:MLA against all-MLA.

    python bench/decode_cpu.py                      # contexts 256 .. 16384 (k3-tiny's context_length), ~3 min
    python bench/decode_cpu.py --max-context 4096   # skip the largest contexts (~40 s)
    python bench/decode_cpu.py --fill tile          # tile one real chunk's MLA latents instead (~10 s)
    python bench/decode_cpu.py --tiny               # seconds-long smoke run (contexts 16, 32)

Each spec is built (`--mode infer`) into a temporary folder and run through its InferenceModel's
decoder with the seeded weights, fp32, batch 1. A context point N is reached by filling the cache
to N - steps - 1 tokens, then decoding one untimed warm-up step and `--steps` timed steps, so the
timed steps attend over the last contexts before N and the cache ends holding exactly N tokens;
its bytes are read there (`DecodeCache.nbytes()`: KDA state vs MLA latents). Tokens/s is the
inverse of the fastest step: on a machine shared with other jobs, slower steps measure their load,
not the decoder (the work of every step at one point is the same); CPU ms/token is the fastest step's
process CPU time (all threads). The header names the CPU capability. One torch thread by default: a one-token step's ops are too small to split, and on a busy 2-core machine
extra threads mostly wait on each other (k3-tiny: 48 ms a step on 1 thread, 0.1-0.7 s on 2).

Filling the cache: `--fill prefill` (default) prefills random bytes through the model in
`--chunk`-token chunks, growing one cache from point to point, so the largest point costs one
chunked prefill in all. `--fill tile` prefills one chunk for real and repeats each MLA layer's real
latent rows up to N; the KDA state is the real one, whose size does not depend on position. A
decode step's work depends only on the cache's shapes, so both fills time the same computation;
the tiled one skips the minutes of prefill.
Nothing here is asserted on; the cache-bytes facts are tested in tests/runtime/test_generate.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from k3compile.runtime.decoder import DecodeCache, Decoder

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"k3-tiny": ROOT / "specs" / "k3-tiny.yaml", "all-mla": ROOT / "specs" / "ablations" / "all-mla.yaml"}
CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384)


@torch.no_grad()
def grow_cache(
    decoder: Decoder, contexts: list[int], chunk: int = 1024, seed: int = 0
) -> Iterator[tuple[int, DecodeCache, float]]:
    """Real chunked prefill of random bytes: yield (context, cache of that many tokens, seconds since the last)."""
    gen = torch.Generator().manual_seed(seed)
    cache, position = None, 0
    for context in sorted(contexts):
        start = time.perf_counter()
        while position < context:
            n = min(chunk, context - position)
            tokens = torch.randint(0, decoder.spec.vocab_size, (1, n), generator=gen)
            _, cache = decoder(tokens, cache)
            position += n
        yield context, cache, time.perf_counter() - start


@torch.no_grad()
def tiled_caches(
    decoder: Decoder, contexts: list[int], chunk: int = 1024, seed: int = 0
) -> Iterator[tuple[int, DecodeCache, float]]:
    """One real prefill of min(chunk, smallest context) tokens; per context, its MLA latent rows repeated to length."""
    base_len = min(chunk, min(contexts))
    start = time.perf_counter()
    _, base, _ = next(grow_cache(decoder, [base_len], chunk, seed))
    seconds = time.perf_counter() - start
    for context in sorted(contexts):
        reps = -(-context // base_len)
        layers = [_tile(s, reps, context) for s in base.layers]
        yield context, DecodeCache(layers=layers, position=context), seconds
        seconds = 0.0


def _tile(state, reps: int, length: int):
    """An MLA latent cache [B, S, C] repeated along S to `length` rows; KDA states pass through."""
    if isinstance(state, torch.Tensor):
        return state.repeat(1, reps, 1)[:, :length].contiguous()
    return state


def cache_bytes_by_context(decoder: Decoder, contexts: list[int], chunk: int = 1024) -> dict[int, dict[str, int]]:
    """context -> DecodeCache.nbytes() after a real prefill of that many tokens."""
    return {n: cache.nbytes() for n, cache, _ in grow_cache(decoder, contexts, chunk)}


@torch.no_grad()
def decode_from(decoder: Decoder, cache: DecodeCache, steps: int) -> tuple[float, float, DecodeCache]:
    """(fastest of `steps` decode steps after one untimed warm-up step, in wall seconds; the same in process
    CPU seconds; the final cache)."""
    token = torch.zeros(1, 1, dtype=torch.long)
    _, cache = decoder(token, cache)
    walls, cpus = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        _, cache = decoder(token, cache)
        cpus.append(time.process_time() - start_cpu)
        walls.append(time.perf_counter() - start)
    return min(walls), min(cpus), cache


def measure(
    decoder: Decoder, contexts: list[int], steps: int, chunk: int, fill: str = "prefill", say=None
) -> list[dict]:
    """One row per context N: bytes of the cache holding N tokens, decode tokens/s just before N (and the CPU
    milliseconds of the fastest step), fill seconds."""
    if min(contexts) <= steps + 1:
        raise ValueError(f"contexts must exceed steps + 1 = {steps + 1}")
    filler = {"tile": tiled_caches, "prefill": grow_cache}[fill]
    rows = []
    for n, (_, cache, fill_s) in zip(sorted(contexts), filler(decoder, [n - steps - 1 for n in contexts], chunk)):
        seconds, cpu_seconds, cache = decode_from(decoder, cache, steps)
        assert cache.position == n
        rows.append({"context": n, **cache.nbytes(), "decode_tok_s": 1.0 / seconds, "decode_cpu_ms": cpu_seconds * 1e3,
                     "fill_s": fill_s})
        if say:
            say(f"context {n}: {rows[-1]['total']:,} cache bytes, {rows[-1]['decode_tok_s']:.1f} tokens/s")
    return rows


def build_decoder(spec_path: Path, out: Path) -> Decoder:
    """Build the spec (inference only) under `out` and return its InferenceModel's decoder."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    dest, _ = build(load_spec(spec_path), out, BuildOptions(mode="infer"))
    return load(dest).InferenceModel().eval().decoder


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads, torch "
            f"{torch.__version__}, Python {platform.python_version()}")


def render(results: dict[str, list[dict]]) -> str:
    """A Markdown table, one row per (variant, context)."""
    lines = ["| variant | context | KDA cache bytes | MLA cache bytes | total bytes | decode tokens/s | CPU ms/token |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['context']:,} | {r['kda_state']:,} | {r['mla_latent']:,} | {r['total']:,} "
                         f"| {r['decode_tok_s']:.2f} | {r['decode_cpu_ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-context", type=int, default=max(CONTEXTS), help="skip contexts above this (default 16384)")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per context point (default 12)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--fill", choices=("prefill", "tile"), default="prefill",
                   help="how the cache reaches each context: prefill every token (default) or tile real latents")
    p.add_argument("--variant", choices=sorted(VARIANTS), action="append", help="only these variants (repeatable)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: one-token ops are too small to split; 0: torch's choice)")
    p.add_argument("--tiny", action="store_true", help="contexts 16 and 32, 2 steps: a smoke run")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [16, 32] if args.tiny else [n for n in CONTEXTS if n <= args.max_context]
    steps = 2 if args.tiny else args.steps
    results = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3-decode-bench-") as tmp:
        for name in args.variant or list(VARIANTS):
            decoder = build_decoder(VARIANTS[name], Path(tmp) / name)
            say = lambda text, name=name: print(f"{name}: {text}", file=sys.stderr, flush=True)
            results[name] = measure(decoder, contexts, steps, args.chunk, args.fill, say)
            del decoder
    seconds = time.perf_counter() - start
    print(f"decode on CPU, batch 1, fp32, seeded weights; {machine()}; {time.strftime('%Y-%m-%d')}")
    print(f"cache fill: {args.fill}, prefill chunk {args.chunk}; {steps} timed decode steps per point; {seconds:.0f} s")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
