"""`k3compile plan`: every dp x tp x pp x ep layout; per-rank numbers checked against counts made by hand from the
spec's dimensions, the pipeline schedules against torch.distributed.pipelining's own, the tp = pp = 1 rows against
`stats`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3compile.analysis.memory import cache_bytes, weight_bytes
from k3compile.analysis.params import param_counts
from k3compile.analysis.plan import GPU_MEMORY, MAX_GPUS, Layout, PlanError, held_per_chunk, in_flight, layouts, plan
from k3compile.analysis.stats import spec_stats
from k3compile.analysis.units import carried_sources
from k3compile.cli import main
from k3compile.spec.load import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"
K3 = SPECS / "kimi-k3.yaml"

# The hand spec (tests/conftest.py HAND_SPEC): d 64, vocab 32, layers K+dense, K+MoE, M+MoE, M+MoE; KDA H 2 x 16,
# conv 3, decay rank 8, gate rank 4; MLA H 2, q_lora 16, kv_lora 32, nope 8, rope 4, v 16; dense intermediate 96;
# 8 experts, top 2, intermediate 32 at latent 32, 2 shared of 16; block AttnRes of 2 layers; seq_len 128.
D, V, SEQ = 64, 32, 128
KDA_TP = 3 * 32 * 64 + 3 * 32 * 3 + 32 * 8 + 2 + 32 + 2 * 64 + 32 * 4 + 64 * 32  # q/k/v, convs, f_up, A_log, dt_bias,
KDA_REP = 8 * 64 + 4 * 64 + 16  # ... b_proj, g_up, o_proj cut by heads; f_down, g_down, o_norm whole
MLA_TP = 2 * 12 * 16 + 2 * 24 * 32 + 2 * 16 * 64 + 64 * 32  # q_b, kv_b, g_proj, o_proj
MLA_REP = 16 * 64 + 16 + 36 * 64 + 32  # q_a, q_a_norm, kv_a, kv_a_norm
LAYER_REP = 2 * (64 + 64) + 2 * 64  # AttnRes before attention and FFN, two pre-norms
DENSE_TP = 3 * 96 * 64
MOE_REP, MOE_TP, MOE_EXP = 8 * 64 + (32 * 64 + 32 + 64 * 32), 2 * 3 * 16 * 64, 8 * 3 * 32 * 32  # router+latent,
# shared experts, routed experts
UNITS = {  # unit: (tp-cut, whole on every TP rank, routed experts) parameter elements
    "embed": (V * D, 0, 0),
    0: (KDA_TP + DENSE_TP, KDA_REP + LAYER_REP, 0),
    1: (KDA_TP + MOE_TP, KDA_REP + LAYER_REP + MOE_REP, MOE_EXP),
    2: (MLA_TP + MOE_TP, MLA_REP + LAYER_REP + MOE_REP, MOE_EXP),
    3: (MLA_TP + MOE_TP, MLA_REP + LAYER_REP + MOE_REP, MOE_EXP),
    "head": (V * D, 2 * 64 + 64, 0),  # lm_head; final AttnRes, final norm
}
# Muon matrices (2-D and up, not the embedding, head or convolutions), per unit and group
KDA_MUON_TP, KDA_MUON_REP = 3 * 32 * 64 + 32 * 8 + 2 * 64 + 32 * 4 + 64 * 32, 8 * 64 + 4 * 64
MOE_MUON_REP = 8 * 64 + 32 * 64 + 64 * 32
MUON = {
    "embed": (0, 0, 0),
    0: (KDA_MUON_TP + DENSE_TP, KDA_MUON_REP, 0),
    1: (KDA_MUON_TP + MOE_TP, KDA_MUON_REP + MOE_MUON_REP, MOE_EXP),
    2: (MLA_TP + MOE_TP, 16 * 64 + 36 * 64 + MOE_MUON_REP, MOE_EXP),
    3: (MLA_TP + MOE_TP, 16 * 64 + 36 * 64 + MOE_MUON_REP, MOE_EXP),
    "head": (0, 0, 0),
}
FP32_TP, FP32_REP = 2 * (2 + 32), 3 * 8 * 64  # keep_fp32: A_log + dt_bias of the KDA layers; the routers
# Activations per token (docs/distributed.md): 10 d per layer; KDA 6 H K; MLA H (2 (nope + rope) + 2 v) cut by TP,
# kv_lora + rope whole; MoE ceil(min(k cf, E) (2 w + 3 I)) + 2 w + 3 S I_s; dense 3 I; head 2 V
MOE_ACT = math.ceil(min(2 * 1.25, 8) * (2 * 32 + 3 * 32)) + 2 * 32 + 3 * 2 * 16
ACT = {"embed": (0, 0), 0: (640 + 6 * 32 + 3 * 96, 0), 1: (640 + 6 * 32 + MOE_ACT, 0),
       2: (640 + 2 * (2 * 12 + 2 * 16) + MOE_ACT, 32 + 4), 3: (640 + 2 * (2 * 12 + 2 * 16) + MOE_ACT, 32 + 4),
       "head": (2 * V, 0)}  # fmt: skip


def total(table: dict, group: int) -> int:
    return sum(v[group] for v in table.values())


@pytest.fixture(scope="module")
def k3():
    return load_spec(K3)


@pytest.fixture(scope="module")
def k3_plan(k3):
    return plan(k3, 64, "h200")


@pytest.fixture
def hand(hand_spec):
    return hand_spec


def one(pl: dict, dp: int, tp: int, pp: int, ep: int) -> dict:
    (row,) = [r for r in pl["layouts"] if (r["dp"], r["tp"], r["pp"], r["ep"]) == (dp, tp, pp, ep)]
    return row


def flat(pl: dict) -> list[dict]:
    """The rows of layouts without tensor or pipeline parallelism (the dp x ep layouts `plan` had before)."""
    return [r for r in pl["layouts"] if r["tp"] == r["pp"] == 1]


# --- layouts ---------------------------------------------------------------------------------------------------------


def test_hand_counts_add_up_to_the_spec(hand):
    counts = param_counts(hand)
    assert total(UNITS, 0) + total(UNITS, 1) + total(UNITS, 2) == counts["total"]
    assert total(UNITS, 2) == counts["by_component"]["routed_experts"]["total"]


def test_layouts_cover_every_divisor_of_the_experts(k3, k3_plan):
    eps = [r["ep"] for r in flat(k3_plan)]
    assert eps == [ep for ep in range(1, 65) if 64 % ep == 0 and k3.moe.num_experts % ep == 0]
    assert all(r["dp"] * r["ep"] == 64 for r in flat(k3_plan))
    six = [(lay.dp, lay.ep) for lay in layouts(k3, 6) if lay.tp == lay.pp == 1]
    assert six == [(6 // ep, ep) for ep in (1, 2, 3, 6) if k3.moe.num_experts % ep == 0]


@pytest.mark.parametrize("gpus", [64, 256, 1024])
@pytest.mark.parametrize("node", [8, None])
def test_layouts_are_every_factorisation_meeting_the_rules(k3, gpus, node):
    divs = [k for k in range(1, gpus + 1) if gpus % k == 0]
    cut = (96, 96, 33792, 3072, 163840)  # KDA and MLA heads, dense FFN and shared-expert widths, vocabulary
    want = {
        Layout(gpus // (tp * pp * ep), tp, pp, ep)
        for tp in divs for pp in divs for ep in divs
        if gpus % (tp * pp * ep) == 0 and all(w % tp == 0 for w in cut) and (node is None or node % tp == 0)
        and 896 % ep == 0 and pp <= 93
    }  # fmt: skip
    got = layouts(k3, gpus, node)
    assert set(got) == want and len(got) == len(want)


def test_gpus_are_bounded_before_any_enumeration(k3):
    with pytest.raises(PlanError, match="--gpus"):
        layouts(k3, 10**12)
    with pytest.raises(PlanError, match="--gpus"):
        plan(k3, MAX_GPUS + 1, "h200")
    largest = plan(k3, MAX_GPUS, "h200", top=1)  # divisors, not a count to N: cheap at the bound
    assert all(r["dp"] * r["tp"] * r["pp"] * r["ep"] == MAX_GPUS for r in largest["layouts"])


# --- the dp x ep rows: as before, and equal to `stats` where they overlap -----------------------------------------------


def test_numbers_shared_with_stats_are_equal(k3, k3_plan):
    counts = param_counts(k3)
    assert k3_plan["params"]["total"] == counts["total"]
    assert k3_plan["params"]["routed_experts"] == counts["by_component"]["routed_experts"]["total"]
    for r in flat(k3_plan):
        st = spec_stats(load_spec(K3, [f"parallel.ep={r['ep']}"]), context=k3_plan["seq"], batch=1)
        assert r["routed_expert_bytes_per_rank"] == st["expert_parallel"]["routed_expert_bytes_per_rank"]
        assert r["experts_per_rank"] == st["expert_parallel"]["experts_per_rank"]
        assert r["serve_cache_bytes"] == st["cache_bytes"]["total"]  # one sequence per rank at 64 of 64
    one_rank = next(r for r in flat(k3_plan) if r["ep"] == 1)
    assert one_rank["serve_weight_bytes"] == weight_bytes(k3)["policy"]


def test_training_bytes_follow_the_layout(k3_plan):
    total_, experts = k3_plan["params"]["total"], k3_plan["params"]["routed_experts"]
    for r in flat(k3_plan):
        assert r["params_per_rank"] == -(-(experts // r["ep"]) // r["dp"]) + -(-(total_ - experts) // 64)
        assert r["param_bytes"] == r["grad_bytes"] == 4 * r["params_per_rank"]
        assert r["params_per_rank"] <= r["optimizer_bytes"] // 4 <= 2 * r["params_per_rank"]
        sharded = 2 * r["param_bytes"] + r["optimizer_bytes"]
        assert r["train_bytes"] == sharded + r["activation_bytes"] + r["fsdp_buffer_bytes"]
        assert r["train_bytes_gathered"] == sharded + r["activation_bytes"] + 8 * (experts // r["ep"] + total_ - experts)
        assert r["train_fits"] == (r["train_bytes"] <= 0.9 * GPU_MEMORY["h200"])
        assert (r["all_to_all_bytes_per_step"] > 0) == (r["ep"] > 1)


def test_cache_scales_with_the_sequences_per_rank(k3):
    pl = plan(k3, 8, "b200", batch=32, seq=1024)
    for r in flat(pl):
        assert r["serve_cache_bytes"] == cache_bytes(k3, 1024, 4)["total"]


# --- sharding: every parameter and weight byte is somewhere, as often as the layout replicates it ---------------------


@pytest.mark.parametrize("gpus", [8, 16])
def test_parameters_over_all_ranks_are_the_spec_s_under_each_sharding(hand, gpus):
    tp_cut, whole, routed = total(UNITS, 0), total(UNITS, 1), total(UNITS, 2)
    pl = plan(hand, gpus, "h200")
    assert len(pl["layouts"]) == pl["layouts_total"] > 4
    for r in pl["layouts"]:
        per_pipeline_rank = r["dp"] * r["tp"] * r["ep"]  # ranks sharing a pipeline rank's layers
        held = sum(p["params_per_rank"] for p in r["pipeline"]) * per_pipeline_rank
        # TP cuts its group, ranks of a TP group each hold the whole of the rest, EP splits the experts; FSDP2's
        # shards round up (at most one element per rank and group)
        want = tp_cut + r["tp"] * whole + routed
        assert want <= held < want + 2 * per_pipeline_rank * r["pp"]
        if r["dp"] == r["ep"] == 1:  # non-expert parameters unsharded, experts split evenly over tp: no rounding
            assert held == want
        weights = sum(p["serve_weight_bytes"] for p in r["pipeline"]) * per_pipeline_rank
        tp_bytes = 2 * (tp_cut - FP32_TP) + 4 * FP32_TP
        whole_bytes = 2 * (whole - FP32_REP) + 4 * FP32_REP
        routed_bytes = routed * 17 // 32  # MXFP4: 4.25 bits a value at block 32
        assert weights == r["dp"] * (r["ep"] * tp_bytes + r["tp"] * r["ep"] * whole_bytes + r["tp"] * routed_bytes)
    assert weight_bytes(hand)["policy"] == tp_bytes + whole_bytes + routed_bytes


def test_k3_parameters_over_all_ranks_without_tensor_parallelism(k3):
    for gpus in (64, 256):
        for r in plan(k3, gpus, "h200")["layouts"]:
            if r["tp"] == 1:
                per_pipeline_rank = r["dp"] * r["ep"]
                held = sum(p["params_per_rank"] for p in r["pipeline"]) * per_pipeline_rank
                assert 0 <= held - param_counts(k3)["total"] < 2 * gpus


# --- one layout by hand: dp 1 x tp 2 x pp 2 x ep 2 of the hand spec -----------------------------------------------------


@pytest.fixture
def hand_row(hand):
    return one(plan(hand, 8, "h200"), dp=1, tp=2, pp=2, ep=2)


def test_hand_layout_memory(hand_row):
    r, tp, ep = hand_row, 2, 2
    assert r["microbatches"] == 4  # 8 sequences over dp x ep = 2 replicas, one sequence per microbatch
    assert [p["layers"] for p in r["pipeline"]] == [[[0, 1]], [[2, 3]]]
    stages = (["embed", 0, 1], [2, 3, "head"])
    for p, units in zip(r["pipeline"], stages, strict=True):
        ne = sum(UNITS[u][0] for u in units) // tp + sum(UNITS[u][1] for u in units)
        ex = sum(UNITS[u][2] for u in units) // ep
        assert p["params_per_rank"] == math.ceil(ne / 2) + math.ceil(ex / 2)  # FSDP2 over dp x ep = 2, dp x tp = 2
        muon = sum(MUON[u][0] for u in units) // tp + sum(MUON[u][1] for u in units)
        muon_ex = sum(MUON[u][2] for u in units) // ep
        adamw, adamw_ex = ne - muon, ex - muon_ex  # two moments each; Muon one momentum
        assert p["optimizer_bytes"] == 4 * (math.ceil((muon + 2 * adamw) / 2) + math.ceil((muon_ex + 2 * adamw_ex) / 2))
    # activations: 1F1B holds 2 microbatches on the first rank, 1 on the last; 128 tokens each, cut by TP (the
    # second stage also holds the 2 AttnRes sources it received: the embedding and block 0's summary)
    T = SEQ
    first = 2 * T * (ACT[0][0] + ACT[1][0]) // tp
    last = 1 * (T * (ACT[2][0] + ACT[3][0] + ACT["head"][0] + 2 * D) // tp + T * (ACT[2][1] + ACT[3][1]))
    assert [p["activation_bytes"] for p in r["pipeline"]] == [4 * first, 4 * last]
    assert r["activation_bytes"] == 4 * max(first, last)
    # checkpointed: each layer keeps its block's running sum (d), the embedding its output, the head its logits;
    # plus the largest layer recomputed
    first_ac = 2 * T * (D + 2 * D) // tp + T * ACT[1][0] // tp
    last_ac = T * (2 * D + 2 * V + 2 * D) // tp + T * ACT[2][0] // tp + T * ACT[2][1]
    assert [p["activation_bytes_ac"] for p in r["pipeline"]] == [4 * first_ac, 4 * last_ac]


def test_hand_layout_communication(hand_row):
    r, tp, ep, m, T = hand_row, 2, 2, 4, SEQ
    ring = lambda n, size: (n - 1) * size // n  # noqa: E731 - bytes one rank sends in a ring AG or RS
    stages = (["embed", 0, 1], [2, 3, "head"])
    gather = []
    for units in stages:
        ne = sum(UNITS[u][0] for u in units) // tp + sum(UNITS[u][1] for u in units)
        ex = sum(UNITS[u][2] for u in units) // ep
        gather.append(ring(2, 4 * ne) + ring(2, 4 * ex))
    muon = [ring(2, 4 * (sum(MUON[u][0] for u in s) // tp + sum(MUON[u][1] for u in s)))
            + ring(2, 4 * (sum(MUON[u][2] for u in s) // ep)) for s in stages]  # fmt: skip
    x = ring(tp, T * D * 4)  # one TP all-gather or reduce-scatter of a microbatch's [T, d]
    cap = math.ceil(1.25 * (T // tp) * 2 / 8)  # the rank's T / tp tokens, top 2 of 8 experts
    sent = 8 * cap * 32 * (ep - 1) // ep * 4  # buffer rows [E, C, latent 32] leaving the rank
    want = {
        "fsdp_all_gather": 2 * m * max(gather),  # reshard: gathered for each microbatch's forward and backward
        "fsdp_reduce_scatter": m * max(gather),
        "muon_all_gather": max(muon),
        "tp_attention": m * 2 * 4 * x,  # 2 layers a rank, AG + RS forward and RS + AG backward
        "tp_ffn": m * 2 * 4 * x,  # dense FFN or shared experts in every layer
        "tp_vocab": m * max(2 * x, 2 * x + 3 * 2 * ring(tp, T * 4)),  # head: + loss-parallel all-reduces of [T]
        "ep_dispatch": 2 * m * 2 * sent,  # the last rank's 2 MoE layers, forward and backward
        "ep_combine": 2 * m * 2 * sent,
        "pp_send": m * 2 * (T * D // tp) * 4,  # 2 sources a microbatch: embedding and block 0's summary
    }
    assert r["fsdp_policy"] == "keep" and not r["activation_checkpointing"]  # tiny: everything fits gathered
    assert {k: v for k, v in r["comm"].items() if k not in ("fsdp_all_gather", "fsdp_reduce_scatter", "recompute")} == {
        k: v for k, v in want.items() if not k.startswith("fsdp")}  # fmt: skip
    assert r["comm"]["fsdp_all_gather"] == r["comm"]["fsdp_reduce_scatter"] == max(gather)  # keep: once a step
    assert r["comm"]["recompute"] == 0
    p0, p1 = r["pipeline"]
    assert p0["fsdp_gather_bytes"] == gather[0] and p1["fsdp_gather_bytes"] == gather[1]
    assert p0["comm"]["pp_send"] == p1["comm"]["pp_send"] == want["pp_send"]  # activations out, gradients back
    assert p1["recompute_bytes"] == (want["tp_attention"] + want["tp_ffn"] + 2 * want["ep_dispatch"]) // 2


def test_hand_layout_serving(hand_row):
    r, tp, ep = hand_row, 2, 2
    sequences = 4  # 8 over the dp x ep = 2 groups
    kda = 2 * 16 * 16 * 4 + 3 * 2 * 16 * (3 - 1) * 2  # fp32 state H K K, bf16 conv state of q, k, v
    mla = SEQ * (32 + 4) * 2  # bf16 latent and rope key per token
    assert [p["serve_cache_bytes"] for p in r["pipeline"]] == [sequences * 2 * kda // tp, sequences * 2 * mla]
    tp0, rep0 = UNITS["embed"][0] + UNITS[0][0] + UNITS[1][0], UNITS[0][1] + UNITS[1][1]
    tp1, rep1 = UNITS[2][0] + UNITS[3][0] + UNITS["head"][0], UNITS[2][1] + UNITS[3][1] + UNITS["head"][1]
    w0 = (2 * (tp0 - FP32_TP) + 4 * FP32_TP) // tp + 2 * (rep0 - 8 * 64) + 4 * 8 * 64 + MOE_EXP * 17 // 32 // ep
    w1 = 2 * tp1 // tp + 2 * (rep1 - 2 * 8 * 64) + 4 * 2 * 8 * 64 + 2 * MOE_EXP * 17 // 32 // ep
    assert [p["serve_weight_bytes"] for p in r["pipeline"]] == [w0, w1]


# --- attention residuals across pipeline stages --------------------------------------------------------------------------


def test_carried_sources_grow_with_the_finished_blocks(k3, specs_dir):
    for layer in range(1, 93):  # K3: embedding, one summary per finished block of 12 layers, the partial block
        assert carried_sources(k3, layer) == 1 + layer // 12 + (layer % 12 != 0)
    full = load_spec(specs_dir / "ablations" / "attn-res-full.yaml")
    assert [carried_sources(full, layer) for layer in range(1, 4)] == [3, 5, 7]  # embedding + 2 sublayers a layer
    plain = load_spec(specs_dir / "kimi-linear-48b-a3b.yaml")
    assert {carried_sources(plain, layer) for layer in range(1, 27)} == {1}  # the hidden state


def test_pipeline_sends_the_sources_of_each_boundary(k3):
    r = one(plan(k3, 64, "h200"), dp=1, tp=1, pp=8, ep=8)
    starts = [0, 11, 22, 33, 45, 57, 69, 81]  # 93 layers in 8 stages, the last 5 one layer longer
    assert [p["layers"][0][0] for p in r["pipeline"]] == starts
    sources = [1 + s // 12 + (s % 12 != 0) for s in starts[1:]]
    assert [b["sources"] for b in r["boundaries"]] == sources == [2, 3, 4, 5, 6, 7, 8]
    m, unit = 8, 4096 * 7168 * 4  # 8 sequences a replica, one a microbatch; a [T, d] fp32 tensor
    for rank, p in enumerate(r["pipeline"]):
        out = sources[rank] if rank < 7 else 0  # activations to the next stage
        back = sources[rank - 1] if rank > 0 else 0  # gradients to the previous one
        assert p["comm"]["pp_send"] == m * (out + back) * unit


# --- pipeline schedules: torch.distributed.pipelining's own order ------------------------------------------------------


def torch_in_flight(pp: int, v: int, m: int, rank: int, sizes: list[int]) -> tuple[int, int]:
    """(most chunk-microbatches in flight, most activation with chunk j weighing sizes[j]) over rank's actions in
    torch's ScheduleInterleaved1F1B order."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    stages = [SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=rank, stage_index=rank + j * pp)
              for j in range(v)]  # fmt: skip
    order = ScheduleInterleaved1F1B(stages, m).pipeline_order[rank]
    count, weight, most, heaviest = 0, 0, 0, 0
    for action in filter(None, order):
        sign = {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
        count += sign
        weight += sign * sizes[(action.stage_index - rank) // pp]
        most, heaviest = max(most, count), max(heaviest, weight)
    return most, heaviest


@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (4, 3, 8), (3, 2, 3), (4, 2, 2), (8, 2, 16)])
def test_interleaved_in_flight_is_torch_s(pp, v, m):
    rng = random.Random(pp * 100 + v * 10 + m)
    for rank in range(pp):
        sizes = [rng.randint(1, 9) for _ in range(v)]
        most, heaviest = torch_in_flight(pp, v, m, rank, sizes)
        held = in_flight(pp, v, m, rank)
        assert held == most
        bound = sum(h * s for h, s in zip(held_per_chunk(held, m, sizes), sizes, strict=True))
        assert heaviest <= bound
        assert torch_in_flight(pp, v, m, rank, [1] * v)[1] == sum(held_per_chunk(held, m, [1] * v))


