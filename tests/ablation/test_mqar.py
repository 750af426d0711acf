"""MQAR scoring: accuracy by query order tells recall from elimination."""

from __future__ import annotations

import torch
from torch import nn

from k3compile.ablation.mqar import MQAR, accuracy, accuracy_by_query, held_out

TASK = MQAR(num_kv_pairs=2, seq_len=16, num_queries=2, vocab=16)


class Eliminates(nn.Module):
    """Binds no key: after a query key it names the first context value not given yet in the query region."""

    def forward(self, tokens):
        B, L = tokens.shape
        D = TASK.num_kv_pairs
        logits = torch.zeros(B, L, 256)
        for b in range(B):
            values = tokens[b, 1 : 2 * D : 2].tolist()
            given = []
            for t in range(2 * D, L):
                tok = int(tokens[b, t])
                if 1 <= tok <= TASK.vocab // 2:  # a queried key: guess
                    left = [v for v in values if v not in given] or values
                    logits[b, t, left[0]] = 1.0
                elif tok > TASK.vocab // 2:
                    given.append(tok)
        return logits


def test_elimination_gets_every_last_query_and_the_first_only_by_luck():
    batches = held_out(TASK, 64, 16, seed=0)
    by_query = accuracy_by_query(Eliminates(), batches)
    tokens = torch.cat([t for t, _ in batches])
    # the first query is right when it asks for the first pair's key, or both pairs hold the same value
    where = [int((row[4:] != 0).nonzero()[0]) + 4 for row in tokens]  # the first query key's position
    lucky = [int(row[w] == row[0] or row[1] == row[3]) for row, w in zip(tokens, where)]
    assert by_query[1] == 1.0
    assert by_query[0] == sum(lucky) / len(lucky)
    assert abs(sum(by_query) / 2 - accuracy(Eliminates(), batches)) < 1e-12
