"""Human-readable views of specs and their static numbers (rich tables), and spec diffs."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3compile.analysis.stats import spec_stats
from k3compile.spec.schema import Spec


def human(n: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M'; bytes use the same decimal prefixes (GB = 1e9 B)."""
    if n is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {prefix}{unit}"
    return f"{n:g} {unit}".rstrip()


def _console() -> Console:
    """A console that keeps wide tables readable when output is piped (no terminal width to ask)."""
    con = Console(highlight=False)
    return con if con.is_terminal else Console(highlight=False, width=140)


def print_stats(st: dict) -> None:
    con = _console()
    p = st["params"]
    t = Table(title=f"{st['spec']}: parameters", title_justify="left")
    t.add_column("component")
    t.add_column("total", justify="right")
    t.add_column("active / token", justify="right")
    for name, c in p["by_component"].items():
        if c["total"]:
            t.add_row(name, f"{c['total']:,}", f"{c['active']:,}")
    t.add_row("[bold]all", f"[bold]{p['total']:,}", f"[bold]{p['active']:,}")
    con.print(t)

    f, w, c, ep = st["flops_per_token"], st["weight_bytes"], st["cache_bytes"], st["expert_parallel"]
    t = Table(title="derived numbers", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("parameters, total / active", f"{human(p['total'])} / {human(p['active'])}")
    t.add_row(f"forward FLOPs / token at context {f['context']:,}", human(f["forward"], "FLOP"))
    t.add_row("  of which matmuls / MLA attention / KDA", " / ".join(human(f[k]) for k in ("matmul", "attention", "kda")))
    t.add_row("weights under the policy", human(w["policy"], "B"))
    t.add_row("weights in bf16", human(w["bf16"], "B"))
    t.add_row(f"decode cache, context {c['context']:,} x batch {c['batch']}", human(c["total"], "B"))
    t.add_row("  MLA latent / KDA state / short conv", " / ".join(human(c[k], "B") for k in ("mla_latent", "kda_state", "short_conv")))
    t.add_row("  same spec, every layer full attention", human(c["all_full_attention"], "B"))
    t.add_row(f"routed experts per EP rank (ep={ep['ep']})", f"{ep['experts_per_rank']} = {human(ep['routed_expert_bytes_per_rank'], 'B')}")
    con.print(t)


def _layout_text(spec: Spec) -> str:
    mixers = "".join(spec.mixers)
    return mixers if len(mixers) <= 48 else f"{mixers[:44]}... ({mixers.count('K')} K, {mixers.count('M')} M)"


def print_check(spec: Spec, path: str) -> None:
    st = spec_stats(spec)
    con = _console()
    t = Table(title=f"{escape(str(path))}: valid spec '{spec.name}'", title_justify="left", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("model", f"d={spec.hidden_size}, {spec.num_layers} layers, vocab {spec.vocab_size:,}, "
              f"context {spec.context_length:,}, {'tied' if spec.tie_embeddings else 'untied'} embeddings")
    t.add_row("layout", _layout_text(spec))
    if spec.kda:
        k = spec.kda
        gate = "full-rank" if k.output_gate_rank is None else f"rank-{k.output_gate_rank}"
        t.add_row("KDA", f"{k.num_heads} x {k.head_dim}, conv {k.short_conv_size}, decay {k.decay.form}, {gate} gate")
    if spec.mla:
        m = spec.mla
        t.add_row("MLA", f"{m.num_heads} heads, q_lora {m.q_lora_rank}, kv_lora {m.kv_lora_rank}, "
                  f"nope/rope/v {m.qk_nope_head_dim}/{m.qk_rope_head_dim}/{m.v_head_dim}, "
                  f"{'RoPE' if m.rope else 'NoPE'}, gate {'on' if m.output_gate else 'off'}")
    if spec.moe:
        m = spec.moe
        latent = f"latent {m.latent_size}" if m.latent_size else "no latent"
        t.add_row("MoE", f"{m.top_k} of {m.num_experts} experts x {m.expert_intermediate_size}, "
                  f"{m.num_shared_experts} shared, {latent}, {m.router.scoring} router, balancing {m.router.balancing}")
    if spec.dense_ffn and spec.dense_ffn.layers:
        t.add_row("dense FFN", f"layers {list(spec.dense_ffn.layers)}, intermediate {spec.dense_ffn.intermediate_size}")
    a = spec.activation
    t.add_row("activation", a.kind + (f" (beta1 {a.beta1:g}, beta2 {a.beta2:g})" if a.kind == "situ_glu" else ""))
    r = spec.residual
    t.add_row("residual", r.kind if r.kind == "plain" else f"attn_res {r.mode}" + (f", block {r.block_size}" if r.block_size else ""))
    q = spec.quantization
    rules = "; ".join(f"{x.match} -> {x.weight}/{x.activation}" for x in q.rules) or "none"
    t.add_row("quantisation", f"default {q.default_weight}, rules: {rules}, QAT {'on' if q.qat else 'off'}")
    par = spec.parallel
    t.add_row("target", f"{spec.target}, dp {par.dp} tp {par.tp} ep {par.ep} pp {par.pp}")
    p = st["params"]
    t.add_row("parameters", f"{human(p['total'])} total, {human(p['active'])} active per token")
    t.add_row("weights", f"{human(st['weight_bytes']['policy'], 'B')} under the policy, "
              f"{human(st['weight_bytes']['bf16'], 'B')} in bf16")
    con.print(t)


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, (list, tuple)) and not all(isinstance(x, (int, float, str)) for x in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: list(obj) if isinstance(obj, tuple) else obj}


def spec_diff(a: Spec, b: Spec, context: int | None = None) -> dict:
    """Fields that differ, then every numeric derived number of both specs with its change."""
    fa, fb = _flatten(a.model_dump(mode="json")), _flatten(b.model_dump(mode="json"))
    fields = {k: {"a": fa.get(k), "b": fb.get(k)} for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)}
    ctx = context or min(a.context_length, b.context_length)
    sa, sb = _flatten(spec_stats(a, ctx)), _flatten(spec_stats(b, ctx))
    derived = {}
    for k in sa.keys() | sb.keys():
        va, vb = sa.get(k), sb.get(k)
        if isinstance(va, (int, float)) or isinstance(vb, (int, float)):
            delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
            derived[k] = {"a": va, "b": vb, "delta": delta}
    return {"fields": fields, "derived": dict(sorted(derived.items())), "context": ctx}