def test_1f1b_holds_up_to_pp_microbatches_on_the_first_stage():
    assert [in_flight(4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, 1, 2, r) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight(1, 1, 5, 0) == 1  # no pipeline: one microbatch at a time


def test_schedules_that_torch_refuses_are_not_ranked_for_training(k3):
    pl = plan(k3, 64, "h200", batch=8)  # 8 sequences: pp > 8 / (dp ep) leaves 1F1B short of microbatches
    short = [r for r in pl["layouts"] if r["microbatches"] < r["pp"]]
    assert short and pl["layouts_not_trainable"] == len(short)
    assert all(r["train_rank"] is None and r["train_note"] and not r["train_fits"] for r in short)
    assert all(r["serve_rank"] is not None for r in short)


# --- Kimi K3 on 64, 256 and 1,024 H200 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [64, 256, 1024])
def test_k3_layouts(k3, gpus):
    pl = plan(k3, gpus, "h200")
    rows = pl["layouts"]
    assert rows and all(r["dp"] * r["tp"] * r["pp"] * r["ep"] == gpus for r in rows)
    state = param_counts(k3)["total"] * (4 + 4 + 4)  # fp32 weights and gradients, Muon's momentum at least
    limit = 0.9 * GPU_MEMORY["h200"]
    for r in rows:
        assert r["train_bytes_chosen"] >= state // gpus  # no sharding beats an even split
        assert r["activation_bytes_ac"] < r["activation_bytes"]
        assert r["train_fits_chosen"] == (r["train_bytes_chosen"] <= limit)
    train = sorted((r for r in rows if r["train_rank"] is not None), key=lambda r: r["train_rank"])
    classes = [0 if not r["train_fits_chosen"] else 1 + (not r["activation_checkpointing"]) for r in train]
    assert classes == sorted(classes, reverse=True)  # without checkpointing first, then with, then not fitting
    serve = sorted(rows, key=lambda r: r["serve_rank"])
    assert [r["serve_fits"] for r in serve] == sorted((r["serve_fits"] for r in serve), reverse=True)
    fitting = [r["serve_sequences_per_gpu"] for r in serve if r["serve_fits"]]
    assert fitting == sorted(fitting, reverse=True)
    if state // gpus > limit:
        assert not any(r["train_fits_chosen"] for r in rows)
    else:
        assert train[0]["train_fits_chosen"]


# --- the command ------------------------------------------------------------------------------------------------------


def test_cli_prints_the_tables_and_json(capsys):
    assert main(["plan", str(K3), "--gpus", "64", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "64 x H200" in out and "1 x 1 x 1 x 64" in out and "serving, per rank" in out and "bytes each rank" in out
    assert main(["plan", str(K3), "--gpus", "64", "--gpu", "h200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"] == 64 and len(doc["layouts"]) >= 2
    assert all(min(r["train_rank"] or 11, r["serve_rank"]) <= 10 for r in doc["layouts"])
    assert main(["plan", str(K3), "--gpus", "64", "--gpu", "h200", "--json", "--all", "--tp-across-nodes"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["layouts"]) == doc["layouts_total"] and {r["tp"] for r in doc["layouts"]} == {1, 2, 4, 8, 16, 32}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "1000000000000"], "--gpus must be between 1 and"),
        (["--gpus", "64", "--seq", "2000000"], "--seq must be between 1 and the spec's context_length"),
        (["--gpus", "64", "--batch", "100000000"], "--batch must be between"),
        (["--gpus", "64", "--virtual-stages", "2"], "--virtual-stages applies to --schedule interleaved only"),
        (["--gpus", "64", "--schedule", "interleaved", "--virtual-stages", "1"], "interleaved needs 2 to num_layers"),
        (["--gpus", "64", "--microbatch", "65"], "--microbatch must be between 1 and the batch"),
    ],
)
def test_cli_refuses_impossible_requests_in_one_line(cli, args, message):
    rc, out, err = cli("plan", K3, "--gpu", "h200", *args)
    assert rc == 2 and out == "" and err.startswith(f"error: {message}") and err.count("\n") == 1


def test_cli_rejects_an_unknown_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(K3), "--gpus", "64", "--gpu", "v100"])
    assert e.value.code == 2
