"""CPU decode benchmark: decode tokens/s and cache bytes at growing context, hybrid KDA:MLA against all-MLA.

    python bench/decode_cpu.py                      # contexts 256 .. 16384 (k3-tiny's context_length)
    python bench/decode_cpu.py --max-context 2048   # skip the largest contexts
    python bench/decode_cpu.py --tiny               # seconds-long smoke run (contexts 16, 32)

Each spec is built (`--mode infer`) into a temporary folder and run through its InferenceModel's
decoder with the seeded weights, fp32, batch 1. Per variant the cache grows once: random byte
tokens are prefilled in chunks from one context point to the next, so the largest point costs one
chunked prefill in all. At each point the cache bytes are read (`DecodeCache.nbytes()`, KDA state
vs MLA latents) and `--steps` single-token decode steps are timed from that cache (one untimed
warm-up step first; decoding returns a new cache, so the growing one is left as it was).
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
    """Yield (context, cache holding that many tokens, seconds of prefill since the previous point)."""
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


def cache_bytes_by_context(decoder: Decoder, contexts: list[int], chunk: int = 1024) -> dict[int, dict[str, int]]:
    """context -> DecodeCache.nbytes() after prefilling that many tokens."""
    return {n: cache.nbytes() for n, cache, _ in grow_cache(decoder, contexts, chunk)}


@torch.no_grad()
def decode_seconds(decoder: Decoder, cache: DecodeCache, steps: int) -> float:
    """Seconds per decode step from `cache` (mean over `steps` after one warm-up step)."""
    token = torch.zeros(1, 1, dtype=torch.long)
    _, c = decoder(token, cache)
    start = time.perf_counter()
    for _ in range(steps):
        _, c = decoder(token, c)
    return (time.perf_counter() - start) / steps


def measure(decoder: Decoder, contexts: list[int], steps: int, chunk: int, say=None) -> list[dict]:
    """One row per context: cache bytes, decode tokens/s, prefill seconds for the tokens added."""
    rows = []
    for n, cache, prefill_s in grow_cache(decoder, contexts, chunk):
        row = {"context": n, **cache.nbytes(), "prefill_s": prefill_s}
        row["decode_tok_s"] = 1.0 / decode_seconds(decoder, cache, steps)
        rows.append(row)
        if say:
            say(f"context {n}: {row['total']:,} cache bytes, {row['decode_tok_s']:.1f} tokens/s")
    return rows


def build_decoder(spec_path: Path, out: Path) -> Decoder:
    """Build the spec (inference only) under `out` and return its InferenceModel's decoder."""
    from k3compile.build import BuildOptions, build
    from k3compile.loader import load
    from k3compile.spec.load import load_spec

    dest, _ = build(load_spec(spec_path), out, BuildOptions(mode="infer"))
    return load(dest).InferenceModel().eval().decoder


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}")


def render(results: dict[str, list[dict]]) -> str:
    """A Markdown table, one row per (variant, context)."""
    lines = ["| variant | context | KDA cache bytes | MLA cache bytes | total bytes | decode tokens/s | prefill s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        for r in rows:
            lines.append(f"| {name} | {r['context']:,} | {r['kda_state']:,} | {r['mla_latent']:,} | {r['total']:,} "
                         f"| {r['decode_tok_s']:.1f} | {r['prefill_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-context", type=int, default=max(CONTEXTS), help="skip contexts above this (default 16384)")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per context point (default 8)")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens (default 1024)")
    p.add_argument("--variant", choices=sorted(VARIANTS), action="append", help="only these variants (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads; default: torch's choice")
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
            results[name] = measure(decoder, contexts, steps, args.chunk, say)
            del decoder
    print(f"decode on CPU, batch 1, fp32, seeded weights; {machine()}; {time.strftime('%Y-%m-%d')}")
    seconds = time.perf_counter() - start
    print(f"{steps} timed decode steps per point, prefill chunk {args.chunk}; {seconds:.0f} s in all")
    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
