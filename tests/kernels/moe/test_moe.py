"""MoE reference kernels: router selection and weights, capacity, slot assignment, dispatch and combine."""

import math

import pytest
import torch

from k3compile.kernels.moe import reference as ref
from k3compile.kernels.moe.op import moe_dispatch_rows


def test_route_selects_by_biased_scores_and_weights_by_unbiased():
    torch.manual_seed(0)
    logits = torch.randn(7, 5)
    bias = torch.tensor([0.0, 10.0, 0.0, 0.0, -10.0])  # expert 1 always chosen, expert 4 never
    weights, indices, scores = ref.route_ref(logits, bias, 2, "sigmoid", True, 2.5)
    s = torch.sigmoid(logits)
    torch.testing.assert_close(scores, s)
    for t in range(7):
        order = sorted(range(5), key=lambda j: -(s[t, j] + bias[j]).item())[:2]
        assert indices[t].tolist() == order
        chosen = s[t, order]
        torch.testing.assert_close(weights[t], chosen / chosen.sum() * 2.5)
    assert (indices == 1).any(-1).all() and not (indices == 4).any()


def test_route_softmax_without_renormalisation():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, dtype=torch.bfloat16)
    weights, indices, scores = ref.route_ref(logits, None, 3, "softmax", False, 1.0)
    assert weights.dtype == scores.dtype == torch.float32 and indices.dtype == torch.int64
    p = torch.softmax(logits.float(), -1)
    torch.testing.assert_close(scores, p)
    torch.testing.assert_close(weights, p.topk(3, -1).values)


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "cf", "expected"),
    [
        (10, 4, 2, 1.0, 5),  # 10*2/4 = 5
        (10, 4, 2, 1.25, 7),  # ceil(6.25)
        (10, 4, 2, 0.0, 10),  # dense
        (10, 4, 2, 100.0, 10),  # never more than T
        (10, 4, 2, 0.01, 1),  # never less than 1
        (8, 896, 16, 1.25, 1),  # ceil(0.18)
    ],
)
def test_expert_capacity_table(tokens, experts, k, cf, expected):
    assert ref.expert_capacity(tokens, experts, k, cf) == expected


def test_slots_equal_token_major_one_hot_cumsum():
    torch.manual_seed(2)
    t, e, k, cap = 40, 6, 3, 5
    indices = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    slots, load, dropped = ref.expert_slots(indices, e, cap)
    one_hot = torch.nn.functional.one_hot(indices.reshape(-1), e)  # [T*K, E], token-major
    pos = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)
    expected = torch.where(pos < cap, indices.reshape(-1) * cap + pos, e * cap)
    assert slots.reshape(-1).tolist() == expected.tolist()
    assert load.tolist() == one_hot.sum(0).tolist()
    assert dropped.item() == sum(max(0, c - cap) for c in load.tolist())


def test_dispatch_buffer_rows_and_combine_by_hand():
    x = torch.arange(12.0).view(4, 3)
    indices = torch.tensor([[0, 1], [1, 2], [1, 0], [1, 2]])  # expert 1 gets tokens 0,1,2,3
    buffer, slots, load, dropped = ref.dispatch_ref(x, indices, 3, 1.0)  # C = ceil(4*2/3) = 3
    assert buffer.shape == (3, 3, 3)
    assert load.tolist() == [2, 4, 2] and dropped.item() == 1  # token 3's choice of expert 1 is dropped
    torch.testing.assert_close(buffer[0], torch.stack([x[0], x[2], torch.zeros(3)]))
    torch.testing.assert_close(buffer[1], x[:3])
    torch.testing.assert_close(buffer[2], torch.stack([x[1], x[3], torch.zeros(3)]))
    weights = torch.tensor([[0.5, 0.5], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    y = ref.combine_ref(buffer * 10, weights, slots)  # expert "output" = 10 * its input
    torch.testing.assert_close(y, 10 * torch.stack([x[0], 3 * x[1], 7 * x[2], 6 * x[3]]))


def test_combine_keeps_dtype_and_sums_in_fp32():
    out = torch.full((2, 3, 4), 1.0 + 2**-7, dtype=torch.bfloat16)
    slots = torch.tensor([[0, 3], [1, 6]])  # 6 = E*C: dropped
    y = ref.combine_ref(out, torch.tensor([[1.0, 1.0], [1.0, 1.0]]), slots)
    assert y.dtype == torch.bfloat16
    assert y[0].tolist() == [float(torch.tensor(2 + 2**-6, dtype=torch.bfloat16))] * 4
    assert y[1].tolist() == [1.0 + 2**-7] * 4


def test_dense_capacity_never_drops():
    torch.manual_seed(3)
    indices = torch.zeros(9, 1, dtype=torch.int64)  # every token on expert 0
    buffer, _, load, dropped = ref.dispatch_ref(torch.randn(9, 2), indices, 4, 0.0)
    assert buffer.shape == (4, 9, 2) and load[0].item() == 9 and dropped.item() == 0
    assert math.isclose(buffer[1:].abs().sum().item(), 0.0)


def test_dispatch_rows_by_hand():
    """The example above without the buffer's empty rows: expert 0's two rows, expert 1's three, expert 2's two,
    then the dropped choice's zero row; the slots point into those rows (8 = T*K: dropped)."""
    x = torch.arange(12.0).view(4, 3)
    indices = torch.tensor([[0, 1], [1, 2], [1, 0], [1, 2]])
    rows, slots, counts, load, dropped = ref.dispatch_rows_ref(x, indices, 3, 1.0)
    assert counts.tolist() == [2, 3, 2] and load.tolist() == [2, 4, 2] and dropped.item() == 1
    torch.testing.assert_close(rows, torch.stack([x[0], x[2], x[0], x[1], x[2], x[1], x[3], torch.zeros(3)]))
    assert slots.tolist() == [[0, 2], [3, 5], [4, 1], [8, 6]]
    weights = torch.tensor([[0.5, 0.5], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    y = ref.combine_ref(rows[None] * 10, weights, slots)  # the rows as one buffer: slot = row
    torch.testing.assert_close(y, 10 * torch.stack([x[0], 3 * x[1], 7 * x[2], 6 * x[3]]))


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 0.0])
def test_dispatch_rows_are_the_capacity_buffers_kept_rows(capacity_factor):
    """Per expert, the rows are its capacity buffer's filled rows in order; load and dropped are dispatch_ref's;
    the hand-written backward (each token sums its kept rows' cotangents) passes gradcheck."""
    torch.manual_seed(4)
    T, E, K, D = 40, 6, 3, 5
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    indices = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    indices[: T // 2, 0] = 0  # an overloaded expert
    buffer, _, load, dropped = ref.dispatch_ref(x, indices, E, capacity_factor)
    rows, slots, counts, load_r, dropped_r = ref.dispatch_rows_ref(x, indices, E, capacity_factor)
    assert torch.equal(load_r, load) and torch.equal(dropped_r, dropped)
    assert counts.tolist() == load.clamp_max(buffer.shape[1]).tolist()
    kept = torch.cat([buffer[e, :n] for e, n in enumerate(counts.tolist())])
    assert torch.equal(rows[: len(kept)], kept) and torch.equal(rows[len(kept) :], torch.zeros_like(rows[len(kept) :]))
    assert (slots == T * K).sum().item() == dropped.item()
    assert torch.autograd.gradcheck(lambda x: moe_dispatch_rows(x, indices, E, capacity_factor)[0], (x,))