def print_diff(diff: dict, name_a: str, name_b: str) -> None:
    con = _console()
    con.print(f"A = {escape(str(name_a))}\nB = {escape(str(name_b))}")
    t = Table(title="changed fields", title_justify="left")
    t.add_column("field")
    t.add_column("A")
    t.add_column("B")
    for k, v in diff["fields"].items():
        t.add_row(k, str(v["a"]), str(v["b"]))
    if not diff["fields"]:
        t.add_row("(none)", "", "")
    con.print(t)
    t = Table(title=f"derived numbers (context {diff['context']:,})", title_justify="left")
    t.add_column("quantity", no_wrap=True)
    for col in ("A", "B", "change"):
        t.add_column(col, justify="right")
    for k, v in diff["derived"].items():
        if v["delta"] == 0:
            continue
        a, b, d = v["a"], v["b"], v["delta"]
        rel = f" ({d / a:+.1%})" if d is not None and a else ""
        t.add_row(k, f"{a:,}" if a is not None else "-", f"{b:,}" if b is not None else "-",
                  (f"{d:+,}" + rel) if d is not None else "-")
    con.print(t)
    same = sum(1 for v in diff["derived"].values() if v["delta"] == 0)
    con.print(f"{same} derived numbers unchanged")


def print_build(dest, manifest: dict) -> None:
    """Summary of a build: what was written, the passes and their statistics, the kernel binding table."""
    con = _console()
    st = manifest["stats"]["params"]
    con.print(
        f"[bold]built[/bold] {escape(str(dest))}  ({manifest['spec']['name']}, target {manifest['target']}, "
        f"modes {'+'.join(manifest['modes'])}, {human(st['total'])} parameters, weights: {manifest['weights']})"
    )
    for mode, records in manifest["passes"].items():
        t = Table(title=f"{mode}: passes", title_justify="left")
        t.add_column("pass")
        t.add_column("status")
        t.add_column("statistics")
        for r in records:
            stats = ", ".join(f"{k} {v}" for k, v in r["statistics"].items())
            t.add_row(r["name"], r["status"], stats)
        con.print(t)
    for mode, rows in manifest["binding_table"].items():
        t = Table(title=f"{mode}: kernel binding ({manifest['target']})", title_justify="left")
        for col in ("op", "implementation", "nodes", "reason"):
            t.add_column(col, justify="right" if col == "nodes" else "left")
        for row in rows:
            if row["impl"] != "native":
                t.add_row(row["op"], row["impl"], str(row["nodes"]), row["reason"])
        native = sum(r["nodes"] for r in rows if r["impl"] == "native")
        t.add_row("PyTorch built-ins", "native", str(native), "linear, embedding, views, elementwise")
        con.print(t)


def _layout(r: dict) -> str:
    return f"{r['dp']} x {r['tp']} x {r['pp']} x {r['ep']}"


