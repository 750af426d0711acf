"""Independent pieces of one op's work side by side on the intra-op threads, each piece single-threaded.

A 128 x 128 GEMM or a few thousand elements of elementwise work barely gains from being split across OpenMP
threads (the split and the join cost about what the second thread saves), while whole pieces side by side scale:
the routed experts' GEMMs, Newton-Schulz matrix by matrix. OpenMP's thread count is a per-thread setting, so
each worker sets its own to one; the caller's is restored after. Grad mode is per thread too: the pieces are a
kernel's, written into its own outputs, so the workers run without autograd (as a Function's forward and backward
do), in the caller's inference mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


def side_by_side(fn: Callable[[Sequence], None], items: Sequence, threads: int | None = None) -> None:
    """fn(share) for `threads` (default torch's intra-op count) interleaved shares of `items`, each on its own
    Python thread running torch single-threaded (the calling thread takes the first), all without autograd; fn
    must write disjoint outputs. One thread, or one item: fn(items) here."""
    threads = min(torch.get_num_threads() if threads is None else threads, len(items))
    if threads <= 1:
        with torch.no_grad():
            fn(items)
        return
    shares = [items[t::threads] for t in range(threads)]
    before = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads - 1) as pool:
            pending = [pool.submit(_single_threaded, fn, share, inference) for share in shares[1:]]
            with torch.no_grad():
                fn(shares[0])
            for done in pending:
                done.result()
    finally:
        torch.set_num_threads(before)


def _single_threaded(fn: Callable[[Sequence], None], share: Sequence, inference: bool) -> None:
    torch.set_num_threads(1)
    with torch.inference_mode(inference), torch.no_grad():  # inference_mode(False) alone turns grad mode on
        fn(share)
