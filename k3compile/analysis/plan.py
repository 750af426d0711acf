"""`k3compile plan`: per-rank memory and per-step traffic of every dp x tp x pp x ep layout of N GPUs (spec alone).

Training holds what a per-layer FSDP2 run holds: fp32 parameters, fp32 gradients and the optimiser's fp32 state
(Per-Head Muon: one momentum per matrix; AdamW: two moments per tensor), tensor parallelism cutting heads, FFN
widths and the vocabulary, FSDP2 sharding the rest over the data-parallel ranks (non-expert parameters over
dp x ep, each EP rank's routed experts over dp x tp), pipeline stages of contiguous layers under 1F1B or
interleaved 1F1B; activations with and without per-layer activation checkpointing. Communication is the bytes
each rank sends per step, per collective. Serving holds the weights under the quantisation policy and the decode
caches of its sequences. A layout fits when its largest rank total is at most FIT_FRACTION of the GPU's memory
(the rest: workspace, allocator, communication buffers). Every formula is in docs/distributed.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3compile.analysis.units import Unit, carried_sources, tp_widths, units
from k3compile.kernels.moe.op import expert_capacity
from k3compile.spec.schema import MAX_BATCH, MAX_WORLD, Spec

GPU_MEMORY = {  # bytes of HBM per GPU (NVIDIA datasheets: A100 80GB, H100 SXM, H200, HGX B200)
    "a100": 80 * 10**9,
    "h100": 80 * 10**9,
    "h200": 141 * 10**9,
    "b200": 180 * 10**9,
}
FIT_FRACTION = 0.9
FP32 = 4
MAX_GPUS = MAX_WORLD  # the largest world `plan` enumerates (checked before any enumeration)
GPUS_PER_NODE = 8  # tensor parallelism stays within a node (NVLink) unless told otherwise
SCHEDULES = ("1f1b", "interleaved")


class PlanError(ValueError):
    """A request `plan` cannot answer (one line)."""


@dataclass(frozen=True)
class Layout:
    """Degrees of one layout: data, tensor, pipeline and expert parallelism (their product is the world)."""

    dp: int
    tp: int
    pp: int
    ep: int


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division up to sqrt(n))."""
    small, large = [], []
    for k in range(1, math.isqrt(n) + 1):
        if n % k == 0:
            small.append(k)
            if k != n // k:
                large.append(n // k)
    return small + large[::-1]


def _check_gpus(gpus: int) -> None:
    if not 1 <= gpus <= MAX_GPUS:
        raise PlanError(f"--gpus must be between 1 and {MAX_GPUS:,}, got {gpus:,}")


def layouts(spec: Spec, gpus: int, gpus_per_node: int | None = GPUS_PER_NODE, virtual_stages: int = 1) -> list[Layout]:
    """Every dp x tp x pp x ep = gpus where tp divides every width it cuts (`units.tp_widths`) and, unless
    `gpus_per_node` is None, the GPUs of a node; ep divides the routed experts; pp x virtual_stages is at most
    num_layers. Enumerated by divisors (never by counting to gpus); ordered by tp, pp, ep."""
    _check_gpus(gpus)
    tp_max = math.gcd(gpus, *tp_widths(spec).values())
    if gpus_per_node is not None:
        tp_max = math.gcd(tp_max, gpus_per_node)
    experts = spec.moe.num_experts if spec.moe is not None else 1
    out = []
    for tp in divisors(tp_max):
        for ep in divisors(math.gcd(experts, gpus // tp)):
            rest = gpus // (tp * ep)
            for pp in divisors(rest):
                if pp == 1 or pp * virtual_stages <= spec.num_layers:
                    out.append(Layout(rest // pp, tp, pp, ep))
    return sorted(out, key=lambda lay: (lay.tp, lay.pp, lay.ep))


def stage_layers(num_layers: int, chunks: int) -> list[range]:
    """Contiguous layer ranges of `chunks` pipeline chunks; the last num_layers % chunks take one layer more
    (the first stage holds the embedding and, under 1F1B, the most microbatches in flight)."""
    q, r = divmod(num_layers, chunks)
    out, start = [], 0
    for c in range(chunks):
        n = q + (c >= chunks - r)
        out.append(range(start, start + n))
        start += n
    return out


def in_flight(pp: int, virtual_stages: int, microbatches: int, rank: int) -> int:
    """Chunk-microbatches whose forward activations pipeline rank `rank` holds at its peak: the warm-up forwards plus
    the first steady-state forward (after it every forward follows a backward) of torch.distributed.pipelining's
    Schedule1F1B (pp - rank) or ScheduleInterleaved1F1B ((v - 1) microbatches per round plus 2 per hop from the last
    rank), at most every microbatch of every local chunk."""
    m, v = microbatches, virtual_stages
    if pp == 1:
        return 1
    if v == 1:
        return min(m, pp - rank)
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, m * v)


def held_per_chunk(held: int, microbatches: int, sizes: list[int]) -> list[int]:
    """The most activation a rank can hold with `held` chunk-microbatches in flight, at most `microbatches` of each
    local chunk: the largest chunks first (exact for one chunk or equal chunks, an upper bound otherwise)."""
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        out[j] = min(microbatches, held)
        held -= out[j]
    return out


def schedule_note(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why torch.distributed.pipelining cannot run this pipeline with this many microbatches, or None."""
    if pp == 1:
        return None
    if schedule == "1f1b" and microbatches < pp:
        return f"1F1B needs at least pp = {pp} microbatches, the batch gives {microbatches}"
    rounds = max(1, microbatches // pp)
    if schedule == "interleaved" and microbatches % rounds:
        return f"interleaved 1F1B needs the microbatches ({microbatches}) to be a multiple of its rounds ({rounds})"
    return None


def _ring(n: int, size: int) -> int:
    """Bytes a rank sends in a ring all-gather or reduce-scatter of `size` bytes over n ranks."""
    return (n - 1) * size // n


class _Pipeline:
    """One layout's pipeline at a batch: per unit, what one rank of the layout holds of it (TP and EP applied,
    before FSDP2), and which units each pipeline rank holds."""

    def __init__(self, spec: Spec, us: list[Unit], carried: list[int], lay: Layout, virtual_stages: int, batch: int,
                 seq: int, microbatch: int | None):  # fmt: skip
        self.spec, self.lay, self.seq = spec, lay, seq
        self.v = virtual_stages if lay.pp > 1 else 1
        self.chunks = stage_layers(spec.num_layers, lay.pp * self.v)
        self.sequences = math.ceil(batch / (lay.dp * lay.ep))  # each replica's share of the global batch
        per = microbatch if microbatch is not None else (1 if lay.pp > 1 else self.sequences)
        per = min(per, self.sequences)
        self.microbatches = math.ceil(self.sequences / per)
        self.tokens = T = per * seq  # tokens of one microbatch (a TP group's, split over its ranks by sequence)
        self.carried_at = carried  # sources crossing into a stage that starts at each layer

        def non_expert(attr: str) -> list[int]:
            return [getattr(u, attr)["tp"] // lay.tp + getattr(u, attr)["rep"] for u in us]

        def expert(attr: str) -> list[int]:
            return [getattr(u, attr)["exp"] // lay.ep for u in us]

        self.ne, self.ex = non_expert("params"), expert("params")
        self.ne_state, self.ex_state = non_expert("state"), expert("state")
        self.ne_muon, self.ex_muon = non_expert("muon"), expert("muon")
        self.ne_policy, self.ex_policy = non_expert("policy"), expert("policy")
        self.act_tp = [u.act_tp for u in us]
        self.act_ckpt = [u.act_ckpt for u in us]
        self.full = [math.ceil(T * u.act_tp / lay.tp) + T * u.act_rep for u in us]  # one microbatch, no recompute
        self.act_rep = [u.act_rep for u in us]
        self.tp_attention = [u.tp_attention for u in us]
        self.tp_ffn = [u.tp_ffn for u in us]
        self.moe = [int(u.moe) for u in us]
        self.cache_token = [u.cache_token for u in us]
        self.cache_sequence = [u.cache_sequence for u in us]

    def span(self, c: int) -> slice:
        """Chunk c's units: its layers, with the embedding on the first chunk and the head on the last."""
        first, last = self.chunks[c].start + 1, self.chunks[c].stop + 1
        return slice(0 if c == 0 else first, last + 1 if c == len(self.chunks) - 1 else last)

    def carried(self, c: int) -> int:
        """[B, T, D] tensors crossing into chunk c (0 for the first)."""
        return self.carried_at[self.chunks[c].start] if c > 0 else 0

    def rank(self, r: int, memory: int) -> dict:
        """Per-rank numbers of pipeline rank r (every dp, tp and ep coordinate of it holds the same amounts)."""
        lay, T, m, d = self.lay, self.tokens, self.microbatches, self.spec.hidden_size
        mine = [r + j * lay.pp for j in range(self.v)]
        spans = [self.span(c) for c in mine]

        def total(values: list[int]) -> int:
            return sum(sum(values[s]) for s in spans)

        n_ne, n_ex = lay.dp * lay.ep, lay.dp * lay.tp  # FSDP2 group sizes: non-expert, routed-expert parameters
        ne, ex = total(self.ne), total(self.ex)
        params = math.ceil(ne / n_ne) + math.ceil(ex / n_ex)
        state = math.ceil(total(self.ne_state) / n_ne) + math.ceil(total(self.ex_state) / n_ex)
        full, kept = [], []  # per local chunk: one microbatch's activations without and with checkpointing
        for c, s in zip(mine, spans, strict=True):
            carried = self.carried(c) * d  # the sources received are held until the microbatch's backward
            full.append(math.ceil(T * (sum(self.act_tp[s]) + carried) / lay.tp) + T * sum(self.act_rep[s]))
            kept.append(math.ceil(T * (sum(self.act_ckpt[s]) + carried) / lay.tp))
        held = in_flight(lay.pp, self.v, m, r)
        act = sum(h * a for h, a in zip(held_per_chunk(held, m, full), full, strict=True)) * FP32
        recompute = max(max(self.full[s.start + (c == 0) : s.stop - (c == len(self.chunks) - 1)])
                        for c, s in zip(mine, spans, strict=True))  # the largest layer, recomputed in backward
        act_ac = (sum(h * a for h, a in zip(held_per_chunk(held, m, kept), kept, strict=True)) + recompute) * FP32
        largest = max(a + b for s in spans for a, b in zip(self.ne[s], self.ex[s], strict=True))  # unit, gathered
        buffers = 3 * largest * FP32  # two units' gathered weights (computing, prefetched), one unit's gradients
        whole = 2 * (ne + ex) * FP32  # every unit's weights and gradients gathered for the whole step
        sharded = (2 * params + state) * FP32
        step = self._communication(mine, spans, n_ne, n_ex)
        w_ne, w_ex = total(self.ne_policy), total(self.ex_policy)
        per_sequence = self.seq * total(self.cache_token)  # MLA latent: whole on every TP rank
        per_sequence += total(self.cache_sequence) // lay.tp  # KDA state and short-conv state: cut by heads
        free = int(FIT_FRACTION * memory) - (w_ne + w_ex)
        return {
            "pipeline_rank": r,
            "layers": [[self.chunks[c].start, self.chunks[c].stop - 1] for c in mine],
            "params_per_rank": params,
            "param_bytes": params * FP32,
            "grad_bytes": params * FP32,
            "optimizer_bytes": state * FP32,
            "activation_bytes": act,
            "activation_bytes_ac": act_ac,
            "fsdp_buffer_bytes": buffers,
            "fsdp_gathered_bytes": whole,
            "train_bytes": sharded + act + buffers,
            "train_bytes_ac": sharded + act_ac + buffers,
            "train_bytes_gathered": sharded + act + whole,
            "train_bytes_gathered_ac": sharded + act_ac + whole,
            "fsdp_gather_bytes": _ring(n_ne, ne * FP32) + _ring(n_ex, ex * FP32),
            "comm": step,
            "recompute_bytes": (step["tp_attention"] + step["tp_ffn"] + step["ep_dispatch"] + step["ep_combine"]) // 2,
            "routed_expert_bytes_per_rank": w_ex,
            "serve_weight_bytes": w_ne + w_ex,
            "serve_cache_bytes": self.sequences * per_sequence,
            "serve_bytes": w_ne + w_ex + self.sequences * per_sequence,
            "serve_max_sequences": max(free, 0) // per_sequence if per_sequence else 0,
        }  # fmt: skip

    def _communication(self, mine: list[int], spans: list[slice], n_ne: int, n_ex: int) -> dict:
        """Bytes the rank sends per step in each collective other than FSDP2's gathers (ring all-gather and
        reduce-scatter: (n - 1) / n of the whole; all-reduce twice that)."""
        spec, lay, T, m = self.spec, self.lay, self.tokens, self.microbatches
        d, K = spec.hidden_size, len(self.chunks)

        def total(values: list[int]) -> int:
            return sum(sum(values[s]) for s in spans)

        x = _ring(lay.tp, T * d * FP32)  # one all-gather or reduce-scatter of a microbatch's [T, d] over TP
        loss = 3 * 2 * _ring(lay.tp, T * FP32)  # loss-parallel cross-entropy: 3 all-reduces of [T]
        vocab = (2 * x if 0 in mine else 0) + (2 * x + loss if K - 1 in mine else 0)  # embedding, head
        sent = 0
        moe = spec.moe
        if moe is not None and lay.ep > 1:
            cap = expert_capacity(math.ceil(T / lay.tp), moe.num_experts, moe.top_k, moe.capacity_factor)
            sent = moe.num_experts * cap * (moe.latent_size or d) * (lay.ep - 1) // lay.ep * FP32
        crossings = sum(self.carried(c + 1) for c in mine if c < K - 1) + sum(self.carried(c) for c in mine if c > 0)
        return {
            "muon_all_gather": _ring(n_ne, total(self.ne_muon) * FP32) + _ring(n_ex, total(self.ex_muon) * FP32),
            "tp_attention": 4 * m * x * total(self.tp_attention),  # AG + RS forward, RS + AG backward
            "tp_ffn": 4 * m * x * total(self.tp_ffn),
            "tp_vocab": m * vocab,
            "ep_dispatch": 2 * m * total(self.moe) * sent,  # forward and backward
            "ep_combine": 2 * m * total(self.moe) * sent,
            "pp_send": m * crossings * math.ceil(T * d / lay.tp) * FP32,  # activations forward, gradients backward
        }


def _max_over(ranks: list[dict]) -> dict:
    """Each number's largest value over the pipeline ranks (each on its own; serving: the narrowest stage)."""
    out = {k: max(r[k] for r in ranks) for k in ranks[0] if k not in ("pipeline_rank", "layers", "comm")}
    out["comm"] = {k: max(r["comm"][k] for r in ranks) for k in ranks[0]["comm"]}
    out["serve_max_sequences"] = min(r["serve_max_sequences"] for r in ranks)
    return out


CONFIGS = (  # (FSDP2 policy, activation checkpointing), in order of preference at equal traffic
    ("keep", False), ("reshard", False), ("keep", True), ("reshard", True),
)  # fmt: skip


def _training_config(row: dict, microbatches: int, limit: float) -> None:
    """Choose the row's training configuration and fill its totals: without checkpointing if one fits, then the
    FSDP2 policy sending fewer bytes. `reshard` (FSDP2's default) gathers each unit for every microbatch's forward
    and backward and reduce-scatters every microbatch's gradients; `keep` gathers once a step and holds the
    rank's units gathered (weights and gradients) until one reduce-scatter at the end."""
    g = row["fsdp_gather_bytes"]
    options = []
    for policy, ac in CONFIGS:
        memory = row[("train_bytes_gathered" if policy == "keep" else "train_bytes") + ("_ac" if ac else "")]
        fsdp = {"fsdp_all_gather": g, "fsdp_reduce_scatter": g} if policy == "keep" else {
            "fsdp_all_gather": 2 * microbatches * g, "fsdp_reduce_scatter": microbatches * g}  # fmt: skip
        comm = {**fsdp, **row["comm"], "recompute": row["recompute_bytes"] if ac else 0}
        fits = row["train_note"] is None and memory <= limit
        key = (0, ac, sum(comm.values()), memory) if fits else (1, False, 0, memory)  # else the closest to fitting
        options.append((key, policy, ac, memory, comm, fits))
    _, policy, ac, memory, comm, fits = min(options, key=lambda o: o[0])
    row.update({
        "fsdp_policy": policy, "activation_checkpointing": ac, "train_bytes_chosen": memory,
        "train_fits_chosen": fits, "comm": comm, "comm_bytes": sum(comm.values()),
    })  # fmt: skip


def _check(spec: Spec, gpus: int, gpu: str, batch: int, seq: int, microbatch: int | None, schedule: str,
           virtual_stages: int, gpus_per_node: int | None) -> None:  # fmt: skip
    """Every bound, before any enumeration."""
    _check_gpus(gpus)
    if gpu not in GPU_MEMORY:
        raise PlanError(f"unknown GPU {gpu!r} (one of {', '.join(GPU_MEMORY)})")
    if not 1 <= batch <= MAX_BATCH:
        raise PlanError(f"--batch must be between 1 and {MAX_BATCH:,} sequences, got {batch:,}")
    if not 1 <= seq <= spec.context_length:
        raise PlanError(f"--seq must be between 1 and the spec's context_length ({spec.context_length:,}), got {seq:,}")
    if microbatch is not None and not 1 <= microbatch <= batch:
        raise PlanError(f"--microbatch must be between 1 and the batch ({batch:,}), got {microbatch:,}")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
    if schedule == "1f1b" and virtual_stages != 1:
        raise PlanError("--virtual-stages applies to --schedule interleaved only")
    if schedule == "interleaved" and not 2 <= virtual_stages <= spec.num_layers:
        raise PlanError(f"interleaved needs 2 to num_layers ({spec.num_layers}) virtual stages, got {virtual_stages}")
    if gpus_per_node is not None and not 1 <= gpus_per_node <= MAX_GPUS:
        raise PlanError(f"--gpus-per-node must be between 1 and {MAX_GPUS:,}, got {gpus_per_node:,}")


def _train_key(row: dict) -> tuple:
    """Fits without checkpointing, then with it (each by the pipeline bubble, then bytes sent, then memory); then
    the layouts that do not fit, closest first."""
    order = row["tp"], row["pp"], row["ep"]
    if not row["train_fits_chosen"]:
        return 2, 0.0, 0, row["train_bytes_chosen"], *order
    cls = 1 if row["activation_checkpointing"] else 0
    return cls, row["bubble"], row["comm_bytes"], row["train_bytes_chosen"], *order


def _serve_key(row: dict) -> tuple:
    """Fits first; then the most sequences per GPU at --seq tokens in the memory the weights leave."""
    return not row["serve_fits"], -row["serve_sequences_per_gpu"], row["serve_bytes"], row["tp"], row["pp"], row["ep"]


def plan(spec: Spec, gpus: int, gpu: str, batch: int | None = None, seq: int | None = None, *,
         microbatch: int | None = None, schedule: str = "1f1b", virtual_stages: int | None = None,
         gpus_per_node: int | None = GPUS_PER_NODE, top: int | None = None) -> dict:  # fmt: skip
    """Per-rank bytes of every dp x tp x pp x ep layout of `gpus` GPUs of kind `gpu` at a global batch of `batch`
    sequences (default: one per GPU) of `seq` tokens (default: training.seq_len), in microbatches of `microbatch`
    sequences (default: 1 under pipeline parallelism, else a replica's whole share), ranked for training and for
    serving; `top` keeps the layouts ranked within the first `top` of either (None: all). JSON-ready."""
    batch = gpus if batch is None else batch
    seq = spec.training.seq_len if seq is None else seq
    v = virtual_stages if virtual_stages is not None else (2 if schedule == "interleaved" else 1)
    _check(spec, gpus, gpu, batch, seq, microbatch, schedule, v, gpus_per_node)
    memory = GPU_MEMORY[gpu]
    us = units(spec)
    carried = [carried_sources(spec, layer) for layer in range(spec.num_layers)]
    rows = []
    for lay in layouts(spec, gpus, gpus_per_node, v):
        pipe = _Pipeline(spec, us, carried, lay, v, batch, seq, microbatch)
        note = schedule_note(schedule, lay.pp, pipe.microbatches)
        ranks = [pipe.rank(r, memory) for r in range(lay.pp)]
        row = {
            "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "virtual_stages": pipe.v,
            "experts_per_rank": spec.moe.num_experts // lay.ep if spec.moe is not None else 0,
            "microbatches": pipe.microbatches, "microbatch_sequences": pipe.tokens // seq,
            "bubble": (lay.pp - 1) / (pipe.v * pipe.microbatches + lay.pp - 1),
            "train_note": note,
            **_max_over(ranks),
        }  # fmt: skip
        limit = FIT_FRACTION * memory  # a layout its schedule cannot run fits no training
        row["train_fits"] = note is None and row["train_bytes"] <= limit
        row["train_fits_ac"] = note is None and row["train_bytes_ac"] <= limit
        row["train_fits_gathered"] = note is None and row["train_bytes_gathered"] <= limit
        row["serve_fits"] = row["serve_bytes"] <= limit
        _training_config(row, pipe.microbatches, limit)
        row["all_to_all_bytes_per_step"] = row["comm"]["ep_dispatch"] + row["comm"]["ep_combine"]
        row["serve_sequences_per_gpu"] = row["serve_max_sequences"] / (lay.tp * lay.pp)
        row["boundaries"] = [{"layer": c.start, "sources": pipe.carried(k)} for k, c in enumerate(pipe.chunks) if k]
        row["pipeline"] = ranks
        rows.append(row)
    for key, name in ((_train_key, "train_rank"), (_serve_key, "serve_rank")):
        ranked = sorted((r for r in rows if name == "serve_rank" or r["train_note"] is None), key=key)
        for i, r in enumerate(ranked, 1):
            r[name] = i
    for r in rows:
        r.setdefault("train_rank", None)
    shown = [r for r in rows if top is None or min(r["train_rank"] or top + 1, r["serve_rank"]) <= top]
    params = {g: sum(u.params[g] for u in us) for g in ("tp", "rep", "exp")}
    return {
        "spec": spec.name,
        "gpus": gpus,
        "gpu": gpu,
        "gpu_memory_bytes": memory,
        "fit_fraction": FIT_FRACTION,
        "batch": batch,
        "seq": seq,
        "microbatch": microbatch,
        "schedule": schedule,
        "virtual_stages": v,
        "rules": {
            "tp_divides": tp_widths(spec),
            "tp_within_node_of": gpus_per_node,
            "ep_divides": spec.moe.num_experts if spec.moe is not None else 1,
            "pp_at_most": spec.num_layers // v,
        },
        "params": {
            "total": sum(params.values()), "routed_experts": params["exp"], "other": params["tp"] + params["rep"],
            "tp_sharded": params["tp"], "tp_replicated": params["rep"],
        },  # fmt: skip
        "top": top,
        "layouts_total": len(rows),
        "layouts_not_trainable": sum(r["train_note"] is not None for r in rows),
        "layouts": shown,
    }
