"""A tiny random transformers KimiLinearForCausalLM, saved in shards, and its k3compile import (built once)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

# 4 layers in the 3:1 layout with the last full, a dense layer 0, MoE with a shared expert after it.
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, num_local_experts=8, num_experts_per_tok=2,
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "full_attn_layers": [4],
                        "kda_layers": [1, 2, 3]},
    first_k_dense_replace=1, routed_scaling_factor=2.446, max_position_embeddings=4096, initializer_range=0.1,
    pad_token_id=None, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
SHARD = "200KB"  # the fp32 model is about 1 MB: several shards


def make_hf_model(seed: int = 0):
    """The tiny model with nothing trivial left: norm gains and selection biases random too."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**TINY)).eval()
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if "norm" in name:
                t.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory) -> tuple[object, Path]:
    """(the fp32 transformers model, the folder save_pretrained wrote in shards)."""
    model = make_hf_model()
    path = tmp_path_factory.mktemp("hf") / "tiny-kimi"
    model.save_pretrained(path, max_shard_size=SHARD)
    return model, path


def k3(*argv) -> int:
    """`k3compile ARGV` in this process; its exit code."""
    from k3compile.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(name="k3")
def k3_fixture():
    return k3


@pytest.fixture(name="make_hf_model")
def make_hf_model_fixture():
    return make_hf_model


@pytest.fixture(scope="session")
def imported(hf_model, tmp_path_factory) -> Path:
    """`k3compile import-hf` of the tiny model (mode both), no overrides: the import itself is drop-free."""
    _, path = hf_model
    out = tmp_path_factory.mktemp("import") / "out"
    assert k3("import-hf", path, "-o", out) == 0
    return out


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def rel_max():
    """rel_max(a, b) = max |a - b| / max |b|: the relative logits difference."""
    return lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max())
