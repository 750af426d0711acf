"""The emitted k3-tiny training Model learns: loss falls over 50 steps on real text.

The text is the source of Python's own `os` module (on every machine), read as bytes; each
step takes a seeded random batch of windows. This is the compiler's end-to-end check that
the bound graph (QAT fake-quantisation, LatentMoE with capacity, block AttnRes, KDA + MLA)
has working gradients; the trainer's own tests live in tests/runtime/test_train.py.
"""

from __future__ import annotations

import os

import torch

import k3compile

STEPS, BATCH, SEQ = 50, 4, 64


def test_emitted_model_loss_falls_over_50_steps_on_real_text(tiny_build):
    torch.manual_seed(0)
    data = torch.frombuffer(bytearray(open(os.__file__, "rb").read()), dtype=torch.uint8).long()
    model = k3compile.load(tiny_build[0]).Model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        starts = torch.randint(0, data.numel() - SEQ, (BATCH,), generator=gen)
        tokens = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
        loss = model(tokens, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"loss over {STEPS} steps: first 5 mean {first:.3f}, last 5 mean {last:.3f}")
    assert losses[0] > 5.0  # about ln 256 = 5.55 at init
    assert last < first - 1.5, losses
