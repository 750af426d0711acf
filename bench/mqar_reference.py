"""An independent reference for the MQAR study: a tiny Llama or DeepSeek V3 from transformers, same batches.

    python bench/mqar_reference.py                                    # 2 layers x 128, AdamW 1e-3, 1000 steps
    python bench/mqar_reference.py --steps 150 --seeds 0,1,2          # the study's budget
    python bench/mqar_reference.py --init-std 0.15 --steps 1000       # a wider initialisation
    python bench/mqar_reference.py --model deepseek_v3 --init-std 0.15 # MLA with k3-tiny's ranks and head dims
    python bench/mqar_reference.py --model deepseek_v3 --lr 3e-4 --weight-decay 0 --schedule constant --steps 400

Tells a defect of k3compile's attention from a task too hard for attention at this budget: the model is
transformers' LlamaForCausalLM (RoPE, causal softmax attention, SwiGLU MLP) or DeepseekV3ForCausalLM (MLA),
trained with torch.optim.AdamW (betas 0.9 / 0.95, weight decay 0.1 on every parameter unless --weight-decay), the
trainer's warmup + cosine (or --schedule) schedule (k3compile.runtime.schedule.lr_at), gradient clipping at 1.0, on
the batches a study's MQAR run draws (k3compile.ablation.mqar, seeded with the run's seed) with the same loss
(cross-entropy of the value after each query, every other label ignored) and the same held-out sequences. Prints,
every --every steps, the accuracy of the first, second, ... query of each sequence (bench/mqar_recall.py prints the
same for a k3compile spec): recall gets every query right, no binding leaves each at chance (about
1 / num_kv_pairs). Prints the CPU capability, threads, CPU and wall seconds. Nothing here is asserted on.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from k3compile.ablation.mqar import IGNORE, MQAR, MQARBatches, accuracy_by_query, held_out
from k3compile.ablation.run import MQAR_HELD_OUT
from k3compile.runtime.schedule import lr_at
from k3compile.spec.schema import Schedule


class Logits(torch.nn.Module):
    """The Llama's logits alone, the interface accuracy_by_query scores."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def reference_model(args, task: MQAR) -> torch.nn.Module:
    """Llama (multi-head attention, RoPE on all of q and k) or DeepSeek V3 (MLA with k3-tiny's ranks and head dims,
    decoupled RoPE on 32 of each head's 64 q/k dims; a dense MLP in every layer)."""
    common = dict(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=task.seq_len,
        rope_theta=args.rope_theta, initializer_range=args.init_std, attn_implementation="eager",
    )  # fmt: skip
    if args.model == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    config = DeepseekV3Config(**common, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                              v_head_dim=64, first_k_dense_replace=args.layers, rope_interleave=False)
    return DeepseekV3ForCausalLM(config)


def train(args, task: MQAR, seed: int) -> None:
    torch.manual_seed(seed)
    model = Logits(reference_model(args, task))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = Schedule(kind=args.schedule, warmup_steps=args.warmup)
    batches = MQARBatches(task, args.batch, seed)
    val = held_out(task, MQAR_HELD_OUT, args.batch * 4, seed)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, schedule)
        tokens, labels = batches.next()
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            by_query = accuracy_by_query(model, val)
            queries = " ".join(f"{a:.2f}" for a in by_query)
            mean = sum(by_query) / len(by_query)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            print(f"seed {seed}  step {step + 1:4d}  loss {float(loss.detach()):.3f}  accuracy {mean:.3f}  "
                  f"by query {queries}  cpu {cpu:.0f} s  wall {wall:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mqar", default="2,16,2,16", help="num_kv_pairs,seq_len,num_queries,vocab (default 2,16,2,16)")
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    ap.add_argument("--every", type=int, default=100, help="evaluate every K steps (default 100)")
    ap.add_argument("--seeds", default="0", help="comma list of seeds, each its own run (default 0)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
    ap.add_argument("--schedule", choices=("cosine", "linear", "constant"), default="cosine",
                    help="decay after warmup, as training.schedule.kind (default cosine, to 0.1 x the peak)")
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay (default 0.1)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--model", choices=("llama", "deepseek_v3"), default="llama",
                    help="llama (multi-head attention) or deepseek_v3 (MLA as k3-tiny's; default llama)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128; the MLP is 4x)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base (default 10000)")
    ap.add_argument("--init-std", type=float, default=0.02, help="std of the normal init of matrices (default 0.02)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    task = MQAR(*(int(x) for x in args.mqar.split(",")))
    if why := task.check():
        ap.error(why)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{args.model} {args.layers} x {args.hidden} ({args.heads} heads), init std {args.init_std}, "
          f"AdamW lr {args.lr} ({args.schedule}, weight decay {args.weight_decay}), batch {args.batch}, MQAR {task}")
    for seed in (int(s) for s in args.seeds.split(",")):
        train(args, task, seed)


if __name__ == "__main__":
    main()
