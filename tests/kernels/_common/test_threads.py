"""k3compile.kernels._common.threads.side_by_side: every item once, on single-threaded workers without autograd, the
caller's thread count restored, a worker's exception raised in the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from k3compile.kernels._common.threads import side_by_side


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_item_once_and_the_thread_count_restored(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen, lock = [], threading.Lock()

        def fn(share):
            assert torch.get_num_threads() == (2 if threads == 1 else 1)
            assert not torch.is_grad_enabled()  # kernel work: no autograd, on any thread
            with lock:
                seen.append(list(share))

        side_by_side(fn, list(range(7)), threads)
        assert sorted(i for share in seen for i in share) == list(range(7))
        assert len(seen) == threads  # one interleaved share per thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_workers_write_disjoint_outputs_and_raise_to_the_caller():
    x = torch.randn(6, 16, 16, requires_grad=True)
    out = torch.empty(6, 16, 16)
    side_by_side(lambda share: [torch.mm(x[i], x[i], out=out[i]) for i in share], range(6), 2)
    assert torch.allclose(out, x.detach() @ x.detach())

    def boom(share):
        if 1 in share:
            raise ValueError("worker failed")

    with pytest.raises(ValueError, match="worker failed"):
        side_by_side(boom, [0, 1], 2)
