"""MQAR: the answers are hidden (Zoology's format), and accuracy by query order scores recall."""

from __future__ import annotations

import torch
from torch import nn

from k3compile.ablation.mqar import FILLER, IGNORE, MQAR, accuracy, accuracy_by_query, held_out

TASK = MQAR(num_kv_pairs=2, seq_len=16, num_queries=2, vocab=16)


class Recalls(nn.Module):
    """Binds every key: at a query key it names the value after that key's first appearance."""

    def forward(self, tokens):
        B, L = tokens.shape
        logits = torch.zeros(B, L, 256)
        for b in range(B):
            pairs = dict(zip(tokens[b, 0 : 2 * TASK.num_kv_pairs : 2].tolist(),
                             tokens[b, 1 : 2 * TASK.num_kv_pairs : 2].tolist()))  # fmt: skip
            for t in range(2 * TASK.num_kv_pairs, L):
                if int(tokens[b, t]) in pairs:
                    logits[b, t, pairs[int(tokens[b, t])]] = 1.0
        return logits


class FirstValue(nn.Module):
    """Binds no key: names the first pair's value after every token."""

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, 256)
        logits[torch.arange(tokens.shape[0]), :, tokens[:, 1]] = 1.0
        return logits


def scored_positions(labels):
    """Positions of one sequence whose label is scored."""
    return (labels != IGNORE).nonzero().flatten().tolist()


def test_the_answer_after_a_query_is_never_shown():
    tokens, labels = TASK.sample(64, torch.Generator().manual_seed(0))
    D, half = TASK.num_kv_pairs, TASK.vocab // 2
    scored = labels != IGNORE
    assert (scored.sum(-1) == TASK.num_queries).all()
    assert (tokens[scored] == FILLER).all()  # the answer's position holds the filler
    region = tokens[:, 2 * D :]
    assert ((region == FILLER) | ((region >= 1) & (region <= half))).all()  # keys and filler only, no values
    for row, lab in zip(tokens, labels):
        pairs = dict(zip(row[0 : 2 * D : 2].tolist(), row[1 : 2 * D : 2].tolist()))
        for t in scored_positions(lab):
            assert int(lab[t]) == pairs[int(row[t - 1])]  # the label is the value bound to the query key


def test_recall_scores_every_query_and_a_fixed_guess_only_its_luck():
    batches = held_out(TASK, 64, 16, seed=0)
    assert accuracy_by_query(Recalls(), batches) == [1.0, 1.0]
    by_query = accuracy_by_query(FirstValue(), batches)
    lucky = [[], []]
    for tokens, labels in batches:
        for lab, row in zip(labels, tokens):
            for q, t in enumerate(scored_positions(lab)):
                lucky[q].append(int(lab[t] == row[1]))
    assert by_query == [sum(x) / len(x) for x in lucky]
    assert abs(sum(by_query) / 2 - accuracy(FirstValue(), batches)) < 1e-12