def print_plan(pl: dict) -> None:
    """`k3compile plan`'s tables: the ranked layouts' per-rank training memory, then their bytes sent per training
    step, then per-rank serving memory; each table in its own ranking."""
    con = _console()
    gb = pl["gpu_memory_bytes"]
    mb = "one sequence under pp > 1, else a replica's share" if pl["microbatch"] is None else pl["microbatch"]
    con.print(
        f"[bold]{escape(pl['spec'])}[/]: {human(pl['params']['total'])} parameters "
        f"({human(pl['params']['routed_experts'])} in routed experts) on {pl['gpus']} x {pl['gpu'].upper()} "
        f"({human(gb, 'B')} each; fits: at most {pl['fit_fraction']:.0%} of it); "
        f"global batch {pl['batch']} x {pl['seq']} tokens, microbatches of {mb}; "
        f"pipeline schedule {pl['schedule']}" + (f" ({pl['virtual_stages']} stages per rank)" if pl["virtual_stages"] > 1 else "")
    )  # fmt: skip
    rules = pl["rules"]
    node = f" and {rules['tp_within_node_of']} (a node)" if rules["tp_within_node_of"] else ""
    con.print(
        f"layouts dp x tp x pp x ep = {pl['gpus']}: tp divides {', '.join(f'{k} {v}' for k, v in rules['tp_divides'].items())}"
        f"{node}; ep divides {rules['ep_divides']}; pp at most {rules['pp_at_most']}. "
        f"{pl['layouts_total']} layouts, {len(pl['layouts'])} shown"
        + ("" if len(pl["layouts"]) == pl["layouts_total"] else " (the best of each table; --all for every one)")
    )  # fmt: skip
    fits = {(True, False): "[green]yes", (True, True): "[yellow]AC", (False, False): "[red]no", (False, True): "[red]no"}
    top = pl["top"] or len(pl["layouts"])
    train = sorted((r for r in pl["layouts"] if (r["train_rank"] or top + 1) <= top), key=lambda r: r["train_rank"])
    t = Table(title="training, per rank (the busiest pipeline rank): fp32 weights, gradients and optimiser state "
              "sharded by FSDP2, activations without and with activation checkpointing (AC)", title_justify="left")
    for col in ("#", "dp x tp x pp x ep", "μbatches", "weights+grads", "optimizer", "activations", "AC", "FSDP2",
                "gathered", "total", "fits"):
        t.add_column(col, justify="left" if col in ("dp x tp x pp x ep", "FSDP2") else "right")
    for r in train:
        gathered = r["fsdp_gathered_bytes"] if r["fsdp_policy"] == "keep" else r["fsdp_buffer_bytes"]
        t.add_row(
            str(r["train_rank"]), _layout(r), str(r["microbatches"]), human(r["param_bytes"] + r["grad_bytes"], "B"),
            human(r["optimizer_bytes"], "B"), human(r["activation_bytes"], "B"), human(r["activation_bytes_ac"], "B"),
            r["fsdp_policy"], human(gathered, "B"), human(r["train_bytes_chosen"], "B"),
            fits[r["train_fits_chosen"], r["activation_checkpointing"]],
        )  # fmt: skip
    con.print(t)
    con.print("FSDP2 reshard: each layer gathered for every microbatch's forward and backward (gathered: two layers' "
              "weights, one's gradients); keep: gathered once a step and held. AC: fits only with per-layer activation "
              "checkpointing. Ranked: fits without AC, then with it; by pipeline bubble, then bytes sent.")
    t = Table(title="training, bytes each rank sends per step (ring collectives: (n - 1) / n of the whole)",
              title_justify="left")  # fmt: skip
    for col in ("#", "dp x tp x pp x ep", "FSDP AG", "FSDP RS", "Muon AG", "TP", "EP a2a", "PP p2p", "recompute",
                "total", "bubble"):
        t.add_column(col, justify="left" if col == "dp x tp x pp x ep" else "right")
    for r in train:
        c = r["comm"]
        t.add_row(
            str(r["train_rank"]), _layout(r), human(c["fsdp_all_gather"], "B"), human(c["fsdp_reduce_scatter"], "B"),
            human(c["muon_all_gather"], "B"), human(c["tp_attention"] + c["tp_ffn"] + c["tp_vocab"], "B"),
            human(c["ep_dispatch"] + c["ep_combine"], "B"), human(c["pp_send"], "B"), human(c["recompute"], "B"),
            human(r["comm_bytes"], "B"), f"{r['bubble']:.0%}",
        )  # fmt: skip
    con.print(t)
    if pl["layouts_not_trainable"]:
        con.print(f"{pl['layouts_not_trainable']} layouts cannot train at this batch: their pipeline schedule has too "
                  "few microbatches (--batch, --microbatch)")
    serve = sorted((r for r in pl["layouts"] if r["serve_rank"] <= top), key=lambda r: r["serve_rank"])
    t = Table(title="serving, per rank: weights under the quantisation policy, decode caches of its sequences",
              title_justify="left")  # fmt: skip
    for col in ("#", "dp x tp x pp x ep", "routed experts", "weights", "cache", "total", "fits", "sequences / GPU"):
        t.add_column(col, justify="left" if col == "dp x tp x pp x ep" else "right")
    for r in serve:
        t.add_row(
            str(r["serve_rank"]), _layout(r), human(r["routed_expert_bytes_per_rank"], "B"),
            human(r["serve_weight_bytes"], "B"), human(r["serve_cache_bytes"], "B"), human(r["serve_bytes"], "B"),
            "[green]yes" if r["serve_fits"] else "[red]no", f"{r['serve_sequences_per_gpu']:.1f}",
        )  # fmt: skip
    con.print(t)
    con.print(f"sequences / GPU: how many sequences of {pl['seq']} tokens the memory the weights leave would hold, "
              "per GPU of a replica (tp x pp GPUs); ranked by it, fitting layouts first.")
