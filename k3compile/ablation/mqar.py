"""MQAR, multi-query associative recall (the synthetic recall task of Zoology, Arora et al. 2023), procedural.

A sequence opens with `num_kv_pairs` key-value pairs `k1 v1 k2 v2 ...` (distinct keys, values drawn with
replacement), then `num_queries` distinct keys of those reappear at random even offsets of the rest of the
sequence; every other position, the one after each query included, holds the filler token 0. As in Zoology, the
answer is never shown: the label of the position after a query is its key's value (predicted at the query),
-100 (ignored) everywhere else, so a model must recall the value bound to the key it sees, and no query can be
answered by elimination (naming the one value not asked for yet). Keys come from tokens [1, 1 + vocab/2), values
from [1 + vocab/2, 1 + vocab): disjoint, inside the byte vocabulary. Accuracy is the fraction of queried values
predicted exactly (argmax) on held-out sequences, drawn from a generator with another seed than training's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE = -100
FILLER = 0
HELD_OUT_SEED = 1_000_003  # added to the run's seed for the held-out sequences


@dataclass(frozen=True)
class MQAR:
    """Difficulty: pairs to memorise, sequence length, how many are queried, and the key + value vocabulary."""

    num_kv_pairs: int = 8
    seq_len: int = 64
    num_queries: int = 8
    vocab: int = 64

    def check(self) -> str | None:
        """None when the parameters describe a valid task, else why not (one phrase naming the field)."""
        if min(self.num_kv_pairs, self.seq_len, self.num_queries, self.vocab) < 1:
            return "mqar fields must all be at least 1"
        if self.vocab % 2 or 1 + self.vocab > 256:
            return f"mqar.vocab ({self.vocab}) must be even and at most 255 (keys and values are bytes)"
        if self.num_kv_pairs > self.vocab // 2:
            return f"mqar.num_kv_pairs ({self.num_kv_pairs}) exceeds the {self.vocab // 2} distinct keys"
        if self.num_queries > self.num_kv_pairs:
            return f"mqar.num_queries ({self.num_queries}) exceeds mqar.num_kv_pairs ({self.num_kv_pairs})"
        if 2 * (self.num_kv_pairs + self.num_queries) > self.seq_len:
            return (f"mqar.seq_len ({self.seq_len}) is shorter than 2 x (num_kv_pairs + num_queries) = "
                    f"{2 * (self.num_kv_pairs + self.num_queries)}")
        return None

    def sample(self, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(tokens, labels), int64 [batch, seq_len] each; labels hold the queried values, IGNORE elsewhere."""
        D, Q, L, half = self.num_kv_pairs, self.num_queries, self.seq_len, self.vocab // 2
        keys = torch.rand(batch, half, generator=generator).argsort(-1)[:, :D] + 1
        values = torch.randint(1 + half, 1 + 2 * half, (batch, D), generator=generator)
        tokens = torch.full((batch, L), FILLER, dtype=torch.long)
        tokens[:, 0 : 2 * D : 2], tokens[:, 1 : 2 * D : 2] = keys, values
        slots = (L - 2 * D) // 2  # the query region, cut into two-token slots
        where = torch.rand(batch, slots, generator=generator).argsort(-1)[:, :Q] * 2 + 2 * D
        which = torch.rand(batch, D, generator=generator).argsort(-1)[:, :Q]
        rows = torch.arange(batch)[:, None]
        tokens[rows, where] = keys.gather(1, which)
        labels = torch.full_like(tokens, IGNORE)
        labels[rows, where + 1] = values.gather(1, which)
        return tokens, labels


class MQARBatches:
    """Training batches of MQAR drawn from a seeded generator; state()/load_state() resume it (as data.Batches)."""

    def __init__(self, task: MQAR, batch_size: int, seed: int):
        self.task, self.batch_size = task, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[Tensor, Tensor]:
        return self.task.sample(self.batch_size, self.generator)

    def state(self) -> Tensor:
        return self.generator.get_state()

    def load_state(self, state: Tensor) -> None:
        self.generator.set_state(state.to(torch.uint8))


def held_out(task: MQAR, sequences: int, batch_size: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """Fixed held-out batches, from a generator seeded apart from training's."""
    gen = torch.Generator().manual_seed(seed + HELD_OUT_SEED)
    out, left = [], sequences
    while left > 0:
        out.append(task.sample(min(batch_size, left), gen))
        left -= batch_size
    return out


@torch.no_grad()
def accuracy(model, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Fraction of the queried values the model predicts exactly (argmax of the logits one position before)."""
    right = total = 0
    was_training = model.training
    model.eval()
    try:
        for tokens, labels in batches:
            predicted = model(tokens)[:, :-1].argmax(-1)
            target = labels[:, 1:]
            scored = target != IGNORE
            right += int((predicted == target)[scored].sum())
            total += int(scored.sum())
    finally:
        model.train(was_training)
    return right / total


@torch.no_grad()
def accuracy_by_query(model, batches: list[tuple[Tensor, Tensor]]) -> list[float]:
    """Accuracy of the first, second, ... query of each sequence (in the order they appear).

    Tells whether recall holds over the query region: a model that binds keys gets every query right.
    """
    right: list[int] = []
    total: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for tokens, labels in batches:
            ok = model(tokens)[:, :-1].argmax(-1) == labels[:, 1:]
            scored = labels[:, 1:] != IGNORE
            order = scored.cumsum(-1) - 1  # the query's index in its sequence
            for q in range(int(scored.sum(-1).max())):
                at = scored & (order == q)
                if q == len(right):
                    right.append(0)
                    total.append(0)
                right[q] += int(ok[at].sum())
                total[q] += int(at.sum())
    finally:
        model.train(was_training)
    return [r / t for r, t in zip(right, total)]
