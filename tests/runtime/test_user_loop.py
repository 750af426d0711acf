"""A PyTorch user's own loop over a generated Model: eval() forwards leave every buffer alone, k3compile.balance
balances the routers without k3compile.train, and InferenceModel.from_training serves the trained weights as
generate's path does."""

from __future__ import annotations

import torch
import k3compile
from k3compile.runtime import checkpoint
from k3compile.runtime.balance import find_routers
from k3compile.runtime.generate import load_inference_model

TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def buffers(model) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def test_eval_forwards_change_no_buffer_training_forwards_record_statistics(small_build):
    model = k3compile.load(small_build).Model()
    before = buffers(model)
    model.eval()
    with torch.no_grad():
        model(TOKENS)
    model(TOKENS, TOKENS).backward()  # eval mode with gradients: still no statistics
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    model.train()
    model(TOKENS, TOKENS)
    changed = {n for n, b in model.named_buffers() if not torch.equal(b, before[n])}
    assert changed and all(".router." in n for n in changed)
    assert all(r.load.sum() == TOKENS.numel() * model.spec.moe.top_k for r in find_routers(model))


def test_balance_in_a_plain_adamw_loop_moves_the_router_biases(small_build):
    """The loop docs/training.md shows: forward, backward, step, k3compile.balance(model)."""
    model = k3compile.load(small_build).Model()
    routers = find_routers(model)
    assert routers and all(not r.bias.any() for r in routers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(TOKENS, TOKENS)
        loss.backward()
        opt.step()
        opt.zero_grad()
        readings = k3compile.balance(model)
    assert all(r.bias.any() for r in routers)  # the rule moved every router's bias
    assert all(not r.load.any() for r in routers)  # and consumed the statistics
    stats = readings.summary()
    assert stats.imbalance >= 1 and 0 <= stats.dropped <= 1
    assert k3compile.balance(model) is not None and all(r.bias.any() for r in routers)  # no new tokens: kept


def test_from_training_serves_what_generate_loads_from_the_checkpoint(small_build, tmp_path):
    pkg = k3compile.load(small_build)
    model = pkg.Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(TOKENS, TOKENS).backward()
    opt.step()
    k3compile.balance(model)
    served = pkg.InferenceModel.from_training(model)
    assert not served.training and served.PACKED
    checkpoint.save(tmp_path, 1, checkpoint.model_tensors(model), {})
    generate_path = load_inference_model(small_build, tmp_path)
    mine, theirs = served.state_dict(), generate_path.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with torch.no_grad():
        assert torch.equal(served(TOKENS), generate_path(TOKENS))
    plain = pkg.InferenceModel()  # what load_state_dict(strict=False) alone leaves: the packed experts untouched
    plain.load_state_dict(model.state_dict(), strict=False)
    assert any(not torch.equal(plain.state_dict()[k], mine[k]) for k in mine)
